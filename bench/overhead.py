"""Measured overhead against the peers: every profiler on every workload, as ratios to nothing running.

Owns: the overhead suite of issue 8. Workloads (each a fixed amount of work,
sized to about --seconds alone): the CPU-bound C loop (workloads/cpu_loop.c,
one thread per CPU), the no-frame-pointer workload (workloads/deep.c built
-O2 -fomit-frame-pointer, DEEP_FRAMES frames, one thread per CPU), pipe
ping-pong pinned to CPU 0 (workloads/pingpong.c), and a CPython loop
(workloads/py_loop.py). Profilers, at each of --rates: this pipeline
on-CPU (frame pointers), on+off-CPU (frame pointers), and on+off-CPU with
DWARF unwinding (the defaults); profile-bpfcc; `perf record -a -g`; `perf
record -a --call-graph dwarf`; py-spy on the Python workload only. The
pipeline runs with overhead_budget_pct 100 so its guard keeps the asked
rate.

Every profiler configuration starts once a round and runs each workload
in turn; just before it, each of those workloads runs once with nothing
running, so every run under a profiler is paired with a run alone (A B A C
...; the order of the configurations and of the workloads is reversed
every other round). Each figure is the median, min and max over the
rounds. Figures: throughput ratio (elapsed alone /
elapsed under the profiler; < 1: slower); CPU of all the profiler's
processes during the workload, as % of one CPU; RSS of each of its
processes at the end of the workload; BPF ns per sample of its sampling
program (the kernel's statistics, on for the whole suite by a
BPF_ENABLE_STATS descriptor); share of the deep workload's samples that
carry the whole stack (down to the thread's start: WHOLE_STACK_FUNCTIONS).

High rates (--high-rates, default 999 and 4999 Hz), on the C loop, where a
cost is above the noise: the cost per sample the slowdown implies —
(elapsed under − elapsed alone) × CPUs − the profiler processes' CPU, over
the samples taken — next to the BPF ns per sample the kernel counts. The
difference is the perf interrupt and whatever the BPF program's run time
does not include (cache and TLB effects on the victim).

Must not: leave a process or a BPF program behind (procs.stop_all and
bench/run.py's check), or write results (bench/run.py does).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import bpf, peer, procs, stats
from bench.pipeline import Pipeline
from bench.procs import BenchError
from bench.unwind import LIBC, wait_for_tables
from collector.bpfstats import RunTimeStats
from shared import pprof

WORKLOADS_DIR = Path(__file__).parent / "workloads"
WORKLOADS = ("cpu_loop", "deep-nofp", "pingpong", "python")
DEEP_FRAMES = 20
# Untimed ping-pong first in every configuration (profilers see the processes; tables load).
PINGPONG_WARMUP_S = 1.0
# An untimed run of deep-nofp under every profiler before the timed one: the pipeline's symbolizer
# builds the unwind tables of the binary and libc meanwhile (DWARF: bench then waits until they are loaded).
DEEP_WARMUP_S = 2.0
# A deep-nofp sample has its whole stack when it reaches the thread's start: the workload's
# worker() and libc's start_thread (below it only clone3, which perf's unwinding omits).
WHOLE_STACK_FUNCTIONS = frozenset({"worker", "start_thread"})


def whole(functions: list[str]) -> bool:
    return {f.split("+")[0] for f in functions} >= WHOLE_STACK_FUNCTIONS


RUN_TIMEOUT_S = 600.0
ATTACH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 120.0
# The pipeline's guard must not change the rate being measured: a whole CPU of budget.
BENCH_BUDGET_PCT = 100.0
HIGH_RATE_WORKLOAD = "cpu_loop"
SAMPLING_PROGRAMS = ("on_cpu_sample", "do_perf_event")
PERF_SAMPLES = re.compile(r"\((\d+) samples\)")


# ------------------------------------------------------------------ workloads


def build(tmp: str) -> dict[str, list[str]]:
    """Each workload's command line without its size argument(s)."""

    def cc(name: str, src: str, flags: list[str]) -> str:
        out = os.path.join(tmp, name)
        r = subprocess.run(
            ["gcc", "-O2", *flags, "-o", out, str(WORKLOADS_DIR / src)], capture_output=True, text=True, check=False
        )
        if r.returncode != 0:
            raise BenchError(f"cannot build {src}: {r.stderr.strip()}")
        return out

    ncpu = str(os.sysconf("SC_NPROCESSORS_ONLN"))
    return {
        "cpu_loop": [cc("cpu_loop", "cpu_loop.c", ["-fno-omit-frame-pointer", "-pthread"])],  # UNITS THREADS
        "deep-nofp": [cc("deep-nofp", "deep.c", ["-fomit-frame-pointer", "-pthread"]), str(DEEP_FRAMES)],
        "pingpong": ["taskset", "-c", "0", cc("pingpong", "pingpong.c", ["-fno-omit-frame-pointer"])],
        "python": ["/usr/bin/python3", "-S", str(WORKLOADS_DIR / "py_loop.py")],
        "_ncpu": [ncpu],
    }


