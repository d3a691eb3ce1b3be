"""report/profiles.py and report/html.py on profiles built here (the pprof format is the agent's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from report import html, profiles
from shared import pprof

PERIOD = 10_000_000
HOSTILE = "</script><img src=x onerror=alert(1)>"


def cpu_profile(service: str, stacks: dict[tuple[str, ...], int], pid: int = 7, window: int = 0) -> bytes:
    """A cpu pprof as a symbolizer worker writes it: stacks root first → sample count."""
    b = pprof.ProfileBuilder(
        [("samples", "count"), ("cpu", "nanoseconds")],
        ("cpu", "nanoseconds"),
        PERIOD,
        1_700_000_000_000_000_000 + window * 2_000_000_000,
        2_000_000_000,
    )
    m = b.mapping("exe", service, "abc")
    for stack, n in stacks.items():
        locs = [b.location((name,), m, 0x1000 + i, [b.function(name)]) for i, name in enumerate(stack)]
        b.sample(list(reversed(locs)), [n, n * PERIOD], {"process.executable": service, "pid": str(pid)})
    return b.gzipped()


def local_dir(tmp_path: Path) -> Path:
    d = tmp_path / "profiles"
    (d / "usr_bin_a").mkdir(parents=True)
    (d / "usr_bin_b").mkdir()
    (d / "usr_bin_a" / "cpu-20261201T000000Z-1.pb.gz").write_bytes(
        cpu_profile("/usr/bin/a", {("main", "work", "heavy"): 30, ("main", "work", "light"): 10}, pid=1)
    )
    (d / "usr_bin_a" / "cpu-20261201T000002Z-2.pb.gz").write_bytes(
        cpu_profile("/usr/bin/a", {("main", "work", "heavy"): 30, ("main", "work", "light"): 10}, pid=1, window=1)
    )
    (d / "usr_bin_b" / "cpu-20261201T000000Z-3.pb.gz").write_bytes(
        cpu_profile("/usr/bin/b", {("main", HOSTILE): 5}, pid=2)
    )
    (d / "usr_bin_b" / "cpu-20261201T000000Z-4.pb.gz").write_bytes(b"not a pprof")
    return d


def test_a_local_dir_loads_by_type_and_service_and_a_bad_file_is_a_counted_skip(tmp_path: Path) -> None:
    skipped = profiles.Skipped()
    loaded = profiles.load([str(local_dir(tmp_path))], skipped)
    assert sorted((x.profile_type, x.service) for x in loaded) == [
        ("cpu", "/usr/bin/a"),
        ("cpu", "/usr/bin/a"),
        ("cpu", "/usr/bin/b"),
    ]
    assert sum(skipped.counts.values()) == 1


def test_folded_stacks_sum_the_windows_and_keep_the_ratio(tmp_path: Path) -> None:
    loaded = profiles.keep_pids(profiles.load([str(local_dir(tmp_path))]), {1})
    assert profiles.folded(loaded) == "main;work;heavy 60\nmain;work;light 20\n"


def test_top_ranks_by_self_with_totals(tmp_path: Path) -> None:
    loaded = profiles.load([str(local_dir(tmp_path))])
    rows, grand = profiles.top(loaded, 3)
    assert grand == 85 * PERIOD
    assert [(r.function, r.self_value // PERIOD, r.total_value // PERIOD) for r in rows] == [
        ("heavy", 60, 60),
        ("light", 20, 20),
        (HOSTILE, 5, 5),
    ]
    table = profiles.top_table(loaded, 2)
    assert re.search(r"0\.60s\s+70\.6%\s+0\.60s\s+70\.6%\s+heavy", table), table


def test_a_merge_is_one_pprof_with_every_sample_and_label(tmp_path: Path) -> None:
    loaded = profiles.load([str(local_dir(tmp_path))])
    merged = pprof.read(profiles.merge(loaded))
    assert merged.total("samples") == 85
    assert {s.labels["process.executable"] for s in merged.samples} == {"/usr/bin/a", "/usr/bin/b"}
    assert ("main", "work", "heavy") in {s.functions for s in merged.samples}
    assert merged.duration_ns == 4_000_000_000  # the windows' span


def test_outputs_by_extension(tmp_path: Path) -> None:
    loaded = profiles.load([str(local_dir(tmp_path))])
    assert profiles.write_outputs(loaded, str(tmp_path / "o.folded")) == [str(tmp_path / "o.folded")]
    assert profiles.write_outputs(loaded, str(tmp_path / "o.pb.gz")) == [str(tmp_path / "o.pb.gz")]
    assert pprof.read((tmp_path / "o.pb.gz").read_bytes()).total("samples") == 85


def test_the_report_holds_every_service_and_no_name_can_break_out_of_its_script(tmp_path: Path) -> None:
    page = html.render(profiles.load([str(local_dir(tmp_path))]))
    assert HOSTILE not in page and "<img" not in page.split('<script id="data"')[1].split("</script>")[0]
    data = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
    assert data is not None
    doc = json.loads(data.group(1))
    assert [(p["type"], p["service"], p["total"] // PERIOD) for p in doc["profiles"]] == [
        ("cpu", html.ALL_SERVICES, 85),
        ("cpu", "/usr/bin/a", 80),
        ("cpu", "/usr/bin/b", 5),
    ]
    a = doc["profiles"][1]["tree"]
    assert a["children"][0]["name"] == "main" and a["children"][0]["value"] == 80 * PERIOD
    assert doc["profiles"][2]["tree"]["children"][0]["children"][0]["name"] == HOSTILE
    # self-contained: nothing is loaded from elsewhere
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=""", page)


