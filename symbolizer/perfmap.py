"""JIT symbol maps (/tmp/perf-<pid>.map) written by profiled processes.

Owns: checking and parsing a process's perf map from a descriptor into a
sorted PerfMap, and PerfMapCache, which re-reads a map when it changes.

The file is untrusted: the profiled process writes it and could make it a
symlink to a file it wants the symbolizer to read, a FIFO that blocks, or a
huge file. The collector's file broker opens it (inside the process's root,
refusing a symlink at /tmp or at the map, and anything but a regular file);
here the descriptor must still be a regular file owned by the process's uid;
size, line length and entry count are capped, and malformed lines are
skipped and counted. Names are made strings by the process-string rule
(shared/safestr.process_string: escaped, no control characters, capped).

Format: one "START SIZE name" per line, START and SIZE hex with or without 0x,
the name the rest of the line (it may contain spaces). A NUL ends an entry
as a newline does (.NET 8 writes some so).

Must not: open paths itself, or keep file descriptors open.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from shared.log import LogOnce
from shared.safestr import process_string
from symbolizer.files import ProcessGone

log = logging.getLogger(__name__)

# Larger maps are refused; node --perf-basic-prof writes ~70 bytes per compiled function.
PERF_MAP_MAX_BYTES = 16 << 20
# Longer lines (newline included) are skipped as malformed; bounds each read.
PERF_MAP_MAX_LINE_BYTES = 4096
# Maps with more entries are refused; each costs ~100 bytes of worker memory.
PERF_MAP_MAX_ENTRIES = 200_000
# Stat a process's map for changes at most this often.
PERF_MAP_RECHECK_S = 1.0
# A changed map is read again only after this many times what its last read cost: a process that
# rewrites a maximum-size map (0.5 s to read) every second costs a worker 5% of a CPU, not half.
PERF_MAP_REREAD_FACTOR = 20.0
# Processes whose maps PerfMapCache keeps.
PERF_MAP_CACHE_ENTRIES = 256

_LINE = re.compile(rb"(?:0[xX])?([0-9A-Fa-f]{1,16})[ \t]+(?:0[xX])?([0-9A-Fa-f]{1,16})[ \t]+(\S.*)")


class PerfMapRefused(Exception):
    """A perf map that is not read; str(e) says why."""


@dataclass(frozen=True)
class PerfMap:
    """The JIT symbols of one process, sorted by start address.

    lookup(address) returns the entry with the greatest start <= address if its
    range covers the address. Of entries with the same start, the later line
    wins; partly overlapping entries are not merged.
    """

    bad_lines: int  # malformed lines skipped (also zero-size entries, which cover nothing)
    mtime_ns: int  # identity of the file as read
    size: int
    _starts: array = field(repr=False, compare=False)
    _ends: array = field(repr=False, compare=False)
    _names: tuple[str, ...] = field(repr=False, compare=False)

    def lookup(self, address: int) -> str | None:
        i = bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._ends[i]:
            return self._names[i]
        return None


def read_perf_map(fd: int, nspid: int, uid: int) -> PerfMap:
    """Check and parse the perf map open at `fd` (closed here) of a process whose uid is `uid`.

    Raises PerfMapRefused for a map that must not be read, OSError if it cannot be read.
    """
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PerfMapRefused(f"perf-{nspid}.map is not a regular file")
        if st.st_uid != uid:
            raise PerfMapRefused(f"perf-{nspid}.map is owned by uid {st.st_uid}, not the process's uid {uid}")
        if st.st_size > PERF_MAP_MAX_BYTES:
            raise PerfMapRefused(f"perf-{nspid}.map has {st.st_size} bytes, more than {PERF_MAP_MAX_BYTES}")
        starts, ends, names, bad_lines = _parse(f)
    return PerfMap(bad_lines, st.st_mtime_ns, st.st_size, starts, ends, names)


# Opens the perf map of (pid, start_ticks): a descriptor, FileNotFoundError if
# there is none, PerfMapRefused or OSError if it must not or cannot be opened.
Opener = Callable[[int, int], int]


@dataclass
class _Entry:
    perf_map: PerfMap | None
    stamp: tuple[int, int] | None  # (mtime_ns, size) of the file when last opened; None: there was none
    checked: float  # when the stamp was last taken or compared
    interval: float = PERF_MAP_RECHECK_S  # until the next check: longer after a costly read


class PerfMapCache:
    """Bounded LRU of perf maps by (pid, start_ticks), so a reused pid is a new process.

    A map is re-read when its (mtime_ns, size) changes, checked at most once per
    PERF_MAP_RECHECK_S per process, or per PERF_MAP_REREAD_FACTOR times what its
    last read cost if that is longer (a map rewritten all the time costs a bounded share).
    A refused or unreadable map is logged once per process and returned as None, like a missing one.
    Once the process has exited (ProcessGone), the map last read from it is kept: it can change no
    more, and it names the samples drained after the exit.
    """

    def __init__(self, opener: Opener, max_entries: int = PERF_MAP_CACHE_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._max_entries = max_entries
        self._open = opener
        self._entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()  # by (pid, start_ticks)
        self._log_once = LogOnce(log)
        self.stats: dict[str, int] = dict.fromkeys(
            ("hits", "loaded", "missing", "gone", "refused", "unreadable", "evicted"), 0
        )

    def get(self, pid: int, start_ticks: int, nspid: int, uid: int, now: float | None = None) -> PerfMap | None:
        now = time.monotonic() if now is None else now
        key = (pid, start_ticks)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            if now - entry.checked < entry.interval:
                self.stats["hits"] += 1
                return entry.perf_map
            entry.checked = now
        started = time.monotonic()
        perf_map, stamp = self._load(pid, start_ticks, nspid, uid, entry)
        if entry is not None and stamp == entry.stamp and stamp is not None:
            self.stats["hits"] += 1
            return entry.perf_map
        cost = time.monotonic() - started
        # The back-off is for the cost of reading a map; a missing one (a process that has not written it
        # yet, a slow broker) is looked for again after PERF_MAP_RECHECK_S.
        interval = (
            max(PERF_MAP_RECHECK_S, cost * PERF_MAP_REREAD_FACTOR) if perf_map is not None else PERF_MAP_RECHECK_S
        )
        self._entries[key] = _Entry(perf_map, stamp, now, interval)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
            self.stats["evicted"] += 1
        return perf_map

    def _load(
        self, pid: int, start_ticks: int, nspid: int, uid: int, entry: _Entry | None
    ) -> tuple[PerfMap | None, tuple[int, int] | None]:
        """The map (re-read only if its stamp changed since `entry`) and its stamp."""
        try:
            fd = self._open(pid, start_ticks)
        except ProcessGone:
            # Exited: the map last read from it can change no more, and its samples drained after the
            # exit (up to a drain's worth) are named by it.
            self.stats["gone"] += 1
            return (entry.perf_map, entry.stamp) if entry is not None else (None, None)
        except FileNotFoundError:
            self.stats["missing"] += 1
            return None, None
        except (PerfMapRefused, OSError) as e:
            refused = isinstance(e, PerfMapRefused) or getattr(e, "error", "") == "refused"
            self.stats["refused" if refused else "unreadable"] += 1
            self._log_once((pid, start_ticks), logging.WARNING, "not using the perf map of pid %d: %s", pid, e)
            return None, None
        st = os.fstat(fd)
        if entry is not None and entry.stamp == (st.st_mtime_ns, st.st_size):
            os.close(fd)
            return entry.perf_map, entry.stamp
        try:
            perf_map = read_perf_map(fd, nspid, uid)
        except (PerfMapRefused, OSError) as e:
            self.stats["refused" if isinstance(e, PerfMapRefused) else "unreadable"] += 1
            self._log_once((pid, start_ticks), logging.WARNING, "not using the perf map of pid %d: %s", pid, e)
            return None, (st.st_mtime_ns, st.st_size)
        self.stats["loaded"] += 1
        return perf_map, (perf_map.mtime_ns, perf_map.size)


def _parse(f: BinaryIO) -> tuple[array, array, tuple[str, ...], int]:
    starts: list[int] = []
    ends: list[int] = []
    names: list[str] = []
    bad_lines = 0
    left = PERF_MAP_MAX_BYTES  # the file may grow while it is read
    while left > 0:
        line = f.readline(min(PERF_MAP_MAX_LINE_BYTES, left))
        left -= len(line)
        if not line.endswith(b"\n"):
            if len(line) < PERF_MAP_MAX_LINE_BYTES:
                break  # end of file; an unfinished last line is still being written
            bad_lines += 1
            while line and not line.endswith(b"\n") and left > 0:  # skip the rest of the long line
                line = f.readline(min(PERF_MAP_MAX_LINE_BYTES, left))
                left -= len(line)
            continue
        # .NET 8 ends some of the lines it writes when asked for a map with a NUL, not a newline.
        for piece in line.rstrip(b"\r\n").split(b"\0"):
            if not piece and b"\0" in line:
                continue
            m = _LINE.fullmatch(piece)
            if m is None:
                bad_lines += 1
                continue
            start, size = int(m[1], 16), int(m[2], 16)
            if size == 0 or start + size >= 1 << 64:
                bad_lines += 1
                continue
            if len(starts) == PERF_MAP_MAX_ENTRIES:
                raise PerfMapRefused(f"more than {PERF_MAP_MAX_ENTRIES} entries")
            starts.append(start)
            ends.append(start + size)
            names.append(process_string(m[3]))

    # Stable sort: of entries with the same start, the last line is last and kept.
    order = sorted(range(len(starts)), key=starts.__getitem__)
    kept = [i for k, i in enumerate(order) if k + 1 == len(order) or starts[order[k + 1]] != starts[i]]
    return (
        array("Q", (starts[i] for i in kept)),
        array("Q", (ends[i] for i in kept)),
        tuple(names[i] for i in kept),
        bad_lines,
    )
