"""The cost of allocation and lock profiling: a malloc/free loop and a contended mutex loop.

Allocation: bench/workloads/malloc_loop.c, malloc and free of 16 to 1024
bytes in a tight loop (the worst case: with uprobes every call traps into
the kernel), as iterations per second. Configurations, each round in turn
(the order reversed every other round): nothing; the pipeline with the
workload as its alloc target, recording every allocation
(alloc_sample_bytes 0), sampling one per 4 KiB, and one per 512 KiB (the
default); and the pipeline profiling the allocations of another process
name, with this one not a target (it must run at full speed: no uprobe is
in its memory). Under a profiler that targets it the workload waits until
its uprobes are on before it times its loop. A profiled run does fewer iterations than one
alone (it is two orders of magnitude slower): the figure is a rate.

Locks: bench/workloads/mutex_loop.c, two threads taking one mutex in a
tight loop (contended: futex waits and wakes), lock/unlock pairs per second,
after an untimed warm-up in which the collector finds the process:
nothing; the pipeline with no lock targets; the pipeline with the workload
as its lock target.

Every figure is the median (min, max) over the rounds, with the ratio to
nothing in the same round (< 1: slower); for the profiled runs also the
BPF run time per run of the probe programs, from the kernel's statistics
(on while the collector runs).

Must not: leave a process or a BPF program behind (procs.stop_all and
bench/run.py's check), or write results (bench/run.py does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import stats
from bench.overhead import bpf_totals, run_workload
from bench.pipeline import Pipeline
from bench.procs import BenchError

WORKLOADS = Path(__file__).parent / "workloads"
SAMPLE_HZ = 19
# Iterations per run: ~0.5 s alone; ~1-3 s with a uprobe trap on every call.
MALLOC_ALONE = 40_000_000
MALLOC_PROFILED = 500_000
# Lock/unlock pairs per thread per run (~1 s alone), after the warm-up.
MUTEX_PAIRS = 3_000_000
MUTEX_WARMUP_S = 3.0
ALLOC_CONFIGS = {"none": None, "alloc, every allocation": 0, "alloc, 1 per 4 KiB": 4096,
                 "alloc, 1 per 512 KiB (default)": 512 * 1024,
                 "alloc of another process (this one not a target)": -1}
LOCK_CONFIGS = ("none", "pipeline, no lock targets", "pipeline, lock target")
PROBE_PROGRAMS = ("alloc_malloc_enter", "alloc_return_probe", "alloc_free_enter",
                  "tracepoint__syscalls__sys_enter_futex", "tracepoint__syscalls__sys_exit_futex")


def build(tmp: str) -> dict[str, str]:
    out = {}
    for name, flags in (("malloc_loop", []), ("mutex_loop", ["-pthread"])):
        out[name] = os.path.join(tmp, name)
        r = subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", *flags, "-o", out[name],
                            str(WORKLOADS / f"{name}.c")], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise BenchError(f"cannot build {name}: {r.stderr.strip()}")
    return out


def rate(argv: list[str], iterations: int) -> float:
    """Iterations per second of one run, as the workload timed them."""
    return iterations / run_workload(argv, os.path.basename(argv[0]))[0]


class AllocLockBench:
    def __init__(self, rounds: int, log: Callable[[str], None], keep: bool) -> None:
        self.rounds = rounds
        self.log = log
        self.keep = keep
        self.our_prog_ids: set[int] = set()

    def _profiled(self, d: Path, argv: list[str], iterations: int, **changes: object) -> tuple[float, dict[str, float]]:
        """(rate of `argv` under the pipeline, BPF ns per run of each probe program that ran)."""
        p = Pipeline(d, SAMPLE_HZ, upload_interval_s=5, workers=1, offcpu=False, **changes)
        try:
            p.start()
            self.our_prog_ids |= p.prog_ids
            before = bpf_totals([p.pids["collector"]])
            r = rate(argv, iterations)
            after = bpf_totals([p.pids["collector"]])
        finally:
            p.stop()
        per_run = {}
        for name in PROBE_PROGRAMS:
            t, c = after.get(name, (0, 0))
            t0, c0 = before.get(name, (0, 0))
            if c > c0:
                per_run[name] = (t - t0) / (c - c0)
        return r, per_run

    def run(self) -> dict:
        tmp = tempfile.mkdtemp(prefix="ebpfprofiler-bench-alloc-")
        os.chmod(tmp, 0o755)
        t_start = time.monotonic()
        runs: list[dict] = []
        try:
            bins = build(tmp)
            for r in range(self.rounds):
                alloc = list(ALLOC_CONFIGS.items())
                lock = list(LOCK_CONFIGS)
                if r % 2:
                    alloc.reverse()
                    lock.reverse()
                for i, (config, n) in enumerate(alloc):
                    d = Path(tmp) / f"r{r}-a{i}"
                    if n is None:
                        fig, ns = rate([bins["malloc_loop"], str(MALLOC_ALONE), "0"], MALLOC_ALONE), {}
                    elif n < 0:   # allocation profiling on, for a name this process does not have
                        fig, ns = self._profiled(d, [bins["malloc_loop"], str(MALLOC_ALONE), "0"], MALLOC_ALONE,
                                                 alloc_targets=("not_this_process",))
                    else:
                        fig, ns = self._profiled(d, [bins["malloc_loop"], str(MALLOC_PROFILED), "1"], MALLOC_PROFILED,
                                                 alloc_targets=("malloc_loop",), alloc_sample_bytes=n)
                    runs.append({"round": r, "suite": "malloc", "config": config, "rate": fig, "bpf_ns": ns})
                    self.log(f"alloc round {r + 1}/{self.rounds} {config}: {fig:,.0f} malloc+free/s")
                for i, config in enumerate(lock):
                    d = Path(tmp) / f"r{r}-l{i}"
                    argv = [bins["mutex_loop"], str(MUTEX_PAIRS), str(MUTEX_WARMUP_S)]
                    if config == "none":
                        fig, ns = rate(argv, 2 * MUTEX_PAIRS), {}
                    else:
                        targets = ("mutex_loop",) if config.endswith("lock target") else ()
                        fig, ns = self._profiled(d, argv, 2 * MUTEX_PAIRS, lock_targets=targets)
                    runs.append({"round": r, "suite": "mutex", "config": config, "rate": fig, "bpf_ns": ns})
                    self.log(f"lock round {r + 1}/{self.rounds} {config}: {fig:,.0f} lock/unlock pairs/s")
        finally:
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        summary: dict[str, dict] = {}
        for suite, configs in (("malloc", list(ALLOC_CONFIGS)), ("mutex", list(LOCK_CONFIGS))):
            for config in configs:
                mine = [x for x in runs if x["suite"] == suite and x["config"] == config]
                none = {x["round"]: x["rate"] for x in runs if x["suite"] == suite and x["config"] == "none"}
                programs = sorted({p for x in mine for p in x["bpf_ns"]})
                summary[f"{suite} | {config}"] = {
                    "rate": stats.summary([x["rate"] for x in mine]),
                    "ratio_to_none": stats.summary([x["rate"] / none[x["round"]] for x in mine]),
                    "bpf_ns_per_run": {p: stats.summary([x["bpf_ns"].get(p) for x in mine]) for p in programs},
                }
        return {"method": __doc__, "rounds": self.rounds, "sample_hz": SAMPLE_HZ, "runs": runs,
                "summary": summary, "seconds": round(time.monotonic() - t_start, 1)}


def section(result: dict) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) for RESULTS.md and the terminal."""
    from bench.report import _mmm

    head = ["workload", "configuration", "operations/s", "ratio to none (same round)", "BPF ns per probe run"]
    rows = []
    for key, f in result["summary"].items():
        suite, config = key.split(" | ")
        unit = "malloc+free" if suite == "malloc" else "lock/unlock pairs"
        ns = ", ".join(f"{p.replace('tracepoint__syscalls__', '')} {s['median']:,.0f}"
                       for p, s in f["bpf_ns_per_run"].items() if s["median"] is not None)
        rows.append([f"{suite} ({unit})", config, _mmm(f["rate"], "{:,.0f}"),
                     "1 (reference)" if config == "none" else _mmm(f["ratio_to_none"], "{:.4f}"), ns or "-"])
    caption = (f"pipeline at {result['sample_hz']} Hz on-CPU, off-CPU off; {result['rounds']} rounds, "
               "configurations in turn; median (min–max); ratio < 1: slower")
    notes = [f"full run: {result['seconds']} s",
             "a uprobe costs a trap into the kernel and back on every call, whatever the sampling: the "
             "sampling rate sets how many allocations are recorded (map updates, stacks), not how many trap",
             "lock profiling costs only in futex syscalls: an uncontended mutex never makes one"]
    return caption, head, rows, notes
