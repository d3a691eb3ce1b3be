"""The runtime reader's side of the interpreter walks done in BPF at each sample (issue 42): walk data out, names in.

A runtime whose frames the collector walks in BPF (CPython: bpf/python.h, collector/pywalk.py) plugs in
through its StackReader (runtimes/runtime.py WalkedReader): walk_data(start_ticks) is what the walker needs
of one process, as a wire message (CPython's PythonProcess: its _PyRuntime and its version's layout), and
name(mem, code, offset) names a frame as the walk recorded it.

Owns: the PUSH socket to the collector's walker (endpoints.python_walk): a process's walk data when the
reader first reads it (Targets' on_reading), and again for every live one at a full ProcessAnnouncement
(the collector re-announces every 30 s: this repairs a collector that restarted), at most every
REOFFER_MIN_S; never blocking (a full queue drops, counted). The ROUTER socket symbolizer workers ask to
name frames (endpoints.python_names): each PythonNameRequest answered with PythonNames to its requester
(identity frame + message frames), the process found by pid and start time (a pid naming another process
now, or a process not read with a walk: refused, answered with no names), its frames named within a
ReadBudget of their own (past it: answered with what was named), and all of them within a share of a CPU
of their own (NAME_CPU_SHARE), not the reader's CpuPace: a frame is named once per process, and a reader
held over its budget by its wall reading (a busy host, or an emulated one) must still name the cpu
profile's frames. Past that share a request is taken and left unanswered (counted), which
symbolizer/pynames.py asks again after its timeout: an answer that leaves a frame out tells it that frame
cannot be named, and it does not ask again.
Malformed requests counted, logged, skipped. Its counters.

Must not: read process memory but through a plug-in's name(), decide what a process is (targets.py and the
plug-ins do), know a runtime's layout (walk_data gives it), block, or end the reader on what a process or a
peer sends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from runtimes.memory import MemoryReadError, ProcessMemory, ReadBudget
from runtimes.runtime import WalkedReader
from runtimes.targets import Entry, Targets
from runtimes.tokens import TokenBucket
from shared import endpoints
from shared.log import LogOnce
from shared.wire import PythonNameRequest, PythonNames, WireError, decode, encode

# Walk data queued for the collector at most: a burst of detections at start is a few hundred processes;
# past it (a collector that does not take them) each one is dropped, counted, and sent again at the next
# full announcement.
WALK_SNDHWM = 4096
# Seconds between two re-sends of every live process's walk data: the collector's full announcements come
# every 30 s, and one split into parts (encode_within) must not re-send at each part.
REOFFER_MIN_S = 25.0
# Bytes of process memory one name request may read: a frame not named before costs its code object, its
# two names and its line table (~1-3 KB), one named before a code header (~200 bytes); 1 MiB names a few
# hundred new frames, and the symbolizer asks again for what was left out.
NAME_BYTES_PER_REQUEST = 1 << 20
# Seconds one name request may read (the reader's ticks wait meanwhile: a tick is 53 ms); a new frame takes
# ~0.1 ms, so a first request of a process names several hundred.
NAME_SECONDS_PER_REQUEST = 0.05
# Naming's own share of one CPU, whatever the reader's CpuPace says (a token bucket: NAME_CPU_SHARE seconds
# a second, NAME_BURST_S at most at once: a new process's first requests).
NAME_CPU_SHARE = 0.05
NAME_BURST_S = 0.25
# Requests taken per wake of the loop: the others wait in the socket while the loop ticks.
MAX_REQUESTS_PER_POLL = 16
# Bytes of a request taken at most: MAX_PYTHON_NAMES (code, instr) pairs of ~30 bytes each, with room.
MAX_REQUEST_BYTES = 256 << 10
# Answers queued per symbolizer at most (each asks and waits): past it an answer is dropped, counted.
NAMES_SNDHWM = 256

# The runtime (RuntimeSpec.name) each kind of name request is for.
_RUNTIME_OF = {PythonNameRequest: "cpython"}

STATS = (
    "walk_offers",
    "walk_offers_dropped",
    "walk_reoffers",
    "name_requests",
    "frames_named",
    "frames_not_named",
    "names_refused",
    "names_malformed",
    "names_over_budget",
    "names_over_share",
    "names_failed",
    "names_unanswered",
)
# The STATS that are checks on what peers and processes sent, for status.
CHECKS = (
    "walk_offers_dropped",
    "names_refused",
    "names_malformed",
    "names_over_budget",
    "names_over_share",
    "names_failed",
    "names_unanswered",
)

log = logging.getLogger("ebpfprofiler.runtime")


class BpfWalks:
    """The two sockets and their figures; offer() and reoffer() push, serve() answers."""

    def __init__(self, run_dir: str, clock: Callable[[], float] = time.monotonic) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        self.walks = ctx.socket(zmq.PUSH)
        self.walks.setsockopt(zmq.SNDHWM, WALK_SNDHWM)
        self.walks.setsockopt(zmq.LINGER, 0)
        self.walks.connect(endpoints.python_walk(run_dir))
        self.names = ctx.socket(zmq.ROUTER)
        self.names.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.names.setsockopt(zmq.SNDHWM, NAMES_SNDHWM)
        self.names.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an answer that cannot go is counted, not lost unseen
        self.names.setsockopt(zmq.LINGER, 0)
        self.names.bind(endpoints.python_names(run_dir))
        self._clock = clock
        self._reoffered: float | None = None
        self.naming = TokenBucket(NAME_CPU_SHARE, NAME_BURST_S, clock)  # seconds of naming allowed now
        self.stats = dict.fromkeys(STATS, 0)
        self._log_once = LogOnce(log)

    # ------------------------------------------------------------ walk data out

    def offer(self, e: Entry) -> None:
        """e's walk data to the collector, if its reader has any (never blocking: a full queue drops it)."""
        if not isinstance(e.reader, WalkedReader):
            return
        try:
            frames = encode(e.reader.walk_data(e.process.start_ticks))
        except Exception as err:  # a plug-in's data that does not fit the wire must not end the reader
            self.stats["walk_offers_dropped"] += 1
            self._log_once(
                ("walk", e.process.pid, e.process.start_ticks),
                logging.WARNING,
                "pid %d: its walk data cannot be sent: %s: %s",
                e.process.pid,
                type(err).__name__,
                err,
            )
            return
        try:
            self.walks.send_multipart(frames, zmq.NOBLOCK)
            self.stats["walk_offers"] += 1
        except zmq.Again:
            self.stats["walk_offers_dropped"] += 1

    def reoffer(self, targets: Targets) -> None:
        """At a full announcement: every live walked process's walk data again, at most every REOFFER_MIN_S."""
        now = self._clock()
        if self._reoffered is not None and now - self._reoffered < REOFFER_MIN_S:
            return
        self._reoffered = now
        self.stats["walk_reoffers"] += 1
        for e in targets.readable():
            if isinstance(e.reader, WalkedReader) and targets.current(e):
                self.offer(e)

    # ------------------------------------------------------------ names in

    def serve(self, targets: Targets, max_bytes: int) -> None:
        """Up to MAX_REQUESTS_PER_POLL name requests answered, within NAME_CPU_SHARE; `max_bytes`: the reader's
        per-tick byte cap (halved over cpu_budget), which bounds a request too."""
        for _ in range(MAX_REQUESTS_PER_POLL):
            try:
                frames = self.names.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                req = decode(frames[1:])
                if type(req) not in _RUNTIME_OF:
                    raise WireError(f"the runtime reader names frames, it takes no {type(req).__name__}")
            except WireError as err:
                self.stats["names_malformed"] += 1
                log.warning("dropped a malformed name request (%d so far): %s", self.stats["names_malformed"], err)
                continue
            assert isinstance(req, PythonNameRequest)
            names = self._name(targets, req, max_bytes)
            if names is None:
                continue
            answer = PythonNames(req.request_id, req.pid, req.start_ticks, names)
            try:
                self.names.send_multipart([frames[0], *encode(answer)], zmq.NOBLOCK)
            except zmq.ZMQError:  # its requester is gone, or has not taken its answers (SNDHWM)
                self.stats["names_unanswered"] += 1

    def _name(
        self, targets: Targets, req: PythonNameRequest, max_bytes: int
    ) -> tuple[tuple[int, int, str, str, int], ...] | None:
        """The frames of `req` named (code, instr, function, file, line), those that could be; None: not
        answered now (naming's share of a CPU is spent)."""
        self.stats["name_requests"] += 1
        e = targets.entries.get(req.pid)
        if (
            e is None
            or e.process.start_ticks != req.start_ticks
            or e.runtime is None
            or e.runtime.spec.name != _RUNTIME_OF[type(req)]
            or not isinstance(e.reader, WalkedReader)
            or not targets.current(e)
        ):
            self.stats["names_refused"] += 1
            return ()
        if self.naming.refill() <= 0:
            self.stats["names_over_share"] += 1
            self.stats["frames_not_named"] += len(req.frames)
            return None
        began = self._clock()
        out = self._named(e, e.reader, req, ReadBudget(min(max_bytes, NAME_BYTES_PER_REQUEST), self._deadline()))
        self.naming.spend(self._clock() - began)
        if not targets.current(e):  # its pid named another process while we read: what we read is not its
            self.stats["names_refused"] += 1
            out = []
        self.stats["frames_named"] += len(out)
        self.stats["frames_not_named"] += len(req.frames) - len(out)
        return tuple(out)

    def _deadline(self) -> float:
        return time.monotonic() + NAME_SECONDS_PER_REQUEST

    def _named(
        self, e: Entry, reader: WalkedReader, req: PythonNameRequest, budget: ReadBudget
    ) -> list[tuple[int, int, str, str, int]]:
        mem = ProcessMemory(req.pid, budget)
        out = []
        for code, instr in req.frames:
            try:
                f = reader.name(mem, code, None if instr == -1 else instr)
            except MemoryReadError as err:  # "budget": answered with what was named; "gone": nothing more to name
                if err.reason == "budget":
                    self.stats["names_over_budget"] += 1
                break
            except Exception as err:  # what a target's memory holds must never end the reader
                self.stats["names_failed"] += 1
                self._log_once(
                    ("names", e.process.pid, e.process.start_ticks),
                    logging.WARNING,
                    "pid %d: naming its frames failed (%s: %s)",
                    req.pid,
                    type(err).__name__,
                    err,
                )
                break
            if f is not None:
                out.append((code, instr, f.function, f.filename, f.line))
        return out

    # ------------------------------------------------------------ figures

    def checks(self) -> dict[str, int]:
        """The checks on what peers and processes sent that fired (RUN_DIR/runtime.counters.json)."""
        return {k: self.stats[k] for k in CHECKS}

    def note(self) -> str:
        """The window log line's part on in-BPF walks ("" while there were none)."""
        if not any(self.stats.values()):
            return ""
        return f"; in-BPF walks {self.stats}"

    def close(self) -> None:
        self.walks.close()
        self.names.close()
