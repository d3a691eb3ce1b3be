"""On-CPU overhead: the slowdown of a CPU-bound workload under ebpfprofiler's
pipeline and under profile-bpfcc, and the pipeline's CPU cost per sample.

Each round runs the same fixed workload once under every configuration, in
the same order (none, pipeline at each rate, profile-bpfcc at each rate), so
slow drifts of the host hit every configuration alike. Every profiler is
started fresh for its run and stopped after it; the workload starts only once
the profiler's BPF program is attached on every CPU.

Pipeline runs also measure the stages' CPU per 10,000 samples, over an
interval [T0, T2] chosen so that numerator and denominator cover the same
samples (see METHOD below and bench/README.md).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import bpf, host, procs, stats, workload
from bench.peer import ProfileBpfcc
from bench.pipeline import Pipeline
from bench.procs import BenchError


def _timing_constants() -> dict[str, float]:
    """The pipeline's drain interval and window grace, from its code (fallbacks if renamed)."""
    out = {"drain_interval_s": 1.0, "window_grace_s": 2.5, "symbolizer_poll_s": 0.25}
    try:
        from collector import main as collector_main

        out["drain_interval_s"] = float(getattr(collector_main, "DRAIN_INTERVAL_S", 1.0))
    except Exception:
        pass
    try:
        from symbolizer import main as symbolizer_main

        out["window_grace_s"] = float(getattr(symbolizer_main, "WINDOW_GRACE_S", 2.5))
        out["symbolizer_poll_s"] = float(getattr(symbolizer_main, "POLL_MS", 250)) / 1000
    except Exception:
        pass
    return out


# Profiles windows of 1 s: wall-clock aligned to whole seconds, so an interval
# that starts and ends on whole seconds splits the samples exactly.
UPLOAD_INTERVAL_S = 1
# A run during which other processes used more CPU than this share of the
# workload's own CPU time is disturbed: it is run again, up to MAX_ATTEMPTS
# times in all (the last attempt is kept, marked disturbed).
DISTURBED_SHARE = 0.05
MAX_ATTEMPTS = 3
# Warm-up before a pipeline measurement: this share of the measured work, then
# this long in the kernel on every thread, so that before T0 the symbolizer has
# parsed the workload's binary and libc and the collector has loaded its kernel
# symbol cache (bcc reads /proc/kallsyms at the first kernel frame: ~0.1 s).
WARMUP_SHARE = 0.05
WARMUP_KERNEL_MS = 300

