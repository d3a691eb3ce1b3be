"""Process announcements to the runtime readers: which processes run, which exited.

Owns: the collector's PUB socket for runtime readers (shared/endpoints.processes)
and what goes on it: every process the collector has seen in its drains,
announced once (without mappings) when first seen (a reused pid: as a new
process, when a drain sees it), its exit announced when a check finds its pid
gone (kill(pid, 0)), and every FULL_EVERY_S a full
re-announcement of the live ones, so a reader that (re)started late catches
up. Sends never block: with no reader listening, or a slow one, ZeroMQ drops
them (the next full announcement repairs that). An announcement over
MAX_BATCH_BYTES (long command lines) is sent in parts (shared/wire.py
encode_within), counted. The same socket carries
what collector/regs.py publishes (RegsBatch), with the same never-blocking send.

Must not: read runtime memory, or decide which processes a reader reads.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace

import zmq

from shared import endpoints
from shared.procstat import alive
from shared.wire import (
    MAX_ANNOUNCED_PROCESSES,
    Process,
    ProcessAnnouncement,
    RegsBatch,
    encode,
    encode_within,
)

# Processes remembered as announced; a host rarely runs more at once (the oldest are forgotten).
MAX_KNOWN = 32768
# How often announced processes are checked for exit (one kill(pid, 0) each).
EXIT_CHECK_S = 2.0
# How often every live process is announced again, for readers that started late.
FULL_EVERY_S = 30.0
# Announcements queued for a slow reader before ZeroMQ drops them.
SEND_QUEUE = 64

log = logging.getLogger(__name__)


class Announcer:
    def __init__(self, ctx: zmq.Context, run_dir: str, host: str) -> None:
        self.host = host
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoints.processes(run_dir))
        self._known: OrderedDict[int, Process] = OrderedDict()  # pid → the process announced
        self._new: list[Process] = []
        self._next_exit_check = time.monotonic() + EXIT_CHECK_S
        self._next_full = time.monotonic() + FULL_EVERY_S
        # split: announcements over MAX_BATCH_BYTES sent in parts; unsendable: a part of one process
        # that still did not fit (not sent; the reader learns of that process at no time).
        self.stats = {"announced": 0, "exited": 0, "messages": 0, "dropped_messages": 0, "split": 0, "unsendable": 0}

    def observe(self, processes: Iterable[Process]) -> None:
        """Processes of a drain; the new ones (or a pid's new process) are announced at the next flush."""
        for p in processes:
            if not p.executable:  # kernel threads and processes gone before we read them
                continue
            known = self._known.get(p.pid)
            if known is not None and known.start_ticks == p.start_ticks:
                continue
            slim = replace(p, mappings=())
            self._known[p.pid] = slim
            self._known.move_to_end(p.pid)
            self._new.append(slim)
            if len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)

    def knows(self, pid: int) -> bool:
        """Whether a process with this pid was announced and has not been found gone."""
        return pid in self._known

    def start_ticks_of(self, pid: int) -> int | None:
        """The start time of the process announced with this pid and not found gone, or None."""
        p = self._known.get(pid)
        return None if p is None else p.start_ticks

    def flush(self) -> None:
        """Send what is new, exits found by a check of the pids, and the periodic full list."""
        now = time.monotonic()
        exited: list[tuple[int, int]] = []
        if now >= self._next_exit_check:
            self._next_exit_check = now + EXIT_CHECK_S
            for pid, p in list(self._known.items()):
                # gone: one kill(pid, 0) (~1 µs), not a /proc/PID/stat read (~50 µs) per known process
                # every check; a reused pid is announced anew when a drain sees it, and readers check
                # the start time before every read.
                if not alive(pid):
                    exited.append((pid, p.start_ticks))
                    del self._known[pid]
            self.stats["exited"] += len(exited)
        full = now >= self._next_full
        if full:
            self._next_full = now + FULL_EVERY_S
            processes = list(self._known.values())
        else:
            processes = [p for p in self._new if self._known.get(p.pid) is p]
        self.stats["announced"] += len(self._new)
        self._new.clear()
        if not processes and not exited:
            return
        for i in range(0, max(len(processes), len(exited)), MAX_ANNOUNCED_PROCESSES):
            self._send(
                ProcessAnnouncement(
                    host=self.host,
                    time_ns=time.time_ns(),
                    processes=tuple(processes[i : i + MAX_ANNOUNCED_PROCESSES]),
                    exited=tuple(exited[i : i + MAX_ANNOUNCED_PROCESSES]),
                    full=full,
                )
            )

    def publish(self, msg: RegsBatch) -> None:
        """Another message for the runtime readers, sent like an announcement."""
        self._send(msg)

    def _send(self, msg: ProcessAnnouncement | RegsBatch) -> None:
        if isinstance(msg, RegsBatch):  # bounded by regs.SAMPLES_PER_MESSAGE
            messages = [encode(msg)]
        else:
            parts, unfit = encode_within(msg)
            messages = [frames for _, frames in parts]
            if len(parts) + len(unfit) > 1:
                self.stats["split"] += 1
                if self.stats["split"] == 1:
                    log.warning(
                        "an announcement of %d processes was over its byte cap: sent in %d parts "
                        "(counted as announcements_split in status; logged once)",
                        len(msg.processes),
                        len(parts),
                    )
            self.stats["unsendable"] += len(unfit)
        for frames in messages:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
                self.stats["messages"] += 1
            except zmq.Again:
                self.stats["dropped_messages"] += 1

    def close(self) -> None:
        self.sock.close()
