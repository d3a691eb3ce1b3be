"""The peer: `profile-bpfcc` from bpfcc-tools, sampling every CPU at the same frequency.

Run in the background for the duration of the workload, folded output to
/dev/null; it counts stacks in the kernel while it runs and symbolizes them
only when it is stopped (SIGINT), after the workload has finished.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import bpf, procs
from bench.procs import BenchError

PROGRAM_NAME = "do_perf_event"
ATTACH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def command() -> str:
    found = shutil.which("profile-bpfcc") or "/usr/sbin/profile-bpfcc"
    if not os.path.exists(found):
        raise BenchError("profile-bpfcc not found: install bpfcc-tools (make test-setup does)")
    return found


class ProfileBpfcc:
    def __init__(self, workdir: Path, sample_hz: int) -> None:
        workdir.mkdir(parents=True)
        self.argv = [command(), "-F", str(sample_hz), "-f"]
        self.log_path = workdir / "profile-bpfcc.stderr"
        self.proc: subprocess.Popen[Any] | None = None
        self.prog_ids: set[int] = set()
        self.start_s = self.stop_s = 0.0

    def start(self) -> None:
        """Start it; return once its program is loaded and attached to a perf event on every CPU."""
        t0 = time.monotonic()
        with open(self.log_path, "w") as err:
            proc = self.proc = procs.start(self.argv, stdout=subprocess.DEVNULL, stderr=err, default_sigint=True)
        ncpu = os.sysconf("SC_NPROCESSORS_ONLN")
        pid = proc.pid
        seen: list[bool] = []

        def attached() -> bool:
            if proc.poll() is not None:
                raise BenchError(
                    f"profile-bpfcc exited with {proc.returncode} while starting: "
                    f"{self.log_path.read_text(errors='replace').strip()}"
                )
            held, perf_fds = bpf.held_by(pid)
            names = {p["id"]: p.get("name") for p in bpf.programs()} if held else {}
            self.prog_ids |= held
            seen.append(any(names.get(i) == PROGRAM_NAME for i in held) and perf_fds >= ncpu)
            return len(seen) >= 2 and seen[-1] and seen[-2]  # the same on two polls: attach finished

        procs.wait_for(f"profile-bpfcc's {PROGRAM_NAME} program on {ncpu} CPUs", attached, ATTACH_TIMEOUT_S, 0.05)
        self.start_s = time.monotonic() - t0

    def cpu(self) -> float:
        if self.proc is None:
            raise BenchError("profile-bpfcc's CPU time was asked for before it started")
        return procs.cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        """SIGINT (it prints its folded stacks to /dev/null and exits); SIGKILL after the deadline."""
        if self.proc is None:
            return
        t0 = time.monotonic()
        code = procs.stop(self.proc, sig=signal.SIGINT, timeout=STOP_TIMEOUT_S)
        self.stop_s = time.monotonic() - t0
        self.proc = None
        if code != 0:
            raise BenchError(
                f"profile-bpfcc exited with {code}: {self.log_path.read_text(errors='replace').strip()[-2000:]}"
            )
