"""The cost of DWARF unwinding: BPF run time per sample, and the slowdown of a workload without frame pointers.

BPF time per sample: the kernel's BPF run-time statistics
(kernel.bpf_stats_enabled, switched on for the measurement and restored)
give run_time_ns and run_cnt of the collector's on_cpu_sample program; the
step programs it tail-calls run inside its invocation, so their time is in
its figure. One copy of bench/workloads/deep.c per CPU keeps every CPU in a
stack of the chosen depth (20 or 64 frames), so (almost) every sample is one
of it. Configurations: frame pointers (dwarf_unwind: false; the workload
built with -fno-omit-frame-pointer; the kernel's frame-pointer walk of user
and kernel stacks, as before this feature) and DWARF (dwarf_unwind: true; the
workload built with -fomit-frame-pointer; the unwinder of bpf/unwind.h, with
the process's tables loaded before the measurement starts).

Slowdown: the DWARF-built workload (20 frames) alone and under the pipeline
with DWARF unwinding at each rate, rounds alternating, as in the oncpu suite.
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
from bench.pipeline import PROGRAM_NAME, Pipeline
from bench.procs import BenchError
from shared import pprof

WORKLOAD = Path(__file__).parent / "workloads" / "deep.c"
PINGPONG = Path(__file__).parent / "workloads" / "pingpong.c"
SWITCH_PROGRAM = "offcpu_switch"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
DEPTHS = (20, 64)
MEASURE_S = 4.0
# Units of deep.c that run for hours: the BPF measurement stops it by pid.
FOREVER_UNITS = 10**9
STATS_SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"
TABLES_TIMEOUT_S = 60.0
SLOWDOWN_DEPTH = 20


def build(tmpdir: str) -> dict[str, str]:
    out = {}
    for name, flags in (
        ("fp", ["-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]),
        ("dwarf", ["-fomit-frame-pointer"]),
    ):
        binary = os.path.join(tmpdir, f"deep-{name}")
        subprocess.run(["gcc", "-O2", *flags, "-o", binary, str(WORKLOAD), "-lpthread"], check=True)
        out[name] = binary
    pingpong = os.path.join(tmpdir, "pingpong-nofp")
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-o", pingpong, str(PINGPONG)], check=True)
    out["pingpong"] = pingpong
    return out


def prog_stats(prog_ids: set[int], name: str = PROGRAM_NAME) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of the collector's program `name` (bpftool shows at most 15 characters)."""
    for p in bpf.programs():
        if p["id"] in prog_ids and name.startswith(p.get("name", "\0")):
            return int(p.get("run_time_ns", 0)), int(p.get("run_cnt", 0))
    raise BenchError(f"the collector's {name} program is not loaded")


def wait_for_tables(p: Pipeline, *paths: str) -> None:
    """Until the collector loaded the tables of `paths`, and one more drain wrote the process entries."""
    for path in paths:
        procs.wait_for(
            f"the unwind table of {os.path.basename(path)} in the collector",
            lambda: f"unwind table loaded for {path}" in p.log_path.read_text(errors="replace"),
            TABLES_TIMEOUT_S,
            0.1,
        )
    time.sleep(2.0)  # the next drains write the processes' unwind_procs entries


def whole_share(p: Pipeline, binary: str, depth: int) -> float:
    """Share of the workload's samples (after the tables came) whose user stack has its full depth:
    the figure is only the cost of a walk of that depth if the walk went that deep."""
    total = whole = 0
    for path in p.local_dir.glob("*/*.pb.gz"):
        for s in pprof.read(path.read_bytes()).samples:
            if s.labels.get("process.executable") != binary:
                continue
            user = [f for f in s.frames if f.module != "[kernel.kallsyms]"]
            total += s.values[0]
            whole += s.values[0] if len(user) >= depth else 0
    return whole / total if total else 0.0


