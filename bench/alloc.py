"""The cost of allocation and lock profiling: a malloc/free loop and a contended mutex loop.

Allocation: bench/workloads/malloc_loop.c, malloc and free of 16 to 1024
bytes in a tight loop (the worst case: while the uprobes are attached every
call traps into the kernel), as iterations per second. Configurations, each
round in turn (the order reversed every other round): nothing; the pipeline
with the workload as its alloc target at the defaults (one sample per 64
KiB, uprobes attached in bursts for 3% of each second), at two other duty
cycles (5% and 20%), and always attached (alloc_duty_pct 100: the design
before bursts); and the pipeline profiling the allocations of another
process name, with this one not a target (no uprobe is in its memory).
Under a profiler that targets it the workload waits until its uprobes are
on (a burst), then a time drawn uniformly over one burst period, before it
times its loop: a run then starts at a random point of the bursts' cycle, as
a program's work does (started at a burst's start, a run of T seconds holds
one burst more than its share: ~1 + T bursts for T; the figures before
this change were taken so). Runs in bursts last ~3 s (three periods and more);
always attached does fewer iterations (it is two orders of magnitude
slower): the figure is a rate.

Accuracy: tests/workloads/alloc_mix.c (blocks of 32-352 bytes freed at once
by mix_a and mix_b, 3:1 in bytes, 4 KiB blocks leaked by leak_page; 15 MB/s
for 40 s) under the pipeline at the defaults: mix_a's share of the two
functions' alloc_space against the truth it printed, the estimated total
against the true total (bursts see a program slowed by its traps: a total
is low by that slowdown, a share is not), and what the last window shows in
use (leak_page's only, against the bytes it leaked).

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
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import procs, stats
from bench.overhead import bpf_totals, kernel_stats, run_workload
from bench.pipeline import Pipeline
from bench.procs import BenchError
from collector.alloc import BURST_PERIOD_S
from shared import pprof
from shared.config import DEFAULT_ALLOC_DUTY_PCT

WORKLOADS = Path(__file__).parent / "workloads"
TEST_WORKLOADS = Path(__file__).parent.parent / "tests" / "workloads"  # the mixed workload the tests run
SAMPLE_HZ = 19
# Iterations per run: ~3 s alone, and in bursts (three periods and more); ~1-3 s with a uprobe
# trap on every call (always attached).
MALLOC_LONG = 400_000_000
MALLOC_ALWAYS = 500_000
MIX_SECONDS, MIX_MB_PER_S = 40, 15
MIX_FUNCTIONS = ("mix_a", "mix_b", "leak_page")
# Lock/unlock pairs per thread per run (~1 s alone), after the warm-up.
MUTEX_PAIRS = 3_000_000
MUTEX_WARMUP_S = 3.0
# configuration -> alloc_duty_pct (None: no profiler; -1: profiling another process); defaults otherwise
ALLOC_CONFIGS = {
    "none": None,
    f"alloc, defaults (bursts, {DEFAULT_ALLOC_DUTY_PCT:g}% duty)": DEFAULT_ALLOC_DUTY_PCT,
    "alloc, 5% duty": 5.0,
    "alloc, 20% duty": 20.0,
    "alloc, always attached (100% duty)": 100.0,
    "alloc of another process (this one not a target)": -1,
}
LOCK_CONFIGS = ("none", "pipeline, no lock targets", "pipeline, lock target")
BPF_OBJ_NAME_CHARS = 15  # BPF_OBJ_NAME_LEN less its NUL
PROBE_PROGRAMS = (
    "alloc_malloc_enter",
    "alloc_return_probe",
    "alloc_free_enter",
    "alloc_calloc_enter",
    "tracepoint__syscalls__sys_enter_futex",
    "tracepoint__syscalls__sys_exit_futex",
)


def build(tmp: str) -> dict[str, str]:
    out = {}
    for name, flags, src in (
        ("malloc_loop", [], WORKLOADS),
        ("mutex_loop", ["-pthread"], WORKLOADS),
        ("alloc_mix", [], TEST_WORKLOADS),
    ):
        out[name] = os.path.join(tmp, name)
        r = subprocess.run(
            ["gcc", "-O2", "-fno-omit-frame-pointer", *flags, "-o", out[name], str(src / f"{name}.c")],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            raise BenchError(f"cannot build {name}: {r.stderr.strip()}")
    return out


def rate(argv: list[str], iterations: int) -> tuple[float, float]:
    """(iterations per second of one run as the workload timed them, iterations per CPU second of it).
    The second is what the probes cost the target on a shared host: other tenants' load slows the
    wall clock of every configuration alike, but a trap is the target's own (system) CPU time."""
    elapsed, cpu, _ = run_workload(argv, os.path.basename(argv[0]))
    return iterations / elapsed, iterations / cpu if cpu > 0 else 0.0


