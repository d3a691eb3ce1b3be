"""Test harness: real stages and the receiver as processes, waiting with deadlines.

Every process started here is ended by its owner's stop(), by pid, even when
the test fails. Waiting is polling with a deadline, never a sleep.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from ebpfprofiler.shared import config as config_mod
from ebpfprofiler.shared import endpoints

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tests" / "workloads"
PY = sys.executable
# -O0: gcc 12 drops the frame of leaf functions at -O1 and above even with
# -mno-omit-leaf-frame-pointer (seen here), and the tests need every frame.
FRAME_POINTER_FLAGS = ["-O0", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 30.0, interval: float = 0.05) -> T:
    """Poll `check` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def stop_process(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Stop a process this test started; kill it if it does not stop in time."""
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.returncode


def bpf_holdings(pid: int) -> tuple[set[int], int]:
    """(ids of the BPF programs `pid` holds, number of perf event fds it holds)."""
    progs, perf = set(), 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target == "anon_inode:[perf_event]":
                perf += 1
            elif target == "anon_inode:bpf-prog":
                for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                    if line.startswith("prog_id:"):
                        progs.add(int(line.split()[1]))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return progs, perf


def bpftool(*args: str) -> list[dict]:
    out = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out or "[]")


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("integration tests load BPF programs: run them as root (make test does)")


class Receiver:
    """The reference receiver on 127.0.0.1, started as a process."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.proc = subprocess.Popen(
            [PY, "-m", "ebpfprofiler.cli.main", "receiver", "--listen", "127.0.0.1:0", "--dir", str(directory)],
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        m = re.search(r"listening on (http://\S+)", line)
        if not m:
            stop_process(self.proc)
            raise AssertionError(f"receiver did not start: {line!r}")
        self.url = m.group(1)

    def stop(self) -> None:
        stop_process(self.proc)


def open_dir(prefix: str) -> Path:
    """A directory under /tmp that the stages' users can enter (pytest's are root-only).

    The caller removes it (shutil.rmtree) when done."""
    path = Path(tempfile.mkdtemp(prefix=f"ebpfprofiler-{prefix}-", dir="/tmp"))
    path.chmod(0o755)
    return path


class Pipeline:
    """`ebpfprofiler run` with a config of the test's, until stop().

    Its runtime, state and config live in an open directory of its own
    (removed at stop), as the stages run as their own users; a test that sets
    local_dir puts it under such a directory too (open_dir)."""

    def __init__(self, workdir: Path, cfg: config_mod.ProfilerConfig) -> None:
        self.cfg = cfg
        self.root = open_dir("pipeline")
        self.run_dir = self.root / "run"
        self.state_dir = self.root / "state"
        self.config_path = self.root / "agent.yaml"
        self.config_path.write_text(config_mod.dump(cfg))
        self.config_path.chmod(0o644)
        self.log_path = workdir / "pipeline.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [PY, "-m", "ebpfprofiler.cli.main", "run", "--config", str(self.config_path),
             "--run-dir", str(self.run_dir), "--state-dir", str(self.state_dir)],
            stdout=self._log, stderr=subprocess.STDOUT)
        stages = ["uploader", "collector"] + [f"symbolizer-{w}" for w in range(cfg.symbolizer_workers)]
        try:
            wait_for("every stage to be ready", lambda: self._ready(stages), timeout=90)
        except AssertionError:
            self.stop()
            raise AssertionError(f"pipeline did not start:\n{self.log()}")

    def _ready(self, stages: list[str]) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"pipeline exited with {self.proc.returncode}:\n{self.log()}")
        return all(os.path.exists(endpoints.ready_file(str(self.run_dir), s)) for s in stages)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        code = stop_process(self.proc, timeout=90)
        self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)
        return code