# Every marker report/template.html holds: a name holding one's text must stay that name.
MARKERS = sorted(set(re.findall(r"@[A-Z0-9_]+@", (Path(html.__file__).parent / "template.html").read_text())))


def data_of(page: str) -> dict:
    found = re.findall(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
    assert len(found) == 1, "the page has no single data block"
    return json.loads(found[0])


def test_a_function_named_like_a_template_marker_leaves_the_page_whole(tmp_path: Path) -> None:
    assert {"@DATA@", "@D3_JS@", "@FLAMEGRAPH_CSS@", "@FLAMEGRAPH_JS@", "@TITLE@"} <= set(MARKERS)
    path = tmp_path / "cpu-20261201T000000Z-1.pb.gz"
    path.write_bytes(cpu_profile("/usr/bin/a", {("main", *tuple(MARKERS)): 3, ("main", "work"): 1}))
    page = html.render(profiles.load([str(path)]))
    # each vendored script and the style sheet once, in its own element, and nothing left unfilled
    # outside the data
    for vendored in ("d3.min.js", "d3-flamegraph.min.js", "d3-flamegraph.css"):
        text = (Path(html.__file__).parent / "vendor" / vendored).read_text()
        assert page.count(text.replace("</script", "<\\/script")[:2000]) == 1, vendored
    outside = re.sub(r'<script id="data" type="application/json">.*?</script>', "", page, flags=re.S)
    assert not re.search(r"@[A-Z0-9_]+@", outside.split("<script>", 1)[0] + outside.rsplit("</script>", 1)[1])
    tree = data_of(page)["profiles"][0]["tree"]
    names = []
    while tree.get("children"):
        tree = max(tree["children"], key=lambda c: c["value"])
        names.append(tree["name"])
    assert names == ["main", *MARKERS]


def big_profile(path: Path) -> Path:
    """A pprof of under 1 MB that made a 500 MB page: 50,000 stacks of 31 frames, no two sharing a root,
    30 of them long names."""
    b = pprof.ProfileBuilder(
        [("samples", "count"), ("cpu", "nanoseconds")],
        ("cpu", "nanoseconds"),
        PERIOD,
        1_700_000_000_000_000_000,
        2_000_000_000,
    )
    m = b.mapping("exe", "/usr/bin/big", "abc")
    deep = [b.location(("d", i), m, 0x2000 + i, [b.function(f"deep_{i:03d}_" + "x" * 290)]) for i in range(30)]
    for i in range(50_000):
        root = b.location(("r", i), m, 0x100000 + i, [b.function(f"root_{i}")])
        b.sample(
            list(reversed([root, *deep])),
            [1 + i % 7, (1 + i % 7) * PERIOD],
            {"process.executable": "/usr/bin/big", "pid": "1"},
        )
    path.write_bytes(b.gzipped())
    assert path.stat().st_size < 1 << 20
    return path


def test_a_page_over_the_byte_cap_merges_the_lightest_frames_into_other_and_says_so(tmp_path: Path) -> None:
    import resource

    loaded = profiles.load([str(big_profile(tmp_path / "cpu-20261201T000000Z-1.pb.gz"))])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    page = html.render(loaded)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - rss_before
    assert len(page.encode()) <= html.MAX_HTML_BYTES
    assert grown < 4 * html.MAX_HTML_BYTES, f"writing the page took {grown >> 20} MB more"
    doc = data_of(page)
    graph = doc["profiles"][0]
    assert graph["merged_frames"] > 0 and "merged into" in doc["note"]
    # the note is in the page itself, not only in its data
    assert re.search(r'<p id="note"[^>]*>This report is cut to stay under \d+ MiB: [\d,]+ frames', page)
    # every sample is still counted: what was merged is in "(other)" frames
    tree = graph["tree"]
    assert tree["value"] == graph["total"] == sum(c["value"] for c in tree["children"])
    others, todo = 0, [tree]
    while todo:
        node = todo.pop()
        others += node["name"] == html.OTHER
        todo += node.get("children", [])
    assert others > 0
    # the heaviest stacks are whole
    heavy = [c for c in tree["children"] if c["name"] == "root_6"]
    assert heavy and len(json.dumps(heavy[0])) > 30 * 290
