"""report/diff.py and the differential page's data (report/html.py), on profiles built here, and
`ebpfprofiler report --diff`'s command line."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from cli import report as report_cli
from report import diff, html, profiles
from shared import pprof

PERIOD = 10_000_000


def cpu_pprof(exe: str, stacks: dict[tuple[str, ...], int], address: int = 0x1000) -> bytes:
    """A cpu pprof as a symbolizer worker writes it (stacks root first → samples), its frames at `address`
    on (another build of the same code puts them elsewhere)."""
    b = pprof.ProfileBuilder(
        [("samples", "count"), ("cpu", "nanoseconds")], ("cpu", "nanoseconds"), PERIOD, 1_700_000_000_000_000_000, 2
    )
    m = b.mapping("exe", exe, exe)
    for stack, n in stacks.items():
        locs = [b.location((exe, name), m, address + 0x40 * i, [b.function(name)]) for i, name in enumerate(stack)]
        b.sample(list(reversed(locs)), [n, n * PERIOD], {"process.executable": exe, "pid": "1"})
    return b.gzipped()


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


BASE_STACKS: dict[tuple[str, ...], int] = {
    ("main", "work", "alpha"): 300,
    ("main", "work", "beta"): 100,
    ("main", "old"): 50,
}
NEW_STACKS: dict[tuple[str, ...], int] = {("main", "work", "alpha"): 10, ("main", "work", "beta"): 90}


def test_shares_are_of_each_sides_own_total_and_the_movers_say_grown_shrunk_and_gone(tmp_path: Path) -> None:
    # Given BASE (450 samples) where alpha is hot and NEW (100 samples, a shorter recording) where beta is,
    # of another build: the same names at other addresses, under another executable path
    base = profiles.load([write(tmp_path / "base.pb.gz", cpu_pprof("/opt/v1/app", BASE_STACKS))])
    new = profiles.load([write(tmp_path / "new.pb.gz", cpu_pprof("/opt/v2/app", NEW_STACKS, address=0x9000))])
    # When they are compared
    pairs = diff.compare(base, new)
    # Then the one service of each side is paired, and named by both
    assert [(p.profile_type, p.service) for p in pairs] == [("cpu", "/opt/v1/app → /opt/v2/app")]
    by_name = {m.function: m for m in pairs[0].movers}
    # beta grew from 100/450 to 90/100 of its side, alpha shrank from 300/450 to 10/100; old is gone
    assert by_name["beta"].status == "grown" and by_name["alpha"].status == "shrunk"
    assert by_name["beta"].self_delta == pytest.approx(0.9 - 100 / 450)
    assert by_name["alpha"].total_delta == pytest.approx(0.1 - 300 / 450)
    assert by_name["old"].status == "gone" and by_name["old"].new_total == 0
    # work's self share did not move (it is never the leaf); its total did, as old went
    assert by_name["work"].self_delta == 0 and by_name["work"].total_delta == pytest.approx(1 - 400 / 450)
    # main is in every stack on both sides: no change, no row
    assert "main" not in by_name
    # biggest change first (old and work both moved by 50/450)
    assert [m.function for m in pairs[0].movers][:2] == ["beta", "alpha"] and len(pairs[0].movers) == 4


def tree_node(tree: dict, *path: str) -> dict:
    for name in path:
        tree = next(c for c in tree["children"] if c["name"] == name)
    return tree


def test_the_page_data_holds_both_sides_values_in_one_tree(tmp_path: Path) -> None:
    # Given the same BASE and NEW
    base = profiles.load([write(tmp_path / "base.pb.gz", cpu_pprof("/usr/bin/app", BASE_STACKS))])
    new = profiles.load([write(tmp_path / "new.pb.gz", cpu_pprof("/usr/bin/app", NEW_STACKS))])
    # When the differential page's data is built
    doc = html.diff_model(diff.compare(base, new), "base.pb.gz", "new.pb.gz")
    # Then it says it is a diff, of which files, and each node carries NEW's value and BASE's
    assert doc["diff"] == {"base": "base.pb.gz", "new": "new.pb.gz", "full_colour": html.FULL_COLOUR_SHARE}
    (graph,) = doc["profiles"]
    assert (graph["total"], graph["base_total"]) == (100 * PERIOD, 450 * PERIOD)
    assert (graph["samples"], graph["base_samples"]) == (100, 450)
    tree = graph["tree"]
    alpha, beta = tree_node(tree, "main", "work", "alpha"), tree_node(tree, "main", "work", "beta")
    assert (alpha["value"], alpha["base"]) == (10 * PERIOD, 300 * PERIOD)
    assert (beta["value"], beta["base"]) == (90 * PERIOD, 100 * PERIOD)
    # a frame only in BASE stays in the tree, with no NEW value: the page draws it in BASE's view
    old = tree_node(tree, "main", "old")
    assert (old["value"], old["base"]) == (0, 50 * PERIOD)
    rows = {m["function"]: m for m in graph["movers"]}
    assert rows["old"]["status"] == "gone" and rows["beta"]["new_self"] == pytest.approx(0.9)


def test_a_service_on_one_side_only_is_compared_with_nothing(tmp_path: Path) -> None:
    # Given BASE with two services and NEW with one of them
    base = profiles.load(
        [
            write(tmp_path / "a.pb.gz", cpu_pprof("/usr/bin/a", {("main", "run"): 30})),
            write(tmp_path / "b.pb.gz", cpu_pprof("/usr/bin/b", {("main", "serve"): 10})),
        ]
    )
    new = profiles.load([write(tmp_path / "n.pb.gz", cpu_pprof("/usr/bin/a", {("main", "run"): 20}))])
    # When they are compared
    pairs = diff.compare(base, new)
    # Then every service together comes first (service as the first frame), then each service
    assert [p.service for p in pairs] == [profiles.ALL_SERVICES, "/usr/bin/a", "/usr/bin/b"]
    together = {m.function: m.status for m in pairs[0].movers}
    assert together["/usr/bin/b"] == "gone" and together["serve"] == "gone"
    assert together["/usr/bin/a"] == "grown"  # from 3/4 of BASE to all of NEW
    assert pairs[2].new.total == 0 and {m.status for m in pairs[2].movers} == {"gone"}


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = report_cli.main(list(argv))
        except SystemExit as e:  # argparse's refusals
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_the_command_writes_the_page_and_refuses_bad_input_clearly(tmp_path: Path) -> None:
    base = write(tmp_path / "base.pb.gz", cpu_pprof("/usr/bin/app", BASE_STACKS))
    new = write(tmp_path / "new.pb.gz", cpu_pprof("/usr/bin/app", NEW_STACKS))
    out = str(tmp_path / "diff.html")
    code, stdout, _ = run_cli("--diff", base, new, "-o", out)
    assert code == 0 and "grown" in stdout and "beta" in stdout, stdout
    assert '"diff":{"base":' in Path(out).read_text()
    # a BASE that is not there, or not a pprof: exit 1, naming the side and the file
    code, _, err = run_cli("--diff", str(tmp_path / "missing.pb.gz"), new, "-o", out)
    assert code == 1 and "--diff BASE" in err and "missing.pb.gz" in err and "no such file" in err, err
    junk = write(tmp_path / "junk.pb.gz", b"not a pprof")
    code, _, err = run_cli("--diff", base, junk, "-o", out)
    assert code == 1 and "--diff NEW" in err and "not a pprof" in err, err
    # the diff is a page: another extension, or more paths, is a usage error
    assert run_cli("--diff", base, new, "-o", str(tmp_path / "d.folded"))[0] == 2
    assert run_cli("--diff", base, new, base, "-o", out)[0] == 2
    # --help explains it
    code, stdout, _ = run_cli("--help")
    assert code == 0 and "--diff BASE NEW" in stdout and "coloured by the change" in " ".join(stdout.split()), stdout
