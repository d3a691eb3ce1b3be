"""`ebpfprofiler report --diff` of two real recordings whose hot function changed, in headless Chromium.

Given tests/workloads/shift.c (main → work → alpha and main → work → beta, the function named on its
command line taking three times the other's CPU) recorded twice by `ebpfprofiler record -p PID -o
X.pb.gz` as root, hot in alpha (BASE) and then in beta (NEW): each run waits for a line on its stdin,
which the test writes once `record` says it is recording, spins 3 CPU seconds and exits, and `record`,
its one pid gone, stops and writes the file; when `report --diff base.pb.gz new.pb.gz -o diff.html`
renders them and Chromium opens the page, then: in NEW's view beta's frame is red and its tooltip says
grown, alpha's is blue and says shrunk; the movers table marks beta grown and alpha shrunk, with the
shares the two recordings give (alpha about 3/4 of BASE's work and 1/4 of NEW's); BASE's view draws
alpha wider than NEW's does.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from shared import pprof
from tests.browser import drive
from tests.harness import PY, require_root

# BPF compile and load, the run's CPU_S, the last windows written (as tests/integration/test_record.py).
RECORD_TIMEOUT_S = 240
# CPU seconds each run spins once told to go: at 199 Hz about 600 samples, a 3:1 split well measured.
CPU_S = 3
# The run ends by itself CPU_S after its go; on a loaded 2-CPU host that may take a few times CPU_S.
WORKLOAD_TIMEOUT_S = 60

DRIVE = """
<script>
(function () {
  const out = {};
  function frames() { return Array.from(document.querySelectorAll("#chart g.frame")); }
  function rectWidth(g) { return Number(g.querySelector("rect").getAttribute("width")); }
  function frame(name) {
    return frames().filter(function (g) { return g.getAttribute("name") === name; })
      .reduce(function (best, g) { return !best || rectWidth(g) > rectWidth(best) ? g : best; }, undefined);
  }
  function drawn(name) { const g = frame(name); return !!g && rectWidth(g) > 0; }
  function seen(name) {
    const g = frame(name);
    if (!g) { return null; }
    const t = g.querySelector("title");
    return {width: rectWidth(g), fill: g.querySelector("rect").getAttribute("fill"), title: t ? t.textContent : ""};
  }
  function done() {
    const pre = document.createElement("pre"); pre.id = "drive-result";
    pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
  }
  function waitFor(cond, then, left) {
    if (cond()) { then(true); } else if (left <= 0) { then(false); }
    else { setTimeout(function () { waitFor(cond, then, left - 100); }, 100); }
  }
  waitFor(function () { return drawn("alpha") && drawn("beta"); }, function (ok) {
    out.drawn = ok;
    out.legend = document.getElementById("legend").textContent;
    out.new = {alpha: seen("alpha"), beta: seen("beta")};
    out.movers = Array.from(document.querySelectorAll("#movers-rows tr")).map(function (tr) {
      return Array.from(tr.children).map(function (td) { return td.textContent; });
    });
    const before = out.new.alpha ? out.new.alpha.width : 0;
    const view = document.getElementById("view");
    view.value = "base";
    view.dispatchEvent(new Event("change"));
    waitFor(function () { return drawn("alpha") && rectWidth(frame("alpha")) !== before; }, function (switched) {
      out.switched = switched;
      out.base = {alpha: seen("alpha"), beta: seen("beta")};
      done();
    }, 10000);
  }, 10000);
})();
</script>
"""


def record_run(directory: Path, exe: Path, hot: str, out: str, started: list[subprocess.Popen]) -> pprof.ReadProfile:
    """One recording of `exe` hot in `hot`, from `record`'s start to the run's own end, to `out`: its profile."""
    run = subprocess.Popen([str(exe), str(CPU_S), hot, "wait"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    started.append(run)
    rec = subprocess.Popen(
        [PY, "-m", "cli.main", "record", "-d", "600", "--hz", "199", "-p", str(run.pid), "-o", out],
        cwd=directory,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started.append(rec)
    assert rec.stdout is not None and run.stdin is not None
    said = []
    for line in rec.stdout:  # until the agent is ready (or record ends: the asserts below say why)
        said.append(line)
        if re.search(r": recording .* for ", line):
            break
    run.stdin.write(b"go\n")
    run.stdin.close()
    assert run.wait(WORKLOAD_TIMEOUT_S) == 0
    rest, _ = rec.communicate(timeout=RECORD_TIMEOUT_S)  # it stops once the run's pid is gone
    assert rec.returncode == 0, "".join(said) + rest
    return pprof.read((directory / out).read_bytes())


def share_in_work(profile: pprof.ReadProfile, name: str) -> float:
    work = [s for s in profile.samples if "work" in s.functions]
    return sum(s.values[-1] for s in work if name in s.functions) / sum(s.values[-1] for s in work)


def rgb(fill: str) -> tuple[int, ...]:
    m = re.fullmatch(r"rgb\((\d+),\s*(\d+),\s*(\d+)\)", fill)
    assert m, fill
    return tuple(int(x) for x in m.groups())


def test_a_diff_of_two_recordings_marks_the_new_hot_function_grown_and_the_old_one_shrunk(
    tmp_path: Path, build: Callable[..., Path], started: list[subprocess.Popen]
) -> None:
    require_root()
    exe = build("shift")
    # Given two recordings of the same program, hot in alpha and then in beta
    base = record_run(tmp_path, exe, "alpha", "base.pb.gz", started)
    new = record_run(tmp_path, exe, "beta", "new.pb.gz", started)
    assert 0.65 < share_in_work(base, "alpha") < 0.85 and 0.65 < share_in_work(new, "beta") < 0.85
    # When report --diff draws them
    r = subprocess.run(
        [PY, "-m", "cli.main", "report", "--diff", "base.pb.gz", "new.pb.gz", "-o", "diff.html"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    got, _ = drive((tmp_path / "diff.html").read_text(), DRIVE, tmp_path)
    # Then NEW's view draws beta red (grown) and alpha blue (shrunk), and their tooltips say so
    assert got["drawn"], got
    assert "BASE: base.pb.gz; NEW: new.pb.gz." in got["legend"], got["legend"]
    red, _, blue = rgb(got["new"]["beta"]["fill"])
    assert red == 255 and blue < 150, got["new"]["beta"]
    red, _, blue = rgb(got["new"]["alpha"]["fill"])
    assert blue == 255 and red < 150, got["new"]["alpha"]
    assert re.fullmatch(r"beta: NEW .*, BASE .*: \+[\d.]+ pts grown", got["new"]["beta"]["title"]), got["new"]
    assert re.fullmatch(r"alpha: NEW .*, BASE .*: −[\d.]+ pts shrunk", got["new"]["alpha"]["title"]), got["new"]
    # the movers table marks them so, at the recordings' own shares (each function's share of all samples)
    rows = {row[0]: row for row in got["movers"]}
    assert rows["beta"][-1] == "grown" and rows["alpha"][-1] == "shrunk", got["movers"]
    total = {side: sum(s.values[-1] for s in p.samples) for side, p in (("base", base), ("new", new))}
    for name, row in (("alpha", rows["alpha"]), ("beta", rows["beta"])):
        base_pct = 100 * sum(s.values[-1] for s in base.samples if name in s.functions) / total["base"]
        new_pct = 100 * sum(s.values[-1] for s in new.samples if name in s.functions) / total["new"]
        assert float(row[4].rstrip("%")) == pytest.approx(base_pct, abs=0.01), (row, base_pct)
        assert float(row[5].rstrip("%")) == pytest.approx(new_pct, abs=0.01), (row, new_pct)
    # and BASE's view draws alpha at its old, wider share
    assert got["switched"], got
    assert got["base"]["alpha"]["width"] > 2 * got["new"]["alpha"]["width"], got
