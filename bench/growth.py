"""`make bench` suite `growth`: does any stage grow over a long run at the shipped defaults, busy?

The agent is bench/budget.py's (`ebpfprofiler run`, deploy/agent.yaml as shipped, local_dir moved),
under budget's busy load (two CPU-bound loops, a CPython loop, a shell starting short processes),
for RUN_S seconds. Every SAMPLE_S each stage's RSS (/proc/PID/status VmRSS) and CPU are read.

Figures per stage: RSS at the end of the warm-up (WARM_S), at the end, the highest seen, and the
growth: the median RSS of the last TAIL_S seconds minus that of the TAIL_S seconds after the
warm-up, in MB and in MB per hour; whether it still grows at the end: the last TAIL_S seconds'
median minus that of the TAIL_S seconds before them; and the run's CPU, % of one CPU. Writes
bench/results/growth.json. One round is one run (`--rounds` runs them back to back).
"""

from __future__ import annotations

import math
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import procs
from bench.budget import SPAWNER, Agent, _cpu_rss, decisions, guard_text, judged_pcts
from bench.procs import BenchError

# The run's length: the 30 minutes.
RUN_S = 1800.0
# Before the first sample counted: BPF compiled, every running module's unwind table built.
WARM_S = 120.0
# Between RSS reads.
SAMPLE_S = 15.0
# The stretch at each end whose median RSS is compared.
TAIL_S = 300.0
BUSY = [
    ["sh", "-c", "while :; do :; done"],
    ["sh", "-c", "while :; do :; done"],
    ["python3", "-c", "while True: pass"],
    ["sh", "-c", SPAWNER],
]


class GrowthBench:
    def __init__(self, rounds: int, run_s: float = RUN_S, log: Callable[[str], None] = print) -> None:
        self.rounds, self.run_s, self.log = rounds, run_s, log
        self.our_prog_ids: set[int] = set()

    def run(self) -> dict[str, Any]:
        runs = []
        for r in range(self.rounds):
            with tempfile.TemporaryDirectory(prefix="ebpfprofiler-growth-", dir="/tmp") as tmp:
                work = Path(tmp)
                work.chmod(0o755)
                runs.append(self._one(work))
            g = runs[-1]["stages"]
            self.log(
                f"growth round {r + 1}: "
                + ", ".join(
                    f"{s} {v['start_mb']:.0f}->{v['end_mb']:.0f} MB ({v['growth_mb']:+.1f})" for s, v in g.items()
                )
            )
        return {"runs": runs, "run_s": self.run_s, "warm_s": WARM_S, "sample_s": SAMPLE_S, "tail_s": TAIL_S}

    def _one(self, work: Path) -> dict[str, Any]:
        agent = Agent(work)
        loads = []
        series: dict[str, list[tuple[float, float]]] = {}
        try:
            agent.start()
            loads = [procs.start(argv) for argv in BUSY]
            t0 = time.monotonic()
            cpu0: dict[str, float] = {}
            stages: dict[str, int] = {}
            windows: dict[int, tuple[str, float]] = {}  # the guard's windows seen: end time -> decision, %
            while (now := time.monotonic() - t0) < self.run_s:
                time.sleep(SAMPLE_S)
                now = time.monotonic() - t0
                got = agent.stages()
                if "collector" not in got:
                    raise BenchError(f"the collector is not running; see {agent.log}")
                if stages and got != stages:
                    raise BenchError(f"a stage restarted during the run ({stages} -> {got}); see {agent.log}")
                stages = got
                agent.note_window(windows)
                for s, pid in stages.items():
                    cpu, rss = _cpu_rss(pid)
                    if now >= WARM_S:
                        cpu0.setdefault(s, cpu)
                        series.setdefault(s, []).append((now, rss / 1e6))
            cpu1 = {s: _cpu_rss(pid)[0] for s, pid in stages.items()}
            status = agent.status()
        finally:
            for p in loads:
                procs.stop(p, sig=signal.SIGKILL, timeout=10)
            agent.stop()
        measured = self.run_s - WARM_S
        out: dict[str, Any] = {}
        for s, pts in series.items():
            growth = _median_mb(pts, self.run_s - TAIL_S) - _median_mb(pts, WARM_S, WARM_S + TAIL_S)
            out[s] = {
                "start_mb": pts[0][1],
                "end_mb": pts[-1][1],
                "max_mb": max(m for _, m in pts),
                "growth_mb": growth,
                "growth_mb_per_h": growth / ((self.run_s - WARM_S - TAIL_S) / 3600),
                "late_growth_mb": late_growth_mb(pts, self.run_s),
                "cpu_pct": 100 * (cpu1[s] - cpu0[s]) / measured,
            }
        return {
            "stages": out,
            "series": {s: pts for s, pts in series.items()},
            "sample_hz": status.get("rate_hz"),
            "guard": status.get("decision"),
            "decisions": decisions(windows),
            "judged_pct": judged_pcts(windows),
            "total_start_mb": sum(v["start_mb"] for v in out.values()),
            "total_end_mb": sum(v["end_mb"] for v in out.values()),
        }


def _median_mb(pts: list[tuple[float, float]], start: float, end: float = math.inf) -> float:
    """The median RSS (MB) of the reads taken from start to end seconds into the run."""
    return statistics.median(m for t, m in pts if start <= t <= end)


def late_growth_mb(pts: list[tuple[float, float]], run_s: float) -> float:
    """The last TAIL_S seconds' median RSS minus that of the TAIL_S seconds before them: whether a stage
    still grows at the end of the run, where `growth_mb` may also hold a cache filling early on."""
    return _median_mb(pts, run_s - TAIL_S) - _median_mb(pts, run_s - 2 * TAIL_S, run_s - TAIL_S)


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    head = [
        "stage",
        "RSS after warm-up MB",
        "RSS at end MB",
        "highest MB",
        "growth MB",
        "MB per hour",
        f"last {2 * result['tail_s'] / 60:.0f} min MB",
        "% of one CPU",
    ]
    rows = []
    for i, run in enumerate(result["runs"]):
        for s, v in run["stages"].items():
            rows.append(
                [
                    f"{s}" + (f" (run {i + 1})" if len(result["runs"]) > 1 else ""),
                    f"{v['start_mb']:.1f}",
                    f"{v['end_mb']:.1f}",
                    f"{v['max_mb']:.1f}",
                    f"{v['growth_mb']:+.1f}",
                    f"{v['growth_mb_per_h']:+.1f}",
                    f"{v['late_growth_mb']:+.1f}" if "late_growth_mb" in v else "",
                    f"{v['cpu_pct']:.2f}",
                ]
            )
    notes = [
        f"run {i + 1}: all stages {r['total_start_mb']:.0f} -> {r['total_end_mb']:.0f} MB; rate "
        f"{r['sample_hz']} Hz at the end; guard: "
        + (guard_text(r["decisions"]) if "decisions" in r else (r["guard"] or "its last window kept the rate"))
        for i, r in enumerate(result["runs"])
    ]
    notes.append(
        "growth: median RSS of the last {0:.0f} s minus that of the first {0:.0f} s after the warm-up; "
        "last {1:.0f} min: that of the last {0:.0f} s minus that of the {0:.0f} s before them".format(
            result["tail_s"], 2 * result["tail_s"] / 60
        )
    )
    caption = (
        f"{result['run_s'] / 60:.0f} minutes under budget's busy load at deploy/agent.yaml's defaults, "
        f"RSS read every {result['sample_s']:.0f} s after {result['warm_s']:.0f} s"
    )
    return caption, head, rows, notes