class UnwindBench:
    def __init__(self, rounds: int, rates: list[int], log: Callable[[str], None], keep: bool) -> None:
        self.rounds = rounds
        self.rates = rates
        self.log = log
        self.keep = keep
        self.our_prog_ids: set[int] = set()
        self.ncpu = os.sysconf("SC_NPROCESSORS_ONLN")

    def _bpf_ns(self, mode: str, binary: str, depth: int, d: Path) -> dict[str, Any]:
        p = Pipeline(d, 99, upload_interval_s=5, workers=1, offcpu=False, dwarf_unwind=(mode == "dwarf"))
        workers: list[subprocess.Popen[Any]] = []
        try:
            p.start()
            self.our_prog_ids |= p.prog_ids
            workers = [procs.start([binary, str(depth), str(FOREVER_UNITS), "1"]) for _ in range(self.ncpu)]
            if mode == "dwarf":
                wait_for_tables(p, binary, LIBC)
            t0, c0 = prog_stats(p.prog_ids)
            time.sleep(MEASURE_S)
            t1, c1 = prog_stats(p.prog_ids)
        finally:
            for w in workers:
                procs.stop(w, timeout=10)
            p.stop()
        if c1 <= c0:
            raise BenchError(f"{mode} {depth}: {PROGRAM_NAME} did not run")
        return {
            "ns_per_sample": (t1 - t0) / (c1 - c0),
            "samples": c1 - c0,
            "whole_share": whole_share(p, binary, depth),
        }

    def _switch_ns(self, mode: str, binary: str, d: Path) -> dict[str, Any]:
        """BPF ns per sched_switch with off-CPU stacks by frame pointers or by DWARF tables (offcpu_dwarf)."""
        p = Pipeline(
            d, 19, upload_interval_s=5, workers=1, offcpu=True, dwarf_unwind=True, offcpu_dwarf=(mode == "dwarf")
        )
        w = None
        try:
            p.start()
            self.our_prog_ids |= p.prog_ids
            w = procs.start(["taskset", "-c", "0", binary, str(FOREVER_UNITS)])
            if mode == "dwarf":
                wait_for_tables(p, binary, LIBC)
            t0, c0 = prog_stats(p.prog_ids, SWITCH_PROGRAM)
            time.sleep(MEASURE_S)
            t1, c1 = prog_stats(p.prog_ids, SWITCH_PROGRAM)
        finally:
            if w is not None:
                procs.stop(w, timeout=10)
            p.stop()
        return {"ns_per_switch": (t1 - t0) / max(c1 - c0, 1), "switches": c1 - c0}

    def _elapsed(self, binary: str, units: int) -> float:
        out = subprocess.run(
            [binary, str(SLOWDOWN_DEPTH), str(units), str(self.ncpu)],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
        return float(out.split("=")[1])

    def run(self) -> dict[str, Any]:
        tmp = tempfile.mkdtemp(prefix="ebpfprofiler-bench-unwind-")
        os.chmod(tmp, 0o755)
        t_start = time.monotonic()
        old_stats = Path(STATS_SYSCTL).read_text().strip()
        try:
            binaries = build(tmp)
            Path(STATS_SYSCTL).write_text("1")
            bpf_runs = [self._bpf_round(r, binaries, Path(tmp)) for r in range(self.rounds)]
            # Slowdown: a fixed amount of work, about 4 s alone.
            units = max(1000, int(4000 * 4.0 / max(self._elapsed(binaries["dwarf"], 4000), 1e-3)))
            slow_runs = [self._slowdown_round(r, binaries["dwarf"], units, Path(tmp)) for r in range(self.rounds)]
        finally:
            Path(STATS_SYSCTL).write_text(old_stats)
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        on = [k for k in bpf_runs[0] if not k.startswith("offcpu")]
        summary = {key: stats.summary([row[key]["ns_per_sample"] for row in bpf_runs]) for key in on}
        whole = {key: stats.summary([row[key]["whole_share"] for row in bpf_runs]) for key in on}
        switch = {
            key: stats.summary([row[key]["ns_per_switch"] for row in bpf_runs])
            for key in bpf_runs[0]
            if key.startswith("offcpu")
        }
        slowdown = {
            cfg: stats.summary([row[cfg] / row["none"] for row in slow_runs]) for cfg in slow_runs[0] if cfg != "none"
        }
        return {
            "workload": f"bench/workloads/deep.c: one thread per CPU in a stack of {DEPTHS} frames",
            "method": __doc__,
            "rounds": self.rounds,
            "bpf_runs": bpf_runs,
            "slow_runs": slow_runs,
            "bpf_ns_per_sample": summary,
            "whole_stack_share": whole,
            "bpf_ns_per_sched_switch": switch,
            "slowdown": slowdown,
            "units": units,
            "seconds": round(time.monotonic() - t_start, 1),
        }

    def _bpf_round(self, r: int, binaries: dict[str, str], tmp: Path) -> dict[str, dict[str, Any]]:
        """Round r's BPF ns per sample at each depth and per sched_switch, by frame pointers and by DWARF."""
        row: dict[str, dict[str, Any]] = {}
        for depth in DEPTHS:
            for mode in ("fp", "dwarf"):
                key = f"{mode} {depth}"
                row[key] = self._bpf_ns(mode, binaries[mode], depth, tmp / f"b{r}-{key.replace(' ', '-')}")
                self.log(
                    f"unwind round {r + 1}/{self.rounds} {key} frames: "
                    f"{row[key]['ns_per_sample']:.0f} ns per sample ({row[key]['samples']} samples)"
                )
        for mode in ("fp", "dwarf"):
            key = f"offcpu {mode}"
            row[key] = self._switch_ns(mode, binaries["pingpong"], tmp / f"o{r}-{mode}")
            self.log(
                f"unwind round {r + 1}/{self.rounds} {key}: {row[key]['ns_per_switch']:.0f} ns per "
                f"sched_switch ({row[key]['switches']} switches)"
            )
        return row

    def _slowdown_round(self, r: int, binary: str, units: int, tmp: Path) -> dict[str, float]:
        """Round r's seconds of `units` of work alone and under the pipeline with DWARF unwinding at each rate."""
        configs = ["none"] + [f"pipeline {hz} Hz dwarf" for hz in self.rates]
        row: dict[str, float] = {}
        for i, cfg in enumerate(configs):
            if cfg == "none":
                row[cfg] = self._elapsed(binary, units)
            else:
                hz = int(cfg.split()[1])
                p = Pipeline(tmp / f"s{r}-{i}", hz, upload_interval_s=5, workers=1, offcpu=False, dwarf_unwind=True)
                try:
                    p.start()
                    self.our_prog_ids |= p.prog_ids
                    row[cfg] = self._elapsed(binary, units)
                finally:
                    p.stop()
            self.log(f"unwind slowdown round {r + 1}/{self.rounds} {cfg}: {row[cfg]:.3f} s")
        return row


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of BPF time per sample and the slowdown with DWARF unwinding."""
    from bench.report import _mmm

    head = ["measure", "configuration", "median (min–max)"]
    rows = []
    for key, s in result["bpf_ns_per_sample"].items():
        mode, depth = key.split()
        rows.append(
            [
                "BPF ns per sample (on_cpu_sample and its tail calls)",
                f"{'frame pointers' if mode == 'fp' else 'DWARF tables'}, {depth} frames",
                _mmm(s, "{:,.0f}"),
            ]
        )
    for key, s in result.get("whole_stack_share", {}).items():
        mode, depth = key.split()
        rows.append(
            [
                "share of samples with all their frames (whole profile)",
                f"{'frame pointers' if mode == 'fp' else 'DWARF tables'}, {depth} frames",
                _mmm(s, "{:.3f}"),
            ]
        )
    for key, s in result.get("bpf_ns_per_sched_switch", {}).items():
        rows.append(
            [
                "BPF ns per sched_switch (pingpong without frame pointers, pinned to CPU 0)",
                "off-CPU stacks by frame pointers" if key.endswith("fp") else "offcpu_dwarf: DWARF tables",
                _mmm(s, "{:,.0f}"),
            ]
        )
    for cfg, s in result["slowdown"].items():
        rows.append(["slowdown: elapsed / elapsed alone (> 1: slower)", cfg.replace("pipeline", "pipeline,"), _mmm(s)])
    caption = (
        f"{result['workload']}; {result['rounds']} rounds, configurations in turn; kernel BPF "
        "statistics (kernel.bpf_stats_enabled) over 4 s with one copy of the workload per CPU"
    )
    return caption, head, rows, [f"full run: {result['seconds']} s"]
