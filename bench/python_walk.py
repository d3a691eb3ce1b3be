"""The cost of Python frames walked in BPF at the sample: on_cpu_sample's time per run with and without them.

Workload: tests/workloads/py_walk.py `deep N` under the system CPython 3.11,
one copy per CPU, each spinning in leaf_spin() at the bottom of a recursion of
descend() N+1 frames deep, under main() and <module>: a stack of N+4 Python
frames, 10, 30 and 100 here (so that almost every sample is one of that
depth). The programs are bpf/oncpu.c compiled with the walker (bpf/python.h,
collector/pywalk.py) and frame-pointer native stacks (the kernel's walk; no
DWARF tables), loaded and attached in this process at SAMPLE_HZ on every CPU,
as tests/integration/test_python_bpf_walk.py does; each copy is named to the
walker with the layout and _PyRuntime address the runtime reader's detection
finds for it.

Each round starts the copies of each depth afresh and measures MEASURE_S
seconds twice: with the copies not in py_procs (the program looks the pid up,
misses, and takes the native stack only: the cost of a sample without Python
frames) and with them in it (the walk reads every frame, up to
PY_WALK_FRAMES, and keeps the root-most PY_MAX_FRAMES); the order alternates
from round to round, so drift over a round falls on both alike. Time per run
of on_cpu_sample two ways, over the same window: the programs' own
self-timing (bpf/common.h "Self-timing", collector/bpftime.py: the mean of the
runs timed, about one in 16, the figure the agent's overhead guard uses) and
the kernel's BPF statistics (kernel.bpf_stats_enabled, switched on for the
run and restored: run_time_ns over run_cnt, every run, including two clock
reads of its own). The added cost per sample is with minus without within the
same round and depth; per frame, that over the frames walked (py_counters).
The walk's own check: the share of the copies' samples that came with a
Python stack, and the frames kept in it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import bpf, host, procs, stats
from bench.procs import BenchError
from collector import bpftime, pywalk
from collector.oncpu import PROGRAM_NAME, OnCpuSampler
from collector.programs import Programs
from runtimes.cpython import version
from runtimes.memory import ProcessMemory, ReadBudget
from runtimes.runtime import FileCache, ProcessContext
from shared.stage_code import default_bpf_dir

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "workloads" / "py_walk.py"
PYTHON = "/usr/bin/python3.11"
DEPTHS = (10, 30, 100)  # Python frames on the stack
# Python frames besides descend()'s N+1: <module>, main() and leaf_spin().
FRAMES_AROUND = 3
SAMPLE_HZ = 999
MEASURE_S = 3.0
# After the copies print "ready": their recursion is down and spinning.
SETTLE_S = 0.3
READY_TIMEOUT_S = 30.0
STATS_SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"
# Issue 42: a 30-frame Python stack adds at most 5 µs of BPF time to a sample.
TARGET_FRAMES = 30
TARGET_ADDED_NS = 5000.0
CONFIGS = ("without", "with")  # not in py_procs / walked


class Sampler:
    """bpf/oncpu.c with the walker, attached at SAMPLE_HZ; processes named to the walker on request."""

    def __init__(self) -> None:
        defines = {"COUNTS_ENTRIES": 16384, "STACK_ENTRIES": 16384, **pywalk.bpf_defines()}
        self.programs = Programs(default_bpf_dir(), ["oncpu"], defines)
        self.walker = pywalk.PyWalker(self.programs.bpf)
        self.oncpu = OnCpuSampler(self.programs.bpf, SAMPLE_HZ, python=self.walker)
        self.oncpu.attach()

    def target(self, pid: int) -> version.Target:
        ctx = ProcessContext(pid, "/proc", ProcessMemory(pid, ReadBudget(1 << 30)), FileCache())
        found = version.detect(ctx, modern=True, legacy=True)
        if not isinstance(found, version.Target):
            raise BenchError(f"pid {pid}: the CPython detection gave {found}")
        return found

    def own_time(self) -> bpftime.ProgTime:
        return bpftime.read(self.programs.bpf).get(PROGRAM_NAME, bpftime.ProgTime())

    def close(self) -> None:
        self.oncpu.detach()
        self.oncpu.close()
        self.programs.close()


def kernel_stats(prog_ids: set[int]) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of our on_cpu_sample by the kernel's statistics (bpftool: 15 characters)."""
    for p in bpf.programs():
        if p["id"] in prog_ids and PROGRAM_NAME.startswith(p.get("name", "\0")):
            return int(p.get("run_time_ns", 0)), int(p.get("run_cnt", 0))
    raise BenchError(f"our {PROGRAM_NAME} program is not loaded")


