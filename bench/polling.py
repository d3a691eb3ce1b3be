"""wait_for: poll a condition until a deadline, for the tests and the benchmarks.

The stages never poll like this (they sleep on their sockets, shared/stopping.py); what
starts them from outside, a test or a benchmark, waits for what they do by polling with a
deadline, never by a bare sleep.

Owns: the one polling loop. Must not: be used as a stage's main loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    what: str,
    check: Callable[[], T | None],
    timeout: float = 30.0,
    interval: float = 0.05,
    error: type[Exception] = AssertionError,
) -> T:
    """Poll `check` until it returns something truthy; raise `error` naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
