"""One process per stage per run directory: a lock held for the process's life.

Owns: <run dir>/<stage>.lock, an flock(2) taken before a stage binds any
socket and never released by hand: the kernel drops it when the process exits,
however it exits, so a crash leaves nothing that blocks the next start. The
file holds the pid of the holder, so a second `ebpfprofiler run` or a second
stage on a run directory in use refuses, naming the pid of the one running,
instead of taking over its sockets.

Must not: remove the lock file (a waiting starter may hold it open), or
decide anything beyond "this run directory's stage is taken".
"""

from __future__ import annotations

import errno
import fcntl
import os

# The pid a lock file holds: a few digits and a newline.
MAX_LOCK_FILE_BYTES = 64

_held: dict[str, int] = {}  # path → descriptor, kept open (and locked) until the process exits


class RunDirInUse(Exception):
    """Another live process holds the stage's lock in this run directory."""

    def __init__(self, stage: str, run_dir: str, pid: int | None) -> None:
        self.pid = pid
        super().__init__(
            f"{stage} is already running on {run_dir} (pid {pid if pid else 'unknown'}); "
            f"stop it first, or use another --run-dir"
        )


def lock_path(run_dir: str, stage: str) -> str:
    return os.path.join(run_dir, f"{stage}.lock")


def hold(run_dir: str, stage: str) -> None:
    """Take `stage`'s lock in `run_dir` for the rest of this process's life; RunDirInUse if it is taken,
    OSError if the lock file cannot be opened (not ours, a symlink, or the directory is missing)."""
    path = lock_path(run_dir, stage)
    if path in _held:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this stage's user")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirInUse(stage, run_dir, _holder(fd)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    _held[path] = fd


def _holder(fd: int) -> int | None:
    raw = os.pread(fd, MAX_LOCK_FILE_BYTES, 0).strip()
    return int(raw) if raw.isdigit() else None
