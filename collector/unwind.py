"""Unwind tables in BPF: asking symbolizers for them, checking and loading them, per-process mappings.

Owns (docs/unwinding.md): which modules that sampled stacks went through
still need a table, and the UnwindRequests for them (the most sampled
processes first, a few per drain, none again for a while); the collector's end of unwind.sock, where symbolizers answer; the
bounds check of every table (shared/unwind_table.decode) before its rows are
copied into unwind_rows; the row allocator and module slots, with eviction of
the least recently sampled modules when rows or slots run out (counted);
unwind_procs entries (each sampled process's mappings that have tables,
sorted, with their biases), rewritten when they change and removed when the
process has not been sampled for a while; the step programs in the families'
program arrays; the in-kernel unwinder counters.

Must not: parse ELF or DWARF (symbolizers do; a table is checked, not
trusted), or attach anything.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import zmq

from shared import endpoints, unwind_table
from shared.safestr import cut
from shared.wire import (
    MAX_UNWIND_TABLE_BYTES,
    Mapping,
    Process,
    StackBatch,
    UnwindRequest,
    UnwindTable,
    WireError,
    decode,
)

log = logging.getLogger(__name__)

# Rows of every loaded table together, 16 bytes each in kernel memory: 2M
# rows (32 MiB) hold node (~370K), libc (~28K), libpython (~74K) and dozens more.
UNWIND_ROWS = 1 << 21
# The largest table loaded: a quarter of the rows, so one module cannot push
# out more than a quarter of the others (node's ~370K fit; libLLVM's ~950K,
# sampled while some bcc tool compiles, do not: frame pointers there).
MAX_TABLE_ROWS = UNWIND_ROWS // 4
# Loaded modules at once (8 bytes each).
UNWIND_MODULES = 4096
# Processes with DWARF unwinding at once; 4 KiB of kernel memory each.
UNWIND_PROCS = 1024
# Mappings with tables per process (bpf/unwind.h UNWIND_MAPPINGS).
UNWIND_MAPPINGS = 128
# Distinct DWARF-unwound user stacks per map and drain; 512 bytes each.
DWARF_STACK_ENTRIES = 8192
# Modules asked for per drain: a process with a hundred libraries gets its
# tables over a few seconds instead of one burst of work for the symbolizers.
MAX_REQUESTS_PER_DRAIN = 32
# A request that got no answer (worker busy or restarted, its answer not sent) is made again after this.
REQUEST_RETRY_S = 10.0
# Processes waiting for one module's table whose unwind_procs entries are rewritten the moment it
# loads (others that map it get it at their next drain): a hundred workers of one server share it.
WAITING_PER_MODULE = 32
# Answers taken per drain; the rest wait in the socket for the next drain.
MAX_TABLES_PER_DRAIN = 128
# Answers queued in the socket: most tables are tens of KB, the largest (node) a few MB.
TABLE_QUEUE = 128
# Modules known to have no usable table (no CFI, a corrupt one); not asked for again.
MAX_UNAVAILABLE = 65536
# A process not sampled for this long loses its unwind_procs entry.
PROC_IDLE_S = 120.0
# Names of the unwind_counters slots in bpf/unwind.h, in order.
COUNTERS = ("tail_call_failed", "stack_map_full", "truncated", "fp_steps", "dwarf_steps")
# The step program of each family, and the program array it goes in.
STEP_PROGRAMS = {
    "oncpu": ("oncpu_unwind_step", "oncpu_unwind_progs"),
    "offcpu": ("offcpu_unwind_step", "offcpu_unwind_progs"),
    "lock": ("lock_unwind_step", "lock_unwind_progs"),
}

ModuleKey = tuple[str, int]  # (dev, inode) as /proc/<pid>/maps gives them


@dataclass
class _Module:
    key: ModuleKey
    path: str
    build_id: str
    table: unwind_table.Table
    slot: int
    row_start: int
    last_used: float


class RowAllocator:
    """First-fit ranges of [0, capacity), freed ranges merged with their neighbours."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (start, length), sorted by start

    @property
    def free_rows(self) -> int:
        return sum(n for _, n in self._free)

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, n))
        # merge with the next, then with the previous
        if i + 1 < len(self._free) and start + n == self._free[i + 1][0]:
            self._free[i] = (start, n + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]