METHOD = {
    "configurations": "none (the workload alone); pipeline at each rate (`ebpfprofiler run`, "
    "1 symbolizer worker, offcpu off, profiles to a local directory); "
    "profile-bpfcc -F HZ -f, output to /dev/null.",
    "order": "Rounds; in each round every configuration runs the workload once, always in the order "
    "listed under configurations. Every profiler is started fresh before its run (pipeline: "
    "until every stage has written its ready file and the collector holds its on_cpu_sample "
    "program and a perf event per CPU; profile-bpfcc: until it holds its do_perf_event program "
    "and a perf event per CPU on two polls in a row) and stopped after it. Before every run "
    "bench waits until no BPF program of another profiler (on_cpu_sample, or any perf_event "
    "program) is loaded.",
    "workload": "bench/workloads/cpu_loop.c built with gcc -O2 -fno-omit-frame-pointer: UNITS x 10^6 "
    "iterations of a multiply-add chain split over THREADS threads (default one per CPU), "
    "the amount fixed for the whole run by a calibration at the start (about --seconds of "
    "wall time with nothing running). It prints its own wall time (elapsed) and CPU time.",
    "elapsed": "Wall seconds of the workload, from the workload itself. Throughput = units / elapsed.",
    "slowdown": "Per round, elapsed of a configuration / elapsed of `none` in the same round (> 1: slower); "
    "median, min and max over rounds. vs_peer: per round, elapsed under the pipeline / "
    "elapsed under profile-bpfcc at the same rate (< 1: the pipeline slows the workload less).",
    "cpu_per_10k_samples": "Pipeline runs only. Profile windows are 1 s (upload_interval_s: 1), aligned to "
    "whole wall-clock seconds; a batch is put in the window of the time it was "
    "drained. After the pipeline is ready, a warm-up run of the workload (5% of the "
    "work, then 0.3 s per thread reading /dev/zero so kernel stacks are seen); T0 = the first whole second after the warm-up's last samples were drained "
    "and their window closed (same rule as T2); bench "
    "reads every stage's CPU clock (clock_getcpuclockid: utime+stime of all threads, "
    "ns resolution) at T0 and starts the workload. T2 = the first whole second after "
    "the workload's last samples were drained and their window closed (drain interval "
    "+ window + grace + symbolizer poll); CPU clocks are read again at T2, then the "
    "pipeline is stopped so every window is written. Samples = the sample counts of "
    "every cpu profile of every service whose window starts in [T0, T2): exactly the "
    "samples drained in [T0, T2), whose draining and symbolizing is the CPU spent in "
    "[T0, T2]. Figure = CPU seconds in [T0, T2] / samples x 10,000. Excluded: start-up "
    "(imports, BPF compile) and stop. Residual bias: windows are built and written "
    "~3.5 s after they end, so [T0, T2] includes building the idle windows just "
    "before T0 and excludes building the idle windows just before T2; they roughly "
    "cancel (workload_profiles_built_after_t2 and "
    "workload_profiles_before_t0_built_after_t0 count exceptions: 0 expected). It includes the stages' fixed per-second costs (drains, /proc "
    "reads), so the figure at a low rate is higher. With 1-s windows profiles are "
    "built 60x as often as with the default 60 s, so the symbolizer's and uploader's "
    "figures are upper bounds for the default config.",
    "coverage": "samples / (sample_hz x host busy CPU seconds in [T0, T2] from /proc/stat): about 1 when "
    "every sample of a busy CPU reached a profile.",
    "other_cpu": "Host busy CPU seconds during the workload (/proc/stat) minus the workload's own CPU time "
    "minus the profiler's CPU time in that interval: other processes on the host (noise). "
    "steal_s is CPU time the hypervisor took from this VM. Pipeline runs also record "
    "other_cpu_interval_s, the same over [T0, T2] (all stages' CPU subtracted). Before every run bench waits "
    "until the host is quiet (at most quiet_share of its CPU busy over quiet_window_s, no "
    "other profiler's BPF program loaded). A run with other_cpu_s (or other_cpu_interval_s) above disturbed_share of "
    "the workload's CPU time, or with another profiler's BPF program loaded when the workload ended "
    "(other_profilers_at_end), is discarded (kept under discarded_runs) and run again, up to "
    "max_attempts in all; the last attempt counts, marked disturbed.",
}


@dataclass(frozen=True)
class Configuration:
    key: str
    kind: str  # none | pipeline | profile-bpfcc
    hz: int | None

    @property
    def label(self) -> str:
        return "none" if self.kind == "none" else f"{self.kind} {self.hz} Hz"

    @property
    def sample_hz(self) -> int:
        """The sampling rate of a configuration that runs a profiler."""
        if self.hz is None:
            raise BenchError(f"configuration {self.key} runs no profiler")
        return self.hz


@dataclass(frozen=True)
class Interval:
    """One pipeline run's accounting interval [t0, t2] (whole seconds), the workload within it ending at t1."""

    t0: int
    t1: float
    t2: int
    cpu: tuple[dict[str, float], dict[str, float], dict[str, float]]  # stage CPU s at t0, t1, t2
    host: dict[str, float]  # the host's CPU seconds over [t0, t2]
    w: workload.Result


def configurations(rates: list[int]) -> list[Configuration]:
    return (
        [Configuration("none", "none", None)]
        + [Configuration(f"pipeline-{hz}", "pipeline", hz) for hz in rates]
        + [Configuration(f"profile-bpfcc-{hz}", "profile-bpfcc", hz) for hz in rates]
    )


