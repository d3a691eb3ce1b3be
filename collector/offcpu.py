"""Off-CPU profiling: bpf/offcpu.c on the sched:sched_switch and sched:sched_wakeup tracepoints.

Owns: draining the double-buffered off-CPU counts (count of blocking
intervals, blocked nanoseconds) into a RawDrain, and the lifetime of ids in
the one off-CPU stack map: an id is deleted only when no pending interval
(a thread still blocked) refers to it and no drain has used it for
STACK_KEEP_DRAINS drains, so a thread that blocks in one interval and wakes
in a later one still finds its stack.

Must not: read /proc or talk to other stages.
"""

from __future__ import annotations

import logging
from typing import Any

from ebpfprofiler.collector.bpfmaps import (DoubleBuffer, LostCounters, RawDrain, delete_dwarf_stacks,
                                            delete_stacks, read_dwarf_stacks, read_stacks, take_counts)

log = logging.getLogger(__name__)

PROFILE_TYPE = "offcpu"
TRACEPOINTS = (b"sched:sched_switch", b"sched:sched_wakeup")
# Names of the offcpu_lost slots in bpf/offcpu.c, in order.
LOST_REASONS = ("counts_map_full", "user_stack_not_recorded", "kernel_stack_not_recorded",
                "start_map_full", "stack_gone")
# Threads blocked at once that can be tracked; a host with more is rare, and
# the map is an LRU: the oldest sleepers are forgotten first (and counted).
START_ENTRIES = 65536
# Stack ids unused for this many drains (and not pending) are deleted.
STACK_KEEP_DRAINS = 10
# The stack map is swept every this many drains (a sweep reads every key).
STACK_SWEEP_EVERY = 5


class OffCpuTracer:
    profile_type = PROFILE_TYPE

    def __init__(self, bpf: Any, min_ms: int, dwarf: bool = False) -> None:
        self.min_ms = min_ms
        self.dwarf = dwarf     # bpf/offcpu.c compiled with OFFCPU_DWARF: offcpu_dwarf_stacks exists
        self._dwarf_stacks = bpf["offcpu_dwarf_stacks"] if dwarf else None
        self._hash_used: dict[int, int] = {}
        self._bpf = bpf
        self._buffers = DoubleBuffer(bpf, "offcpu")
        self._lost = LostCounters(bpf["offcpu_lost"], LOST_REASONS[:4])
        self._stacks = bpf["offcpu_stacks"]
        self._last_used: dict[int, int] = {}
        self._drains = 0
        # bcc attached the TRACEPOINT_PROBE when it loaded the module.
        self._attached = True
        log.info("off-CPU profiling attached to %s: blocked intervals of %d ms and more",
                 " and ".join(t.decode() for t in TRACEPOINTS), min_ms)

    def drain(self) -> RawDrain:
        self._drains += 1
        _, counts = self._buffers.retire()
        out = RawDrain()
        refs = take_counts(counts, out, lambda v: (v.count, v.ns))
        gone = read_stacks(self._stacks, refs.user, out.user_stacks) + \
            read_stacks(self._stacks, refs.kernel, out.kernel_stacks)
        if self._dwarf_stacks is not None:
            gone += read_dwarf_stacks(self._dwarf_stacks, refs.hashes, out.user_stacks)
            for h in refs.hashes:
                self._hash_used[h] = self._drains
        for sid in refs.user | refs.kernel:
            self._last_used[sid] = self._drains
        if self._drains % STACK_SWEEP_EVERY == 0:
            self._sweep()
        out.lost = self._lost.delta()
        if gone:
            out.lost["stack_gone"] = gone
        return out

    def _sweep(self) -> None:
        present = [k.value for k in self._stacks.keys()]   # before the pending scan: see the module doc
        pending: set[int] = set()
        for v in self._bpf["offcpu_start"].values():
            pending.add(v.user_stack)
            pending.add(v.kernel_stack)
        horizon = self._drains - STACK_KEEP_DRAINS
        stale = [sid for sid in present if sid not in pending and self._last_used.get(sid, -1) < horizon]
        delete_stacks(self._stacks, stale)
        for sid in stale:
            self._last_used.pop(sid, None)
        log.debug("off-CPU stack sweep: %d ids, %d pending, %d deleted", len(present), len(pending), len(stale))
        if self._dwarf_stacks is not None:
            present = [k.value for k in self._dwarf_stacks.keys()]
            pending_hashes = {v.user_hash for v in self._bpf["offcpu_start"].values()}
            stale = [h for h in present if h not in pending_hashes and self._hash_used.get(h, -1) < horizon]
            delete_dwarf_stacks(self._dwarf_stacks, stale)
            for h in stale:
                self._hash_used.pop(h, None)

    def attach(self) -> None:
        """Attach the tracepoints again after detach() (bcc attached them at load).

        Threads that blocked before the pause and were woken during it left
        start records whose wakeup was never seen; they are cleared first, so
        no paused time is charged as blocked time."""
        if self._attached:
            return
        self._bpf["offcpu_start"].clear()
        for tp in TRACEPOINTS:
            category, name = tp.split(b":")
            self._bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + category + b"__" + name)
        self._attached = True
        log.info("off-CPU profiling attached again to %s", " and ".join(t.decode() for t in TRACEPOINTS))

    def detach(self) -> None:
        if self._attached:
            for tp in TRACEPOINTS:
                self._bpf.detach_tracepoint(tp)
            self._attached = False
            log.info("off-CPU profiling detached")
