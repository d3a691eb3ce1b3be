"""The programs' new-process events (bpf/common.h notify_new_pid), read from the new_pids ring buffer.

Owns: opening the ring buffer (only on kernels with ring buffers: without them new processes wait
for the regular drains), and taking its events, at most MAX_NOTIFIED_PER_TAKE per wake-up, into
EarlyDrains (collector/drains.py).

Must not: read the processes (see NewProcessEvents.take), or decide when to drain.
"""

from __future__ import annotations

import ctypes
from typing import Any

from collector.drains import EarlyDrains

# New-process events looked at per wake-up (a backlog after a stall needs only a few).
MAX_NOTIFIED_PER_TAKE = 64


class NewProcessEvents:
    """The new_pids ring buffer of the loaded programs `bpf`; `ringbuf`: whether the kernel has them."""

    def __init__(self, bpf: Any, early: EarlyDrains, ringbuf: bool) -> None:
        self._bpf = bpf
        self._early = early
        self._ringbuf = ringbuf
        self._notified: list[int] = []

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
        self._early.notified(pids)
