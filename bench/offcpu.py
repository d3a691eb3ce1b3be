"""Off-CPU cost on a context-switch-heavy workload: two processes ping-ponging a byte.

Each round runs the same number of round trips once under every
configuration, in turn: nothing; the pipeline with on-CPU profiling only; the
pipeline with on-CPU and off-CPU profiling; the same with offcpu_dwarf (each
switch-out walks the user stack with the unwind tables); and `perf record -e
sched:sched_switch -g`, the off-CPU peer that runs on these machines (bcc's
offcputime needs kprobes, and CONFIG_KPROBES is off here). Every profiler is
started fresh for its run, the workload starts once it is attached on every
CPU, and it is stopped after. Figures: round trips per second, and the ratio
to nothing in the same round (< 1: slower), median with min and max.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import bpf, procs, stats
from bench.pipeline import Pipeline
from bench.procs import BenchError

WORKLOAD = Path(__file__).parent / "workloads" / "pingpong.c"
# Round trips per run: ~0.7 s alone here, a few seconds under the slowest profiler.
ROUND_TRIPS = 200_000
# Untimed ping-pong before the timed part, in every configuration: the profiler
# sees the two processes (on-CPU samples) and, with offcpu_dwarf, loads their
# unwind tables and process entries before the measurement.
WARMUP_S = 3.0
SAMPLE_HZ = 19
RUN_TIMEOUT_S = 300.0
PERF_ATTACH_TIMEOUT_S = 60.0
CONFIGS = (
    "none",
    "pipeline on-CPU",
    "pipeline on+off-CPU",
    "pipeline on+off-CPU, offcpu_dwarf",
    "perf sched_switch -g",
)
PEER_NOT_RUN = ("bcc offcputime", "needs kprobes; CONFIG_KPROBES is off on these machines, so it cannot run")


def build(tmpdir: str) -> str:
    binary = os.path.join(tmpdir, "pingpong")
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-o", binary, str(WORKLOAD)], check=True)
    return binary


def run_workload(binary: str, round_trips: int) -> float:
    """Round trips per second of one run, both processes on CPU 0.

    Pinned, every round trip is the same two context switches on one CPU; on
    two CPUs it is dominated by cross-CPU wakeup latency, which a profiler that
    keeps CPUs out of deep idle can even shorten."""
    out = subprocess.run(
        ["taskset", "-c", "0", binary, str(round_trips), str(WARMUP_S)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if out.returncode != 0:
        raise BenchError(f"pingpong failed: {out.stderr.strip()}")
    fields = dict(kv.split("=") for kv in out.stdout.split())
    return int(fields["round_trips"]) / float(fields["seconds"])


class PerfSchedSwitch:
    """`perf record -a -g -e sched:sched_switch`, streamed to /dev/null (pipe mode)."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True)
        self.err = workdir / "perf.stderr"
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> None:
        with open(self.err, "w") as err:
            proc = self.proc = procs.start(
                ["perf", "record", "-a", "-g", "-e", "sched:sched_switch", "-o", "-"],
                stdout=subprocess.DEVNULL,
                stderr=err,
                default_sigint=True,
            )
        ncpu = os.sysconf("SC_NPROCESSORS_ONLN")

        def attached() -> bool:
            if proc.poll() is not None:
                raise BenchError(f"perf exited with {proc.returncode}: {self.err.read_text().strip()}")
            return bpf.held_by(proc.pid)[1] >= ncpu

        procs.wait_for("perf's sched_switch events on every CPU", attached, PERF_ATTACH_TIMEOUT_S, 0.05)

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, sig=2, timeout=60)
            self.proc = None


class PingPongBench:
    def __init__(self, rounds: int, round_trips: int, log: Callable[[str], None], keep: bool) -> None:
        self.rounds = rounds
        self.round_trips = round_trips
        self.log = log
        self.keep = keep
        self.our_prog_ids: set[int] = set()

    def _one(self, config: str, binary: str, d: Path) -> float:
        if config == "none":
            return run_workload(binary, self.round_trips)
        if config.startswith("pipeline"):
            p = Pipeline(
                d,
                SAMPLE_HZ,
                upload_interval_s=5,
                workers=1,
                offcpu="off-CPU" in config,
                offcpu_dwarf=config.endswith("offcpu_dwarf"),
            )
            try:
                p.start()
                self.our_prog_ids |= p.prog_ids
                return run_workload(binary, self.round_trips)
            finally:
                p.stop()
        perf = PerfSchedSwitch(d)
        try:
            perf.start()
            return run_workload(binary, self.round_trips)
        finally:
            perf.stop()

    def run(self) -> dict[str, Any]:
        tmp = tempfile.mkdtemp(prefix="ebpfprofiler-bench-pingpong-")
        os.chmod(tmp, 0o755)
        t_start = time.monotonic()
        try:
            binary = build(tmp)
            runs: list[dict[str, Any]] = []
            for r in range(self.rounds):
                row: dict[str, float] = {}
                for i, config in enumerate(CONFIGS):
                    row[config] = self._one(config, binary, Path(tmp) / f"r{r}-{i}")
                    self.log(f"pingpong round {r + 1}/{self.rounds} {config}: {row[config]:,.0f} round trips/s")
                runs.append(row)
        finally:
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        summary = {}
        for config in CONFIGS:
            summary[config] = {
                "round_trips_per_s": stats.summary([row[config] for row in runs]),
                "ratio_to_none": stats.summary([row[config] / row["none"] for row in runs]),
            }
        return {
            "workload": f"pingpong: {self.round_trips} round trips of one byte over two pipes "
            f"between two processes pinned to CPU 0 (2 context switches each)",
            "sample_hz": SAMPLE_HZ,
            "rounds": self.rounds,
            "configs": list(CONFIGS),
            "runs": runs,
            "summary": summary,
            "not_run": {PEER_NOT_RUN[0]: PEER_NOT_RUN[1]},
            "seconds": round(time.monotonic() - t_start, 1),
        }
