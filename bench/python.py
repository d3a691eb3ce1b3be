"""The cost of Python stacks: the runtime reader's CPU per sampled stack, and the slowdown of a
CPU-bound Python workload under it and under py-spy.

Workload: bench/workloads/py_cpu.py under the system CPython 3.11, one copy
per CPU (each a main thread computing 20 Python frames deep and a blocked
thread), an untimed warm-up (the profilers find the processes and read their
code objects), then a fixed number of units, timed by each copy; throughput
is the sum of units per second over the copies.

Each round runs the workload once under every configuration, in turn: nothing;
the pipeline at 19 Hz with Python stacks off (on-CPU profiling only: what
the reader is added to); the pipeline with the runtime reader reading them
(python_stacks, and runtime_stacks: [python_legacy] for 3.11) at its 19 Hz;
`py-spy record --nonblocking -r 19`, one per copy (py-spy reads one process),
which like the reader reads with process_vm_readv and never stops the
process. Figures: throughput, its ratio to nothing in the same round (< 1:
slower), and the CPU the reader or py-spy used while the timed part ran,
per stack and as a share of one CPU. The reader's CPU per stack is its CPU
from ready to the workload's end over the stacks its python_wall profiles
hold; py-spy's, its CPU over the stacks 19 Hz gives for every thread of the
copy it reads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import procs, stats
from bench.pipeline import Pipeline
from bench.procs import BenchError
from shared import pprof

WORKLOAD = Path(__file__).parent / "workloads" / "py_cpu.py"
PYTHON = "/usr/bin/python3.11"
PY_SPY = str(Path(sys.executable).parent / "py-spy")
SAMPLE_HZ = 19
# The untimed part of every run: the reader detects a process in a tick or two after the
# collector announces it (its first drain with a sample of it, within 1 s).
WARMUP_S = 3.0
# Wall seconds of the timed part alone, about.
TIMED_S = 4.0
RUN_TIMEOUT_S = 300.0
PY_SPY_START_TIMEOUT_S = 30.0
# Threads per copy of the workload: its main thread and the blocked one.
THREADS_PER_COPY = 2
CONFIGS = ("none", "pipeline, python stacks off", "pipeline, python stacks on", "py-spy record --nonblocking")


class PySpy:
    """`py-spy record --nonblocking -r 19` on each pid, raw output to files, stopped with SIGINT."""

    def __init__(self, workdir: Path, pids: list[int]) -> None:
        if not os.path.exists(PY_SPY):
            raise BenchError(f"{PY_SPY} is missing: make test-setup installs it (requirements-dev.txt)")
        workdir.mkdir(parents=True)
        self.procs: list[subprocess.Popen[Any]] = []
        self.errs: list[Path] = []
        for pid in pids:
            err = workdir / f"py-spy-{pid}.log"  # it says "Sampling process" on stdout
            with open(err, "w") as e:
                self.procs.append(
                    procs.start(
                        [
                            PY_SPY,
                            "record",
                            "--nonblocking",
                            "-r",
                            str(SAMPLE_HZ),
                            "--pid",
                            str(pid),
                            "--format",
                            "raw",
                            "-o",
                            str(workdir / f"py-spy-{pid}.txt"),
                        ],
                        stdout=e,
                        stderr=e,
                        default_sigint=True,
                    )
                )
            self.errs.append(err)

        def sampling() -> bool:
            for p, err in zip(self.procs, self.errs):
                if p.poll() is not None:
                    raise BenchError(f"py-spy exited with {p.returncode}: {err.read_text(errors='replace')[-2000:]}")
            return all("Sampling process" in err.read_text(errors="replace") for err in self.errs)

        procs.wait_for("py-spy sampling every copy", sampling, PY_SPY_START_TIMEOUT_S, 0.05)

    def cpu(self) -> float:
        return sum(procs.cpu_seconds(p.pid) for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            procs.stop(p, sig=signal.SIGINT, timeout=60)


def python_wall_stacks(p: Pipeline, pids: set[int]) -> tuple[int, int]:
    """(stacks of the workload's processes, stacks of every process) in the pipeline's python_wall profiles."""
    ours = total = 0
    for path in p.local_dir.glob("*/python_wall-*.pb.gz"):
        for s in pprof.read(path.read_bytes()).samples:
            total += s.values[0]
            pid = str(s.labels.get("pid", ""))
            if pid.isdigit() and int(pid) in pids:
                ours += s.values[0]
    return ours, total


class PythonBench:
    def __init__(self, rounds: int, log: Callable[[str], None], keep: bool) -> None:
        self.rounds = rounds
        self.log = log
        self.keep = keep
        self.our_prog_ids: set[int] = set()
        self.copies = os.sysconf("SC_NPROCESSORS_ONLN")

    def _start_copies(self, units: int, warmup_s: float) -> list[subprocess.Popen[Any]]:
        return [
            procs.start([PYTHON, str(WORKLOAD), str(units), str(warmup_s)], stdout=subprocess.PIPE, text=True)
            for _ in range(self.copies)
        ]

    def _finish(self, copies: list[subprocess.Popen[Any]]) -> dict[str, Any]:
        total_units, per_s, seconds = 0, 0.0, []
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for c in copies:
            try:
                out, _ = c.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BenchError(f"the Python workload took over {RUN_TIMEOUT_S:.0f} s") from None
            if c.returncode != 0 or not out.strip():
                raise BenchError(f"the Python workload failed ({c.returncode})")
            r = json.loads(out.strip().splitlines()[-1])
            total_units += r["units"]
            per_s += r["units"] / r["seconds"]
            seconds.append(r["seconds"])
        return {"units_per_s": per_s, "timed_s": max(seconds)}

    def _one(self, config: str, units: int, d: Path) -> dict[str, Any]:
        if config == "none":
            return self._finish(self._start_copies(units, WARMUP_S))
        if config.startswith("pipeline"):
            return self._under_pipeline(units, d, reader_on=config.endswith("on"))
        return self._under_py_spy(units, d)

    def _under_pipeline(self, units: int, d: Path, reader_on: bool) -> dict[str, Any]:
        """The copies under the pipeline, its runtime reader on or off; with it on, the reader's CPU."""
        p = Pipeline(
            d,
            SAMPLE_HZ,
            upload_interval_s=5,
            workers=1,
            offcpu=False,
            python_stacks=reader_on,
            runtime_stacks=("python_legacy",) if reader_on else (),
            plain_pid=True,
        )
        try:
            p.start()
            self.our_prog_ids |= p.prog_ids
            c_start = p.cpu()
            copies = self._start_copies(units, WARMUP_S)
            # The timed part starts WARMUP_S after the copies (their own clocks); the reader's
            # CPU is taken across it: from the end of the warm-up to the last copy's end.
            procs.sleep_until_wall(time.time() + WARMUP_S)
            c0, t0 = p.cpu(), time.monotonic()
            row = self._finish(copies)
            c1, t1 = p.cpu(), time.monotonic()
        finally:
            p.stop()
        if not reader_on:
            return row
        ours, total = python_wall_stacks(p, {c.pid for c in copies})
        if not ours:
            raise BenchError(f"the runtime reader read no stack of the workload:\n{p.log_tail()}")
        reader_s = c1["runtime"] - c0["runtime"]
        interval = t1 - t0
        # Per stack: its CPU from ready to the workload's end (idle ticks and detection
        # included) over every stack its profiles hold.
        return {
            **row,
            "reader_cpu_s": reader_s,
            "interval_s": interval,
            "reader_cpu_share": reader_s / interval,
            "reader_us_per_stack": 1e6 * (c1["runtime"] - c_start["runtime"]) / total,
            "python_wall_stacks_of_workload": ours,
            "python_wall_stacks_all": total,
        }

    def _under_py_spy(self, units: int, d: Path) -> dict[str, Any]:
        """The copies under py-spy, and its CPU."""
        copies = self._start_copies(units, WARMUP_S)
        spy = PySpy(d, [c.pid for c in copies])
        try:
            procs.sleep_until_wall(time.time() + WARMUP_S)
            s0, t0 = spy.cpu(), time.monotonic()
            row = self._finish(copies)
            s1, t1 = spy.cpu(), time.monotonic()
        finally:
            spy.stop()
        interval = t1 - t0
        return {
            **row,
            "py_spy_cpu_s": s1 - s0,
            "interval_s": interval,
            "py_spy_cpu_share": (s1 - s0) / interval,
            "py_spy_us_per_stack": 1e6 * (s1 - s0) / (SAMPLE_HZ * interval * self.copies * THREADS_PER_COPY),
        }

    def run(self) -> dict[str, Any]:
        tmp = tempfile.mkdtemp(prefix="ebpfprofiler-bench-python-")
        os.chmod(tmp, 0o755)
        t_start = time.monotonic()
        try:
            probe = self._finish(self._start_copies(200, 0.0))
            units = max(200, int(probe["units_per_s"] / self.copies * TIMED_S))
            runs: list[dict[str, Any]] = []
            for r in range(self.rounds):
                row: dict[str, dict[str, Any]] = {}
                for i, config in enumerate(CONFIGS):
                    row[config] = self._one(config, units, Path(tmp) / f"r{r}-{i}")
                    extra = ""
                    if "reader_us_per_stack" in row[config]:
                        extra = (
                            f"; reader {row[config]['reader_us_per_stack']:.0f} us CPU per stack, "
                            f"{100 * row[config]['reader_cpu_share']:.2f}% of a CPU"
                        )
                    if "py_spy_us_per_stack" in row[config]:
                        extra = (
                            f"; py-spy {row[config]['py_spy_us_per_stack']:.0f} us CPU per stack, "
                            f"{100 * row[config]['py_spy_cpu_share']:.2f}% of a CPU"
                        )
                    self.log(
                        f"python round {r + 1}/{self.rounds} {config}: {row[config]['units_per_s']:,.0f} units/s{extra}"
                    )
                runs.append(row)
        finally:
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        summary = {}
        for config in CONFIGS:
            summary[config] = {
                "units_per_s": stats.summary([row[config]["units_per_s"] for row in runs]),
                "ratio_to_none": stats.summary(
                    [row[config]["units_per_s"] / row["none"]["units_per_s"] for row in runs]
                ),
            }
        on, spy = CONFIGS[2], CONFIGS[3]
        summary[on]["us_per_stack"] = stats.summary([row[on]["reader_us_per_stack"] for row in runs])
        summary[on]["cpu_share"] = stats.summary([row[on]["reader_cpu_share"] for row in runs])
        summary[spy]["us_per_stack"] = stats.summary([row[spy]["py_spy_us_per_stack"] for row in runs])
        summary[spy]["cpu_share"] = stats.summary([row[spy]["py_spy_cpu_share"] for row in runs])
        return {
            "workload": f"bench/workloads/py_cpu.py under {PYTHON}: {self.copies} copies (one per CPU), "
            f"each a main thread computing {units} units 20 frames deep and a blocked thread",
            "method": __doc__,
            "sample_hz": SAMPLE_HZ,
            "rounds": self.rounds,
            "units": units,
            "configs": list(CONFIGS),
            "runs": runs,
            "summary": summary,
            "seconds": round(time.monotonic() - t_start, 1),
        }


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the python suite."""
    from bench.report import _mmm

    head = [
        "configuration",
        "units/s",
        "ratio to none (same round)",
        "profiler µs CPU per stack",
        "profiler share of a CPU",
    ]
    rows = []
    for c in result["configs"]:
        e = result["summary"][c]
        rows.append(
            [
                c,
                _mmm(e["units_per_s"], "{:,.0f}"),
                "1 (reference)" if c == "none" else _mmm(e["ratio_to_none"]),
                _mmm(e["us_per_stack"], "{:.0f}") if "us_per_stack" in e else "",
                _mmm(e["cpu_share"], "{:.4f}") if "cpu_share" in e else "",
            ]
        )
    caption = (
        f"{result['workload']}; {result['sample_hz']} Hz; {result['rounds']} rounds, configurations in "
        "turn; median (min–max); ratio < 1: slower"
    )
    notes = [
        "profiler share of a CPU: its CPU clock (the reader, or every py-spy) across the timed part",
        (
            "µs per stack: the reader's CPU from ready to the workload's end over the stacks in its profiles "
            "(idle ticks and detection included); py-spy's CPU over 19 stacks per second per thread"
        ),
        f"full run: {result['seconds']} s",
    ]
    return caption, head, rows, notes
