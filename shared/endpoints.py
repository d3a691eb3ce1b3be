"""Where stages find each other: the ZeroMQ endpoints inside the runtime directory.

Owns: the names of the ipc:// sockets and the default directories. Every stage
derives its endpoints from the same run directory through these functions.

Must not: create sockets.
"""

from __future__ import annotations

import os

DEFAULT_RUN_DIR = "/run/ebpfprofiler"
DEFAULT_STATE_DIR = "/var/lib/ebpfprofiler"


def symbolizer(run_dir: str, worker: int) -> str:
    """The PULL socket of symbolizer worker `worker` (0-based); the collector pushes batches to it."""
    return f"ipc://{os.path.join(run_dir, f'symbolizer-{worker}.sock')}"


def uploader(run_dir: str) -> str:
    """The PULL socket of the uploader; symbolizer workers push profiles to it."""
    return f"ipc://{os.path.join(run_dir, 'uploader.sock')}"


def unwind(run_dir: str) -> str:
    """The collector's PULL socket; symbolizer workers push unwind tables (answers to its requests) to it."""
    return f"ipc://{os.path.join(run_dir, 'unwind.sock')}"


def file_broker(run_dir: str) -> str:
    """The collector's Unix socket that hands symbolizers descriptors of mapped files."""
    return os.path.join(run_dir, "files.sock")


def ready_file(run_dir: str, stage: str) -> str:
    """Written by a stage once it is serving (the supervisor and tests wait for it)."""
    return os.path.join(run_dir, f"{stage}.ready")


def progress_file(run_dir: str, stage: str) -> str:
    """Written by a stage while a long start-up step runs (what it does, a heartbeat); removed when it ends."""
    return os.path.join(run_dir, f"{stage}.progress")


def processes(run_dir: str) -> str:
    """The collector's PUB socket; runtime readers subscribe to process announcements on it."""
    return f"ipc://{os.path.join(run_dir, 'processes.sock')}"


def python_walk(run_dir: str) -> str:
    """The collector's PULL socket; runtime readers push PythonProcess answers (a CPython process they detected,
    with its layout, for the walk in BPF) to it."""
    return f"ipc://{os.path.join(run_dir, 'python-walk.sock')}"


def python_names(run_dir: str) -> str:
    """The runtime reader's ROUTER socket; symbolizer workers ask it to name Python frames (PythonNameRequest)."""
    return f"ipc://{os.path.join(run_dir, 'python-names.sock')}"
