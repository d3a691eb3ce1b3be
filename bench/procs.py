"""Processes bench starts: starting them so they die with bench, stopping them by
pid, waiting with deadlines, and reading CPU time.

Every process bench starts is registered here and ended by `stop_all()` (called
from run.py's `finally`), by pid, even when a benchmark fails half way.
Waiting is polling with a deadline, never a sleep used as synchronisation.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, TypeVar

from bench import polling
from shared.procstat import read_stat, start_ticks, stat_fields

T = TypeVar("T")

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_PR_SET_PDEATHSIG = 1
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Every Popen bench started and has not yet seen exit.
_started: list[subprocess.Popen[Any]] = []


class BenchError(RuntimeError):
    """A benchmark could not be measured; the message says what happened."""


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.02) -> T:
    """Poll `check` until it returns something truthy; BenchError naming `what` at the deadline."""
    return polling.wait_for(what, check, timeout, interval, error=BenchError)


def sleep_until_wall(t: float) -> None:
    """Sleep until the wall clock (time.time()) reaches t: a schedule, not a synchronisation."""
    while True:
        left = t - time.time()
        if left <= 0:
            return
        time.sleep(left)


def _child_setup(default_sigint: bool) -> Callable[[], None]:
    def setup() -> None:
        # Die with bench even if bench itself is killed (SIGTERM lets it clean up).
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if default_sigint:
            # A background child may inherit SIGINT ignored; profile-bpfcc stops on SIGINT.
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    return setup


def start(
    argv: Sequence[str],
    *,
    stdout: int | IO[Any] | None = subprocess.DEVNULL,
    stderr: int | IO[Any] | None = subprocess.DEVNULL,
    stdin: int | IO[Any] | None = None,
    default_sigint: bool = False,
    text: bool = False,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.Popen[Any]:
    """Start a process in its own session (a Ctrl-C at the terminal reaches bench only)."""
    p = subprocess.Popen(
        list(argv),
        stdout=stdout,
        stderr=stderr,
        stdin=stdin,
        text=text,
        start_new_session=True,
        preexec_fn=_child_setup(default_sigint),  # noqa: PLW1509 - signals set in the child
        env=env,
        cwd=cwd,
    )
    _started.append(p)
    return p


def stop(p: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Stop a process bench started: `sig`, then SIGKILL after `timeout`; returns its exit code."""
    if p.poll() is None:
        try:
            p.send_signal(sig)
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if p in _started:
        _started.remove(p)
    return p.returncode


def kill_pid(pid: int, started: int, timeout: float = 10.0) -> None:
    """End a process bench caused (a pipeline stage) that is not its child: TERM, then KILL.

    `started` is its start time (start_time()): a pid reused by another process is left alone.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not same_process(pid, started):
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while same_process(pid, started) and time.monotonic() < deadline:
            time.sleep(0.02)


def start_time(pid: int) -> int:
    """The start time of `pid` in clock ticks after boot (with the pid, it names one process)."""
    ticks = start_ticks(pid)
    if ticks is None:
        raise ProcessLookupError(f"pid {pid} is gone")
    return ticks


def same_process(pid: int, started: int) -> bool:
    """True while the process `pid` that started at `started` exists and is not a zombie."""
    try:
        return alive(pid) and start_time(pid) == started
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return False


def argv_of(p: subprocess.Popen[Any]) -> list[str]:
    """The argv a process bench started was given (start() always passes a list)."""
    args = p.args
    if isinstance(args, (str, bytes, os.PathLike)):
        return [os.fsdecode(args)]
    return [os.fsdecode(a) for a in args]


def stop_all() -> list[str]:
    """Stop every process bench started and has not stopped; what had to be stopped."""
    left = []
    for p in list(_started):
        if p.poll() is None:
            left.append(f"pid {p.pid} ({os.path.basename(argv_of(p)[0])})")
        stop(p, timeout=30.0)
    return left


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    text = read_stat(pid)
    try:
        state = stat_fields(text)[0] if text is not None else "X"
    except (ValueError, IndexError):
        return False
    return state not in ("Z", "X")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread, exited ones included) of a live process, in seconds.

    The process CPU-time clock (clock_getcpuclockid) has nanosecond resolution;
    it is the sum that /proc/<pid>/stat reports as utime + stime in ticks of
    1/CLK_TCK s (10 ms here), too coarse for intervals of a few seconds.
    """
    clock = ctypes.c_int()
    err = _libc.clock_getcpuclockid(pid, ctypes.byref(clock))
    if err != 0:
        raise BenchError(f"cannot read the CPU clock of pid {pid}: {os.strerror(err)}")
    try:
        return time.clock_gettime_ns(clock.value) / 1e9
    except OSError as e:
        raise BenchError(f"cannot read the CPU clock of pid {pid}: {e}") from None


def stat_cpu_seconds(pid: int) -> float:
    """utime + stime of /proc/<pid>/stat, in seconds (tick resolution; a cross-check)."""
    text = read_stat(pid)
    if text is None:
        raise ProcessLookupError(f"pid {pid} is gone")
    fields = stat_fields(text)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def host_cpu() -> dict[str, float]:
    """Host-wide CPU seconds from /proc/stat: busy (not idle or iowait), idle, steal."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return {
        "busy_s": (user + nice + system + irq + softirq) / CLK_TCK,
        "idle_s": (idle + iowait) / CLK_TCK,
        "steal_s": steal / CLK_TCK,
    }


def host_cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 3) for k in before}
