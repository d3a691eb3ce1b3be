"""Telling the supervisor that a stage is starting, serving, or stopping.

Owns: the ready file (<run dir>/<stage>.ready holding the stage's pid, which
`ebpfprofiler run` and tests wait for); the progress file of a long start-up
step (<run dir>/<stage>.progress: what the stage is doing, for how long, and a
heartbeat counter rewritten every beat, removed when the step ends however it
ends); the systemd notifications that go with them, on $NOTIFY_SOCKET for
Type=notify units (READY=1 / STOPPING=1; with every beat STATUS= and
EXTEND_TIMEOUT_USEC=, which extends the unit's start timeout while the step
proves it is alive), written at the same moments so both supervisors see the
same thing; and the rule by which a supervisor reads a starting stage
(StartWatch): ready; working (its heartbeat is fresh: no time limit); quiet
(nothing said: the supervisor's own timeout runs); stale (no beat for
STALE_BEATS beats: as good as hung).

Must not: decide when a stage is ready (the stage calls announce() once it is),
or how long a supervisor waits for a stage that says nothing (run and record
choose).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shared import endpoints, files

# A working step rewrites its progress file this often: often enough that a supervisor knows within
# seconds that it stopped, rarely enough to cost nothing (a small write and a datagram).
BEAT_S = 5.0
# A heartbeat not renewed for this many beats is stale: the stage is stopped, hung, or starved. Also how
# far each beat extends a systemd unit's start timeout (EXTEND_TIMEOUT_USEC).
STALE_BEATS = 3
# A progress file is a few hundred bytes; anything larger is not one.
MAX_PROGRESS_BYTES = 4096

log = logging.getLogger("ebpfprofiler.ready")


def _notify(message: str) -> None:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]  # abstract socket
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
    _unlink(endpoints.ready_file(run_dir, stage))


def forget(run_dir: str, stage: str) -> None:
    """Before a stage (re)starts: remove the ready and progress files an earlier process of it left
    (one killed outright removes neither)."""
    _unlink(endpoints.ready_file(run_dir, stage))
    _unlink(endpoints.progress_file(run_dir, stage))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def progress(run_dir: str, stage: str, doing: str, beat_s: float = BEAT_S) -> Iterator[None]:
    """While the block runs, the stage is `doing` (e.g. "compiling and loading BPF programs"): its
    progress file says so and how long it has been at it, renewed every `beat_s` by a thread (work done
    in C through ctypes, such as bcc's compile, releases the GIL), and systemd hears STATUS= and
    EXTEND_TIMEOUT_USEC= with each beat. When the block ends, however it ends, the file is removed and
    systemd's status says how long the step took.

    The heartbeat reports, it does not work: a beat that cannot be written (or sent) is logged once and
    never fails the step; a supervisor then sees the step quiet or stale, by its own rule."""
    path = endpoints.progress_file(run_dir, stage)
    start = time.monotonic()
    stop = threading.Event()
    lock = threading.Lock()  # no beat is written once the block has ended and removed the file
    state = {"beat": 0, "closed": False, "warned": False}

    def beat() -> None:
        with lock:
            if state["closed"]:
                return
            elapsed = time.monotonic() - start
            doc = {
                "pid": os.getpid(),
                "doing": doing,
                "elapsed_s": round(elapsed, 1),
                "beat": state["beat"],
                "beat_s": beat_s,
            }
            state["beat"] += 1
            try:
                files.write_atomic(path, json.dumps(doc).encode() + b"\n", mode=0o644)
                _notify(
                    f"STATUS={doing} ({elapsed:.0f} s so far)\nEXTEND_TIMEOUT_USEC={round(STALE_BEATS * beat_s * 1e6)}"
                )
            except OSError as e:
                if not state["warned"]:
                    state["warned"] = True
                    log.warning("%s: cannot report progress (%s): %s", stage, doing, e)

    def heartbeat() -> None:
        while not stop.wait(beat_s):
            beat()

    beat()  # before the step begins: a supervisor polling sees it at once
    thread = threading.Thread(target=heartbeat, name=f"{stage}-heartbeat", daemon=True)
    thread.start()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        stop.set()
        with lock:
            state["closed"] = True
            _unlink(path)
        thread.join()  # at most one beat was in flight, and it has finished (it held the lock)
        took = time.monotonic() - start
        log.info("%s: %s %.1f s", doing, outcome, took)
        with contextlib.suppress(OSError):
            _notify(f"STATUS={doing}: {outcome} {took:.0f} s")


@dataclass(frozen=True)
class Progress:
    """A progress file as read."""

    pid: int
    doing: str
    elapsed_s: float
    beat: int
    beat_s: float


def read_progress(run_dir: str, stage: str) -> Progress | None:
    """The stage's progress file, or None when there is none (or it is not one: written by anyone in
    the run directory's group, it is read as untrusted, bounded input)."""
    try:
        with open(endpoints.progress_file(run_dir, stage), "rb") as f:
            doc = json.loads(f.read(MAX_PROGRESS_BYTES + 1)[:MAX_PROGRESS_BYTES])
        got = Progress(
            int(doc["pid"]), str(doc["doing"])[:200], float(doc["elapsed_s"]), int(doc["beat"]), float(doc["beat_s"])
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return got if got.beat_s > 0 else None


class State(enum.Enum):
    READY = "ready"  # its ready file is there
    WORKING = "working"  # a step says what it does, and its heartbeat is fresh
    QUIET = "quiet"  # nothing said (yet, or since its last step ended)
    STALE = "stale"  # a step's heartbeat was not renewed for STALE_BEATS beats


@dataclass(frozen=True)
class Start:
    """One look at a starting stage."""

    state: State
    quiet_s: float = 0.0  # QUIET: seconds since its last sign of life; STALE: since its last beat
    doing: str = ""  # WORKING, STALE: what its step says it does
    elapsed_s: float = 0.0  # WORKING, STALE: how long the step has run, as far as is known


class StartWatch:
    """A supervisor's view of one stage while it starts: call check() as often as it likes.

    A sign of life is the watch's creation, a new beat, or the ready file's first sight; the
    watch measures time with the reader's own clock only (a beat is new when its counter changes),
    so the writer's clock, or a clock of another namespace, never enters. `pid`, when known, skips a
    progress file another process of the stage left."""

    def __init__(self, run_dir: str, stage: str, pid: int | None = None) -> None:
        self.run_dir, self.stage, self.pid = run_dir, stage, pid
        self.last_sign = time.monotonic()
        self._beat: tuple[int, int] | None = None  # (pid, beat) last seen
        self._ready = False

    def check(self) -> Start:
        now = time.monotonic()
        if os.path.exists(endpoints.ready_file(self.run_dir, self.stage)):
            if not self._ready:
                self._ready, self.last_sign = True, now
            return Start(State.READY)
        got = read_progress(self.run_dir, self.stage)
        if got is not None and (self.pid is None or got.pid == self.pid):
            if (got.pid, got.beat) != self._beat:
                self._beat, self.last_sign = (got.pid, got.beat), now
            since = now - self.last_sign
            elapsed = got.elapsed_s + since
            if since > STALE_BEATS * got.beat_s:
                return Start(State.STALE, since, got.doing, elapsed)
            return Start(State.WORKING, 0.0, got.doing, elapsed)
        return Start(State.QUIET, now - self.last_sign)
