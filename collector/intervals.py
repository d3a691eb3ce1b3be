"""Families that time intervals on tracepoints: off-CPU (bpf/offcpu.c) and lock waits (bpf/lock.c).

Both keep, per thread, where an interval began and its stacks
(<prefix>_start), and charge (count, nanoseconds) to those stacks when it
ends, in double-buffered <prefix>_counts_<buf>; the shapes of key, value,
start record and lost slots are the same in both files.

Owns: draining those counts into a RawDrain, and the lifetime of ids in the
family's one stack map: an id is deleted only when no pending interval (a
thread still blocked) refers to it and no drain has used it for
STACK_KEEP_DRAINS drains, so a thread that blocks in one interval and wakes
in a later one still finds its stack. (Its tracepoints are attached by bcc when
the module loads and stay attached until it is unloaded: the family pauses by
its own means, lock.py by emptying its pid set.)

Must not: read /proc or talk to other stages.
"""

from __future__ import annotations

import logging
from typing import Any

from collector.bpfmaps import (
    DoubleBuffer,
    LostCounters,
    RawDrain,
    delete_dwarf_stacks,
    delete_stacks,
    read_dwarf_stacks,
    read_stacks,
    stale_ids,
    take_counts,
)
from collector.sources import EventSource

log = logging.getLogger(__name__)

# Names of the <prefix>_lost slots in bpf/offcpu.c and bpf/lock.c, in order.
LOST_REASONS = (
    "counts_map_full",
    "user_stack_not_recorded",
    "kernel_stack_not_recorded",
    "start_map_full",
    "stack_gone",
)
# Threads blocked at once that can be tracked; a host with more is rare, and
# the map is an LRU: the oldest sleepers are forgotten first (and counted).
START_ENTRIES = 65536
# Stack ids unused for this many drains (and not pending) are deleted.
STACK_KEEP_DRAINS = 10
# The stack map is swept every this many drains (a sweep reads every key).
STACK_SWEEP_EVERY = 5


class IntervalTracer(EventSource):
    """One interval family: `prefix` names its maps, `tracepoints` its TRACEPOINT_PROBEs (for the log)."""

    def __init__(
        self, bpf: Any, prefix: str, profile_type: str, tracepoints: tuple[bytes, ...], label: str, dwarf: bool = False
    ) -> None:
        self.profile_type = profile_type
        self.label = label  # how the log names it
        self.prefix = prefix
        self.tracepoints = tracepoints
        self.dwarf = dwarf  # compiled with its DWARF path: <prefix>_dwarf_stacks exists
        self._dwarf_stacks = bpf[f"{prefix}_dwarf_stacks"] if dwarf else None
        self._hash_used: dict[int, int] = {}
        self._bpf = bpf
        self._buffers = DoubleBuffer(bpf, prefix)
        self._lost = LostCounters(bpf[f"{prefix}_lost"], LOST_REASONS[:4])
        self._stacks = bpf[f"{prefix}_stacks"]
        self._last_used: dict[int, int] = {}
        self._drains = 0

    def drain(self) -> RawDrain:
        self._drains += 1
        _, counts = self._buffers.retire()
        out = RawDrain()
        refs = take_counts(counts, out, lambda v: (v.count, v.ns))
        gone = read_stacks(self._stacks, refs.user, out.user_stacks) + read_stacks(
            self._stacks, refs.kernel, out.kernel_stacks
        )
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
        present = [k.value for k in self._stacks]  # before the pending scan: see the module doc
        pending: set[int] = set()
        for v in self._bpf[f"{self.prefix}_start"].values():
            pending.add(v.user_stack)
            pending.add(v.kernel_stack)
        horizon = self._drains - STACK_KEEP_DRAINS
        stale = stale_ids(present, pending, self._last_used, horizon)
        delete_stacks(self._stacks, stale)
        log.debug("%s stack sweep: %d ids, %d pending, %d deleted", self.prefix, len(present), len(pending), len(stale))
        if self._dwarf_stacks is not None:
            present = [k.value for k in self._dwarf_stacks]
            pending_hashes = {v.user_hash for v in self._bpf[f"{self.prefix}_start"].values()}
            delete_dwarf_stacks(self._dwarf_stacks, stale_ids(present, pending_hashes, self._hash_used, horizon))
