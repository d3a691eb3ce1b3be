"""Processes found by a slow sweep of /proc, for the runtime readers: the ones that never run.

A process is announced to the runtime readers when a drain sees it (collector/announce.py), that is
when it ran on a CPU or ended a blocking wait. One that sleeps through every window (an idle
php-fpm worker blocked in accept, a forked child in one long sleep, a Python service whose only
thread waits on a queue) is never in a drain, and wall profiles exist to show where such processes
wait. So while a runtime reader runs, the collector lists /proc at its drains, at most every
SWEEP_S (it wakes for nothing else: a quiet host drains once a window, up to 60 s apart), and reads
each pid that was in the previous listing too and has not been read (procfs.read_process: no
mappings), and hands them to the announcer, which announces the ones it does not know. A process
that never runs is announced at the second sweep after its start: within ~20 s on a host that
drains often, within two windows on a quiet one.

Cost (docs/overhead.md, the cost model's "process discovery"): a listing is ~1.4 µs per process on
the host (1.6 ms for 1,100), and a read ~200 µs per process, once in its life, at most
MAX_READS_PER_SWEEP a sweep. A pid must be in two listings in a row before it is read, so the
short-lived processes of a busy host (a shell loop's children live milliseconds) are never read
here. A pid reused between two sweeps by a new process keeps the old one's announcement until a
drain sees the new one (pids wrap only after pid_max, 4,194,304 on 64-bit hosts).

Owns: the listing, the pids seen and read, and the choice of which to read.

Must not: read mappings or memory, or decide what a reader reads (the readers detect runtimes; the
announcer drops what it already announced).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from collector.procfs import read_process
from shared.wire import Process

# Seconds between sweeps at least (they run at drains): a process that sleeps from its start is
# announced at the second sweep after it; a host of 1,100 processes pays 0.16 ms/s at this rate.
SWEEP_S = 10.0
# Processes read per sweep (~200 µs each): a host found with thousands is read over several sweeps,
# and one that starts many long-lived processes at once costs at most ~13 ms a sweep.
MAX_READS_PER_SWEEP = 64


class ProcessSweep:
    """What a sweep of `proc` finds that is new: `due()` says when, `run()` returns the processes."""

    def __init__(
        self,
        with_cmdline: bool,
        proc: str = "/proc",
        every_s: float = SWEEP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._with_cmdline = with_cmdline
        self._proc = proc
        self._every_s = every_s
        self._clock = clock
        self._next = clock()  # the first sweep lists only: its pids are read at the second
        self._listed: set[int] = set()  # the last listing
        self._read: set[int] = set()  # pids read while they stayed listed
        self.stats = {"sweeps": 0, "read": 0, "gone": 0, "deferred": 0}

    def due(self) -> bool:
        return self._clock() >= self._next

    def run(self, known: Callable[[int], bool] = lambda pid: False) -> list[Process]:
        """One sweep: the processes in this listing and the last that were not read yet and are not
        `known` (announced already), at most MAX_READS_PER_SWEEP; the rest wait for the next sweep."""
        self._next = self._clock() + self._every_s
        self.stats["sweeps"] += 1
        try:
            listed = {int(name) for name in os.listdir(self._proc) if name.isdigit()}
        except OSError:
            return []
        self._read &= listed  # a pid that left the listing is new when it comes back
        self._read |= {pid for pid in listed & self._listed if known(pid)}
        wanted = sorted((listed & self._listed) - self._read)
        self._listed = listed
        if len(wanted) > MAX_READS_PER_SWEEP:
            self.stats["deferred"] += len(wanted) - MAX_READS_PER_SWEEP
            wanted = wanted[:MAX_READS_PER_SWEEP]
        found: list[Process] = []
        for pid in wanted:
            self._read.add(pid)
            p = read_process(pid, self._with_cmdline, self._proc)
            if p is None:
                self.stats["gone"] += 1
                continue
            self.stats["read"] += 1
            found.append(p)
        return found
