"""Which CPython processes the walk in BPF reads: the runtime reader's answers, checked and applied.

Owns: the collector's end of python-walk.sock (shared/endpoints.python_walk), where runtime readers
push a PythonProcess for a process they found to be CPython; taking at most MAX_ANSWERS_PER_DRAIN of
them a drain; accepting one only for a process the collector announced, with the same start time (a
stage never trusts a message it did not ask for: the announcement is the question), and whose layout
collector/pywalk.py accepts (else refused, counted and logged once per reason); the py_procs entry of
each accepted process, removed once the announcer no longer knows it (it exited, or its pid is
another process's); the counters of both.

Must not: read process memory or decide a version (the runtime reader does), or parse anything but
wire messages.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from collector.announce import Announcer
from collector.pywalk import LayoutRefused, PyWalker
from shared import endpoints
from shared.log import LogOnce
from shared.safestr import cut
from shared.wire import RECEIVE_LIMIT_BYTES, PythonProcess, WireError, decode

log = logging.getLogger(__name__)

# Answers taken per drain (one per new CPython process, and a full round every 30 s); the rest wait in
# the socket for the next drain.
MAX_ANSWERS_PER_DRAIN = 256
# Answers queued in the socket (a few hundred bytes each).
ANSWER_QUEUE = 4096


class PythonWalks:
    def __init__(self, bpf: Any, run_dir: str, ctx: zmq.Context[Any]) -> None:
        self.walker = PyWalker(bpf)
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, ANSWER_QUEUE)
        self.sock.setsockopt(zmq.MAXMSGSIZE, RECEIVE_LIMIT_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoints.python_walk(run_dir))
        self._starts: dict[int, int] = {}  # pid → start ticks of the process walked
        self._log_once = LogOnce(log)
        self.stats = {
            "python_walked": 0,
            "python_refused": 0,
            "python_unasked": 0,
            "python_malformed": 0,
            "python_exited": 0,
        }
        self.in_kernel: dict[str, int] = {}  # py_counters of bpf/python.h, summed since start
        self.closed = False

    def after_drain(self, announcer: Announcer) -> None:
        """A drain's turn: the answers that arrived taken, exited processes no longer walked."""
        self.receive(announcer)
        self.forget_exited(announcer)

    def receive(self, announcer: Announcer) -> None:
        """Take the answers that arrived; walk the processes they name that the announcer knows."""
        for _ in range(MAX_ANSWERS_PER_DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            try:
                msg = decode(frames)
            except WireError as e:
                self.stats["python_malformed"] += 1
                self._log_once(
                    f"malformed:{e.reason}", logging.WARNING, "python-walk.sock: malformed message skipped: %s", e
                )
                continue
            if not isinstance(msg, PythonProcess):
                self.stats["python_malformed"] += 1
                self._log_once(
                    f"kind:{type(msg).__name__}",
                    logging.WARNING,
                    "python-walk.sock takes PythonProcess only, not %s",
                    type(msg).__name__,
                )
                continue
            self._take(msg, announcer)

    def _take(self, msg: PythonProcess, announcer: Announcer) -> None:
        if announcer.start_ticks_of(msg.pid) != msg.start_ticks:
            self.stats["python_unasked"] += 1  # not announced, gone since, or its pid now another process's
            return
        if self._starts.get(msg.pid) == msg.start_ticks:
            return  # walked already (a full announcement's answer)
        try:
            self.walker.add(msg.pid, msg.layout, msg.runtime)
        except LayoutRefused as e:
            self.stats["python_refused"] += 1
            self._log_once(
                f"refused:{e}",
                logging.WARNING,
                "CPython %s (pid %d): no Python frames in its cpu profile: %s",
                cut(msg.version),
                msg.pid,
                e,
            )
            return
        if msg.pid not in self._starts:
            self.stats["python_walked"] += 1
            log.info("CPython %s (pid %d): its Python frames are walked at each sample", cut(msg.version), msg.pid)
        self._starts[msg.pid] = msg.start_ticks

    def forget_exited(self, announcer: Announcer) -> None:
        """Stop walking processes the announcer no longer knows (exited, or their pid reused)."""
        for pid, start in list(self._starts.items()):
            if announcer.start_ticks_of(pid) != start:
                self.walker.remove(pid)
                del self._starts[pid]
                self.stats["python_exited"] += 1

    def counters(self) -> dict[str, int]:
        """The walk's checks since start: answers taken or refused here, and bpf/python.h's counters (their
        last reading once closed: the maps go with the programs)."""
        if not self.closed:
            for name, n in self.walker.counters().items():
                self.in_kernel[name] = self.in_kernel.get(name, 0) + n
        return {**self.stats, **{f"python_walk_{k}": v for k, v in self.in_kernel.items()}}

    def close(self) -> None:
        """Remove every process from py_procs and read the counters a last time; before the programs and
        their maps are unloaded."""
        for pid in list(self._starts):
            self.walker.remove(pid)
        self._starts.clear()
        self.counters()
        self.closed = True
        self.sock.close(0)
