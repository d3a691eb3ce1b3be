"""The HTML report in a real browser: headless Chromium (Debian's, installed by make test-setup).

Given a recording of the 3:1 workload (heavy:light) made with `record -o
out.pb.gz`, and two offcpu profiles of other services, rendered with
`ebpfprofiler report`, when Chromium opens the
report from a file with the network unreachable (the page's own CSP forbids
any fetch), then: the flame graph drew the workload's frames; typing
"light" into the search reports a share within ±10% of light's share in the
pprof; a click on "light" zooms it to most of the chart's width; the tooltip
text carries time and percent; the profile-type switch draws the offcpu graph
with its services; a screenshot goes to the test's output directory. The test drives the page with a script of its own,
appended to a copy of the report, which writes what it saw into the DOM;
Chromium's --dump-dom prints it. The copy also gets a frame clock of timers
(FRAME_CLOCK): headless Chromium's own animation frames are not dependable.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from shared import pprof
from tests.browser import chromium, drive
from tests.harness import PY, RECORD_TIMEOUT_S, require_root

DRIVE = """
<script>
(function () {
  const out = {};
  function frames() { return Array.from(document.querySelectorAll("#chart g.frame")); }
  function rectWidth(g) { return Number(g.querySelector("rect").getAttribute("width")); }
  // the widest frame of that name: a function on two paths (a stack cut short before its module's
  // unwind table arrived) has two frames, and a zoom hides the one not clicked
  function frame(name) {
    return frames().filter(function (g) { return g.getAttribute("name") === name; })
      .reduce(function (best, g) { return !best || rectWidth(g) > rectWidth(best) ? g : best; }, undefined);
  }
  function width(name) { const g = frame(name); return g ? rectWidth(g) : 0; }
  function done() {
    const pre = document.createElement("pre"); pre.id = "drive-result";
    pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
  }
  // polls (transitions run on animation frames): then(true) once cond holds, then(false) at the deadline
  function waitFor(cond, then, left) {
    if (cond()) { then(true); } else if (left <= 0) { then(false); }
    else { setTimeout(function () { waitFor(cond, then, left - 100); }, 100); }
  }
  let last = -1;
  function stable() { const w = width("work"); const same = w > 0 && w === last; last = w; return same; }
  waitFor(stable, function (drawn) {
    out.drawn = drawn;
    out.types = Array.from(document.querySelectorAll("#type option")).map(function (o) { return o.value; });
    out.names = frames().map(function (g) { return g.getAttribute("name"); });
    const work = frame("work");
    out.title = work && work.querySelector("title") ? work.querySelector("title").textContent : null;
    const search = document.getElementById("search");
    search.value = "light";
    search.dispatchEvent(new Event("input"));
    out.share = document.getElementById("share").dataset.share;
    out.shareText = document.getElementById("share").textContent;
    out.svgWidth = Number(document.querySelector("#chart svg").getAttribute("width"));
    out.lightBefore = width("light");
    // the click once the search's redraw has settled (a click during its transition was lost once on
    // CI); the frame found again: the redraw may have put another frame in an element found before it
    last = -1;
    waitFor(stable, function () {
    function zoomIn(then) {
      frame("light").dispatchEvent(new MouseEvent("click", {bubbles: true}));
      waitFor(function () { return width("light") >= 0.85 * out.svgWidth; }, then, 10000);
    }
    zoomIn(function (zoomed) {
      out.zoomed = zoomed;
      out.lightAfter = width("light");
      out.highlighted = frames().filter(function (g) {
        return (g.querySelector("rect").getAttribute("fill") || "").toUpperCase() === "#E600E6";
      }).map(function (g) { return g.getAttribute("name"); });
      // the profile-type switch: offcpu has its own services and frames
      const type = document.getElementById("type");
      type.value = "offcpu";
      type.dispatchEvent(new Event("change"));
      waitFor(function () { return !!frame("nanosleep_caller"); }, function (switched) {
        out.switched = switched;
        out.offcpuServices = Array.from(document.querySelectorAll("#service option")).map(function (o) {
          return o.textContent; });
        out.offcpuNames = frames().map(function (g) { return g.getAttribute("name"); });
        type.value = "cpu";
        type.dispatchEvent(new Event("change"));
        done();
      }, 10000);
    });
    }, 10000);
  }, 10000);
})();
</script>
"""


def offcpu_profile(service: str) -> bytes:
    """An offcpu pprof as a symbolizer worker writes it: main → nanosleep_caller blocked 2 s."""
    b = pprof.ProfileBuilder(
        [("samples", "count"), ("offcpu", "nanoseconds")],
        ("offcpu", "nanoseconds"),
        1,
        1_700_000_000_000_000_000,
        2_000_000_000,
    )
    m = b.mapping("exe", service, "")
    locs = [b.location((n,), m, 0x1000 + i, [b.function(n)]) for i, n in enumerate(("main", "nanosleep_caller"))]
    b.sample(list(reversed(locs)), [4, 2_000_000_000], {"process.executable": service, "pid": "1"})
    return b.gzipped()


def share_of(profile: pprof.ReadProfile, name: str) -> float:
    """The share of the default value (the last sample type) in stacks through `name`."""
    total = sum(s.values[-1] for s in profile.samples)
    through = sum(s.values[-1] for s in profile.samples if name in s.functions)
    return through / total


def record_and_report(directory: Path, pid: int) -> str:
    """5 s of `pid` recorded to out.pb.gz, and report.html of it and of an off-CPU profile of two other
    services (as the agent's local_dir would hold them), in `directory`; the page."""
    r = subprocess.run(
        [PY, "-m", "cli.main", "record", "-d", "5", "--hz", "199", "-p", str(pid), "-o", "out.pb.gz"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=RECORD_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    offcpu = ["offcpu-20261201T000000Z-1.pb.gz", "offcpu-20261201T000000Z-2.pb.gz"]
    (directory / offcpu[0]).write_bytes(offcpu_profile("/usr/bin/sleeper"))
    (directory / offcpu[1]).write_bytes(offcpu_profile("/usr/bin/waiter"))
    r = subprocess.run(
        [PY, "-m", "cli.main", "report", "out.pb.gz", *offcpu, "-o", "report.html"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return (directory / "report.html").read_text()


def drive_in_chromium(page: str, directory: Path) -> tuple[dict, Path]:
    """The page with the frame clock and DRIVE added (driven.html in `directory`), run in chromium:
    (what DRIVE saw, the driven page)."""
    got, driven = drive(page, DRIVE, directory)
    return dict(got), driven


def test_the_report_draws_searches_zooms_and_shows_in_chromium(
    tmp_path: Path, ratio_workload: subprocess.Popen[bytes]
) -> None:
    require_root()
    page = record_and_report(tmp_path, ratio_workload.pid)
    # one file, nothing fetched: no external script, style, font or URL to load
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=""", page)
    assert "Content-Security-Policy" in page
    got, driven = drive_in_chromium(page, tmp_path)
    # the flame graph drew the workload's frames
    assert {"main", "work", "heavy", "light"} <= set(got["names"]), got["names"]
    assert got["types"] == ["cpu", "offcpu"]
    # switching the type draws the other profile, with its services (and all of them together)
    assert got["switched"], got
    assert got["offcpuServices"] == ["(all services)", "/usr/bin/sleeper", "/usr/bin/waiter"], got
    assert {"/usr/bin/sleeper", "/usr/bin/waiter", "nanosleep_caller"} <= set(got["offcpuNames"])
    assert "heavy" not in got["offcpuNames"]
    # the tooltip gives time and percent
    assert re.fullmatch(r"work: [\d.]+ (s|ms) \(\d+\.\d\d%\)", got["title"] or ""), got["title"]
    # the search's share is the pprof's, ±10%
    expected = share_of(pprof.read((tmp_path / "out.pb.gz").read_bytes()), "light")
    assert 0.15 < expected < 0.35, expected  # the workload's 1 in 4
    assert float(got["share"]) == pytest.approx(expected, rel=0.10), got
    assert "light" in got["highlighted"] and "heavy" not in got["highlighted"], got["highlighted"]
    assert re.match(r"1 function matched: \d+\.\d\d% ", got["shareText"]), got["shareText"]
    # a click on a frame zooms it to most of the chart's width
    assert got["zoomed"], got
    assert got["lightAfter"] >= 0.85 * got["svgWidth"] > got["lightBefore"], got

    shot = tmp_path / "report.png"
    r = chromium(f"--screenshot={shot}", driven.as_uri(), cwd=tmp_path)
    assert shot.exists() and shot.stat().st_size > 10_000, r.stderr[-3000:]
    print(f"screenshot: {shot}")


NAMES_DRIVE = """
<script>
(function () {
  function names() {
    return Array.from(document.querySelectorAll("#chart g.frame")).map(function (g) { return g.getAttribute("name"); });
  }
  function finish() {
    const pre = document.createElement("pre"); pre.id = "drive-result";
    pre.textContent = JSON.stringify({names: names(), d3: typeof d3, flamegraph: typeof flamegraph,
                                      scripts: document.scripts.length, title: document.title});
    document.body.appendChild(pre);
  }
  let left = 10000;
  (function poll() {
    if (names().length > 4 || left <= 0) { finish(); } else { left -= 100; setTimeout(poll, 100); }
  })();
})();
</script>
"""


def test_function_names_holding_the_template_markers_still_give_a_drawn_flame_graph(tmp_path: Path) -> None:
    # Given a pprof whose function names are the template's markers, a closing script tag and escapes
    markers = sorted(
        set(re.findall(r"@[A-Z0-9_]+@", (Path(__file__).parents[2] / "report" / "template.html").read_text()))
    )
    assert {"@D3_JS@", "@FLAMEGRAPH_CSS@", "@FLAMEGRAPH_JS@", "@DATA@"} <= set(markers)
    hostile = [*markers, "</script><script>document.title='owned'</script>", "\x1b[2Jx\ny"]
    b = pprof.ProfileBuilder(
        [("samples", "count"), ("cpu", "nanoseconds")],
        ("cpu", "nanoseconds"),
        10_000_000,
        1_700_000_000_000_000_000,
        2_000_000_000,
    )
    m = b.mapping("exe", "/usr/bin/hostile", "")
    stack = ["main", *hostile]
    locs = [b.location((n,), m, 0x1000 + i, [b.function(n)]) for i, n in enumerate(stack)]
    b.sample(list(reversed(locs)), [5, 50_000_000], {"process.executable": "/usr/bin/hostile", "pid": "1"})
    (tmp_path / "cpu-20261201T000000Z-1.pb.gz").write_bytes(b.gzipped())
    # When `ebpfprofiler report` renders it
    r = subprocess.run(
        [PY, "-m", "cli.main", "report", "cpu-20261201T000000Z-1.pb.gz", "-o", "report.html"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "report.html").read_text()
    # Then the page keeps d3 and the flame graph (issue 40 case 1: they went into the data, and the page was blank)
    assert page.count("<script") == 4, page.count("<script")
    got, _ = drive(page, NAMES_DRIVE, tmp_path)
    # And Chromium draws every frame, each hostile name as that name, and runs none of them
    assert got["d3"] == "object" and got["flamegraph"] == "function", got
    assert set(hostile) | {"main"} <= set(got["names"]), got["names"]
    assert got["title"] != "owned", got["title"]