def bpf_defines(offcpu_dwarf: bool, lock_dwarf: bool = False) -> dict[str, int]:
    """The -D flags of bpf/unwind.h and the families' DWARF paths."""
    d = {
        "DWARF_UNWIND": 1,
        "UNWIND_ROWS": UNWIND_ROWS,
        "UNWIND_MODULES": UNWIND_MODULES,
        "UNWIND_PROCS": UNWIND_PROCS,
        "DWARF_STACK_ENTRIES": DWARF_STACK_ENTRIES,
    }
    if offcpu_dwarf:
        d["OFFCPU_DWARF"] = 1
    if lock_dwarf:
        d["LOCK_DWARF"] = 1
    return d


def supported() -> str:
    """ "" when this machine's BPF unwinder can run, else why not."""
    machine = os.uname().machine
    if machine != "x86_64":
        return f"the BPF unwinder walks x86-64 stacks; this machine is {machine}"
    return ""


class ProcEntries:
    """unwind_procs: each sampled process's mappings that have tables (`modules`, as UnwindTables
    loads and evicts them), sorted, with their biases; rewritten when they change, removed when the
    process has not been sampled for PROC_IDLE_S, the least recently sampled evicted past
    UNWIND_PROCS (counted in `stats`)."""

    def __init__(self, procs_map: Any, modules: dict[ModuleKey, _Module], stats: dict[str, int]) -> None:
        self._map = procs_map
        self._modules = modules
        self.stats = stats
        # pid → (start ticks, entries written, when last sampled)
        self._written: dict[int, tuple[int, tuple[tuple[int, int, int, int, int], ...], float]] = {}

    def _entries(self, proc: Process) -> tuple[tuple[int, int, int, int, int], ...]:
        out = []
        for m in proc.mappings:
            mod = self._modules.get((m.dev, m.inode))
            if mod is None:
                continue
            h = mod.table.header
            size = m.end - m.start
            if m.offset >= h.text_offset + h.text_size or m.offset + size <= h.text_offset:
                continue  # this mapping is not the part of the file the rows cover
            bias = unwind_table.bias(mod.table, m.start, m.offset) & ((1 << 64) - 1)
            out.append((m.start, m.end, bias, h.span, mod.slot))
        out.sort()
        if len(out) > UNWIND_MAPPINGS:
            self.stats["mappings_over_cap"] += 1
            out = out[:UNWIND_MAPPINGS]
        return tuple(out)

    def update(self, proc: Process, now: float) -> None:
        """`proc`'s entry as its mappings with tables are now (`now`: it was sampled)."""
        entries = self._entries(proc)
        old = self._written.get(proc.pid)
        if old is not None and old[0] == proc.start_ticks and old[1] == entries:
            self._written[proc.pid] = (old[0], old[1], now)
            return
        if not entries:
            if old is not None:
                self._remove(proc.pid)
            return
        self._write(proc.pid, proc.start_ticks, entries, now)

    def _write(self, pid: int, ticks: int, entries: tuple[tuple[int, int, int, int, int], ...], sampled: float) -> None:
        if not entries:
            self._remove(pid)
            return
        if pid not in self._written and len(self._written) >= UNWIND_PROCS:
            oldest = min(self._written, key=lambda p: self._written[p][2])
            self._remove(oldest)
            self.stats["procs_evicted"] += 1
        leaf = self._map.Leaf()
        leaf.count = len(entries)
        for i, (start, end, bias, span, slot) in enumerate(entries):
            e = leaf.maps[i]
            e.start, e.end, e.bias, e.span, e.module = start, end, bias, span, slot
        self._map[ctypes.c_uint32(pid)] = leaf
        self._written[pid] = (ticks, entries, sampled)
        self.stats["procs"] = len(self._written)

    def _remove(self, pid: int) -> None:
        self._written.pop(pid, None)
        with contextlib.suppress(KeyError):
            del self._map[ctypes.c_uint32(pid)]
        self.stats["procs"] = len(self._written)

    def drop_slot(self, slot: int) -> None:
        """The module in `slot` was evicted: every entry that uses it is rewritten without it."""
        for pid, (ticks, entries, sampled) in list(self._written.items()):
            if any(e[4] == slot for e in entries):
                self._write(pid, ticks, tuple(e for e in entries if e[4] != slot), sampled)

    def sweep(self) -> None:
        """Remove the entries of processes not sampled for PROC_IDLE_S (most have exited)."""
        now = time.monotonic()
        for pid in [p for p, w in self._written.items() if now - w[2] >= PROC_IDLE_S]:
            self._remove(pid)


