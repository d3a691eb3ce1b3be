"""Answers the collector's unwind requests: one UnwindTable per module asked for.

Owns: serving the UnwindRequests a StackBatch carries (docs/unwinding.md,
"Who does what", step 2). For each: open the module through the file broker
(the descriptor the symbolizer reads symbols from), read its build id and
layout (cfi.read_module), take the table from the disk cache
(unwind_cache.py) or build it (cfi.build_table), and push an UnwindTable to
the collector's unwind socket: status ok with the table, none (no CFI) or
failed (unusable CFI) with the reason. A module that cannot be opened (its
process exited, the broker is restarting) gets no answer: the collector asks
again if it still needs it. A module answered within ANSWERED_RECENTLY_S is
not built again. Everything hostile input can cause is a counted, logged
skip; the stats are logged when they change.

Must not: send anything but UnwindTable messages, block on the collector
(sends never wait: a full or absent peer is a counted drop), or keep tables
in memory between requests.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

from shared import endpoints
from shared.log import LogOnce
from shared.wire import (
    Mapping,
    Process,
    StackBatch,
    UnwindRequest,
    UnwindTable,
    encode,
)
from symbolizer import cfi
from symbolizer.files import FileClient
from symbolizer.unwind_cache import UnwindCache, file_identity

log = logging.getLogger(__name__)

# A module answered this recently is not built or sent again (the collector asks only once per file;
# a repeat means our answer was lost, or another worker's batch carried the same file).
ANSWERED_RECENTLY_S = 60.0
# Modules remembered as answered; bounds the worker's memory on a host with many distinct files.
MAX_ANSWERED = 4096
# Answers queued towards the collector, which takes them once a drain: most are tens of KB,
# node's is 6 MB.
SEND_QUEUE = 32
# Building stops for this batch once this much time went into it (node's table takes ~1 s here);
# the rest is asked again later, so a batch's samples are not held up for long.
BUILD_SECONDS_PER_BATCH = 5.0


class UnwindServer:
    def __init__(
        self,
        files: FileClient,
        run_dir: str,
        state_dir: str,
        ctx: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._files = files
        self._cache = UnwindCache(state_dir)
        self._clock = clock
        self._answered: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._log_once = LogOnce(log)
        ctx = ctx or zmq.Context.instance()
        self._out = ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        self._out.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued towards an absent collector
        self._out.setsockopt(zmq.LINGER, 0)  # an unsent answer is asked for again
        self._out.connect(endpoints.unwind(run_dir))
        self.stats: dict[str, int | float] = dict.fromkeys(
            (
                "requests",
                "built",
                "from_cache",
                "none",
                "failed",
                "unreadable",
                "recently_answered",
                "deferred",
                "sent",
                "send_failed",
                "fallback_fdes",
            ),
            0,
        )
        self.stats["build_seconds"] = 0.0
        self.failed_by_reason: dict[str, int] = {}
        self._logged: tuple = ()

    def serve(self, batch: StackBatch) -> None:
        """Answer the batch's unwind requests (at most BUILD_SECONDS_PER_BATCH of building)."""
        if not batch.unwind_requests:
            return
        procs = {p.pid: p for p in batch.processes}
        started = self._clock()
        built_before = self.stats["built"]
        for req in batch.unwind_requests:
            self.stats["requests"] += 1
            key = (req.dev, req.inode)
            now = self._clock()
            when = self._answered.get(key)
            if when is not None and now - when < ANSWERED_RECENTLY_S:
                self.stats["recently_answered"] += 1
                continue
            if now - started > BUILD_SECONDS_PER_BATCH:
                self.stats["deferred"] += 1
                continue
            # The first module built in a batch may take its whole budget (a big one is built at all);
            # the others only what is left of the batch's, and are deferred if that runs out.
            left = (
                cfi.CFI_BUILD_SECONDS
                if self.stats["built"] == built_before
                else BUILD_SECONDS_PER_BATCH - (now - started)
            )
            answer = self._answer(req, procs.get(req.pid), left)
            if answer is not None and self._send(answer):
                self._answered[key] = self._clock()
                self._answered.move_to_end(key)
                while len(self._answered) > MAX_ANSWERED:
                    self._answered.popitem(last=False)
        self._log_stats()

    def _answer(
        self, req: UnwindRequest, proc: Process | None, seconds: float = cfi.CFI_BUILD_SECONDS
    ) -> UnwindTable | None:
        proc, mapping = self._target(req, proc)
        try:
            f = self._files.module(proc, mapping)
        except OSError as e:
            self.stats["unreadable"] += 1
            log.debug(
                "cannot open %s (pid %d, %#x-%#x) for its unwind table: %s",
                mapping.path or "module",
                req.pid,
                req.start,
                req.end,
                e,
            )
            return None
        build_id = ""
        with f:
            try:
                module = cfi.read_module(f)
                build_id = module.build_id
                identity = file_identity(f.fileno())
                table = self._cache.get(build_id, identity, module.arch) if build_id else None
                if table is not None:
                    self.stats["from_cache"] += 1
                else:
                    t0 = self._clock()
                    try:
                        built = cfi.build_table(f, module, seconds)
                    finally:
                        self.stats["build_seconds"] += self._clock() - t0
                    table = built.table
                    self.stats["built"] += 1
                    self.stats["fallback_fdes"] += built.fallback_fdes
                    if build_id:
                        self._cache.put(build_id, identity, module.arch, table)
                    log.debug("built the unwind table of %s: %s", mapping.path, cfi.describe(built))
            except cfi.NoCfi as e:
                self.stats["none"] += 1
                return UnwindTable(req.dev, req.inode, mapping.path, build_id, "none", str(e)[:200])
            except cfi.CfiError as e:
                if e.kind == "too_slow" and seconds < cfi.CFI_BUILD_SECONDS:
                    self.stats["deferred"] += 1  # cut by the batch's budget, not its own: asked again later
                    return None
                self.stats["failed"] += 1
                self.failed_by_reason[e.kind] = self.failed_by_reason.get(e.kind, 0) + 1
                self._log_once(
                    (req.dev, req.inode),
                    logging.WARNING,
                    "no unwind table for %s (%s %d): %s: %s",
                    mapping.path,
                    req.dev,
                    req.inode,
                    e.kind,
                    e,
                )
                return UnwindTable(req.dev, req.inode, mapping.path, build_id, "failed", f"{e.kind}: {e}"[:200])
        return UnwindTable(req.dev, req.inode, mapping.path, build_id, "ok", "", table)

    @staticmethod
    def _target(req: UnwindRequest, proc: Process | None) -> tuple[Process, Mapping]:
        """The process and mapping the request means: from the batch, else as the request names them
        (the file broker checks that the process maps an executable file there either way)."""
        if proc is None or proc.start_ticks != req.start_ticks:
            proc = Process(req.pid, req.start_ticks, 0, req.pid, "", "", "")
        for m in proc.mappings:
            if m.start == req.start and m.end == req.end:
                return proc, m
        return proc, Mapping(req.start, req.end, 0, "", req.dev, req.inode)

    def _send(self, answer: UnwindTable) -> bool:
        try:
            self._out.send_multipart(encode(answer), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            self.stats["send_failed"] += 1
            self._log_once(
                "send",
                logging.WARNING,
                "cannot send unwind tables to the collector (%s); it will ask again (counted in send_failed)",
                e,
            )
            return False
        self.stats["sent"] += 1
        return True

    def _log_stats(self, force: bool = False) -> None:
        now = (tuple(v for k, v in self.stats.items() if k != "build_seconds"), tuple(self.failed_by_reason.items()))
        if now != self._logged or force:
            self._logged = now
            log.info("unwind tables: %s", self.describe())

    def describe(self) -> str:
        s = self.stats
        return (
            f"{s['requests']} requests: {s['built']} built ({s['build_seconds']:.2f} s), {s['from_cache']} "
            f"from cache, {s['none']} none, {s['failed']} failed {self.failed_by_reason or ''}, "
            f"{s['unreadable']} unreadable, {s['recently_answered']} answered recently, {s['deferred']} "
            f"deferred; sent {s['sent']}, send failed {s['send_failed']}; cache {self._cache.stats}"
        )

    def close(self) -> None:
        self._log_stats(force=True)
        self._out.close()
