"""File operations shared by the stages: durable writes, and opening a profiled process's files safely.

Owns: write_atomic, the one way a file is written (root's outputs for a user
included: `record -o`, `report -o`): a temporary file created beside the
target through one descriptor of the target's directory (O_CREAT|O_EXCL|
O_NOFOLLOW, 0600 unless a mode is asked for), fsync, then rename over the
target (which replaces a symlink there, never follows it), fsync of the
directory, so a reader sees a file absent, old, or whole; output_dir_problem
(is a -o path's directory there and writable, asked before a recording
starts); parse_mode (a --mode argument); ensure_dir (a directory created or
taken over by root for a stage user without following any symlink: each
component opened O_NOFOLLOW|O_DIRECTORY from its parent's descriptor, owner
and mode set on the descriptor, refused when a symlink or someone else's);
open_in_root and open_under (the one openat2 wrapper of the tree, RESOLVE_IN_ROOT:
a path inside a process's root whose symlinks and .. cannot leave it), reopen
and open_regular (an O_PATH descriptor opened for reading, by open_regular only
once fstat says it is a regular file: a FIFO would hang the reader, a device
node would be opened by whoever asks).

Must not: choose paths or names.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import pwd
import secrets
import stat

_SYS_OPENAT2 = 437  # one number on every architecture (added after the syscall tables were unified)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long


# What open_in_root opens by default: a descriptor that names the file without opening it, so a FIFO
# or device node planted at the path is fstat'd before anything opens it (open_regular).
PATH_ONLY = os.O_PATH | os.O_CLOEXEC


def open_in_root(dirfd: int, path: str, flags: int = PATH_ONLY) -> int:
    """A descriptor of `path` opened with `flags` (by default O_PATH), resolved with `dirfd` as its root
    (symlinks and .. stay inside, magic links are refused); OSError otherwise (ENOSYS on kernels
    before 5.6). The one openat2 wrapper of the tree."""
    how = _OpenHow(flags, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_long(dirfd),
        os.fsencode(path),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def open_under(root: str, path: str, flags: int = PATH_ONLY) -> int:
    """open_in_root with the directory `root` (a path, such as /proc/<pid>/root) as the root."""
    dirfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_in_root(dirfd, path, flags)
    finally:
        os.close(dirfd)


# How reopen opens what an O_PATH descriptor names: read-only, and non-blocking (a FIFO, had one got
# past the caller's fstat, would hang the reader; a regular file is read as usual).
READ_ONLY = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK


class NotRegular(OSError):
    """open_regular's refusal (errno EINVAL): the descriptor names a FIFO, device, directory ..."""


def reopen(path_fd: int, flags: int = READ_ONLY) -> int:
    """The file `path_fd` (an O_PATH descriptor; left open) names, opened with `flags`: the one way a
    descriptor checked with fstat is then opened for reading (through /proc/self/fd, no path again)."""
    return os.open(f"/proc/self/fd/{path_fd}", flags)


def open_regular(path_fd: int, what: str, flags: int = READ_ONLY) -> int:
    """`path_fd` (an O_PATH descriptor; left open) opened with `flags` if it is a regular file;
    NotRegular (an OSError, EINVAL) if it is anything else, which is then never opened."""
    if not stat.S_ISREG(os.fstat(path_fd).st_mode):
        raise NotRegular(errno.EINVAL, f"{what} is not a regular file")
    return reopen(path_fd, flags)