class UnwindTables:
    def __init__(
        self,
        bpf: Any,
        families: Sequence[str],
        run_dir: str,
        ctx: zmq.Context,
        rows: int = UNWIND_ROWS,
        max_table_rows: int = MAX_TABLE_ROWS,
    ) -> None:
        """`rows` must be the UNWIND_ROWS the programs were compiled with (bpf_defines)."""
        from bcc import BPF  # only the collector imports bcc

        self._bpf = bpf
        self._rows = bpf["unwind_rows"]
        self._modules_map = bpf["unwind_modules"]
        self._counters = bpf["unwind_counters"]
        for family in families:
            fn_name, array = STEP_PROGRAMS[family]
            kind = BPF.PERF_EVENT if family == "oncpu" else BPF.TRACEPOINT
            fn = bpf.load_func(fn_name, kind)
            bpf[array][ctypes.c_int(0)] = ctypes.c_int(fn.fd)
        self.families = tuple(families)
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_UNWIND_TABLE_BYTES + 65536)
        self.sock.setsockopt(zmq.RCVHWM, TABLE_QUEUE)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoints.unwind(run_dir))
        self.rows = rows
        self.max_table_rows = max_table_rows
        self._alloc = RowAllocator(rows)
        self._free_slots = list(range(UNWIND_MODULES - 1, -1, -1))
        self.modules: dict[ModuleKey, _Module] = {}
        self.unavailable: dict[ModuleKey, str] = {}
        self._requested: dict[ModuleKey, float] = {}
        self._waiting: dict[ModuleKey, dict[int, Process]] = {}  # asked-for module → pid → process
        self._counters_seen = [0] * len(COUNTERS)
        self.stats = {
            "requested": 0,
            "loaded": 0,
            "rows": 0,
            "none": 0,
            "failed": 0,
            "rejected": 0,
            "unasked": 0,
            "evicted": 0,
            "too_large": 0,
            "procs": 0,
            "procs_evicted": 0,
            "mappings_over_cap": 0,
        }
        self.procs = ProcEntries(bpf["unwind_procs"], self.modules, self.stats)

    # ------------------------------------------------------------ answers

    def receive(self) -> None:
        """Take the symbolizers' answers waiting in the socket (at most MAX_TABLES_PER_DRAIN)."""
        for _ in range(MAX_TABLES_PER_DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                msg = decode(frames)
                if not isinstance(msg, UnwindTable):
                    raise WireError(f"expected an unwind_table, got {type(msg).__name__}")
            except WireError as e:
                self.stats["rejected"] += 1
                log.warning("unwind.sock: dropped a malformed message: %s", e)
                continue
            self._answer(msg)

    def checks(self) -> dict[str, int]:
        """The checks on the unwind service's answers and on the files behind them that fired, for
        status: a file whose CFI could not be read (its frames use frame pointers), an answer not
        asked for, a malformed one, a table over its cap, a process over its mappings cap."""
        s = self.stats
        return {
            "unwind_tables_failed": s["failed"],
            "unwind_answers_unasked": s["unasked"],
            "unwind_answers_rejected": s["rejected"],
            "unwind_tables_too_large": s["too_large"],
            "unwind_mappings_over_cap": s["mappings_over_cap"],
        }

    def _answer(self, msg: UnwindTable) -> None:
        key = (msg.dev, msg.inode)
        waiting = self._waiting.pop(key, {})
        if self._requested.pop(key, None) is None or key in self.modules:
            # Not asked for (any member of the agent's group can write to unwind.sock), or a late
            # second answer: a table is loaded only for a module the collector asked about.
            self.stats["unasked"] += 1
            if self.stats["unasked"] == 1:
                log.warning(
                    "unwind.sock: dropped an answer for %s (%s %d) that was not asked for; "
                    "further ones are only counted",
                    cut(msg.path),
                    cut(msg.dev),
                    msg.inode,
                )
            return
        if msg.status != "ok":
            self.stats[msg.status] += 1
            self._mark_unavailable(key, f"{msg.status}: {msg.reason}")
            log.info(
                "no unwind table for %s (%s %d): %s: %s; its frames use frame pointers",
                msg.path,
                msg.dev,
                msg.inode,
                msg.status,
                msg.reason,
            )
            return
        try:
            table = unwind_table.decode(msg.table, unwind_table.ARCH_X86_64)
        except unwind_table.UnwindTableError as e:
            self.stats["rejected"] += 1
            self._mark_unavailable(key, f"rejected: {e}")
            log.warning("unwind table for %s rejected by the bounds check: %s", msg.path, e)
            return
        self._load(key, msg.path, msg.build_id, table)
        if key in self.modules:  # the processes that asked unwind through it from now on
            now = time.monotonic()
            for proc in waiting.values():
                self.procs.update(proc, now)

    def _mark_unavailable(self, key: ModuleKey, reason: str) -> None:
        if len(self.unavailable) >= MAX_UNAVAILABLE:
            self.unavailable.pop(next(iter(self.unavailable)))
        self.unavailable[key] = reason

    def _load(self, key: ModuleKey, path: str, build_id: str, table: unwind_table.Table) -> None:
        n = table.row_count
        if n > self.max_table_rows:
            self.stats["too_large"] += 1
            self._mark_unavailable(key, f"{n} rows, more than the {self.max_table_rows} one table may take")
            log.warning(
                "unwind table for %s has %d rows, more than the %d one module may take (a quarter "
                "of the map); its frames use frame pointers",
                path,
                n,
                self.max_table_rows,
            )
            return
        start = self._alloc.alloc(n)
        while (start is None or not self._free_slots) and self.modules:
            self._evict(min(self.modules.values(), key=lambda m: m.last_used))
            if start is None:
                start = self._alloc.alloc(n)
        if start is None or not self._free_slots:
            return
        slot = self._free_slots.pop()
        keys = (self._rows.Key * n)(*range(start, start + n))
        values = (self._rows.Leaf * n).from_buffer_copy(table.rows)
        self._rows.items_update_batch(keys, values)
        leaf = self._modules_map.Leaf()
        leaf.row_start, leaf.row_count = start, n
        self._modules_map[ctypes.c_int(slot)] = leaf
        self.modules[key] = _Module(key, path, build_id, table, slot, start, time.monotonic())
        self.stats["loaded"] += 1
        self.stats["rows"] += n
        log.info(
            "unwind table loaded for %s: %d rows (%d of %d rows in use)",
            path,
            n,
            self.rows - self._alloc.free_rows,
            self.rows,
        )

    def _evict(self, m: _Module) -> None:
        """Unload the least recently sampled module; processes mapping it walk it with frame pointers."""
        empty = self._modules_map.Leaf()
        self._modules_map[ctypes.c_int(m.slot)] = empty  # first: no program reads its rows from here on
        del self.modules[m.key]
        self.procs.drop_slot(m.slot)
        self._alloc.free(m.row_start, m.table.row_count)
        self._free_slots.append(m.slot)
        self._requested[m.key] = time.monotonic()  # not asked for again at once: see REQUEST_RETRY_S
        self.stats["evicted"] += 1
        log.info(
            "unwind table of %s evicted (least recently sampled) to make room; evictions so far: %d",
            m.path,
            self.stats["evicted"],
        )

    # ------------------------------------------------------------ per drain

    def annotate(self, batch: StackBatch) -> StackBatch:
        """The batch with UnwindRequests for its sampled processes; their unwind_procs entries updated."""
        now = time.monotonic()
        addresses: dict[int, set[int]] = {}
        weight: dict[int, int] = {}
        for s in batch.samples:
            weight[s.pid] = weight.get(s.pid, 0) + s.count
            if s.user_stack >= 0:
                addresses.setdefault(s.pid, set()).update(batch.user_stacks[s.user_stack])
        requests: list[UnwindRequest] = []
        # The most sampled processes ask first: their stacks matter most.
        for proc in sorted(batch.processes, key=lambda p: -weight.get(p.pid, 0)):
            if proc.start_ticks == 0 or not proc.mappings:  # exited before it was read
                continue
            # Only the modules sampled stacks went through (asking for every module of a process at
            # first sight made start-up a burst of table builds that delayed the symbolizers' windows:
            # issue 14, not done).
            self._ask(proc, self._sampled_mappings(proc, addresses.get(proc.pid, ()), now), now, requests)
            self.procs.update(proc, now)
        self._forget_old_requests(now)
        if not requests:
            return batch
        return replace(batch, unwind_requests=batch.unwind_requests + tuple(requests))

    def track(self, proc: Process) -> list[UnwindRequest]:
        """A target process (lock profiling): tables for every module it maps, not only the sampled
        ones, so its stacks are whole from its first futex wait; its unwind_procs entry kept current."""
        now = time.monotonic()
        requests: list[UnwindRequest] = []
        if proc.start_ticks == 0 or not proc.mappings:
            return requests
        for m in proc.mappings:
            mod = self.modules.get((m.dev, m.inode))
            if mod is not None:
                mod.last_used = now
        self._ask(proc, proc.mappings, now, requests)
        self.procs.update(proc, now)
        self._forget_old_requests(now)
        return requests

    def covered(self, proc: Process) -> list[str]:
        """The paths of `proc`'s modules that have a table loaded."""
        return sorted({m.path for m in proc.mappings if (m.dev, m.inode) in self.modules})

    def _ask(self, proc: Process, mappings: Iterable[Mapping], now: float, requests: list[UnwindRequest]) -> None:
        """Append requests for the modules of `mappings` that have no table and were not asked for lately
        (up to MAX_REQUESTS_PER_DRAIN in `requests`)."""
        for m in mappings:
            if len(requests) >= MAX_REQUESTS_PER_DRAIN:
                break
            key = (m.dev, m.inode)
            if not m.path.startswith("/") or m.inode == 0 or key in self.modules or key in self.unavailable:
                continue
            waiting = self._waiting.setdefault(key, {})
            if len(waiting) < WAITING_PER_MODULE:
                waiting[proc.pid] = proc
            asked = self._requested.get(key)
            if asked is not None and now - asked < REQUEST_RETRY_S:
                continue
            self._requested[key] = now
            requests.append(
                UnwindRequest(
                    pid=proc.pid, start_ticks=proc.start_ticks, start=m.start, end=m.end, dev=m.dev, inode=m.inode
                )
            )
            self.stats["requested"] += 1

    def _forget_old_requests(self, now: float) -> None:
        if len(self._requested) > MAX_UNAVAILABLE:  # answers that never came, for modules long gone
            for key in [k for k, t in self._requested.items() if now - t >= REQUEST_RETRY_S]:
                del self._requested[key]
                self._waiting.pop(key, None)
        for key in [k for k in self._waiting if k not in self._requested]:  # answered, evicted, retried
            del self._waiting[key]

    def _sampled_mappings(self, proc: Process, addresses: Iterable[int], now: float) -> list[Mapping]:
        """The mappings that sampled stacks went through, leaf modules first; their tables are marked used.

        Only these get tables: a module appears in a stack once the frames below it unwind, so
        a process's modules are asked for a few drains apart, in the order its stacks need
        them, and modules it maps but never runs (LLVM in a process that compiled once) are
        never built."""
        maps = proc.mappings
        starts = [m.start for m in maps]
        seen: dict[int, Mapping] = {}
        for a in addresses:
            i = bisect.bisect_right(starts, a) - 1
            if i >= 0 and a < maps[i].end and i not in seen:
                seen[i] = maps[i]
                mod = self.modules.get((maps[i].dev, maps[i].inode))
                if mod is not None:
                    mod.last_used = now
        return list(seen.values())

    def sweep(self) -> None:
        """Remove the unwind_procs entries of processes not sampled for PROC_IDLE_S (most have exited)."""
        self.procs.sweep()

    def counters(self) -> dict[str, int]:
        """The in-kernel unwinder's counters since the previous call (steps, truncations, failures)."""
        out: dict[str, int] = {}
        for i, name in enumerate(COUNTERS):
            total = sum(self._counters[ctypes.c_int(i)])
            if total > self._counters_seen[i]:
                out[name] = total - self._counters_seen[i]
            self._counters_seen[i] = total
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
