"""The runtime reader's test harness: the stage's own Reader driven tick by tick, and the workloads it reads.

Owns: DrivenReader (runtimes/main.py's Reader in the test process: the
collector's announcements in, built from /proc by the collector's own
read_process; ticks; its closed windows out as stacks), start and go (a
workload started with a pipe for stdin, and its go), spinner (a CPython
script whose stacks are known), the interpreter the runtime tests run
(PYTHON311), and the pipeline a runtime's module fixture profiles its
workloads with (runtime_config, runtime_pipeline, wait_for_stacks,
start_logged, wait_warmed_up). Every runtime's integration tests and the
runtime contract tests (tests/unit/test_runtime_contract.py) use it; no test
module imports another.

Must not: assert what a test judges (the tests do; the harness asserts only
that its processes started and ended cleanly), or mock what a runtime decides.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from collector.procfs import read_process
from runtimes.main import Reader
from shared import endpoints
from shared.config import ProfilerConfig
from shared.labels import process_labels
from shared.wire import ProcessAnnouncement
from tests.harness import Pipeline, Receiver, wait_for

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
        self.reader.walks.close()


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


def runtime_config(work: Path, receiver: Receiver, runtime: str, **changes: Any) -> ProfilerConfig:
    """The config of a runtime's pipeline test: 5 s windows to `receiver`, plain pids, `runtime`'s stacks
    alone, and `changes` over that. Other processes of a busy test host are read too; a budget the
    test's CPU will not hit keeps the reader at full rate for the workloads. Nothing else of the
    pipeline competes for the CPU with the workloads: building unwind tables for every process on a
    fresh start takes seconds of CPU, and a preempted thread's wall time blurs the ratios judged."""
    fields: dict[str, Any] = {
        "upload_interval_s": 5,
        "endpoint": receiver.url,
        "local_dir": str(work / "unused"),
        "plain_pid": True,
        "python_stacks": False,
        "runtime_stacks": (runtime,),
        "cpu_budget": 50.0,
        "dwarf_unwind": False,
        "offcpu": False,
    }
    return ProfilerConfig(**{**fields, **changes})


@contextlib.contextmanager
def runtime_pipeline(work: Path, cfg: ProfilerConfig) -> Iterator[Pipeline]:
    """The pipeline run with `cfg`, once its runtime reader is ready; stopped on the way out, and its
    exit 0 asserted when the body ended without an error."""
    pipeline = Pipeline(work, cfg)
    try:
        ready = Path(endpoints.ready_file(str(pipeline.run_dir), "runtime"))
        wait_for("the runtime reader", ready.exists, timeout=30)
        yield pipeline
    finally:
        code = pipeline.stop()
    assert code == 0, pipeline.log()


def wait_for_stacks(pipeline: Pipeline, what: str, enough: Callable[[], bool], timeout: float) -> None:
    """wait_for `enough`, each second; when it times out, the runtime reader's last lines say why."""
    try:
        wait_for(what, enough, timeout=timeout, interval=1.0)
    except AssertionError as e:
        runtime_log = [ln for ln in pipeline.log().splitlines() if " runtime[" in ln]
        raise AssertionError(f"{e}; the runtime reader said:\n" + "\n".join(runtime_log[-30:])) from None


def start_logged(argv: list[str], out: Path, started: list[subprocess.Popen]) -> subprocess.Popen:
    """argv with its output in `out` and no stdin, handed to `started` (a module's module_started:
    killed and reaped at the module's end, conftest.py) as it starts."""
    with open(out, "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    started.append(p)
    return p


def wait_warmed_up(name: str, p: subprocess.Popen, out: Path, marker: str) -> None:
    """Until `marker` is in p's output `out`, or p ends (asserted it did not)."""
    wait_for(f"{name}'s warm-up", lambda: marker in out.read_text() or p.poll() is not None, timeout=90, interval=0.2)
    assert p.poll() is None, f"{name} ended:\n{out.read_text()[-2000:]}"
