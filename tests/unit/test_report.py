"""report/profiles.py and report/html.py on profiles built here (the pprof format is the agent's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ebpfprofiler.report import html, profiles
from ebpfprofiler.shared import pprof

PERIOD = 10_000_000
HOSTILE = "</script><img src=x onerror=alert(1)>"


def cpu_profile(service: str, stacks: dict[tuple[str, ...], int], pid: int = 7, window: int = 0) -> bytes:
    """A cpu pprof as a symbolizer worker writes it: stacks root first → sample count."""
    b = pprof.ProfileBuilder([("samples", "count"), ("cpu", "nanoseconds")], ("cpu", "nanoseconds"),
                             PERIOD, 1_700_000_000_000_000_000 + window * 2_000_000_000, 2_000_000_000)
    m = b.mapping("exe", service, "abc")
    for stack, n in stacks.items():
        locs = [b.location((name,), m, 0x1000 + i, [b.function(name)]) for i, name in enumerate(stack)]
        b.sample(list(reversed(locs)), [n, n * PERIOD],
                 {"process.executable": service, "pid": str(pid)})
    return b.gzipped()


def local_dir(tmp_path: Path) -> Path:
    d = tmp_path / "profiles"
    (d / "usr_bin_a").mkdir(parents=True)
    (d / "usr_bin_b").mkdir()
    (d / "usr_bin_a" / "cpu-20261201T000000Z-1.pb.gz").write_bytes(
        cpu_profile("/usr/bin/a", {("main", "work", "heavy"): 30, ("main", "work", "light"): 10}, pid=1))
    (d / "usr_bin_a" / "cpu-20261201T000002Z-2.pb.gz").write_bytes(
        cpu_profile("/usr/bin/a", {("main", "work", "heavy"): 30, ("main", "work", "light"): 10}, pid=1, window=1))
    (d / "usr_bin_b" / "cpu-20261201T000000Z-3.pb.gz").write_bytes(
        cpu_profile("/usr/bin/b", {("main", HOSTILE): 5}, pid=2))
    (d / "usr_bin_b" / "cpu-20261201T000000Z-4.pb.gz").write_bytes(b"not a pprof")
    return d


def test_a_local_dir_loads_by_type_and_service_and_a_bad_file_is_a_counted_skip(tmp_path: Path) -> None:
    skipped = profiles.Skipped()
    loaded = profiles.load([str(local_dir(tmp_path))], skipped)
    assert sorted((x.profile_type, x.service) for x in loaded) == [
        ("cpu", "/usr/bin/a"), ("cpu", "/usr/bin/a"), ("cpu", "/usr/bin/b")]
    assert sum(skipped.counts.values()) == 1


def test_folded_stacks_sum_the_windows_and_keep_the_ratio(tmp_path: Path) -> None:
    loaded = profiles.keep_pids(profiles.load([str(local_dir(tmp_path))]), {1})
    assert profiles.folded(loaded) == "main;work;heavy 60\nmain;work;light 20\n"


def test_top_ranks_by_self_with_totals(tmp_path: Path) -> None:
    loaded = profiles.load([str(local_dir(tmp_path))])
    rows, grand = profiles.top(loaded, 3)
    assert grand == 85 * PERIOD
    assert [(r.function, r.self_value // PERIOD, r.total_value // PERIOD) for r in rows] == [
        ("heavy", 60, 60), ("light", 20, 20), (HOSTILE, 5, 5)]
    table = profiles.top_table(loaded, 2)
    assert re.search(r"0\.60s\s+70\.6%\s+0\.60s\s+70\.6%\s+heavy", table), table


def test_a_merge_is_one_pprof_with_every_sample_and_label(tmp_path: Path) -> None:
    loaded = profiles.load([str(local_dir(tmp_path))])
    merged = pprof.read(profiles.merge(loaded))
    assert merged.total("samples") == 85
    assert {s.labels["process.executable"] for s in merged.samples} == {"/usr/bin/a", "/usr/bin/b"}
    assert ("main", "work", "heavy") in {s.functions for s in merged.samples}
    assert merged.duration_ns == 4_000_000_000   # the windows' span


def test_outputs_by_extension(tmp_path: Path) -> None:
    loaded = profiles.load([str(local_dir(tmp_path))])
    assert profiles.write_outputs(loaded, str(tmp_path / "o.folded")) == [str(tmp_path / "o.folded")]
    assert profiles.write_outputs(loaded, str(tmp_path / "o.pb.gz")) == [str(tmp_path / "o.pb.gz")]
    assert pprof.read((tmp_path / "o.pb.gz").read_bytes()).total("samples") == 85


def test_the_report_holds_every_service_and_no_name_can_break_out_of_its_script(tmp_path: Path) -> None:
    page = html.render(profiles.load([str(local_dir(tmp_path))]))
    assert HOSTILE not in page and "<img" not in page.split('<script id="data"')[1].split("</script>")[0]
    doc = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert [(p["type"], p["service"], p["total"] // PERIOD) for p in doc["profiles"]] == [
        ("cpu", html.ALL_SERVICES, 85), ("cpu", "/usr/bin/a", 80), ("cpu", "/usr/bin/b", 5)]
    a = doc["profiles"][1]["tree"]
    assert a["children"][0]["name"] == "main" and a["children"][0]["value"] == 80 * PERIOD
    assert doc["profiles"][2]["tree"]["children"][0]["children"][0]["name"] == HOSTILE
    # self-contained: nothing is loaded from elsewhere
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=""", page)
