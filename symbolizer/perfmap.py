"""JIT symbol maps (/tmp/perf-<pid>.map) written by profiled processes.

Owns: opening a process's perf map through /proc/<pid>/root (the process's own
/tmp, also inside containers), parsing it into a sorted PerfMap, and
PerfMapCache, which re-reads a map when it changes.

The file is untrusted: the profiled process writes it and could make it a
symlink to a file it wants the symbolizer to read, a FIFO that blocks, or a
huge file. So the process's /tmp must be a directory and the map a regular
file owned by the process's uid, each opened without following a symlink; size,
line length and entry count are capped, and malformed lines are skipped and
counted.

Format: one "START SIZE name" per line, START and SIZE hex with or without 0x,
the name the rest of the line (it may contain spaces).

Must not: follow a symlink at /tmp or at the map, read any other path, or keep
file descriptors open.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from array import array
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import BinaryIO

from ebpfprofiler.shared.log import LogOnce

log = logging.getLogger(__name__)

# Larger maps are refused; node --perf-basic-prof writes ~70 bytes per compiled function.
PERF_MAP_MAX_BYTES = 16 << 20
# Longer lines (newline included) are skipped as malformed; bounds each read.
PERF_MAP_MAX_LINE_BYTES = 4096
# Maps with more entries are refused; each costs ~100 bytes of worker memory.
PERF_MAP_MAX_ENTRIES = 200_000
# Stat a process's map for changes at most this often.
PERF_MAP_RECHECK_S = 1.0
# Processes whose maps PerfMapCache keeps.
PERF_MAP_CACHE_ENTRIES = 256

_LINE = re.compile(rb"(?:0[xX])?([0-9A-Fa-f]{1,16})[ \t]+(?:0[xX])?([0-9A-Fa-f]{1,16})[ \t]+(\S.*)")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
    mtime_ns: int   # identity of the file as read
    size: int
    _starts: array = field(repr=False, compare=False)
    _ends: array = field(repr=False, compare=False)
    _names: tuple[str, ...] = field(repr=False, compare=False)

    def lookup(self, address: int) -> str | None:
        i = bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._ends[i]:
            return self._names[i]
        return None


def open_perf_map(pid: int, nspid: int, uid: int, proc_dir: str = "/proc") -> PerfMap:
    """Read the perf map of process `pid` (`nspid` in its namespace), whose uid is `uid`.

    Raises PerfMapRefused for a map that must not be read, FileNotFoundError if
    there is none (the normal case), OSError if it cannot be read.
    """
    tmp_fd = _open_no_symlink(f"{proc_dir}/{pid}/root/tmp", os.O_DIRECTORY, "the process's /tmp")
    try:
        fd = _open_no_symlink(f"perf-{nspid}.map", 0, f"perf-{nspid}.map", dir_fd=tmp_fd)
    finally:
        os.close(tmp_fd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PerfMapRefused(f"perf-{nspid}.map is not a regular file")
        if st.st_uid != uid:
            raise PerfMapRefused(f"owned by uid {st.st_uid}, not the process's uid {uid}")
        if st.st_size > PERF_MAP_MAX_BYTES:
            raise PerfMapRefused(f"{st.st_size} bytes, more than {PERF_MAP_MAX_BYTES}")
        starts, ends, names, bad_lines = _parse(f)
    return PerfMap(bad_lines, st.st_mtime_ns, st.st_size, starts, ends, names)


@dataclass
class _Entry:
    perf_map: PerfMap | None
    stamp: tuple[int, int] | None  # (mtime_ns, size) of the file when last opened; None: there was none
    checked: float                 # when the stamp was last taken or compared


class PerfMapCache:
    """Bounded LRU of perf maps by (pid, start_ticks), so a reused pid is a new process.

    A map is re-read when its (mtime_ns, size) changes, checked at most once per
    PERF_MAP_RECHECK_S per process. A refused or unreadable map is logged once
    per process and returned as None, like a missing one.
    """

    def __init__(self, max_entries: int = PERF_MAP_CACHE_ENTRIES, proc_dir: str = "/proc") -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._max_entries = max_entries
        self._proc_dir = proc_dir
        self._entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()  # by (pid, start_ticks)
        self._log_once = LogOnce(log)
        self.stats: dict[str, int] = dict.fromkeys(
            ("hits", "loaded", "missing", "refused", "unreadable", "evicted"), 0)

    def get(self, pid: int, start_ticks: int, nspid: int, uid: int, now: float | None = None) -> PerfMap | None:
        now = time.monotonic() if now is None else now
        key = (pid, start_ticks)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            if now - entry.checked < PERF_MAP_RECHECK_S:
                self.stats["hits"] += 1
                return entry.perf_map
            entry.checked = now
            if self._stamp(pid, nspid) == entry.stamp:
                self.stats["hits"] += 1
                return entry.perf_map
        perf_map, stamp = self._load(pid, start_ticks, nspid, uid)
        self._entries[key] = _Entry(perf_map, stamp, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
            self.stats["evicted"] += 1
        return perf_map

    def _load(self, pid: int, start_ticks: int, nspid: int, uid: int) -> tuple[PerfMap | None, tuple[int, int] | None]:
        try:
            perf_map = open_perf_map(pid, nspid, uid, self._proc_dir)
        except FileNotFoundError:
            self.stats["missing"] += 1
            return None, None
        except (PerfMapRefused, OSError) as e:
            self.stats["refused" if isinstance(e, PerfMapRefused) else "unreadable"] += 1
            self._log_once((pid, start_ticks), logging.WARNING, "not using the perf map of pid %d: %s", pid, e)
            return None, self._stamp(pid, nspid)
        self.stats["loaded"] += 1
        return perf_map, (perf_map.mtime_ns, perf_map.size)

    def _stamp(self, pid: int, nspid: int) -> tuple[int, int] | None:
        try:
            st = os.stat(f"{self._proc_dir}/{pid}/root/tmp/perf-{nspid}.map", follow_symlinks=False)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size


def _open_no_symlink(path: str, flags: int, what: str, dir_fd: int | None = None) -> int:
    try:
        return os.open(path, _OPEN_FLAGS | flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PerfMapRefused(f"{what} is a symlink") from None
        if e.errno == errno.ENOTDIR:  # what O_DIRECTORY|O_NOFOLLOW gives for a symlink, too
            raise PerfMapRefused(f"{what} is a symlink or not a directory") from None
        raise


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
        m = _LINE.fullmatch(line.rstrip(b"\r\n"))
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
        names.append(m[3].decode("utf-8", "replace"))

    # Stable sort: of entries with the same start, the last line is last and kept.
    order = sorted(range(len(starts)), key=starts.__getitem__)
    kept = [i for k, i in enumerate(order) if k + 1 == len(order) or starts[order[k + 1]] != starts[i]]
    return (array("Q", (starts[i] for i in kept)), array("Q", (ends[i] for i in kept)),
            tuple(names[i] for i in kept), bad_lines)
