"""The targets of the targeted sources (lock waits, allocations) followed from drain to drain.

Owns: at each drain, each TargetWatcher's scan handed to its source (targets that appeared get
their probes, those gone lose them, only while sampling), and for a DWARF-unwound source (lock
waits) the unwind tables of every module of each target, asked for in a batch of no samples; the
log line of a target unwound with the tables of more modules.

Must not: match targets (collector/targets.py), attach probes itself (the sources do), or choose
how a batch is sent (collector/sender.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from collector.procfs import ProcessTable
from collector.routing import worker_for
from collector.sender import BatchSender
from collector.sources import TargetedSource
from collector.targets import TargetWatcher
from collector.unwind import UnwindTables
from shared.wire import Process, StackBatch, UnwindRequest

log = logging.getLogger("ebpfprofiler.collector")


class TargetFollower:
    """`watchers`: each targeted source with the watcher of its specs."""

    def __init__(
        self,
        watchers: list[tuple[TargetWatcher, TargetedSource]],
        procs: ProcessTable,
        unwind: UnwindTables | None,
        sender: BatchSender,
        host: str,
    ) -> None:
        self.watchers = watchers
        self.procs = procs
        self.unwind = unwind
        self.sender = sender
        self.host = host
        # (profile type, target pid) → modules with tables, as last logged
        self._target_tables: dict[tuple[str, int], int] = {}

    def follow(self, live: Sequence[int], sampling: bool, sample_hz: int) -> None:
        """Targets that appeared get their probes and those gone lose them (while sampling); a
        DWARF-unwound source's targets get their unwind tables asked for."""
        if sampling:
            for watcher, tracer in self.watchers:
                appeared, gone = watcher.scan()
                for t in gone:
                    tracer.remove(t)
                    self._target_tables.pop((tracer.profile_type, t.pid), None)
                for t in appeared:
                    tracer.add(t)
        if self.unwind is not None:
            for _, tracer in self.watchers:
                if tracer.dwarf and tracer.target_pids():
                    self.track_targets(tracer, live, sample_hz)

    def track_targets(self, source: TargetedSource, live: Sequence[int], sample_hz: int) -> None:
        """Unwind tables for every module of each target of a DWARF-unwound source (lock waits),
        asked for in a batch of no samples."""
        assert self.unwind is not None
        by_worker: dict[int, tuple[list[Process], list[UnwindRequest]]] = {}
        for pid in sorted(source.target_pids()):
            proc = self.procs.get(pid)
            if proc is None:
                continue
            requests = self.unwind.track(proc)
            self._log_tables(source.profile_type, pid, self.unwind.covered(proc))
            if requests:
                procs, reqs = by_worker.setdefault(worker_for(proc.service, live), ([], []))
                procs.append(proc)
                reqs.extend(requests)
        for worker, (procs, reqs) in by_worker.items():
            self.sender.send(
                worker,
                StackBatch(
                    host=self.host,
                    profile_type=source.profile_type,
                    sample_hz=sample_hz,
                    time_ns=time.time_ns(),
                    processes=tuple(procs),
                    user_stacks=(),
                    kernel_stacks=(),
                    samples=(),
                    unwind_requests=tuple(reqs),
                ),
            )

    def _log_tables(self, profile_type: str, pid: int, covered: Sequence[str]) -> None:
        """Logged when a target is unwound with the tables of more modules than last logged."""
        key = (profile_type, pid)
        if len(covered) > self._target_tables.get(key, 0):
            self._target_tables[key] = len(covered)
            log.info(
                "%s profiling: pid %d unwound with the tables of %s",
                profile_type,
                pid,
                ", ".join(os.path.basename(c) for c in covered),
            )