def workload_argv(cmds: dict[str, list[str]], name: str, units: int) -> list[str]:
    ncpu = cmds["_ncpu"][0]
    if name == "cpu_loop":
        return [*cmds[name], str(units), ncpu]
    if name == "deep-nofp":
        return [*cmds[name], str(units), ncpu]
    if name == "pingpong":
        return [*cmds[name], str(units), str(PINGPONG_WARMUP_S)]
    return [*cmds[name], str(units)]


def elapsed_of(name: str, stdout: str) -> float:
    """The workload's own timing of its work, from what it printed."""
    m = re.search(r"(?:elapsed_s|elapsed|seconds)=([\d.]+)", stdout)
    if not m:
        raise BenchError(f"{name}: no timing in its output {stdout[-300:]!r}")
    return float(m.group(1))


def run_workload(argv: list[str], name: str) -> tuple[float, float, int]:
    """(elapsed seconds as the workload timed its work, CPU seconds of every process it started, its pid)."""
    t0 = os.times()
    p = procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{name} ran longer than {RUN_TIMEOUT_S:.0f} s") from None
    finally:
        procs.stop(p, timeout=10)
    t1 = os.times()
    if p.returncode != 0:
        raise BenchError(f"{name} exited with {p.returncode}: {err.strip()[-500:]}")
    return elapsed_of(name, out), (t1.children_user + t1.children_system - t0.children_user - t0.children_system), p.pid


def size(cmds: dict[str, list[str]], name: str, seconds: float) -> int:
    """Units of `name` that take about `seconds` alone (a small run, scaled; the larger of two)."""
    units = {"cpu_loop": 200, "deep-nofp": 2000, "pingpong": 20000, "python": 100}[name]
    for _ in range(8):
        took, _, _ = run_workload(workload_argv(cmds, name, units), name)
        if took >= 0.3:
            return max(1, int(units * seconds / took))
        units *= 4
    raise BenchError(f"cannot size {name}: still under 0.3 s at {units} units")


# ------------------------------------------------------------------ profilers


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Profiler:
    """One profiler's run: start (attached on every CPU), its processes, stop; figures after."""

    name = ""
    wraps_workload = False  # py-spy: it starts the workload itself

    def start(self) -> None: ...
    def pids(self) -> dict[str, int]:
        return {}

    def stop(self) -> None: ...
    def samples(self) -> int | None:
        return None  # when the BPF statistics cannot say

    def completeness(self, binary: str, pid: int) -> float | None:
        return None

    def wrap(self, argv: list[str]) -> list[str]:
        return argv


class PipelineProfiler(Profiler):
    def __init__(self, d: Path, hz: int, offcpu: bool, dwarf: bool) -> None:
        self.name = f"pipeline {'on+off-CPU' if offcpu else 'on-CPU'}{', DWARF' if dwarf else ''}"
        self.p = Pipeline(
            d,
            hz,
            upload_interval_s=5,
            workers=1,
            offcpu=offcpu,
            dwarf_unwind=dwarf,
            offcpu_dwarf=False,
            overhead_budget_pct=BENCH_BUDGET_PCT,
            plain_pid=True,
        )

    def start(self) -> None:
        self.p.start()

    def pids(self) -> dict[str, int]:
        return dict(self.p.pids)

    def stop(self) -> None:
        self.p.stop()

    def completeness(self, binary: str, pid: int) -> float | None:
        total = complete = 0
        for path in self.p.local_dir.glob("*/cpu-*.pb.gz"):
            for s in pprof.read(path.read_bytes()).samples:
                if s.labels.get("process.executable") != binary or s.labels.get("pid") != str(pid):
                    continue
                total += s.values[0]
                complete += s.values[0] if whole(list(s.functions)) else 0
        return complete / total if total else None


