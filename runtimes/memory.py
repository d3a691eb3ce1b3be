"""Reading another process's memory: process_vm_readv, bounded, never anything else.

Owns: ProcessMemory (reads of one process, each at most MAX_READ_BYTES, each
charged to a ReadBudget: a process's share of the tick's, in bytes and time; several independent reads in one system
call with read_many), and turning every failure into a
MemoryReadError with a short reason: the process is gone (ESRCH), an address
is not mapped (EFAULT), or we may not read it (EPERM).

Must not: ptrace-attach, stop, or write to a process. process_vm_readv does
none of these: the target runs on while we read, so whatever we read may be
torn; callers validate it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import time

# One read is at most this: a code object's location table or a name is far
# smaller; a larger request means a corrupt length.
MAX_READ_BYTES = 64 << 10
# User-space addresses on x86-64 and arm64 (48-bit): anything above is not a pointer into a process.
MAX_USER_ADDRESS = (1 << 47) - 1
# Reads in one process_vm_readv call (the kernel's UIO_MAXIOV).
MAX_IOVECS = 1024


class MemoryReadError(Exception):
    """A read that failed; `reason` is one of gone, unmapped, denied, too_large, budget, bad_address."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class ReadBudget:
    """Bytes (and, with a deadline, time) that may still be spent reading; every read is charged to it.

    One per tick; a process read within a tick gets one of its own whose `parent` is the tick's, so a
    read is charged to both. `spent` names the cap that fired first ("bytes" or "time"), "" while none
    has: the reader tells a process over its own share from a tick whose budget is spent."""

    def __init__(self, max_bytes: int, deadline: float | None = None, parent: ReadBudget | None = None) -> None:
        self.max_bytes = max_bytes
        self.deadline = deadline  # time.monotonic() past which no read is made
        self.parent = parent
        self.used = 0
        self.spent = ""

    def charge(self, n: int) -> None:
        if self.parent is not None:
            self.parent.charge(n)
        if self.used + n > self.max_bytes:
            self.spent = self.spent or "bytes"
            raise MemoryReadError("budget", f"{self.max_bytes} bytes spent")
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.spent = self.spent or "time"
            raise MemoryReadError("budget", "time spent")
        self.used += n


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv = _libc.process_vm_readv
_readv.restype = ctypes.c_ssize_t
_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")

# read_many's iovec arrays, shared (the reader reads from one thread): 16 bytes a range.
_IOVEC = struct.Struct("<QQ")
_LOCAL_VECS = ctypes.create_string_buffer(_IOVEC.size * MAX_IOVECS)
_REMOTE_VECS = ctypes.create_string_buffer(_IOVEC.size * MAX_IOVECS)
_LOCAL_VECS_P = ctypes.cast(_LOCAL_VECS, ctypes.POINTER(_IoVec))
_REMOTE_VECS_P = ctypes.cast(_REMOTE_VECS, ctypes.POINTER(_IoVec))

# Pages are read whole or not at all (read_window).
_PAGE = os.sysconf("SC_PAGE_SIZE")

_REASONS = {errno.ESRCH: "gone", errno.EFAULT: "unmapped", errno.EPERM: "denied", errno.EACCES: "denied"}


