"""The JVM's Java threads: where they are, their OS thread ids, stack bounds and last Java frames.

Owns: the thread list (ThreadsSMRSupport::_java_thread_list's array from
JDK 12; JDK 11's Threads::_thread_list linked by JavaThread::_next), each
JavaThread's fields the reader needs (its JavaFrameAnchor, OSThread, stack
base and size, thread state) read in one call for all threads, its OS
thread id (OSThread::_thread_id) in one more; a JavaFrameAnchor's (sp, pc,
fp); and, for on-CPU samples, the JavaThread of an OS thread id (cached,
read again when a sample names a thread not known).

Must not: walk frames (walker.py), write to the target, or log.
"""

from __future__ import annotations

import struct

from runtimes.jvm.frames import BadFrame, Counts
from runtimes.jvm.layouts import Layout
from runtimes.memory import MAX_USER_ADDRESS, MemoryReadError, ProcessMemory

# Java threads read per process (a busy server has a few hundred).
MAX_THREADS = 2048
# A thread stack larger than this is corrupt (HotSpot's -Xss is at most 1 GiB).
MAX_THREAD_STACK = 1 << 32

_Q = struct.Struct("<Q")


def read_anchor(mem: ProcessMemory, lay: Layout, at: int) -> tuple[int, int, int]:
    """(sp, pc, fp) of the JavaFrameAnchor at `at` (sp 0: no last Java frame)."""
    raw = mem.read(at, 24)
    return (
        _Q.unpack_from(raw, lay.anchor_sp)[0],
        _Q.unpack_from(raw, lay.anchor_pc)[0],
        _Q.unpack_from(raw, lay.anchor_fp)[0],
    )


class JavaThreads:
    def __init__(self, layout: Layout, counts: Counts) -> None:
        self.lay, self.counts = layout, counts
        # OS thread id → (JavaThread*, stack base, stack size), read again when a sample names another
        self._by_tid: dict[int, tuple[int, int, int]] = {}

    def self_check(self, mem: ProcessMemory) -> None:
        """The thread list is where the tables say (raises BadFrame or MemoryReadError)."""
        at = self.lay.java_thread_list if self.lay.java_thread_list >= 0 else self.lay.threads_head
        tl = mem.u64(at)
        if tl & 7:
            raise BadFrame(f"the thread list pointer is {tl:#x}")

    def _threads(self, mem: ProcessMemory) -> list[int]:
        lay = self.lay
        if lay.java_thread_list < 0:  # JDK 11: the list linked by JavaThread::_next
            out: list[int] = []
            t = mem.u64(lay.threads_head)
            while t and not t & 7 and len(out) < MAX_THREADS:
                out.append(t)
                t = mem.u64(t + lay.jt_next)
            return out
        tl = mem.u64(lay.java_thread_list)
        if not tl or tl & 7:
            self.counts.drop("thread_list")
            return []
        raw = mem.read(tl, max(lay.tl_length + 4, lay.tl_threads + 8))
        n = struct.unpack_from("<I", raw, lay.tl_length)[0]
        arr = _Q.unpack_from(raw, lay.tl_threads)[0]
        if n > MAX_THREADS:
            self.counts.drop("threads_capped")
            n = MAX_THREADS
        if not n:
            return []
        return [p for (p,) in struct.iter_unpack("<Q", mem.read(arr, 8 * n))]

    def records(self, mem: ProcessMemory) -> tuple[int, list[tuple[int, bytes | None, int]]]:
        """(lo, [(JavaThread*, its fields from offset lo on or None, its OS thread id or 0)]) of every Java
        thread: the list, the threads' fields and their OS thread ids in three reads."""
        lay = self.lay
        try:
            ptrs = self._threads(mem)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            self.counts.drop("thread_list_unreadable")
            return 0, []
        lo = min(lay.jt_anchor, lay.jt_osthread, lay.jt_stack_base, lay.jt_stack_size, lay.jt_thread_state)
        if not ptrs:
            return lo, []
        hi = max(
            lay.jt_anchor + 24,
            lay.jt_osthread + 8,
            lay.jt_stack_base + 8,
            lay.jt_stack_size + 8,
            lay.jt_thread_state + 4,
        )
        got = mem.read_many([(p + lo, hi - lo) if p and not p & 7 else (0, 0) for p in ptrs])
        osreads = []
        for raw_t in got:
            if raw_t is None:
                osreads.append((0, 0))
                continue
            os_t = _Q.unpack_from(raw_t, lay.jt_osthread - lo)[0]
            osreads.append((os_t + lay.os_thread_id, 4) if os_t and not os_t & 7 else (0, 0))
        tids = mem.read_many(osreads)
        return lo, [
            (t, raw_t, struct.unpack("<i", raw_tid)[0] if raw_tid else 0) for t, raw_t, raw_tid in zip(ptrs, got, tids)
        ]

    def bounds(self, raw_t: bytes, lo: int) -> tuple[int, int]:
        """(stack base, stack size) of a JavaThread's fields read from offset lo; (0, 0) if implausible."""
        base = _Q.unpack_from(raw_t, self.lay.jt_stack_base - lo)[0]
        size = _Q.unpack_from(raw_t, self.lay.jt_stack_size - lo)[0]
        if not 0 < size < MAX_THREAD_STACK or not size < base <= MAX_USER_ADDRESS or base & 7:
            return 0, 0
        return base, size

    def of_tid(self, mem: ProcessMemory, tid: int) -> tuple[int, int, int] | None:
        """(JavaThread*, stack base, stack size) of the Java thread with OS thread id `tid` (size 0: its
        bounds are implausible), or None when no Java thread has it."""
        t = self._by_tid.get(tid)
        if t is None:
            lo, records = self.records(mem)
            self._by_tid = {n: (p, *self.bounds(raw, lo)) for p, raw, n in records if raw is not None and n}
            t = self._by_tid.get(tid)
        return t

    def forget(self, tid: int) -> None:
        """A new thread with an old one's id: read again next time."""
        del self._by_tid[tid]