class BpfccProfiler(Profiler):
    def __init__(self, d: Path, hz: int) -> None:
        self.name = "profile-bpfcc"
        d.mkdir(parents=True)
        self.out = d / "folded.txt"
        self.err = d / "stderr.txt"
        self.argv = [peer.command(), "-F", str(hz), "-f", "-a"]
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> None:
        with open(self.out, "w") as out, open(self.err, "w") as err:
            proc = self.proc = procs.start(self.argv, stdout=out, stderr=err, default_sigint=True)
        ncpu = os.sysconf("SC_NPROCESSORS_ONLN")
        seen: list[bool] = []

        def attached() -> bool:
            if proc.poll() is not None:
                raise BenchError(f"profile-bpfcc exited with {proc.returncode}: {self.err.read_text()[-500:]}")
            held, perf_fds = bpf.held_by(proc.pid)
            names = {p["id"]: p.get("name") for p in bpf.programs()} if held else {}
            seen.append(any(names.get(i) == peer.PROGRAM_NAME for i in held) and perf_fds >= ncpu)
            return len(seen) >= 2 and seen[-1] and seen[-2]

        procs.wait_for("profile-bpfcc attached on every CPU", attached, ATTACH_TIMEOUT_S, 0.05)

    def pids(self) -> dict[str, int]:
        return {"profile-bpfcc": self.proc.pid} if self.proc else {}

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, sig=signal.SIGINT, timeout=STOP_TIMEOUT_S)
            self.proc = None

    def completeness(self, binary: str, pid: int) -> float | None:
        """From its folded output, by command name (it has no pids: the warm-up run counts too)."""
        comm = os.path.basename(binary)[:15]
        total = complete = 0
        for line in self.out.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            if not count.isdigit() or frames[0] != comm:
                continue
            total += int(count)
            complete += int(count) if whole([f for f in frames[1:] if not f.endswith("_[k]")]) else 0
        return complete / total if total else None


class PerfProfiler(Profiler):
    def __init__(self, d: Path, hz: int, dwarf: bool) -> None:
        self.name = "perf --call-graph dwarf" if dwarf else "perf -g"
        d.mkdir(parents=True)
        self.data = d / "perf.data"
        self.err = d / "stderr.txt"
        self.argv = [
            "perf",
            "record",
            "-a",
            "-F",
            str(hz),
            *(["--call-graph", "dwarf"] if dwarf else ["-g"]),
            "-o",
            str(self.data),
        ]
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> None:
        with open(self.err, "w") as err:
            proc = self.proc = procs.start(self.argv, stdout=subprocess.DEVNULL, stderr=err, default_sigint=True)
        ncpu = os.sysconf("SC_NPROCESSORS_ONLN")

        def attached() -> bool:
            if proc.poll() is not None:
                raise BenchError(f"perf exited with {proc.returncode}: {self.err.read_text()[-500:]}")
            return bpf.held_by(proc.pid)[1] >= ncpu

        procs.wait_for("perf's events on every CPU", attached, ATTACH_TIMEOUT_S, 0.05)

    def pids(self) -> dict[str, int]:
        return {"perf": self.proc.pid} if self.proc else {}

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, sig=signal.SIGINT, timeout=STOP_TIMEOUT_S)
            self.proc = None

    def samples(self) -> int | None:
        m = PERF_SAMPLES.search(self.err.read_text(errors="replace"))
        return int(m.group(1)) if m else None

    def completeness(self, binary: str, pid: int) -> float | None:
        """From `perf script` (its unwinding of the recorded stacks, after the run, not timed)."""
        out = subprocess.run(
            ["perf", "script", "-i", str(self.data), "--pid", str(pid), "-F", "comm,ip,sym"],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        ).stdout
        total = complete = 0
        for block in out.split("\n\n"):
            lines = [ln for ln in block.splitlines() if ln.strip()]
            if not lines:
                continue
            total += 1
            complete += 1 if whole([ln.split()[1] for ln in lines[1:] if len(ln.split()) > 1]) else 0
        return complete / total if total else None


class PySpyProfiler(Profiler):
    name = "py-spy"
    wraps_workload = True

    def __init__(self, d: Path, hz: int) -> None:
        d.mkdir(parents=True)
        found = shutil.which("py-spy") or str(Path(__file__).resolve().parent.parent / ".venv" / "bin" / "py-spy")
        if not os.path.exists(found):
            raise BenchError("py-spy not found: make test-setup installs it into .venv")
        self.argv = [found, "record", "-r", str(hz), "-f", "raw", "-o", str(d / "raw.txt"), "--nonblocking", "--"]
        self.proc: subprocess.Popen[Any] | None = None

    def wrap(self, argv: list[str]) -> list[str]:
        return [*self.argv, *argv]


