"""File operations shared by the stages: durable writes, and opening a profiled process's files safely.

Owns: write_atomic (temporary file in the same directory, fsync, rename, fsync
of the directory), so a reader sees a file absent, old, or whole; open_in_root
(openat2 with RESOLVE_IN_ROOT: a path inside a process's root whose symlinks and
.. cannot leave it) and open_regular (an O_PATH descriptor opened for reading
only once fstat says it is a regular file: a FIFO would hang the reader, a
device node would be opened by whoever asks).

Must not: choose paths or names.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import tempfile

_SYS_OPENAT2 = 437            # one number on every architecture (added after the syscall tables were unified)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long


def open_in_root(dirfd: int, path: str) -> int:
    """An O_PATH descriptor of `path` resolved with `dirfd` as its root (symlinks and .. stay inside,
    magic links are refused); OSError otherwise (ENOSYS on kernels before 5.6)."""
    how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(dirfd), os.fsencode(path), ctypes.byref(how),
                  ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def open_regular(path_fd: int, what: str) -> int:
    """`path_fd` (an O_PATH descriptor; left open) opened read-only if it is a regular file; OSError
    (EINVAL) if it is anything else, which is then never opened."""
    if not stat.S_ISREG(os.fstat(path_fd).st_mode):
        raise OSError(errno.EINVAL, f"{what} is not a regular file")
    return os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)


def write_atomic(path: str, data: bytes, mode: int | None = None, gid: int | None = None) -> None:
    """Write `data` to `path` so that `path` is either absent, old, or complete and durable.

    The file is 0600 (mkstemp), or `mode` (and group `gid`) before it takes its name."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
