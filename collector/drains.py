"""When a new process brings the collector's next drain forward.

Owns: the pids of the new-process events (bpf/common.h, notify_new_pid) waiting for an early
drain, and the decision whether one is due: only for a process that still lives EARLY_ALIVE_S
after it was first counted. A host that starts hundreds of processes a second (a shell loop's
children, each alive for a millisecond or two) otherwise drained five times a second for
processes already gone, each drain a whole round of map reads, /proc joins and batches for the
collector and the symbolizer; their samples lose nothing by waiting for the regular drain.

Must not: read BPF maps, or /proc beyond whether a pid exists (the `alive` callable).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable

# An early drain is at least this long after the last drain (at most five a second).
EARLY_DRAIN_S = 0.2
# A new process must still live this long after its event was taken for a drain to be brought
# forward for it: a shell loop's /bin/true or `sleep 0.001` lives 1-5 ms. While processes wait,
# the collector wakes once per look (collector/main.py), at most 1 / EARLY_ALIVE_S times a second.
EARLY_ALIVE_S = 0.25
# Pids kept waiting (at most one event per NEW_PID_NOTIFY_NS arrives; one that lives is enough).
MAX_EARLY_PIDS = 64


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


class EarlyDrains:
    """The new processes an early drain may be for, and when it is due."""

    def __init__(self, alive: Callable[[int], bool] = _alive,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._alive = alive
        self._clock = clock
        self._pending: dict[int, float] = {}   # pid → when its event was taken
        self.gone = 0                          # early drains not made: their processes had exited

    def notified(self, pids: Iterable[int]) -> None:
        now = self._clock()
        for pid in pids:
            if len(self._pending) >= MAX_EARLY_PIDS:
                break
            self._pending.setdefault(pid, now)

    def due_at(self, last_drain: float) -> float | None:
        """When to look: EARLY_ALIVE_S after the oldest waiting process's event, and not before
        EARLY_DRAIN_S after the last drain; None when no process waits."""
        if not self._pending:
            return None
        return max(last_drain + EARLY_DRAIN_S, min(self._pending.values()) + EARLY_ALIVE_S)

    def drain_now(self) -> bool:
        """At due_at(): whether a process that has waited EARLY_ALIVE_S still lives. Those are then
        forgotten; younger ones wait for the next look."""
        now = self._clock()
        old = [pid for pid, t in self._pending.items() if t + EARLY_ALIVE_S <= now]   # as due_at() adds
        for pid in old:
            del self._pending[pid]
        if any(self._alive(pid) for pid in old):
            return True
        self.gone += bool(old)
        return False

    def drained(self) -> None:
        """A drain was made: what the waiting processes were counted for went with it."""
        self._pending.clear()