class OnCpuBench:
    def __init__(
        self,
        rounds: int,
        seconds: float,
        threads: int,
        rates: list[int],
        quiet_wait_s_max: float,
        log: Callable[[str], None],
        keep_dir: bool = False,
    ) -> None:
        self.rounds = rounds
        self.seconds = seconds
        self.threads = threads
        self.rates = rates
        self.quiet_wait_s_max = quiet_wait_s_max
        self.log = log
        self.keep_dir = keep_dir
        self.timing = _timing_constants()
        self.configs = configurations(rates)
        self.our_prog_ids: set[int] = set()
        self._foreign: list[str] = []
        self.units = 0
        self.binary = ""
        self.timeout = 0.0

    # --- one run per configuration ---------------------------------------------------------------

    def _workload(self, units: int | None = None, kernel_ms: int = 0) -> workload.Result:
        return workload.run(self.binary, units or self.units, self.threads, self.timeout, kernel_ms)

    def _measured(self) -> workload.Result:
        """The measured workload run; notes another profiler that appeared meanwhile."""
        w = self._workload()
        self._foreign = [f"{p.get('name', '?')} (prog {p['id']})" for p in bpf.foreign_profilers(self.our_prog_ids)]
        return w

    def run_none(self, _cfg: Configuration, _dir: Path) -> dict[str, Any]:
        w = self._measured()
        return {**_workload_fields(w), "profiler_cpu_s": 0.0, "other_cpu_s": _other(w, 0.0)}

    def run_peer(self, cfg: Configuration, d: Path) -> dict[str, Any]:
        peer = ProfileBpfcc(d, cfg.sample_hz)
        try:
            peer.start()
            self.our_prog_ids |= peer.prog_ids
            c0 = peer.cpu()
            w = self._measured()
            c1 = peer.cpu()
        finally:
            peer.stop()
        prof = c1 - c0
        return {
            **_workload_fields(w),
            "profiler_cpu_s": round(prof, 6),
            "other_cpu_s": _other(w, prof),
            "profiler_start_s": round(peer.start_s, 3),
            "profiler_stop_s": round(peer.stop_s, 3),
            "bpf_prog_ids": sorted(peer.prog_ids),
        }

    def run_pipeline(self, cfg: Configuration, d: Path) -> dict[str, Any]:
        p = Pipeline(d, cfg.sample_hz, UPLOAD_INTERVAL_S, workers=1)
        try:
            p.start()
            self.our_prog_ids |= p.prog_ids
            iv = self._interval(p)
        finally:
            p.stop()
        return self._pipeline_record(cfg, p, iv)

    def _interval(self, p: Pipeline) -> Interval:
        """Warm up, then the measured workload inside an interval whose windows are all built in it."""
        t = self.timing
        # A workload's last samples are drained within a drain interval; their window
        # ends UPLOAD_INTERVAL_S later and is built after the grace and a poll.
        settle = t["drain_interval_s"] + UPLOAD_INTERVAL_S + t["window_grace_s"] + t["symbolizer_poll_s"] + 0.1
        self._workload(max(self.threads, round(self.units * WARMUP_SHARE)), WARMUP_KERNEL_MS)
        # T0 once the warm-up's windows are built: the windows built in [T0, T2] but
        # not counted (just before T0) are then idle, like those counted but built
        # after T2 (just before T2).
        t0 = math.ceil(time.time() + settle)
        procs.sleep_until_wall(t0)
        c0, h0 = p.cpu(), procs.host_cpu()
        w = self._measured()
        t1 = time.time()
        c1 = p.cpu()
        t2 = math.ceil(t1 + settle)
        procs.sleep_until_wall(t2)
        c2, h2 = p.cpu(), procs.host_cpu()
        return Interval(t0, t1, t2, (c0, c1, c2), procs.host_cpu_delta(h0, h2), w)

    def _pipeline_record(self, cfg: Configuration, p: Pipeline, iv: Interval) -> dict[str, Any]:
        """A pipeline run's figures: its stages' CPU, the samples of the windows of the interval."""
        t0, t2, w, host = iv.t0, iv.t2, iv.w, iv.host
        c0, c1, c2 = iv.cpu
        written = p.profiles(self.binary)
        inside = [x for x in written if t0 * 10**9 <= x.window_start_ns < t2 * 10**9]
        samples = sum(x.samples for x in inside)
        # Built after T2, so their cost is not counted: expected only for idle windows.
        late = [x for x in inside if x.written_at > t2]
        early = [x for x in written if x.window_start_ns < t0 * 10**9 and x.written_at > t0]
        stages = [s for s in c0 if s != "symbolizers"]
        during = sum(c1[s] - c0[s] for s in stages)
        whole = sum(c2[s] - c0[s] for s in stages)
        per_10k = {
            s: (round((c2[s] - c0[s]) / samples * 10_000, 6) if samples else None)
            for s in ["collector", "symbolizers", "uploader"]
        }
        return {
            **_workload_fields(w),
            "profiler_cpu_s": round(during, 6),
            "other_cpu_s": _other(w, during),
            "profiler_start_s": round(p.start_s, 3),
            "profiler_stop_s": round(p.stop_s, 3),
            "bpf_prog_ids": sorted(p.prog_ids),
            "interval": {"t0": t0, "t1": round(iv.t1, 3), "t2": t2, "seconds": t2 - t0},
            "stage_cpu_s": {s: round(c2[s] - c0[s], 6) for s in c0},
            "stage_cpu_during_workload_s": {s: round(c1[s] - c0[s], 6) for s in c0},
            "samples": samples,
            "workload_samples": sum(x.workload_samples for x in inside),
            "samples_all_windows": sum(x.samples for x in written),
            "windows": len({x.window_start_ns for x in inside}),
            "profiles": len(inside),
            "profiles_built_after_t2": len(late),
            "workload_profiles_built_after_t2": sum(1 for x in late if x.workload_samples),
            "profiles_before_t0_built_after_t0": len(early),
            "workload_profiles_before_t0_built_after_t0": sum(1 for x in early if x.workload_samples),
            "host_cpu_interval": host,
            "other_cpu_interval_s": round(host["busy_s"] - w.cpu_s - whole, 3),
            "coverage": round(samples / (cfg.sample_hz * host["busy_s"]), 3) if host["busy_s"] > 0 else None,
            "cpu_per_10k_samples_s": per_10k,
        }

    # --- the whole benchmark ---------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        tmp = tempfile.mkdtemp(prefix="ebpfprofiler-bench-", dir="/tmp")
        os.chmod(tmp, 0o755)  # the pipeline's stages run as their own users and must enter it
        runs: list[dict[str, Any]] = []
        discarded: list[dict[str, Any]] = []
        try:
            self.binary = workload.build(tmp)
            self.units, calibration = workload.calibrate(
                self.binary,
                self.threads,
                self.seconds,
                DISTURBED_SHARE,
                before_each=lambda: host.wait_until_quiet(self.our_prog_ids, self.quiet_wait_s_max, self.log),
            )
            self.timeout = max(120.0, 20 * self.seconds)
            self.log(
                f"workload: {self.units} units on {self.threads} threads "
                f"(~{self.units / calibration['units_per_s']:.1f} s alone); "
                f"{self.rounds} rounds of {', '.join(c.label for c in self.configs)}"
            )
            for r in range(self.rounds):
                for cfg in self.configs:
                    self._measure_config(r, cfg, Path(tmp), runs, discarded)
        finally:
            left = procs.stop_all()
            if self.keep_dir:
                self.log(f"kept bench files in {tmp}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        if left:
            raise BenchError(f"processes still running at the end were stopped: {', '.join(left)}")
        return self._result(runs, discarded, calibration, started)

    def _measure_config(
        self, r: int, cfg: Configuration, tmp: Path, runs: list[dict[str, Any]], discarded: list[dict[str, Any]]
    ) -> None:
        """Round r's run of `cfg` into `runs`, run again (up to MAX_ATTEMPTS) while disturbed; the disturbed
        ones into `discarded`."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            rec = self._attempt(r, cfg, attempt, tmp)
            self.log(_progress(r, self.rounds, cfg, rec))
            if rec["disturbed"] and attempt < MAX_ATTEMPTS:
                also = f", other profilers loaded: {', '.join(self._foreign)}" if self._foreign else ""
                self.log(
                    f"  disturbed: other processes used {_other_max(rec):.2f} CPU s "
                    f"during the measurement{also}; running it again"
                )
                discarded.append(rec)
                continue
            runs.append(rec)
            break

    def _attempt(self, r: int, cfg: Configuration, attempt: int, tmp: Path) -> dict[str, Any]:
        """One run of `cfg` once the host is quiet, and whether something disturbed it."""
        waited = host.wait_until_quiet(self.our_prog_ids, self.quiet_wait_s_max, self.log)
        d = tmp / f"round{r + 1}-{cfg.key}-{attempt}"
        if cfg.kind == "none":
            d.mkdir()
            rec = self.run_none(cfg, d)
        elif cfg.kind == "pipeline":
            rec = self.run_pipeline(cfg, d)
        else:
            rec = self.run_peer(cfg, d)
        return {
            "round": r + 1,
            "config": cfg.key,
            "attempt": attempt,
            "quiet_wait_s": round(waited, 1),
            **rec,
            "other_profilers_at_end": self._foreign,
            "disturbed": (_other_max(rec) > DISTURBED_SHARE * rec["workload_cpu_s"] or bool(self._foreign)),
        }

    def _result(
        self,
        runs: list[dict[str, Any]],
        discarded: list[dict[str, Any]],
        calibration: dict[str, Any],
        started: float,
    ) -> dict[str, Any]:
        return {
            "workload": {
                "binary": "bench/workloads/cpu_loop.c",
                "cflags": workload.CFLAGS,
                "threads": self.threads,
                "units": self.units,
                "iterations": self.units * 10**6,
                **calibration,
            },
            "settings": {
                "rounds": self.rounds,
                "rates_hz": self.rates,
                "seconds": self.seconds,
                "upload_interval_s": UPLOAD_INTERVAL_S,
                "symbolizer_workers": 1,
                "warmup_share": WARMUP_SHARE,
                "warmup_kernel_ms": WARMUP_KERNEL_MS,
                "pipeline_timing": self.timing,
                "disturbed_share": DISTURBED_SHARE,
                "max_attempts": MAX_ATTEMPTS,
                "quiet_share": host.QUIET_SHARE,
                "quiet_window_s": host.QUIET_WINDOW_S,
            },
            "configurations": [{"key": c.key, "label": c.label, "kind": c.kind, "hz": c.hz} for c in self.configs],
            "method": METHOD,
            "runs": runs,
            "discarded_runs": discarded,
            "summary": summarize(self.configs, self.rates, runs, self.units),
            "bench_seconds": round(time.monotonic() - started, 1),
        }


def _workload_fields(w: workload.Result) -> dict[str, Any]:
    return {"elapsed_s": round(w.elapsed_s, 6), "workload_cpu_s": round(w.cpu_s, 6), "host_cpu": w.host}


def _other_max(rec: dict[str, Any]) -> float:
    """Other processes' CPU seconds during the measurement (pipeline runs: the larger of the
    workload's span and the whole CPU-accounting interval)."""
    return max(rec["other_cpu_s"], rec.get("other_cpu_interval_s", 0.0))


def _other(w: workload.Result, profiler_cpu_s: float) -> float:
    return round(w.host["busy_s"] - w.cpu_s - profiler_cpu_s, 3)


def _progress(r: int, rounds: int, cfg: Configuration, rec: dict[str, Any]) -> str:
    line = f"round {r + 1}/{rounds} {cfg.label:<20} elapsed {rec['elapsed_s']:7.3f} s"
    if cfg.kind != "none":
        line += f"  profiler CPU {rec['profiler_cpu_s']:.3f} s"
    if cfg.kind == "pipeline":
        c = rec["cpu_per_10k_samples_s"]
        line += (
            f"  {rec['samples']} samples in {rec['interval']['seconds']} s; per 10k: collector "
            f"{_fmt(c['collector'])} s, symbolizer {_fmt(c['symbolizers'])} s"
        )
    return line


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def summarize(configs: list[Configuration], rates: list[int], runs: list[dict[str, Any]], units: int) -> dict[str, Any]:
    by = {c.key: {r["round"]: r for r in runs if r["config"] == c.key} for c in configs}
    rounds = sorted(by["none"])
    out: dict[str, Any] = {"configurations": {}, "cpu_per_10k_samples_s": {}}
    for c in configs:
        mine = by[c.key]
        elapsed = [mine[r]["elapsed_s"] for r in rounds if r in mine]
        entry = {
            "label": c.label,
            "elapsed_s": stats.summary(elapsed),
            "throughput_munits_per_s": stats.summary([units / e for e in elapsed]),
            "slowdown_vs_none": stats.summary(
                [mine[r]["elapsed_s"] / by["none"][r]["elapsed_s"] for r in rounds if r in mine]
            ),
            "profiler_cpu_s_during_workload": stats.summary([mine[r]["profiler_cpu_s"] for r in rounds if r in mine]),
            "other_cpu_s": stats.summary([mine[r]["other_cpu_s"] for r in rounds if r in mine]),
            "steal_s": stats.summary([mine[r]["host_cpu"]["steal_s"] for r in rounds if r in mine]),
        }
        if c.kind == "pipeline":
            peer = by[f"profile-bpfcc-{c.hz}"]
            entry["vs_peer"] = stats.summary(
                [mine[r]["elapsed_s"] / peer[r]["elapsed_s"] for r in rounds if r in mine and r in peer]
            )
        out["configurations"][c.key] = entry
    for hz in rates:
        mine = by[f"pipeline-{hz}"]
        out["cpu_per_10k_samples_s"][str(hz)] = {
            stage: stats.summary(
                [
                    mine[r]["cpu_per_10k_samples_s"][stage]
                    for r in rounds
                    if mine[r]["cpu_per_10k_samples_s"][stage] is not None
                ]
            )
            for stage in ("collector", "symbolizers", "uploader")
        }
        out["cpu_per_10k_samples_s"][str(hz)]["samples_per_interval"] = stats.summary(
            [mine[r]["samples"] for r in rounds]
        )
        out["cpu_per_10k_samples_s"][str(hz)]["coverage"] = stats.summary(
            [mine[r]["coverage"] for r in rounds if mine[r]["coverage"] is not None]
        )
    return out
