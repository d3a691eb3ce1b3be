"""Lock contention: bpf/lock.c on syscalls:sys_enter_futex and sys_exit_futex, for target processes.

Owns: the family's name and tracepoints, and lock_pids, the set of processes
whose futex waits are recorded (the collector adds a lock target when it
appears and removes it when it exits). Pausing empties lock_pids (the programs
then return at their first lookup) rather than detaching the tracepoints: attaching
one again is a perf_event_open(2), which kernel.perf_event_paranoid=3 (Debian's
default) allows only with CAP_SYS_ADMIN, held at start only (collector/perfevents.py). Draining and the stack map's lifetime
are collector/intervals.py's, shared with off-CPU.

Must not: read /proc (collector/targets.py finds the targets) or talk to
other stages.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Any

from collector.intervals import IntervalTracer
from collector.sources import TargetedSource
from collector.targets import Target

log = logging.getLogger(__name__)

PROFILE_TYPE = "lock"
TRACEPOINTS = (b"syscalls:sys_enter_futex", b"syscalls:sys_exit_futex")
# Lock target processes at once (bpf/lock.c lock_pids): a map entry each.
LOCK_PIDS = 4096


class LockTracer(IntervalTracer, TargetedSource):
    def __init__(self, bpf: Any, dwarf: bool = False) -> None:
        super().__init__(bpf, "lock", PROFILE_TYPE, TRACEPOINTS, "lock", dwarf)
        self._pids = bpf["lock_pids"]
        self.pids: set[int] = set()
        self.refused = 0
        self._attached = True  # bcc attached the tracepoints when it loaded the module
        log.info("lock profiling attached to %s for target processes", " and ".join(t.decode() for t in TRACEPOINTS))

    def add(self, t: Target) -> None:
        if len(self.pids) >= LOCK_PIDS:
            self.refused += 1
            log.warning(
                "lock profiling: %d target processes already; pid %d (%s) is not profiled",
                LOCK_PIDS,
                t.pid,
                t.executable,
            )
            return
        if self._attached:
            self._pids[ctypes.c_uint32(t.pid)] = ctypes.c_uint8(1)
        self.pids.add(t.pid)
        log.info("lock profiling: futex waits of pid %d (%s, target %r) are recorded", t.pid, t.executable, t.spec)

    def attach(self) -> None:
        """Record the targets' futex waits again after detach(). Threads that began a wait before the
        pause and ended it during it left start records whose end was never seen: cleared first, so no
        paused time is charged."""
        if self._attached:
            return
        self._bpf["lock_start"].clear()
        for pid in self.pids:
            self._pids[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        self._attached = True
        log.info("lock profiling resumed for %d target processes", len(self.pids))

    def detach(self) -> None:
        if self._attached:
            self._pids.clear()
            self._attached = False
            log.info("lock profiling paused (the tracepoints stay attached; no process is recorded)")

    def target_pids(self) -> set[int]:
        return self.pids

    def counts(self) -> dict[str, int]:
        return {"targets_refused": self.refused} if self.refused else {}

    def remove(self, t: Target) -> None:
        if t.pid not in self.pids:
            return
        self.pids.discard(t.pid)
        with contextlib.suppress(KeyError):
            del self._pids[ctypes.c_uint32(t.pid)]
        log.info("lock profiling: pid %d (%s) is gone; no longer recorded", t.pid, t.executable)
