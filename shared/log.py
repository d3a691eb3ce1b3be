"""Logging for every stage: one format, one setup call, and log-once helpers.

Owns: the log line format (stage name and pid on each line, so the interleaved
output of `ebpfprofiler run` reads clearly) and LogOnce, which keeps a bounded
memory of what it has already said.

Must not: decide what is worth logging; stages do.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Hashable

# Remember this many already-logged keys; older ones may be logged again.
LOG_ONCE_KEYS = 4096


def setup(stage: str, level: str | int | None = None) -> logging.Logger:
    """Configure the root logger for `stage` and return the stage's logger."""
    level = level or os.environ.get("EBPFPROFILER_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {stage}[%(process)d] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger(f"ebpfprofiler.{stage}")


class LogOnce:
    """Logs a message the first time its key is seen (bounded memory)."""

    def __init__(self, logger: logging.Logger, capacity: int = LOG_ONCE_KEYS) -> None:
        self._logger = logger
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._capacity = capacity

    def __call__(self, key: Hashable, level: int, msg: str, *args: object) -> bool:
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        self._logger.log(level, msg, *args)
        return True
