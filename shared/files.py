"""Durable file writes shared by every stage that writes files.

Owns: write_atomic (temporary file in the same directory, fsync, rename, fsync
of the directory), so a reader sees a file absent, old, or whole.

Must not: choose paths or names.
"""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` so that `path` is either absent, old, or complete and durable.

    The file is 0600 (mkstemp), or `mode` before it takes its name."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
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
