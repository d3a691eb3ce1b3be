"""The runtime reader's token bucket: one rate limiter for its CPU pace, its naming share and its
register samples.

Owns: tokens filled at a rate per second of a clock, at most a capacity kept, spent by the caller in
any unit (CPU seconds, samples); a bucket may go below zero when one spend was larger than what was
left, and fills back from there.

Must not: decide what a token is worth or what to do when the bucket is empty (its users do:
runtimes/main.py CpuPace and RegsGate, runtimes/bpf_walks.py naming).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """Tokens filled at `rate` a second of `clock`, at most `capacity` kept (both may change between
    refills: RegsGate follows the reader's caps)."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self.tokens = capacity  # starts full: a new process's first requests, a reader's first ticks
        self._filled = clock()

    def refill(self) -> float:
        """The tokens now, after the time since the last refill has added its share."""
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._filled) * self.rate)
        self._filled = now
        return self.tokens

    def spend(self, amount: float) -> None:
        self.tokens -= amount
