"""Host identity: the per-host secret that pid labels are hashed with.

Owns: creating the secret once per host (in the state directory, mode 0600)
and hashing (pid, start time) with it, so profiles from one host can be told
apart per process without revealing pids to the backend.

Must not: log the secret or write anywhere but the state directory.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os

SECRET_FILE = "pid-secret"
SECRET_BYTES = 32
# Hex characters of the HMAC kept in the label: 64 bits, collision-free in practice.
PID_HASH_HEX = 16


def load_or_create_secret(state_dir: str) -> bytes:
    """The host's secret, created on first use; every worker of the host reads the same one."""
    os.makedirs(state_dir, mode=0o750, exist_ok=True)
    path = os.path.join(state_dir, SECRET_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno != errno.EEXIST:
            raise
    else:
        # Written under a temporary name first would be cleaner, but O_EXCL makes
        # one writer win; readers retry below until the secret is whole.
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
    for _ in range(100):
        with open(path, "rb") as f:
            secret = f.read(SECRET_BYTES + 1)
        if len(secret) == SECRET_BYTES:
            return secret
        os.sched_yield()
    raise RuntimeError(f"{path} does not hold a {SECRET_BYTES}-byte secret; remove it to make a new one")


def pid_label(secret: bytes, pid: int, start_ticks: int) -> str:
    """The pid label of a process: a keyed hash of its identity."""
    mac = hmac.new(secret, f"{pid}:{start_ticks}".encode(), hashlib.sha256)
    return mac.hexdigest()[:PID_HASH_HEX]
