"""Telling the supervisor that a stage is serving, or stopping.

Owns: the ready file (<run dir>/<stage>.ready holding the stage's pid, which
`ebpfprofiler run` and tests wait for) and the systemd notification
(READY=1 / STOPPING=1 on $NOTIFY_SOCKET, for Type=notify units), written at
the same moment so both supervisors see the same thing.

Must not: decide when a stage is ready; the stage calls announce() once it is.
"""

from __future__ import annotations

import os
import socket

from ebpfprofiler.shared import endpoints, files


def _notify(message: str) -> None:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]   # abstract socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(path)
        s.sendall(message.encode())


def announce(run_dir: str, stage: str, status: str = "") -> None:
    """The stage is serving: write its ready file, tell systemd."""
    # Whole or absent: a supervisor polling for the file must never read it empty.
    files.write_atomic(endpoints.ready_file(run_dir, stage), f"{os.getpid()}\n".encode(), mode=0o644)
    _notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def withdraw(run_dir: str, stage: str) -> None:
    """The stage is stopping: tell systemd, remove its ready file."""
    _notify("STOPPING=1")
    try:
        os.unlink(endpoints.ready_file(run_dir, stage))
    except FileNotFoundError:
        pass
