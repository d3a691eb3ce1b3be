"""The programs' new-process events (bpf/common.h notify_new_pid), read from the new_pids ring buffer.

Owns: opening the ring buffer (only on kernels with ring buffers: without them new processes wait
for the regular drains), and taking its events, at most MAX_NOTIFIED_PER_TAKE per wake-up, into
EarlyDrains (collector/drains.py).

An event for a process the collector has read already (the same start time and name) is dropped:
the programs notify a pid again when its last count is over EARLY_STALE_S old, so every long-lived
process that runs once a window (the uploader, a cron-like worker) brought an early look at each
window's start. Looks are at least EARLY_LOOK_GAP_S apart (then a second), so a new process started
just then waited a second for its tables: its first window's whole stacks fell from ~98% to 90%
(tests/integration/test_new_process_stacks.py, one run in four).

Must not: read the processes beyond their /proc/PID/stat (see NewProcessEvents.take), or decide when
to drain.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from collector.drains import EarlyDrains

# New-process events looked at per wake-up (a backlog after a stall needs only a few).
MAX_NOTIFIED_PER_TAKE = 64


class NewProcessEvents:
    """The new_pids ring buffer of the loaded programs `bpf`; `ringbuf`: whether the kernel has them."""

    def __init__(self, bpf: Any, early: EarlyDrains, ringbuf: bool, known: Callable[[int], bool]) -> None:
        self._bpf = bpf
        self._early = early
        self._ringbuf = ringbuf
        self._known = known  # the process table's: read already, as the process it is now
        self._notified: list[int] = []
        self.known_dropped = 0  # events for processes read already

    def fd(self) -> int | None:
        """A descriptor that is readable when a process the programs had not seen is first counted; None
        without ring buffers (bpf/common.h: new processes then wait for the regular drains)."""
        self._notified = []
        if not self._ringbuf:
            return None
        new_pids = self._bpf["new_pids"]
        new_pids.open_ring_buffer(self._on_new_pid)
        return int(new_pids.map_fd)

    def _on_new_pid(self, _ctx: object, data: int, size: int) -> None:
        if size >= 4 and len(self._notified) < MAX_NOTIFIED_PER_TAKE:
            self._notified.append(ctypes.cast(data, ctypes.POINTER(ctypes.c_uint32)).contents.value)

    def take(self) -> None:
        """Consume the new-process events; their pids wait in EarlyDrains. The process is not read
        here: its first count is often that of a child forked to exec, whose mappings are about to be
        replaced (an executable's table asked for then was the parent's, and its answer made
        /proc/PID/map_files unreadable for the new image)."""
        if self._ringbuf:
            self._bpf.ring_buffer_consume()
        pids, self._notified = self._notified, []
        new = [pid for pid in pids if not self._known(pid)]
        self.known_dropped += len(pids) - len(new)
        self._early.notified(new)
