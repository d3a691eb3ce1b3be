"""Names of the Python frames of mixed stacks, asked of the runtime reader (a symbolizer cannot read a process).

Owns: the worker's side of the name exchange on the runtime reader's ROUTER socket
(shared.endpoints.python_names): a DEALER that sends each PythonNameRequest as `shared.wire.encode`
gives it (no envelope; the ROUTER sees [its peer id, *those frames]) and takes each PythonNames answer
the same way; the request ids, the requests still unanswered, their timeouts and bounded re-asks;
and the names per process, (pid, start ticks) → (code, instr) → (function, file, line), in bounded
LRUs. A process is forgotten when it is evicted or when its pid shows up with another start time.

An answer is taken only for a request still outstanding whose pid and start ticks are the request's,
and only for the frames that request asked; anything else is dropped and counted (a stage never
trusts a message it did not ask for). Names are untrusted: escaped and capped with shared/safestr
before they are kept. A frame the reader left out of its answer is not asked again (it could not
name it); one whose request got no answer is asked again after ANSWER_TIMEOUT_S, MAX_ASKS times in
all. A frame with no name when its profile is built gets a placeholder (symbolizer/pystacks.py),
counted as python_unnamed: a sample is never lost for lack of a name.

Must not: block (every send and receive is NOBLOCK; a request the socket will not take now is
dropped, counted, and asked again with the next batch that holds its frames), read process memory,
or splice stacks (symbolizer/pystacks.py does).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq

from shared import endpoints
from shared.safestr import process_string, quote
from shared.wire import (
    MAX_PYTHON_NAMES,
    RECEIVE_LIMIT_BYTES,
    PythonNameRequest,
    PythonNames,
    WireError,
    decode,
    encode,
)
from symbolizer.pystacks import PythonFrame

log = logging.getLogger(__name__)

# Requests sent and not yet answered, at most; past it a request is not sent (counted) and its frames
# are asked with the next batch that holds them. A batch asks once per process with new frames.
MAX_OUTSTANDING_REQUESTS = 64
# Requests ZeroMQ queues towards the reader before a send fails (counted): a few batches' worth.
REQUEST_QUEUE = 16
# A request unanswered this long is asked again: the reader answers in milliseconds, and a window
# closes 2.5 s after its end (symbolizer/main.py WINDOW_GRACE_S), so one re-ask still lands in time.
ANSWER_TIMEOUT_S = 1.0
# Times a frame is asked at most before it is given up until its process is forgotten (no reader).
MAX_ASKS = 3
# Processes whose names are kept, the least recently sampled forgotten first: a host's Python processes.
PYTHON_PROCESSES = 512
# Names kept per process, the oldest forgotten first: the (code, instr) pairs a service is sampled in.
NAMES_PER_PROCESS = 8192
# Names kept in all (least recently sampled processes forgotten past it): tens of MB at most.
MAX_NAMES = 200_000
# Characters kept of a function name or a file (a qualified name is under 100, a path a few hundred).
MAX_NAME_CHARS = 512

Name = tuple[str, str, int]  # function (qualified name), file, line
Key = tuple[int, int]  # (code, instr), instr -1: not started


@dataclass
class _Process:
    names: OrderedDict[Key, Name | None] = field(default_factory=OrderedDict)  # None: given up
    asking: dict[Key, int] = field(default_factory=dict)  # frames being asked → times asked
    strings: dict[str, str] = field(default_factory=dict)  # one copy of each name and file


@dataclass(frozen=True)
class _Request:
    process: tuple[int, int]
    frames: tuple[Key, ...]
    sent_at: float


class PythonNameClient:
    """Asks the runtime reader for names and keeps them; polled from the worker's loop, never blocks."""

    def __init__(self, run_dir: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        ctx: zmq.Context = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued towards an absent reader: counted instead
        self.sock.setsockopt(zmq.SNDHWM, REQUEST_QUEUE)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, RECEIVE_LIMIT_BYTES)
        self.sock.connect(endpoints.python_names(run_dir))
        # a random start: an answer meant for an earlier worker's request does not match one of ours
        self._ids = itertools.count(secrets.randbits(31) + 1)
        self._procs: OrderedDict[tuple[int, int], _Process] = OrderedDict()
        self._starts: dict[int, int] = {}  # pid → the start ticks its names are kept for
        self._pending: OrderedDict[int, _Request] = OrderedDict()  # request id → request, oldest first
        self.counts = {
            k: 0
            for k in (
                "python_name_requests",
                "python_name_requests_dropped",
                "python_name_reasks",
                "python_names",
                "python_names_refused",
                "python_names_timed_out",
                "python_names_bad",
                "python_names_unsolicited",
                "python_names_unasked",
                "python_unnamed",
            )
        }

    # ------------------------------------------------------------ asking

    def ask(self, pid: int, start_ticks: int, keys: Iterable[Key]) -> None:
        """Ask for the names of these frames of a process that are neither known nor being asked."""
        proc = self._process(pid, start_ticks)
        new = [k for k in dict.fromkeys(keys) if k not in proc.names and k not in proc.asking]
        if new:
            self._send((pid, start_ticks), proc, new)

    def _process(self, pid: int, start_ticks: int) -> _Process:
        key = (pid, start_ticks)
        old = self._starts.get(pid)
        if old is not None and old != start_ticks:  # the pid is another process's now
            self._procs.pop((pid, old), None)
        self._starts[pid] = start_ticks
        proc = self._procs.get(key)
        if proc is None:
            proc = self._procs[key] = _Process()
            while len(self._procs) > PYTHON_PROCESSES:
                self._forget_oldest()
        self._procs.move_to_end(key)
        return proc

    def _forget_oldest(self) -> None:
        (pid, start), _ = self._procs.popitem(last=False)
        if self._starts.get(pid) == start:
            del self._starts[pid]

    def _send(self, process: tuple[int, int], proc: _Process, keys: list[Key]) -> None:
        for i in range(0, len(keys), MAX_PYTHON_NAMES):
            chunk = tuple(keys[i : i + MAX_PYTHON_NAMES])
            if len(self._pending) >= MAX_OUTSTANDING_REQUESTS:
                self._dropped(proc, chunk)
                continue
            rid = next(self._ids)
            request = PythonNameRequest(rid, process[0], process[1], chunk)
            try:
                self.sock.send_multipart(encode(request), zmq.NOBLOCK)
            except zmq.Again:  # no reader connected, or its queue is full
                self._dropped(proc, chunk)
                continue
            self._pending[rid] = _Request(process, chunk, self._clock())
            self.counts["python_name_requests"] += 1
            for k in chunk:
                proc.asking[k] = proc.asking.get(k, 0) + 1

    def _dropped(self, proc: _Process, chunk: tuple[Key, ...]) -> None:
        """A request not sent: its frames are asked again with the next batch that holds them."""
        self.counts["python_name_requests_dropped"] += 1
        for k in chunk:
            proc.asking.pop(k, None)

    # ------------------------------------------------------------ answers

    def poll(self) -> None:
        """Take every answer that arrived, then ask again what timed out; never waits."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._answer(frames)
        self._expire(self._clock())

    def _answer(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
            if not isinstance(msg, PythonNames):
                raise WireError(f"a name answer is python_names, not {type(msg).__name__}")
        except WireError as e:
            self.counts["python_names_bad"] += 1
            log.warning("dropped a malformed name answer (%d so far): %s", self.counts["python_names_bad"], e)
            return
        req = self._pending.get(msg.request_id)
        if req is None or req.process != (msg.pid, msg.start_ticks):
            self.counts["python_names_unsolicited"] += 1
            if self.counts["python_names_unsolicited"] == 1:
                log.warning(
                    "dropped a name answer to no request of ours (request %s, pid %s; counted as "
                    "python_names_unsolicited, logged once)",
                    quote(msg.request_id),
                    quote(msg.pid),
                )
            return
        del self._pending[msg.request_id]
        proc = self._procs.get(req.process)
        if proc is None:  # forgotten since it was asked
            return
        self._store(proc, req, msg.names)

    def _store(self, proc: _Process, req: _Request, names: Iterable[tuple[int, int, str, str, int]]) -> None:
        asked = set(req.frames)
        for code, instr, function, file, line in names:
            key = (code, instr)
            if key not in asked:
                self.counts["python_names_unasked"] += 1
                continue
            asked.discard(key)
            proc.asking.pop(key, None)
            proc.names[key] = (self._text(proc, function), self._text(proc, file), line)
            self.counts["python_names"] += 1
        for key in asked:  # left out: the reader could not name it
            if proc.asking.pop(key, None) is not None:
                proc.names[key] = None
                self.counts["python_names_refused"] += 1
        while len(proc.names) > NAMES_PER_PROCESS:
            proc.names.popitem(last=False)
        while len(self._procs) > 1 and sum(len(p.names) for p in self._procs.values()) > MAX_NAMES:
            self._forget_oldest()

    @staticmethod
    def _text(proc: _Process, raw: str) -> str:
        text = process_string(raw, MAX_NAME_CHARS)
        if len(proc.strings) >= 2 * NAMES_PER_PROCESS:
            proc.strings.clear()
        return proc.strings.setdefault(text, text)

    def _expire(self, now: float) -> None:
        while self._pending:
            rid, req = next(iter(self._pending.items()))
            if now - req.sent_at < ANSWER_TIMEOUT_S:
                break
            del self._pending[rid]
            proc = self._procs.get(req.process)
            if proc is None:
                continue
            again = []
            for k in req.frames:
                times = proc.asking.get(k)
                if times is None:
                    continue
                if times >= MAX_ASKS:
                    del proc.asking[k]
                    proc.names[k] = None
                    self.counts["python_names_timed_out"] += 1
                else:
                    again.append(k)
            if again:
                self.counts["python_name_reasks"] += 1
                self._send(req.process, proc, again)

    def settle(self, timeout_s: float) -> None:
        """Take answers until none is outstanding or timeout_s has passed (on stop, before the last windows)."""
        deadline = self._clock() + timeout_s
        while self._pending:
            left = deadline - self._clock()
            if left <= 0:
                break
            if self.sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                self.poll()

    def next_due(self) -> float | None:
        """When poll() next has a request to ask again (the clock's time), or None."""
        if not self._pending:
            return None
        return next(iter(self._pending.values())).sent_at + ANSWER_TIMEOUT_S

    # ------------------------------------------------------------ names

    def name(self, frame: PythonFrame) -> Name | None:
        """The frame's (function, file, line), or None (counted as python_unnamed: it gets a placeholder)."""
        proc = self._procs.get((frame.pid, frame.start_ticks))
        got = proc.names.get(frame.key) if proc is not None else None
        if got is None:
            self.counts["python_unnamed"] += 1
        return got

    def checks(self) -> dict[str, int]:
        return dict(self.counts)

    def close(self) -> None:
        self.sock.close()
