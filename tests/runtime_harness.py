"""The runtime reader's test harness: the stage's own Reader driven tick by tick, and the workloads it reads.

Owns: DrivenReader (runtimes/main.py's Reader in the test process: the
collector's announcements in, built from /proc by the collector's own
read_process; ticks; its closed windows out as stacks), start and go (a
workload started with a pipe for stdin, and its go), spinner (a CPython
script whose stacks are known), and the interpreter the runtime tests run
(PYTHON311). Every runtime's integration tests and the runtime contract
tests (tests/unit/test_runtime_contract.py) use it; no test module imports
another.

Must not: assert (the tests do), or mock what a runtime decides.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from collector.procfs import read_process
from runtimes.main import Reader
from shared.config import ProfilerConfig
from shared.labels import process_labels
from shared.wire import ProcessAnnouncement

PYTHON311 = "/usr/bin/python3.11"

# A workload whose stacks are known: main() → outer() → inner() → spin(), in a file of its own;
# it spins for argv[1] seconds from the test's go (a line on stdin), then ends as argv[2] says.
SPINNER = """\
import os, sys, time

def spin(end):
    while time.monotonic() < end:
        pass

def inner(end):
    spin(end)

def outer(end):
    inner(end)

def main():
    seconds, how = float(sys.argv[1]), sys.argv[2]
    print("ready", flush=True)
    sys.stdin.readline()             # the test's go
    outer(time.monotonic() + seconds)
    if how == "_exit":
        os._exit(0)

main()
"""
SPINNER_FUNCTIONS = {"<module>", "main", "outer", "inner", "spin"}


class DrivenReader:
    """The stage's Reader, driven by the test: announcements in, ticks, closed windows out."""

    def __init__(self, directory: Path, runtime_stacks: tuple[str, ...] = ("python_legacy",), **cfg: Any) -> None:
        self.cfg = ProfilerConfig(plain_pid=False, runtime_stacks=runtime_stacks, cpu_budget=100.0, **cfg)
        self.reader = Reader(self.cfg, str(directory), str(directory))
        self.rows: dict[tuple, int] = {}

    def announce(self, *pids: int, full: bool = False) -> None:
        procs = tuple(p for p in (read_process(pid, False) for pid in pids) if p is not None)
        self.reader.targets.announce(
            ProcessAnnouncement(host="test", time_ns=time.time_ns(), processes=procs, exited=(), full=full)
        )

    def tick(self) -> int:
        """One tick of the reader; the stacks it has read so far."""
        self.reader.tick(time.time_ns())
        return self.reader.stats["stacks"]

    def stacks(self) -> dict[tuple, int]:
        """(labels as a dict's items, frames) → stacks, of every window so far."""
        for w in self.reader.windows.close_all():
            for (labels, frames), (count, _) in w.data.rows.items():
                self.rows[(labels, frames)] = self.rows.get((labels, frames), 0) + count
        return self.rows

    def labels_of(self, pid: int, ticks: int) -> tuple[tuple[str, str], ...]:
        proc = read_process(pid, False)
        assert proc is not None and proc.start_ticks == ticks
        return process_labels(self.reader.host, proc, self.reader.secret, plain_pid=False, strip_process_args=True)

    def close(self) -> None:
        self.reader.inbox.close()
        self.reader.outbox.close()


def start(procs: list[subprocess.Popen], argv: list[str]) -> tuple[subprocess.Popen, str]:
    """argv started with a pipe for stdin (closing it ends the fake interpreter); (process, first line)."""
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, f"{argv[0]} printed nothing (exit {p.poll()})"
    return p, line


def go(p: subprocess.Popen) -> None:
    """Start a spinner's countdown."""
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()


def spinner(directory: Path) -> Path:
    path = directory / "spinner.py"
    path.write_text(SPINNER)
    return path