# Names tried for the temporary file before giving up: each is random (16 hex digits), so a clash
# means someone is creating names there on purpose.
TEMP_NAME_TRIES = 16
# Permission bits a --mode may set: no set-uid, set-gid or sticky bit on a file root writes for a user.
MODE_BITS = 0o777
# Mode of the files written for a user (their stacks may be other users'): root's alone.
PRIVATE_MODE = 0o600
# Mode of a directory component ensure_dir creates on the way to the one it was asked for (as mkdir -p).
PARENT_DIR_MODE = 0o755

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path root must not write or chown through (a symlink, someone else's directory, not a
    directory); the message names it and says what to do."""


def write_atomic(path: str, data: bytes, mode: int | None = None, gid: int | None = None) -> None:
    """Write `data` to `path` so that `path` is either absent, old, or complete and durable.

    The file is created beside `path` through one descriptor of its directory, with O_EXCL and
    O_NOFOLLOW, then renamed over `path`: a symlink at `path` is replaced, its target never opened.
    It is 0600, or `mode` (and group `gid`), before it takes its name."""
    directory, name = os.path.split(path)
    if not name:
        raise IsADirectoryError(errno.EISDIR, "no file name", path)
    dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, tmp = _create_temp(dfd, name, path)
        try:
            try:
                if gid is not None:
                    os.fchown(fd, -1, gid)
                os.fchmod(fd, PRIVATE_MODE if mode is None else mode)  # exactly, whatever the umask
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _create_temp(dfd: int, name: str, path: str) -> tuple[int, str]:
    """A new, empty, 0600 file beside `name` in the directory `dfd`: (descriptor, its name)."""
    for _ in range(TEMP_NAME_TRIES):
        tmp = f".{name[:64]}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_MODE, dir_fd=dfd
            ), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name after {TEMP_NAME_TRIES} tries", path)


def output_dir_problem(path: str) -> str | None:
    """Why `path` cannot be written (its directory is missing, not a directory, not writable; `path`
    itself is a directory), or None. Asked before work that would be lost if the write failed."""
    directory = os.path.dirname(path) or "."
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return f"{path}: the directory {directory} does not exist (create it first)"
    except OSError as e:
        return f"{path}: cannot reach the directory {directory}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path}: {directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return f"{path}: the directory {directory} is not writable"
    if os.path.isdir(path) and not os.path.islink(path):
        return f"{path} is a directory; name a file"
    return None


def parse_mode(text: str) -> int:
    """A --mode argument: octal permission bits (0600, 644); argparse.ArgumentTypeError otherwise."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0600 or 0644") from None
    if not 0 <= mode <= MODE_BITS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: only permission bits (0000 to 0777), no set-uid, set-gid or sticky bit"
        )
    return mode


def ensure_dir(path: str, uid: int, gid: int, mode: int) -> None:
    """`path` as a directory owned by `uid`:`gid` with `mode`, created (with root's 0755 parents) if
    missing, without following a symlink anywhere in it.

    Each component is opened with O_NOFOLLOW|O_DIRECTORY relative to its parent's descriptor, and the
    owner and mode are set on the last one's descriptor, so a symlink swapped in at any time is never
    followed. UnsafePath (nothing changed) if a component is a symlink or not a directory, or if `path`
    exists owned by someone other than root or `uid`."""
    parts = [p for p in os.path.abspath(path).split("/") if p]
    fd = os.open("/", _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            where = "/" + "/".join(parts[: i + 1])
            last = i == len(parts) - 1
            child = _open_dir(fd, part, where, path)
            if child is None:
                try:  # noqa: SIM105
                    os.mkdir(part, 0o700 if last else PARENT_DIR_MODE, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: opened (and checked) below like any other
                child = _open_dir(fd, part, where, path)
                if child is None:
                    raise FileNotFoundError(errno.ENOENT, "removed as it was made", where)
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        if st.st_uid not in (0, uid):
            raise UnsafePath(
                f"{path} is owned by uid {st.st_uid} ({_user(st.st_uid)}): only root or "
                f"{_user(uid)} may own a directory the agent uses; chown it, or choose another"
            )
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _open_dir(dfd: int, part: str, where: str, path: str) -> int | None:
    """A descriptor of the directory `part` in `dfd`, never through a symlink; None if it is missing."""
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        unsafe = _unsafe(dfd, part, where, path)
        if unsafe is None:
            raise
        raise unsafe from e


def _unsafe(dfd: int, part: str, where: str, path: str) -> UnsafePath | None:
    """The refusal for a component that did not open as a directory, or None (some other error)."""
    try:
        st = os.lstat(part, dir_fd=dfd)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(part, dir_fd=dfd)
        except OSError:
            target = "?"
        return UnsafePath(
            f"{path}: {where} is a symbolic link (to {target}, owned by {_user(st.st_uid)}); "
            f"the agent does not create or chown directories through one: give the real path"
        )
    if not stat.S_ISDIR(st.st_mode):
        return UnsafePath(f"{path}: {where} is not a directory")
    return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