def kernel_stats() -> RunTimeStats:
    """The kernel's BPF run-time statistics on until close(), for the figures bpf_totals reads (the
    agent leaves them off: collector/bpftime.py)."""
    on = RunTimeStats(allow_sysctl=False)
    if not on.on:
        raise BenchError(f"cannot switch the kernel's BPF statistics on: {on.problem}")
    return on


def bpf_totals(pids: list[int]) -> dict[str, tuple[int, int]]:
    """Program name → (run_time_ns, run_cnt) of the BPF programs `pids` hold."""
    ids: set[int] = set()
    for pid in pids:
        ids |= bpf.held_by(pid)[0]
    out: dict[str, tuple[int, int]] = {}
    for p in bpf.programs():
        if p["id"] in ids:
            t, c = out.get(p.get("name", "?"), (0, 0))
            out[p.get("name", "?")] = (t + int(p.get("run_time_ns", 0)), c + int(p.get("run_cnt", 0)))
    return out


# ------------------------------------------------------------------ the suite


class OverheadBench:
    def __init__(
        self,
        rounds: int,
        seconds: float,
        rates: list[int],
        high_rates: list[int],
        quiet_wait: float,
        log: Callable[[str], None],
        keep: bool,
        workloads: tuple[str, ...] = WORKLOADS,
    ) -> None:
        self.rounds = rounds
        self.seconds = seconds
        self.rates = rates
        self.high_rates = high_rates
        self.quiet_wait = quiet_wait
        self.log = log
        self.keep = keep
        self.workloads = workloads
        self.our_prog_ids: set[int] = set()
        self.ncpu = os.sysconf("SC_NPROCESSORS_ONLN")

    def configs(self) -> list[tuple[str, int, tuple[str, ...]]]:
        """(profiler, rate, the workloads run under one start of it), in a round's order."""
        out = []
        for hz in self.rates:
            for profiler in (
                "pipeline on-CPU",
                "pipeline on+off-CPU",
                "pipeline on+off-CPU, DWARF",
                "profile-bpfcc",
                "perf -g",
                "perf --call-graph dwarf",
            ):
                out.append((profiler, hz, self.workloads))
            if "python" in self.workloads:
                out.append(("py-spy", hz, ("python",)))
        if HIGH_RATE_WORKLOAD in self.workloads:
            for hz in self.high_rates:
                for profiler in ("pipeline on-CPU", "profile-bpfcc", "perf -g"):
                    out.append((profiler, hz, (HIGH_RATE_WORKLOAD,)))
        return out

    def make(self, profiler: str, hz: int, d: Path) -> Profiler:
        if profiler.startswith("pipeline"):
            return PipelineProfiler(d, hz, offcpu="off-CPU" in profiler, dwarf="DWARF" in profiler)
        if profiler == "profile-bpfcc":
            return BpfccProfiler(d, hz)
        if profiler.startswith("perf"):
            return PerfProfiler(d, hz, dwarf="dwarf" in profiler)
        return PySpyProfiler(d, hz)

    def under(
        self,
        profiler: str,
        hz: int,
        d: Path,
        runs: list[tuple[str, list[str], float]],
        warmup_argv: dict[str, list[str]],
    ) -> list[dict[str, Any]]:
        """`runs` ((workload, argv, CPU seconds alone), in turn) under one start of `profiler` at `hz`:
        each one's figures. The CPU alone is for a profiler that starts the workload (py-spy: its CPU
        is the difference)."""
        prof = self.make(profiler, hz, d)
        out: list[dict[str, Any]] = []
        pids_of_runs: list[int] = []
        try:
            prof.start()
            pids = prof.pids()
            if isinstance(prof, PipelineProfiler):
                self.our_prog_ids |= prof.p.prog_ids
            for pid in pids.values():
                self.our_prog_ids |= bpf.held_by(pid)[0]
            for workload, argv, alone_cpu_s in runs:
                if workload == "deep-nofp" and not prof.wraps_workload:
                    run_workload(warmup_argv[workload], workload)  # untimed: tables load for DWARF
                    if isinstance(prof, PipelineProfiler) and "DWARF" in prof.name:
                        wait_for_tables(prof.p, argv[0], LIBC)
                fig, pid = self._one(prof, pids, workload, argv, alone_cpu_s)
                out.append(fig)
                pids_of_runs.append(pid)
        finally:
            prof.stop()
        if len(runs) == 1 and out[0]["samples"] is None:
            out[0]["samples"] = prof.samples()  # perf counts its samples for the whole of its run
        for fig, (workload, argv, _), pid in zip(out, runs, pids_of_runs):
            if workload == "deep-nofp":  # from what the profiler wrote by its stop
                fig["whole_stack_share"] = prof.completeness(argv[0], pid)
        if not self.keep:
            shutil.rmtree(d, ignore_errors=True)
        return out

    @staticmethod
    def _one(
        prof: Profiler, pids: dict[str, int], workload: str, argv: list[str], alone_cpu_s: float
    ) -> tuple[dict[str, Any], int]:
        """One timed run of `workload` under the started `prof`: (its figures, the workload's pid)."""
        cpu0 = {n: procs.cpu_seconds(pid) for n, pid in pids.items()}
        bpf0 = bpf_totals(list(pids.values()))
        if prof.wraps_workload:
            elapsed, both_cpu_s, pid = run_workload(prof.wrap(argv), workload)
            rss: dict[str, int] = {}
            profiler_cpu_s = max(0.0, both_cpu_s - alone_cpu_s)
        else:
            elapsed, _, pid = run_workload(argv, workload)
            rss = {n: rss_bytes(p) for n, p in pids.items()}
            profiler_cpu_s = sum(procs.cpu_seconds(p) - cpu0[n] for n, p in pids.items())
        bpf1 = bpf_totals(list(pids.values()))
        sampling = [
            (bpf1[n][0] - bpf0.get(n, (0, 0))[0], bpf1[n][1] - bpf0.get(n, (0, 0))[1])
            for n in bpf1
            if n in SAMPLING_PROGRAMS
        ]
        sampled_ns, sampled = sum(t for t, _ in sampling), sum(c for _, c in sampling)
        bpf_ns = sum(bpf1[n][0] - bpf0.get(n, (0, 0))[0] for n in bpf1)
        fig = {
            "workload": workload,
            "elapsed_s": elapsed,
            "profiler_cpu_s": profiler_cpu_s,
            "profiler_cpu_pct": 100 * profiler_cpu_s / elapsed,
            "rss_bytes": rss,
            "bpf_ns": bpf_ns,
            "bpf_pct": 100 * bpf_ns / 1e9 / elapsed,
            "bpf_ns_per_sample": sampled_ns / sampled if sampled else None,
            "samples": sampled or None,
        }
        return fig, pid

    def run(self) -> dict[str, Any]:
        tmp = tempfile.mkdtemp(prefix="ebpfprofiler-bench-overhead-")
        os.chmod(tmp, 0o755)
        t_start = time.monotonic()
        runtime_stats = kernel_stats()
        runs: list[dict[str, Any]] = []
        try:
            cmds = build(tmp)
            units = {w: size(cmds, w, self.seconds) for w in self.workloads}
            argvs = {w: workload_argv(cmds, w, units[w]) for w in self.workloads}
            warmup = {
                w: workload_argv(cmds, w, max(1, int(u * DEEP_WARMUP_S / self.seconds))) for w, u in units.items()
            }
            self.log(f"overhead: workloads sized to ~{self.seconds} s alone: {units}")
            n = 0
            for r in range(self.rounds):
                bpf.wait_until_no_foreign_profiler(self.our_prog_ids, self.quiet_wait, self.log)
                configs = self.configs()
                if r % 2:
                    configs.reverse()
                for profiler, hz, workloads in configs:
                    n += 1
                    runs += self._config_runs(r, profiler, hz, workloads, argvs, warmup, Path(tmp) / f"r{n}")
        finally:
            runtime_stats.close()
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        return {
            "method": __doc__,
            "rounds": self.rounds,
            "rates": self.rates,
            "high_rates": self.high_rates,
            "units": units,
            "seconds_alone": self.seconds,
            "cpus": self.ncpu,
            "runs": runs,
            "summary": summarize(runs, self.ncpu, self.rates),
            "seconds": round(time.monotonic() - t_start, 1),
        }

    def _config_runs(
        self,
        r: int,
        profiler: str,
        hz: int,
        workloads: tuple[str, ...],
        argvs: dict[str, list[str]],
        warmup: dict[str, list[str]],
        d: Path,
    ) -> list[dict[str, Any]]:
        """Round r's runs of `workloads`: each alone (A), then each under one start of `profiler` (B)."""
        order = list(reversed(workloads)) if r % 2 else list(workloads)
        alone = {w: run_workload(argvs[w], w)[:2] for w in order}  # A, each
        figs = self.under(profiler, hz, d, [(w, argvs[w], alone[w][1]) for w in order], warmup)  # B, each
        for fig in figs:
            alone_s = alone[fig["workload"]][0]
            fig.update(
                {"round": r, "profiler": profiler, "hz": hz, "alone_s": alone_s, "ratio": alone_s / fig["elapsed_s"]}
            )
            self.log(
                f"overhead round {r + 1}/{self.rounds} {fig['workload']} {profiler} {hz} Hz: "
                f"ratio {fig['ratio']:.3f}, profiler CPU {fig['profiler_cpu_pct']:.2f}%"
                + (f", BPF {fig['bpf_ns_per_sample']:.0f} ns/sample" if fig["bpf_ns_per_sample"] else "")
            )
        return figs