class ProcessMemory:
    """Reads of one process's memory, charged to `budget` (replace it every tick)."""

    def __init__(self, pid: int, budget: ReadBudget) -> None:
        self.pid = pid
        self.budget = budget
        self.reads = 0
        self._buf = ctypes.create_string_buffer(MAX_READ_BYTES)
        self._buf_address = ctypes.addressof(self._buf)
        # One pair of iovecs, refilled per read: building them per read was a third of a read's cost.
        self._local = _IoVec(self._buf_address, 0)
        self._remote = _IoVec(0, 0)
        self._local_ref, self._remote_ref = ctypes.byref(self._local), ctypes.byref(self._remote)

    def read(self, address: int, size: int) -> bytes:
        if size <= 0 or size > MAX_READ_BYTES:
            raise MemoryReadError("too_large", f"{size} bytes at {address:#x}")
        if not 0 < address <= MAX_USER_ADDRESS - size:
            raise MemoryReadError("bad_address", f"{address:#x}")
        self.budget.charge(size)
        self.reads += 1
        self._local.iov_len = size
        self._remote.iov_base, self._remote.iov_len = address, size
        n = _readv(self.pid, self._local_ref, 1, self._remote_ref, 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            raise MemoryReadError(_REASONS.get(err, "failed"), f"{os.strerror(err)} at {address:#x}")
        if n != size:
            raise MemoryReadError("unmapped", f"short read ({n} of {size}) at {address:#x}")
        # Only `size` bytes: the buffer's .raw would copy all MAX_READ_BYTES of it first.
        return ctypes.string_at(self._buf_address, size)

    def read_many(self, requests: list[tuple[int, int]]) -> list[bytes | None]:
        """Independent reads (address, size) in as few system calls as fit (MAX_IOVECS elements,
        MAX_READ_BYTES in all); None for each that could not be read (unmapped, a bad address or
        size). MemoryReadError only if the process is gone, may not be read, or the budget is spent."""
        out: list[bytes | None] = [None] * len(requests)
        todo = [
            i
            for i, (address, size) in enumerate(requests)
            if 0 < size <= MAX_READ_BYTES and 0 < address <= MAX_USER_ADDRESS - size
        ]
        self.budget.charge(sum(requests[i][1] for i in todo))  # once, however many calls it takes
        while todo:
            batch: list[int] = []
            total = 0
            for i in todo:
                size = requests[i][1]
                if len(batch) == MAX_IOVECS or total + size > MAX_READ_BYTES:
                    break
                batch.append(i)
                total += size
            self.reads += 1
            k = len(batch)
            at = 0
            for j, i in enumerate(batch):
                address, size = requests[i]
                _IOVEC.pack_into(_LOCAL_VECS, j * 16, self._buf_address + at, size)
                _IOVEC.pack_into(_REMOTE_VECS, j * 16, address, size)
                at += size
            n = _readv(self.pid, _LOCAL_VECS_P, k, _REMOTE_VECS_P, k, 0)
            if n < 0:
                err = ctypes.get_errno()
                reason = _REASONS.get(err, "failed")
                if reason != "unmapped":
                    raise MemoryReadError(reason, f"{os.strerror(err)} reading {k} ranges")
                n = 0  # the first range is not mapped
            # The kernel copies whole elements, in order, and stops at the first it cannot read.
            got = ctypes.string_at(self._buf_address, n) if n else b""
            at = done = 0
            for i in batch:
                size = requests[i][1]
                if at + size > n:
                    break
                out[i] = got[at : at + size]
                at += size
                done += 1
            todo = todo[done + 1 :] if done < k else todo[k:]  # past the one that failed
        return out

    def read_window(self, address: int, size: int, below: int) -> tuple[int, bytes]:
        """`size` bytes at `address` and as much as can be read of the `below` bytes under it, in one
        system call: (the window's start address, its bytes, which end at address + size). A chain of
        records laid out downwards (CPython's frames in a thread's data stack) is then walked from one
        read instead of one read a record. The part below is read a page at a time from the top down,
        and the kernel stops at the first page it cannot read, so an unmapped page under `address`
        only shortens the window. MemoryReadError as read() when `address` itself cannot be read."""
        if size <= 0 or below < 0 or size + below > MAX_READ_BYTES:
            raise MemoryReadError("too_large", f"{size} + {below} bytes at {address:#x}")
        if not 0 < address <= MAX_USER_ADDRESS - size:
            raise MemoryReadError("bad_address", f"{address:#x}")
        low = max(address - below, _PAGE)  # the first page is never mapped
        pieces = [(address, size)]
        top = address
        while top > low:
            start = max((top - 1) & ~(_PAGE - 1), low)
            pieces.append((start, top - start))
            top = start
        self.budget.charge(size + address - low)
        self.reads += 1
        for j, (at, n) in enumerate(pieces):  # each piece in its place: the buffer holds [low, address + size)
            _IOVEC.pack_into(_LOCAL_VECS, j * 16, self._buf_address + at - low, n)
            _IOVEC.pack_into(_REMOTE_VECS, j * 16, at, n)
        got = _readv(self.pid, _LOCAL_VECS_P, len(pieces), _REMOTE_VECS_P, len(pieces), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise MemoryReadError(_REASONS.get(err, "failed"), f"{os.strerror(err)} at {address:#x}")
        if got < size:
            raise MemoryReadError("unmapped", f"short read ({got} of {size}) at {address:#x}")
        start, done = address, size
        for at, n in pieces[1:]:  # the kernel copies whole pieces, in order, and stops at the first it cannot
            if done + n > got:
                break
            start, done = at, done + n
        return start, ctypes.string_at(self._buf_address + start - low, address + size - start)

    def u64(self, address: int) -> int:
        return _U64.unpack(self.read(address, 8))[0]

    def u64_or_none(self, address: int) -> int | None:
        """u64(), or None when this one read fails (a bad pointer); a process gone or the tick's
        budget spent still raise, as they end the whole read."""
        try:
            return self.u64(address)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            return None

    def u32(self, address: int) -> int:
        return _U32.unpack(self.read(address, 4))[0]

    def i32(self, address: int) -> int:
        return _I32.unpack(self.read(address, 4))[0]
