"""collector/newprocs.py on a real ring buffer: a known process's event is dropped, a new one's waits.

Given a BPF program with a `new_pids` ring buffer (as bpf/common.h's) that submits the calling
process's pid at each getppid() (a syscall this test makes on purpose), NewProcessEvents reading it
with the collector's ProcessTable.known on the real /proc, and this test's own process read into
that table, when this process and a child never read both call getppid(), then take() passes only
the child to EarlyDrains, and counts this process's events as dropped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from collector.drains import EarlyDrains
from collector.newprocs import NewProcessEvents
from collector.procfs import ProcessTable
from tests.harness import require_root, wait_for

PROGRAM = b"""
BPF_RINGBUF_OUTPUT(new_pids, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (pid != WATCHED_A && pid != WATCHED_B)
        return 0;
    new_pids.ringbuf_output(&pid, sizeof(pid), 0);
    return 0;
}
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    """A process that calls getppid() each time it reads a line, and ends when its stdin closes."""
    code = "import os, sys\nfor _ in sys.stdin:\n    os.getppid()\n    print('ok', flush=True)\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


def test_only_a_process_not_read_already_waits_for_an_early_drain(child: subprocess.Popen) -> None:
    require_root()
    from bcc import BPF

    bpf = BPF(text=PROGRAM, cflags=[f"-DWATCHED_A={os.getpid()}", f"-DWATCHED_B={child.pid}"])
    try:
        asked: list[int] = []

        def alive(pid: int) -> bool:
            asked.append(pid)
            return True

        early = EarlyDrains(alive=alive)
        table = ProcessTable(with_cmdline=False)
        assert table.get(os.getpid()) is not None  # this process: read already
        events = NewProcessEvents(bpf, early, ringbuf=True, known=table.known)
        assert events.fd() is not None
        # when both call getppid()
        os.getppid()
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"

        def both_taken() -> bool:
            events.take()
            return events.known_dropped >= 1 and early.due_at(0.0) is not None

        wait_for("both events taken", both_taken, timeout=10, interval=0.05)
        # then only the child waits for an early drain, and this process's event was counted as dropped
        assert early.drain_now()
        assert asked == [child.pid]
        assert events.known_dropped == 1
    finally:
        bpf.cleanup()
