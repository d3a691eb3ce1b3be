"""Where a Node.js process's Isolate is: the one address in its anonymous memory that its StackGuard and its
ThreadLocalTop both point back at.

Owns: the search (a few MiB a tick, charged to the tick's read budget) in
the process's anonymous read-write memory; searched again in its new
mappings while none is found (a process announced as it execs has none
yet), at most MAX_SEARCHES times.

Must not: read the Isolate's stack (reader.py does), write to the target,
or log.
"""

from __future__ import annotations

import struct
import time

from runtimes.memory import MAX_READ_BYTES, MemoryReadError, ProcessMemory
from runtimes.node.frames import Counts
from runtimes.node.layouts import Layout
from runtimes.runtime import Mapping, read_maps

# Anonymous memory searched for the Isolate: per mapping, in all, and per tick (charged to the tick's budget).
MAX_SCAN_MAPPING = 64 << 20
MAX_SCAN_TOTAL = 512 << 20
SCAN_BYTES_PER_TICK = 2 << 20
# A process announced as it starts has no Isolate yet: its memory is searched again (new mappings,
# a grown [heap]) this long after a search found none, at most MAX_SEARCHES times (a minute).
SEARCH_AGAIN_S = 2.0
MAX_SEARCHES = 30

_Q = struct.Struct("<Q")


def scan_ranges(maps: list[Mapping]) -> list[tuple[int, int]]:
    """The anonymous read-write memory the Isolate may be in (malloc'd: [heap] or an anonymous mapping)."""
    out, total = [], 0
    for m in maps:
        if not m.perms.startswith("rw") or m.path not in ("", "[heap]") or m.end - m.start > MAX_SCAN_MAPPING:
            continue
        if total + (m.end - m.start) > MAX_SCAN_TOTAL:
            break
        out.append((m.start, m.end))
        total += m.end - m.start
    return out


class IsolateFinder:
    def __init__(self, layout: Layout, ranges: list[tuple[int, int]], pid: int, proc: str, counts: Counts) -> None:
        self.layout, self.pid, self.proc, self.counts = layout, pid, proc, counts
        self._searches, self._search_after = 1, 0.0
        self._scan = list(ranges)
        self._scan_at = self._scan[0][0] if self._scan else 0

    def find(self, mem: ProcessMemory) -> int | None:
        """The Isolate's address, or None: not found (yet) in this tick's share of the search."""
        lay, spent = self.layout, 0
        if not self._scan and self.pid and self._searches < MAX_SEARCHES and time.monotonic() >= self._search_after:
            self._searches += 1
            self._scan = scan_ranges(read_maps(self.pid, self.proc))
            self._scan_at = self._scan[0][0] if self._scan else 0
        searching = bool(self._scan)
        while self._scan and spent < SCAN_BYTES_PER_TICK:
            lo, hi = self._scan[0]
            at = max(self._scan_at, lo)
            n = min(MAX_READ_BYTES, hi - at)
            if n <= 0:
                self._scan.pop(0)
                self._scan_at = self._scan[0][0] if self._scan else 0
                continue
            spent += n
            try:
                data = mem.read(at, n)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                data = b""
            self._scan_at = at + n
            for cand in self.self_pointers(data, at, lay.stack_guard_isolate):
                try:
                    if mem.u64(cand + lay.thread_local_top + lay.tlt_isolate) == cand:
                        return cand
                except MemoryReadError as e:
                    if e.reason in ("gone", "budget"):
                        raise
        if not self._scan:
            if searching:  # this search is over: the next one in SEARCH_AGAIN_S
                self._search_after = time.monotonic() + SEARCH_AGAIN_S
            self.counts.drop("no_isolate")
        return None

    @staticmethod
    def self_pointers(data: bytes, base: int, back: int) -> list[int]:
        """Addresses a (8-aligned) in data at which the word at a + back is a itself."""
        out = []
        for hi_bits in range((base - back) >> 16, ((base + len(data)) >> 16) + 1):  # 2 or 3 values
            pattern = (hi_bits << 16).to_bytes(8, "little")[2:]
            i = data.find(pattern)
            while i >= 0:
                slot = i - 2
                if slot >= 0 and (base + slot) % 8 == 0 and slot + 8 <= len(data):
                    word = _Q.unpack_from(data, slot)[0]
                    if word == base + slot - back and word:
                        out.append(word)
                i = data.find(pattern, i + 1)
        return out
