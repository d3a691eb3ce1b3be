"""ebpfprofiler's pipeline as bench runs it: `ebpfprofiler run` with a bench config.

Owns: the config bench profiles with, starting `run` and waiting until every
stage is ready (RUN/<stage>.ready holds its pid), the stages' CPU clocks,
stopping `run` (and any stage that outlives it, by pid), and reading the
profiles it wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import bpf, procs
from bench.procs import BenchError
from shared import config as config_mod
from shared import endpoints, pprof

PROGRAM_NAME = "on_cpu_sample"  # the collector's perf_event program (bpf/oncpu.c)
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class WrittenProfile:
    service_dir: str
    window_start_ns: int
    samples: int  # sum of the sample counts
    workload_samples: int  # samples whose process.executable is the workload binary
    written_at: float  # file mtime (wall clock): when the uploader wrote it


class Pipeline:
    def __init__(
        self,
        workdir: Path,
        sample_hz: int,
        upload_interval_s: int,
        workers: int,
        offcpu: bool = False,
        python_stacks: bool = False,
        **changes: object,
    ) -> None:
        self.workdir = workdir
        self.run_dir = workdir / "run"
        self.local_dir = workdir / "profiles"
        workdir.mkdir(parents=True)
        workdir.chmod(0o755)  # the stages run as their own users and must enter it
        # The rate bench asks for is the rate measured: the overhead guard would halve it (a whole CPU
        # of budget keeps it; a suite that measures the guard passes its own).
        changes.setdefault("overhead_budget_pct", 100.0)
        self.cfg = config_mod.ProfilerConfig().replace(
            sample_hz=sample_hz,
            upload_interval_s=upload_interval_s,
            endpoint="",
            local_dir=str(self.local_dir),
            symbolizer_workers=workers,
            offcpu=offcpu,  # explicit: off unless asked for, whatever the default becomes
            python_stacks=python_stacks,  # the same: the runtime reader runs only where asked for
            **changes,
        )
        self.config_path = workdir / "agent.yaml"
        self.config_path.write_text(config_mod.dump(self.cfg))
        self.config_path.chmod(0o644)  # read by every stage's own user
        self.log_path = workdir / "pipeline.log"
        reader = ["runtime"] if self.cfg.runtime_reader_wanted else []
        self.stages = ["uploader"] + [f"symbolizer-{w}" for w in range(workers)] + reader + ["collector"]
        self.pids: dict[str, int] = {}
        self.started: dict[str, int] = {}  # stage → start time, to never signal a reused pid
        self.prog_ids: set[int] = set()
        self.proc: subprocess.Popen[Any] | None = None
        self.start_s = self.stop_s = 0.0

    def start(self) -> None:
        """Start `run`; return once every stage is ready and the collector's program is attached."""
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            proc = self.proc = procs.start(
                [
                    sys.executable,
                    "-m",
                    "cli.main",
                    "run",
                    "--config",
                    str(self.config_path),
                    "--run-dir",
                    str(self.run_dir),
                    "--state-dir",
                    str(self.workdir / "state"),
                ],
                stdout=log,
                stderr=log,
            )
        procs.wait_for("every pipeline stage to be ready", self._all_ready, READY_TIMEOUT_S)
        self.pids["run"] = proc.pid  # the supervisor: part of the pipeline's cost
        for s in self.stages:
            self.pids[s] = int(Path(endpoints.ready_file(str(self.run_dir), s)).read_text().split()[0])
            self.started[s] = procs.start_time(self.pids[s])
        collector = self.pids["collector"]
        ncpu = os.sysconf("SC_NPROCESSORS_ONLN")

        def attached() -> bool:
            held, perf_fds = bpf.held_by(collector)
            names = {p["id"]: p.get("name") for p in bpf.programs()}
            ours = {i for i in held if names.get(i) == PROGRAM_NAME}
            self.prog_ids |= held
            return bool(ours) and perf_fds >= ncpu

        procs.wait_for(f"the collector's {PROGRAM_NAME} program on {ncpu} CPUs", attached, 30.0, 0.05)
        self.start_s = time.monotonic() - t0

    def _all_ready(self) -> bool:
        proc = self.proc
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"the pipeline exited with {proc.returncode} while starting:\n{self.log_tail()}")
        return all(os.path.exists(endpoints.ready_file(str(self.run_dir), s)) for s in self.stages)

    def cpu(self) -> dict[str, float]:
        """CPU seconds of every stage so far."""
        out = {s: procs.cpu_seconds(pid) for s, pid in self.pids.items()}
        out["symbolizers"] = sum(v for s, v in out.items() if s.startswith("symbolizer-"))
        return out

    def stop(self) -> None:
        """SIGTERM to `run` (it stops the stages in order, flushing every window); waits."""
        if self.proc is None:
            return
        t0 = time.monotonic()
        code = procs.stop(self.proc, timeout=STOP_TIMEOUT_S)
        for s, started in self.started.items():
            procs.kill_pid(self.pids[s], started)  # only a stage that outlived `run`
        self.stop_s = time.monotonic() - t0
        self.proc = None
        if code != 0:
            raise BenchError(f"the pipeline exited with {code} when stopped:\n{self.log_tail()}")

    def profiles(self, workload_binary: str) -> list[WrittenProfile]:
        """Every cpu profile written under local_dir."""
        out = []
        for path in sorted(self.local_dir.glob("*/*.pb.gz")):
            p = pprof.read(path.read_bytes())
            if p.period_type != ("cpu", "nanoseconds") or p.sample_types[0] != ("samples", "count"):
                continue  # not an on-CPU profile
            work = sum(s.values[0] for s in p.samples if s.labels.get("process.executable") == workload_binary)
            out.append(WrittenProfile(path.parent.name, p.time_ns, p.total("samples"), work, path.stat().st_mtime))
        return out

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
