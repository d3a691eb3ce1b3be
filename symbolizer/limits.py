"""Time limits for parsing untrusted input in the symbolizer.

Owns: time_budget, a wall-clock budget for a block of code (SIGALRM via
setitimer(ITIMER_REAL)), so a crafted file that makes a parser loop costs a
bounded amount of time.

Must not: install anything that outlives the block; the previous SIGALRM
handler and timer are put back on exit.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class BudgetExceeded(Exception):
    """The block ran longer than its time budget."""


@contextmanager
def time_budget(seconds: float) -> Iterator[None]:
    """Raise BudgetExceeded inside the block if it runs longer than `seconds`.

    Signals are delivered to the main thread only, so elsewhere the block runs
    without a budget. If an outer timer is pending, ours fires no later than it
    would, and the outer timer is re-armed with its remaining time on exit.
    The budget interrupts Python code only: a single long C call (one huge
    read) finishes before the exception is raised.
    """
    if seconds <= 0:
        raise ValueError(f"time budget must be positive, got {seconds}")
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    armed = True

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if armed:
            raise BudgetExceeded(f"took longer than {seconds:g}s")

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    if previous_delay:
        signal.setitimer(signal.ITIMER_REAL, min(seconds, previous_delay))
    try:
        try:
            yield
        finally:
            # The alarm may still fire up to here; the outer finally restores anyway.
            signal.setitimer(signal.ITIMER_REAL, 0)
            armed = False
    finally:
        # None: the previous handler was installed outside Python; SIG_DFL is the best we can do.
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        if previous_delay:
            remaining = previous_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-6), previous_interval)
