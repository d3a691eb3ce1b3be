"""Each stage's counters of the checks that fired on hostile input, for `ebpfprofiler status`.

Owns: RUN_DIR/<stage>.counters.json, {"version", "stage", "pid", "time_ns",
"counters": {reason: count since the stage started}}, written whole
(shared/files.write_atomic) when a count changed, at most every WRITE_GAP_S
(a change within it is written when the gap ends, by a one-shot timer: a
stage that sleeps long, as the uploader does, still shows it) and at a
stage's close; and reading those files back as untrusted input of bounded
size (cli/status.py prints the ones whose stage still runs).

Must not: decide what is counted, or log (the stage that counts logs once per
process or reason).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from shared import files
from shared.procstat import alive

log = logging.getLogger(__name__)

SUFFIX = ".counters.json"
VERSION = 1
# A stage rewrites its file at most this often: counts change per drain or per attempt, and a status
# a second or two old is as good to a reader.
WRITE_GAP_S = 2.0
# A counters file is a few hundred bytes; anything larger is not one.
MAX_FILE_BYTES = 64 << 10
# Reasons in one file at most (each a short name the stage chose).
MAX_REASONS = 256


def path(run_dir: str, stage: str) -> str:
    return os.path.join(run_dir, stage + SUFFIX)


class CounterFile:
    """The counters file of one stage; counts may come from several threads."""

    def __init__(self, run_dir: str, stage: str, clock: Any = time.monotonic) -> None:
        self.path = path(run_dir, stage)
        self.stage = stage
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._written: dict[str, int] | None = None
        self._at = float("-inf")
        self._later: threading.Timer | None = None  # the write of a change held back by WRITE_GAP_S

    def count(self, reason: str, n: int = 1) -> None:
        """One more (or `n` more) of `reason`; written as update() writes."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + n
        self.flush()

    def update(self, counters: Mapping[str, int], force: bool = False) -> None:
        """Set these counts (since the stage started) and write as flush() does."""
        with self._lock:
            self._counts.update({k: int(v) for k, v in counters.items()})
        self.flush(force)

    def flush(self, force: bool = False) -> None:
        """Write the counts if they changed and WRITE_GAP_S has passed since the last write (or `force`)."""
        with self._lock:
            now = self._clock()
            current = dict(self._counts)
            if current == self._written:
                return
            if not force and now - self._at < WRITE_GAP_S:
                if self._later is None:  # one timer at a time, only while counts change: none when idle
                    self._later = threading.Timer(WRITE_GAP_S - (now - self._at), self._write_later)
                    self._later.daemon = True
                    self._later.start()
                return
            doc = {
                "version": VERSION,
                "stage": self.stage,
                "pid": os.getpid(),
                "time_ns": time.time_ns(),
                "counters": dict(sorted(current.items())),
            }
            try:
                files.write_atomic(self.path, json.dumps(doc).encode() + b"\n", mode=0o644)
            except OSError as e:
                log.warning("cannot write %s: %s", self.path, e.strerror)
                return
            self._written, self._at = current, now

    def _write_later(self) -> None:
        with self._lock:
            self._later = None
        self.flush()

    def get(self, reason: str) -> int:
        with self._lock:
            return self._counts.get(reason, 0)


def read_all(run_dir: str) -> dict[str, dict[str, int]]:
    """stage → its counters, from the files of stages that still run (the pid in the file lives);
    a file that is not a counters file is skipped."""
    out: dict[str, dict[str, int]] = {}
    try:
        names = sorted(n for n in os.listdir(run_dir) if n.endswith(SUFFIX))
    except OSError:
        return out
    for name in names:
        try:
            with open(os.path.join(run_dir, name), "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            doc = json.loads(raw) if len(raw) <= MAX_FILE_BYTES else None
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            continue
        pid, counters = doc.get("pid"), doc.get("counters")
        if type(pid) is not int or pid <= 0 or not alive(pid) or not isinstance(counters, dict):
            continue
        out[name[: -len(SUFFIX)]] = {str(k)[:100]: v for k, v in list(counters.items())[:MAX_REASONS] if type(v) is int}
    return out