def tally(drain: Any, pids: set[int]) -> dict[str, int]:
    """The copies' samples in a drain: all, those with a Python stack, their frames kept, those cut short."""
    out = {"samples": 0, "walked": 0, "frames_kept": 0, "truncated": 0}
    for s in drain.samples:
        if s[0] not in pids:
            continue
        out["samples"] += s[4]
        stack = drain.python_stacks.get(s[7]) if len(s) > 7 and s[7] else None
        if stack is not None:
            out["walked"] += s[4]
            out["frames_kept"] += len(stack.frames) * s[4]
            out["truncated"] += s[4] if stack.truncated else 0
    return out


class PythonWalkBench:
    def __init__(self, rounds: int, quiet_wait: float, log: Callable[[str], None], keep: bool) -> None:
        self.rounds = rounds
        self.quiet_wait = quiet_wait
        self.log = log
        self.keep = keep  # nothing is written to keep: the figures are all in the results
        self.our_prog_ids: set[int] = set()
        self.ncpu = os.sysconf("SC_NPROCESSORS_ONLN")

    def run(self) -> dict[str, Any]:
        if not os.path.exists(PYTHON):
            raise BenchError(f"{PYTHON} is missing: Debian 12's python3.11 (make setup installs it)")
        t_start = time.monotonic()
        waited = host.wait_until_quiet(self.our_prog_ids, self.quiet_wait, self.log)
        old_stats = Path(STATS_SYSCTL).read_text().strip()
        sampler = None
        try:
            Path(STATS_SYSCTL).write_text("1")
            sampler = Sampler()
            self.our_prog_ids |= bpf.held_by(os.getpid())[0]
            runs = [self._round(r, sampler) for r in range(self.rounds)]
        finally:
            if sampler is not None:
                sampler.close()
            Path(STATS_SYSCTL).write_text(old_stats)
        return {
            "workload": (
                f"tests/workloads/py_walk.py deep N under {PYTHON}, {self.ncpu} copies (one per CPU), "
                f"{', '.join(map(str, DEPTHS))} Python frames"
            ),
            "method": __doc__,
            "rounds": self.rounds,
            "sample_hz": SAMPLE_HZ,
            "measure_s": MEASURE_S,
            "limits": {"PY_MAX_FRAMES": pywalk.PY_MAX_FRAMES, "PY_WALK_FRAMES": pywalk.PY_WALK_FRAMES},
            "target": {"frames": TARGET_FRAMES, "added_ns_at_most": TARGET_ADDED_NS},
            "runs": runs,
            "summary": summarize(runs),
            "quiet_wait_s": round(waited, 1),
            "seconds": round(time.monotonic() - t_start, 1),
        }

    def _round(self, r: int, sampler: Sampler) -> dict[str, dict[str, Any]]:
        """Round r: each depth's copies started afresh, measured without and with the walk (order alternating)."""
        row: dict[str, dict[str, Any]] = {}
        for depth in DEPTHS:
            copies = [
                procs.start(
                    [PYTHON, str(WORKLOAD), "deep", str(depth - FRAMES_AROUND - 1)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
                for _ in range(self.ncpu)
            ]
            try:
                for c in copies:
                    assert c.stdout is not None
                    if c.stdout.readline().strip() != b"ready":
                        raise BenchError(f"py_walk.py deep {depth} (pid {c.pid}) did not start")
                targets = {c.pid: sampler.target(c.pid) for c in copies}
                time.sleep(SETTLE_S)
                order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
                row[str(depth)] = {cfg: self._measure(sampler, targets, cfg == "with") for cfg in order}
            finally:
                for c in copies:
                    procs.stop(c, timeout=10)
            self._log_depth(r, depth, row[str(depth)])
        return row

    def _measure(self, sampler: Sampler, targets: dict[int, version.Target], walk: bool) -> dict[str, Any]:
        """One window of MEASURE_S with the copies walked or not: on_cpu_sample's ns per run, two ways."""
        for pid, t in targets.items():
            if walk:
                sampler.walker.add(pid, t.layout, t.runtime)
            else:
                sampler.walker.remove(pid)
        sampler.oncpu.drain()  # empty both buffers: the window's samples alone are tallied
        sampler.walker.counters()
        own0, (k_ns0, k_runs0) = sampler.own_time(), kernel_stats(self.our_prog_ids)
        time.sleep(MEASURE_S)
        (k_ns1, k_runs1), own1 = kernel_stats(self.our_prog_ids), sampler.own_time()
        own = own1.since(own0)
        counters = sampler.walker.counters()
        seen = tally(sampler.oncpu.drain(), set(targets))
        if not own.timed or k_runs1 <= k_runs0:
            raise BenchError(f"{PROGRAM_NAME} did not run ({own.runs} runs, none timed)")
        return {
            "own_ns_per_run": own.timed_ns / own.timed,
            "runs": own.runs,
            "timed": own.timed,
            "kernel_ns_per_run": (k_ns1 - k_ns0) / (k_runs1 - k_runs0),
            "kernel_runs": k_runs1 - k_runs0,
            "walks": counters["walks"],
            "frames_walked_per_walk": counters["frames"] / counters["walks"] if counters["walks"] else 0.0,
            "walks_ended_early": sum(counters[k] for k in ("no_thread", "bad_read", "bad_code", "loop")),
            **seen,
        }

    def _log_depth(self, r: int, depth: int, got: dict[str, dict[str, Any]]) -> None:
        a, b = got["without"], got["with"]
        self.log(
            f"python_walk round {r + 1}/{self.rounds}, {depth} frames: {a['own_ns_per_run']:.0f} ns without, "
            f"{b['own_ns_per_run']:.0f} ns with the walk (kernel's statistics {a['kernel_ns_per_run']:.0f} / "
            f"{b['kernel_ns_per_run']:.0f}); {b['runs']} runs, {b['walked']} of the copies' {b['samples']} "
            f"samples walked, {b['frames_walked_per_walk']:.1f} frames walked a walk"
        )


def summarize(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per depth: median (min–max) over rounds of each figure, and the added cost within each round."""
    out: dict[str, dict[str, Any]] = {}
    for depth in DEPTHS:
        rows = [r[str(depth)] for r in runs]
        walked = [row["with"]["frames_walked_per_walk"] for row in rows]
        entry: dict[str, Any] = {}
        for how in ("own", "kernel"):
            key = f"{how}_ns_per_run"
            added = [row["with"][key] - row["without"][key] for row in rows]
            entry[how] = {
                "without": stats.summary([row["without"][key] for row in rows]),
                "with": stats.summary([row["with"][key] for row in rows]),
                "added": stats.summary(added),
                "added_per_frame": stats.summary([a / w if w else None for a, w in zip(added, walked, strict=True)]),
            }
        entry["frames_walked"] = stats.summary(walked)
        entry["frames_kept"] = stats.summary(
            [row["with"]["frames_kept"] / row["with"]["walked"] if row["with"]["walked"] else None for row in rows]
        )
        entry["walked_share"] = stats.summary(
            [row["with"]["walked"] / row["with"]["samples"] if row["with"]["samples"] else None for row in rows]
        )
        entry["truncated_share"] = stats.summary(
            [row["with"]["truncated"] / row["with"]["walked"] if row["with"]["walked"] else None for row in rows]
        )
        if depth == TARGET_FRAMES:
            added = entry["own"]["added"]["median"]
            entry["target_pass"] = added is not None and added <= TARGET_ADDED_NS
        out[str(depth)] = entry
    return out


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the python_walk suite."""
    from bench.report import _mmm

    head = [
        "Python frames",
        "walked / kept",
        "ns per sample without",
        "ns per sample with",
        "added ns per sample",
        "added ns per frame",
        "added ns, kernel's statistics",
        "samples walked",
        "target (30 frames: ≤ 5 µs added)",
    ]
    rows = []
    for depth, e in result["summary"].items():
        own = e["own"]
        target = ""
        if "target_pass" in e:
            target = "pass" if e["target_pass"] else "FAIL"
        rows.append(
            [
                depth,
                f"{e['frames_walked']['median']:.0f} / {e['frames_kept']['median']:.0f}",
                _mmm(own["without"], "{:,.0f}"),
                _mmm(own["with"], "{:,.0f}"),
                _mmm(own["added"], "{:,.0f}"),
                _mmm(own["added_per_frame"], "{:.1f}"),
                _mmm(e["kernel"]["added"], "{:,.0f}"),
                _mmm(e["walked_share"], "{:.3f}"),
                target,
            ]
        )
    caption = (
        f"{result['workload']}; on_cpu_sample at {result['sample_hz']} Hz on every CPU, {result['measure_s']} s "
        f"without then with the walk (order alternating), {result['rounds']} rounds; median (min–max) over rounds"
    )
    notes = [
        "ns per sample: on_cpu_sample's own timing (bpf/common.h, ~1 run in 16 timed), frame-pointer native stacks",
        "added: with minus without in the same round; per frame: over the frames walked (py_counters)",
        f"kept: a walk keeps the root-most {result['limits']['PY_MAX_FRAMES']} frames and walks at most "
        f"{result['limits']['PY_WALK_FRAMES']}",
        "kernel's statistics: kernel.bpf_stats_enabled run_time_ns / run_cnt over the same windows",
        f"full run: {result['seconds']} s",
    ]
    return caption, head, rows, notes