def summarize(runs: list[dict[str, Any]], ncpu: int, rates: list[int]) -> dict[str, Any]:
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["profiler"], r["hz"]), []).append(r)
    out = {}
    for (workload, profiler, hz), rs in groups.items():
        procs_seen = sorted({p for r in rs for p in r["rss_bytes"]})
        fig = {
            "ratio": stats.summary([r["ratio"] for r in rs]),
            "profiler_cpu_pct": stats.summary([r["profiler_cpu_pct"] for r in rs]),
            "bpf_pct": stats.summary([r["bpf_pct"] for r in rs]),
            "bpf_ns_per_sample": stats.summary([r["bpf_ns_per_sample"] for r in rs]),
            "rss_mb": {
                p: stats.summary([r["rss_bytes"][p] / 2**20 for r in rs if p in r["rss_bytes"]]) for p in procs_seen
            },
        }
        if workload == "deep-nofp":
            fig["whole_stack_share"] = stats.summary([r.get("whole_stack_share") for r in rs])
        if workload == HIGH_RATE_WORKLOAD and hz not in rates:
            # Lost victim CPU (all CPUs busy) beyond the profiler processes' own, per sample.
            fig["implied_ns_per_sample"] = stats.summary(
                [
                    ((r["elapsed_s"] - r["alone_s"]) * ncpu - (r["profiler_cpu_s"] or 0)) * 1e9 / r["samples"]
                    for r in rs
                    if r["samples"]
                ]
            )
        out[f"{workload} | {profiler} | {hz}"] = fig
    return out


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) for RESULTS.md and the terminal."""
    from bench.report import _mmm

    head = [
        "workload",
        "profiler",
        "Hz",
        "throughput ratio",
        "profiler CPU % of one CPU",
        "BPF ns/sample",
        "BPF % of one CPU",
        "RSS MB (each process, median)",
        "whole stacks",
        "implied ns/sample",
    ]
    rows = []
    for key, f in result["summary"].items():
        workload, profiler, hz = key.split(" | ")
        rss = ", ".join(f"{p} {s['median']:.0f}" for p, s in f["rss_mb"].items() if s["median"] is not None)
        rows.append(
            [
                workload,
                profiler,
                hz,
                _mmm(f["ratio"], "{:.3f}"),
                _mmm(f["profiler_cpu_pct"], "{:.2f}"),
                _mmm(f["bpf_ns_per_sample"], "{:,.0f}"),
                _mmm(f["bpf_pct"], "{:.3f}"),
                rss or "-",
                _mmm(f["whole_stack_share"], "{:.3f}") if "whole_stack_share" in f else "",
                _mmm(f["implied_ns_per_sample"], "{:,.0f}") if "implied_ns_per_sample" in f else "",
            ]
        )
    caption = (
        f"each run paired with the same workload alone just before it; {result['rounds']} rounds; "
        f"workloads ~{result['seconds_alone']} s alone on {result['cpus']} CPUs; median (min–max)"
    )
    notes = [
        f"full run: {result['seconds']} s",
        "py-spy starts the workload: its CPU is (py-spy + workload) minus the workload alone; no RSS",
        "perf: no BPF; its samples from perf's own count; whole stacks by `perf script` after the run",
        (
            "profiler CPU is what its processes use while the workload runs: profile-bpfcc and perf symbolize "
            "after it (at their stop, not counted); the pipeline symbolizes as it goes"
        ),
        (
            "whole stacks: samples of the timed deep-nofp process reaching worker() and start_thread; the "
            "pipeline's DWARF unwinding covers a new process from the first drain after it is first sampled "
            "(~1 s), so a run of a few seconds shows less than a long-running process gets"
        ),
    ]
    return caption, head, rows, notes