class AllocLockBench:
    def __init__(self, rounds: int, log: Callable[[str], None], keep: bool) -> None:
        self.rounds = rounds
        self.log = log
        self.keep = keep
        self.our_prog_ids: set[int] = set()
        self.rng = random.Random()  # each run's start in the bursts' cycle

    def _profiled(
        self,
        d: Path,
        argv: list[str],
        iterations: int,
        **changes: Any,  # ProfilerConfig fields, each its own type
    ) -> tuple[tuple[float, float], dict[str, float]]:
        """(rates of `argv` under the pipeline, BPF ns per run of each probe program that ran)."""
        p = Pipeline(d, SAMPLE_HZ, upload_interval_s=5, workers=1, offcpu=False, **changes)
        try:
            p.start()
            self.our_prog_ids |= p.prog_ids
            # the kernel's statistics on for the probes' ns per run (the agent leaves them off): as
            # the figures of this suite were taken before, when the collector kept them on
            stats_on = kernel_stats()
            try:
                before = bpf_totals([p.pids["collector"]])
                r = rate(argv, iterations)
                after = bpf_totals([p.pids["collector"]])
            finally:
                stats_on.close()
        finally:
            p.stop()
        per_run: dict[str, float] = {}
        for name in PROBE_PROGRAMS:
            # the alloc programs are loaded without BTF: the kernel keeps 15 characters of their names
            short = name[:BPF_OBJ_NAME_CHARS]
            t, c = after.get(name) or after.get(short) or (0, 0)
            t0, c0 = before.get(name) or before.get(short) or (0, 0)
            if c > c0:
                per_run[name] = (t - t0) / (c - c0)
        return r, per_run

    def run(self) -> dict[str, Any]:
        tmp = tempfile.mkdtemp(prefix="ebpfprofiler-bench-alloc-")
        os.chmod(tmp, 0o755)
        t_start = time.monotonic()
        runs: list[dict[str, Any]] = []
        accuracy: list[dict[str, Any]] = []
        try:
            bins = build(tmp)
            for r in range(self.rounds):
                alloc = list(ALLOC_CONFIGS.items())
                lock = list(LOCK_CONFIGS)
                if r % 2:
                    alloc.reverse()
                    lock.reverse()
                for i, (config, duty) in enumerate(alloc):
                    runs.append(self._malloc_run(Path(tmp) / f"r{r}-a{i}", r, config, duty, bins["malloc_loop"]))
                accuracy.append(self._accuracy(Path(tmp) / f"r{r}-mix", bins["alloc_mix"]))
                self.log(f"alloc round {r + 1}/{self.rounds} mixed workload at the defaults: {accuracy[-1]}")
                for i, config in enumerate(lock):
                    runs.append(self._mutex_run(Path(tmp) / f"r{r}-l{i}", r, config, bins["mutex_loop"]))
        finally:
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        acc = {
            k: stats.summary([a[k] for a in accuracy if a.get(k) is not None])
            for k in ("share_a", "share_a_truth", "share_error", "total_ratio", "inuse_ratio")
        }
        return {
            "method": __doc__,
            "rounds": self.rounds,
            "sample_hz": SAMPLE_HZ,
            "runs": runs,
            "summary": summarize(runs),
            "accuracy_runs": accuracy,
            "accuracy": acc,
            "seconds": round(time.monotonic() - t_start, 1),
        }

    def _malloc_run(self, d: Path, r: int, config: str, duty: float | None, exe: str) -> dict[str, Any]:
        """One run of malloc_loop in configuration `config` (alloc profiling at `duty` %, None: no pipeline)."""
        ns: dict[str, float]
        if duty is None:
            fig, ns = rate([exe, str(MALLOC_LONG), "0"], MALLOC_LONG), {}
        elif duty < 0:  # allocation profiling on, for a name this process does not have
            fig, ns = self._profiled(d, [exe, str(MALLOC_LONG), "0"], MALLOC_LONG, alloc_targets=("not_this_process",))
        else:
            n = MALLOC_ALWAYS if duty >= 100 else MALLOC_LONG
            delay_us = 0 if duty >= 100 else int(1e6 * self.rng.uniform(0, BURST_PERIOD_S))
            fig, ns = self._profiled(
                d,
                [exe, str(n), "1", str(delay_us)],
                n,
                alloc_targets=("malloc_loop",),
                alloc_duty_pct=duty,
            )
        self.log(
            f"alloc round {r + 1}/{self.rounds} {config}: {fig[0]:,.0f} malloc+free/s, {fig[1]:,.0f} per CPU second"
        )
        return {"round": r, "suite": "malloc", "config": config, "rate": fig[0], "cpu_rate": fig[1], "bpf_ns": ns}

    def _mutex_run(self, d: Path, r: int, config: str, exe: str) -> dict[str, Any]:
        """One run of mutex_loop in configuration `config`."""
        argv = [exe, str(MUTEX_PAIRS), str(MUTEX_WARMUP_S)]
        ns: dict[str, float]
        if config == "none":
            fig, ns = rate(argv, 2 * MUTEX_PAIRS), {}
        else:
            targets = ("mutex_loop",) if config.endswith("lock target") else ()
            fig, ns = self._profiled(d, argv, 2 * MUTEX_PAIRS, lock_targets=targets)
        self.log(f"lock round {r + 1}/{self.rounds} {config}: {fig[0]:,.0f} lock/unlock pairs/s")
        return {"round": r, "suite": "mutex", "config": config, "rate": fig[0], "cpu_rate": fig[1], "bpf_ns": ns}

    def _accuracy(self, d: Path, exe: str) -> dict[str, Any]:
        """The mixed workload under the pipeline at the defaults: shares, totals and inuse against the truth."""
        p = Pipeline(d, SAMPLE_HZ, upload_interval_s=5, workers=1, offcpu=False, alloc_targets=("alloc_mix",))
        try:
            p.start()
            self.our_prog_ids |= p.prog_ids
            w = procs.start(
                [exe, str(MIX_SECONDS), str(MIX_MB_PER_S)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            try:
                out, inp = w.stdout, w.stdin
                if out is None or inp is None:
                    raise BenchError("alloc_mix was started without its pipes")
                out.readline()
                done = dict(f.split("=", 1) for f in out.readline().split()[1:])
                time.sleep(12)  # two more windows of 5 s: the idle one shows the leak alone in use
                inp.close()
            finally:
                procs.stop(w, timeout=10)
        finally:
            p.stop()
        space: dict[str, int] = {f: 0 for f in MIX_FUNCTIONS}
        last_inuse: dict[str, int] = {}
        for path in sorted(p.local_dir.glob("*/*.pb.gz"), key=lambda x: x.stat().st_mtime):
            prof = pprof.read(path.read_bytes())
            if [t for t, _ in prof.sample_types][:2] != ["alloc_objects", "alloc_space"]:
                continue
            inuse = {f: 0 for f in MIX_FUNCTIONS}
            for smp in prof.samples:
                if smp.labels.get("process.executable") != exe:
                    continue
                for f in MIX_FUNCTIONS:
                    if f in smp.functions:
                        space[f] += smp.values[1]
                        inuse[f] += smp.values[3]
            if any(inuse.values()):
                last_inuse = inuse
        a, b, leak = int(done["a_bytes"]), int(done["b_bytes"]), int(done["leak_bytes"])
        share = space["mix_a"] / (space["mix_a"] + space["mix_b"]) if space["mix_a"] + space["mix_b"] else None
        truth = a / (a + b)
        return {
            "share_a": share,
            "share_a_truth": truth,
            "share_error": None if share is None else share / truth - 1,
            "ratio": None if not space["mix_b"] else space["mix_a"] / space["mix_b"],
            "ratio_truth": a / b,
            "total_ratio": sum(space.values()) / (a + b + leak),
            "space": space,
            "inuse_last": last_inuse,
            "inuse_ratio": last_inuse.get("leak_page", 0) / leak if leak else None,
            "inuse_not_leak": last_inuse.get("mix_a", 0) + last_inuse.get("mix_b", 0),
        }


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload and configuration: its rates, their ratios to `none` of the same round, BPF ns per run."""
    summary: dict[str, dict[str, Any]] = {}
    for suite, configs in (("malloc", list(ALLOC_CONFIGS)), ("mutex", list(LOCK_CONFIGS))):
        for config in configs:
            mine = [x for x in runs if x["suite"] == suite and x["config"] == config]
            none = {x["round"]: x["rate"] for x in runs if x["suite"] == suite and x["config"] == "none"}
            none_cpu = {x["round"]: x["cpu_rate"] for x in runs if x["suite"] == suite and x["config"] == "none"}
            programs = sorted({p for x in mine for p in x["bpf_ns"]})
            summary[f"{suite} | {config}"] = {
                "rate": stats.summary([x["rate"] for x in mine]),
                "ratio_to_none": stats.summary([x["rate"] / none[x["round"]] for x in mine]),
                "cpu_ratio_to_none": stats.summary(
                    [x["cpu_rate"] / none_cpu[x["round"]] for x in mine if none_cpu[x["round"]]]
                ),
                "bpf_ns_per_run": {p: stats.summary([x["bpf_ns"].get(p) for x in mine]) for p in programs},
            }
    return summary


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) for RESULTS.md and the terminal."""
    head = [
        "workload",
        "configuration",
        "operations/s",
        "ratio to none (same round)",
        "ratio per CPU second of the workload",
        "BPF ns per probe run",
    ]
    rows = [_config_row(key, f) for key, f in result["summary"].items()]
    acc = result.get("accuracy", {})
    if acc:
        rows += _accuracy_rows(acc)
    caption = (
        f"pipeline at {result['sample_hz']} Hz on-CPU, off-CPU off; {result['rounds']} rounds, "
        "configurations in turn; median (min–max); ratio < 1: slower"
    )
    return caption, head, rows, [f"full run: {result['seconds']} s", *NOTES]


def _config_row(key: str, f: dict[str, Any]) -> list[str]:
    """The table's row of one workload in one configuration."""
    from bench.report import _mmm

    suite, config = key.split(" | ")
    unit = "malloc+free" if suite == "malloc" else "lock/unlock pairs"
    ns = ", ".join(
        f"{p.replace('tracepoint__syscalls__', '')} {s['median']:,.0f}"
        for p, s in f["bpf_ns_per_run"].items()
        if s["median"] is not None
    )
    return [
        f"{suite} ({unit})",
        config,
        _mmm(f["rate"], "{:,.0f}"),
        "1 (reference)" if config == "none" else _mmm(f["ratio_to_none"], "{:.4f}"),
        "1 (reference)" if config == "none" else _mmm(f.get("cpu_ratio_to_none", {}), "{:.4f}"),
        ns or "-",
    ]


def _accuracy_rows(acc: dict[str, Any]) -> list[list[str]]:
    """The table's rows of the mixed workload at the defaults: its shares and totals against the truth."""
    from bench.report import _mmm

    return [
        [
            "alloc_mix (3:1 in bytes, 15 MB/s)",
            "alloc, defaults: mix_a's share of alloc_space",
            _mmm(acc["share_a"], "{:.4f}"),
            f"truth {_mmm(acc['share_a_truth'], '{:.4f}')}",
            f"share error {_mmm(acc['share_error'], '{:+.2%}')}",
            "-",
        ],
        [
            "alloc_mix",
            "alloc, defaults: estimated total / true total",
            _mmm(acc["total_ratio"], "{:.3f}"),
            "-",
            f"leak in use / leaked {_mmm(acc['inuse_ratio'], '{:.3f}')}",
            "-",
        ],
    ]


# The table's notes after the run's length.
NOTES = [
    "ratio per CPU second: iterations per CPU second of the workload (user + system, where the traps "
    "are), against the same alone: what the probes cost the target itself; the wall-clock ratio also "
    "carries the pipeline's CPU and every other tenant's load on this shared 2-CPU host",
    "while attached, a uprobe costs a trap into the kernel and back on every call, whatever the "
    "sampling; bursts bound the time it is attached (alloc_duty_pct), so the slowdown of a program that "
    "only allocates is about the duty cycle",
    "peers, cited from their own reports, not rerun here: OpenTelemetry's eBPF profiler with kernel "
    "uprobes on malloc/free, 295K against 160M iterations/s (0.0018); bpftime's daemon mode, the same "
    "probes run in user space inside the target (code injected into it), 0.97",
    "lock profiling costs only in futex syscalls: an uncontended mutex never makes one",
]
