"""Allocation profiling: bpf/alloc.c's uprobes on libc's allocator, attached to target processes only.

Owns: attaching the seven uprobes (malloc, calloc, realloc entry and return;
free entry) to a target process's own libc when it appears, and detaching
them when it goes; the sampling table (quantiles of an exponential
distribution, bpf/alloc.c draws from it); draining the double-buffered
allocation counts, and snapshots of the live allocations (inuse, sent once
per upload window by the collector) into RawDrains whose user stacks have
the caller frame the entry probe's walk skips put back; the lifetime of ids
in the alloc stack map (kept while a live allocation or a recent drain
refers to them); the live entries of processes that exited.

Must not: decide which processes are targets (collector/targets.py), or talk
to other stages.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ebpfprofiler.collector.bpfmaps import DoubleBuffer, LostCounters, RawDrain, delete_stacks, stale_ids
from ebpfprofiler.collector.procfs import read_maps
from ebpfprofiler.collector.targets import Target
from ebpfprofiler.shared import privileges

log = logging.getLogger(__name__)

PROFILE_TYPE = "alloc"
# Names of the alloc_lost slots in bpf/alloc.c, in order; stack_gone is counted here.
LOST_REASONS = ("counts_map_full", "user_stack_not_recorded", "live_map_full", "pending_map_full", "stack_gone")
# Distinct (pid, tid, stack, caller) keys per drain.
ALLOC_COUNTS_ENTRIES = 16384
# Distinct allocation stacks kept (127 x 8 bytes each: 16 MiB).
ALLOC_STACK_ENTRIES = 16384
# Sampled allocations not yet freed, over all targets (~100 bytes each: 6.5 MB).
# At the default 512 KiB sampling that is 32 GiB of live heap.
ALLOC_LIVE_ENTRIES = 65536
# bcc allows 1000 probes per BPF object; seven per process.
MAX_ALLOC_PROCESSES = 128
# Quantiles of Exp(1) bpf/alloc.c draws the distance to the next sample point from.
EXP_ENTRIES = 256
# Stack ids unused for this many drains (and not referred to by a live allocation) are deleted.
STACK_KEEP_DRAINS = 10
STACK_SWEEP_EVERY = 5
# (symbol, entry program, return program or None)
PROBES = (("malloc", "alloc_malloc_enter", "alloc_return_probe"),
          ("calloc", "alloc_calloc_enter", "alloc_return_probe"),
          ("realloc", "alloc_realloc_enter", "alloc_return_probe"),
          ("free", "alloc_free_enter", None))
_LIBC = re.compile(r"libc(?:\.so(?:\.\d+)*|-\d+\.\d+\.so)$")


def bpf_defines(sample_bytes: int) -> dict[str, int]:
    return {"ALLOC_SAMPLE_BYTES": sample_bytes, "ALLOC_COUNTS_ENTRIES": ALLOC_COUNTS_ENTRIES,
            "ALLOC_STACK_ENTRIES": ALLOC_STACK_ENTRIES, "ALLOC_LIVE_ENTRIES": ALLOC_LIVE_ENTRIES}


def exp_quantiles(n: int = EXP_ENTRIES) -> list[int]:
    """n quantiles of Exp(1) at (i + 0.5) / n, scaled so their mean is exactly 1, in 16.16 fixed point:
    the mean distance between sample points is then the configured number of bytes."""
    q = [-math.log(1 - (i + 0.5) / n) for i in range(n)]
    mean = sum(q) / n
    return [max(1, round(x / mean * 65536)) for x in q]


def libc_of(pid: int) -> str | None:
    """The path (inside the process's root) of the libc `pid` maps, or None."""
    for m in read_maps(pid):
        if _LIBC.search(m.path):
            return m.path
    return None


@dataclass
class _Attached:
    target: Target
    events: list[tuple[bytes, bool]] = field(default_factory=list)    # (bcc event name, is a return probe)


class AllocTracer:
    profile_type = PROFILE_TYPE

    def __init__(self, bpf: Any, sample_bytes: int) -> None:
        self._bpf = bpf
        self.sample_bytes = sample_bytes
        table = bpf["alloc_exp"]
        for i, v in enumerate(exp_quantiles()):
            table[ctypes.c_int(i)] = ctypes.c_uint32(v)
        self._buffers = DoubleBuffer(bpf, "alloc")
        self._lost = LostCounters(bpf["alloc_lost"], LOST_REASONS[:4])
        self._stacks = bpf["alloc_stacks"]
        self._live = bpf["alloc_live"]
        self._pending = bpf["alloc_pending"]
        self.attached: dict[int, _Attached] = {}
        self.waiting: dict[int, Target] = {}      # targets while paused
        self.paused = False
        self._last_used: dict[int, int] = {}
        self._drains = 0
        self.stats = {"attached": 0, "attach_failed": 0, "no_libc": 0, "over_cap": 0, "detached": 0}
        log.info("allocation profiling ready: uprobes on libc malloc, calloc, realloc, free of target processes; "
                 "%s", f"one sample per {sample_bytes} bytes on average" if sample_bytes else "every allocation")

    # ------------------------------------------------------------ targets

    def add(self, t: Target) -> None:
        if self.paused:
            self.waiting[t.pid] = t
            return
        if len(self.attached) >= MAX_ALLOC_PROCESSES:
            self.stats["over_cap"] += 1
            log.warning("allocation profiling: %d processes attached already (bcc's probe limit); pid %d (%s) "
                        "is not profiled", MAX_ALLOC_PROCESSES, t.pid, t.executable)
            return
        libc = libc_of(t.pid)
        if libc is None:
            self.stats["no_libc"] += 1
            log.warning("allocation profiling: pid %d (%s) maps no libc (static, or another allocator only); "
                        "not profiled", t.pid, t.executable)
            return
        from bcc import BPF  # type: ignore[import-not-found]   # only the collector imports bcc

        path = f"/proc/{t.pid}/root{libc}".encode()
        a = _Attached(t)
        try:
            for sym, entry, ret in PROBES:
                module, addr = BPF._check_path_symbol(path, sym.encode(), None, t.pid)
                self._bpf.attach_uprobe(name=module, addr=addr, fn_name=entry.encode(), pid=t.pid)
                a.events.append((self._bpf._get_uprobe_evname(b"p", module, addr, t.pid), False))
                if ret:
                    self._bpf.attach_uretprobe(name=module, addr=addr, fn_name=ret.encode(), pid=t.pid)
                    a.events.append((self._bpf._get_uprobe_evname(b"r", module, addr, t.pid), True))
        except Exception as e:  # bcc raises bare Exception; the process may have exited meanwhile
            self._detach(a)
            self.stats["attach_failed"] += 1
            why = "" if privileges.held()["CapEff"] >> privileges.CAP_SYS_ADMIN & 1 else (
                " (the collector lacks CAP_SYS_ADMIN, which creating a uprobe takes on Linux 6.16+: under "
                "systemd add it with a drop-in, see README \"Allocation and lock profiles\")")
            log.warning("allocation profiling: cannot attach to pid %d (%s): %s%s", t.pid, t.executable, e, why)
            return
        self.attached[t.pid] = a
        self.stats["attached"] += 1
        log.info("allocation profiling: %d uprobes attached to pid %d (%s, target %r) in %s", len(a.events),
                 t.pid, t.executable, t.spec, libc)

    def remove(self, t: Target) -> None:
        self.waiting.pop(t.pid, None)
        a = self.attached.pop(t.pid, None)
        if a is None:
            return
        self._detach(a)
        self.stats["detached"] += 1
        dropped = self._forget_live({t.pid})
        log.info("allocation profiling: pid %d (%s) is gone: uprobes detached, %d live allocations forgotten",
                 t.pid, t.executable, dropped)

    def _detach(self, a: _Attached) -> None:
        for ev, _ in a.events:
            try:
                self._bpf.detach_uprobe_event(ev)
            except Exception as e:  # already gone with the process's exit is fine; say anything else
                log.debug("detaching %s: %s", ev.decode(errors="replace"), e)
        a.events.clear()

    def _forget_live(self, pids: set[int]) -> int:
        keys = [k for k in self._live.keys() if k.pid in pids]
        for k in keys:
            try:
                del self._live[k]
            except KeyError:
                pass
        return len(keys)

    def attach(self) -> None:
        """After detach(): every target again."""
        if not self.paused:
            return
        self.paused = False
        waiting, self.waiting = self.waiting, {}
        for t in waiting.values():
            self.add(t)
        log.info("allocation profiling attached again to %d processes", len(self.attached))

    def detach(self) -> None:
        """Every uprobe off (remote config paused profiling, or the collector stops); targets are kept."""
        if self.paused:
            return
        for pid, a in list(self.attached.items()):
            self._detach(a)
            self.waiting[pid] = a.target
        self.attached.clear()
        self._live.clear()
        self.paused = True
        log.info("allocation profiling detached")

    # ------------------------------------------------------------ maps

    def drain(self) -> RawDrain:
        """The allocations counted since the previous drain: count and value are (objects, bytes)."""
        self._drains += 1
        _, counts = self._buffers.retire()
        rows = [(k.pid, k.tid, k.user_stack, k.caller, v.objects_milli, v.bytes) for k, v in counts.items()]
        counts.clear()
        out = self._raw(rows, inuse=False)
        out.lost.update(self._lost.delta())
        if self._drains % STACK_SWEEP_EVERY == 0:
            self._sweep()
        return out

    def inuse(self) -> RawDrain:
        """Allocations sampled and not freed, by stack: extra values (inuse objects, inuse bytes)."""
        sums: dict[tuple[int, int, int, int], list[int]] = defaultdict(lambda: [0, 0])
        gone: list[Any] = []      # entries of processes no longer attached (exited while paused)
        for k, v in self._live.items():
            if k.pid not in self.attached:
                gone.append(k)
                continue
            s = sums[(k.pid, v.tid, v.user_stack, v.caller)]
            s[0] += v.objects_milli
            s[1] += v.bytes
        for k in gone:
            try:
                del self._live[k]
            except KeyError:
                pass
        return self._raw([(*key, o, b) for key, (o, b) in sums.items()], inuse=True)

    def _raw(self, rows: list[tuple[int, int, int, int, int, int]], inuse: bool) -> RawDrain:
        out = RawDrain()
        ids: dict[tuple[int, int], int] = {}
        walked: dict[int, tuple[int, ...] | None] = {}
        gone = 0
        for pid, tid, sid, caller, objects_milli, nbytes in rows:
            key = (sid, caller)
            uid = ids.get(key)
            if uid is None:
                frames: tuple[int, ...] = ()
                if sid >= 0:
                    if sid not in walked:
                        try:
                            walked[sid] = tuple(self._stacks.walk(sid))
                        except KeyError:
                            walked[sid] = None
                    if walked[sid] is None:
                        gone += 1
                    else:
                        frames = walked[sid]
                        self._last_used[sid] = self._drains
                if caller:   # the frame the entry probe's walk skipped
                    frames = frames[:1] + (caller,) + frames[1:]
                uid = ids[key] = len(ids)
                out.user_stacks[uid] = frames
            objects = (objects_milli + 500) // 1000
            if inuse:
                out.samples.append((pid, tid, uid, -1, 0, 0, (objects, nbytes)))
            else:
                out.samples.append((pid, tid, uid, -1, objects, nbytes, (0, 0)))
        if gone:
            out.lost["stack_gone"] = gone
        return out

    def _sweep(self) -> None:
        present = [k.value for k in self._stacks.keys()]
        for sid in present:   # an id no drain has used yet may belong to a call still in progress: young
            self._last_used.setdefault(sid, self._drains)
        keep = {v.user_stack for v in self._live.values()} | {v.user_stack for v in self._pending.values()}
        delete_stacks(self._stacks, stale_ids(present, keep, self._last_used, self._drains - STACK_KEEP_DRAINS))

    def close(self) -> None:
        for a in self.attached.values():
            self._detach(a)
        self.attached.clear()
