"""A symbolizer worker: stack batches in, one gzip pprof per service per window out.

Owns: the stage's command line and loop: receive StackBatch messages on its
own socket, resolve frames (frames.py), label samples, sum them into windows
(window.py), and when a window closes build its profiles (profile.py) and push
them to the uploader. On SIGTERM it closes every open window, the one in
progress included, so a clean stop loses nothing. When remote config changes
upload_interval_s (the overrides file, shared/remote_config.py, checked every
loop turn with one stat), it hands out the windows in progress and goes on
with windows of the new length. With dwarf_unwind, it also answers the
unwind requests a batch carries (unwind.py), after the batch's samples. A
sample with a Python stack has it spliced into its user frames (pystacks.py),
and the frames' names are asked of the runtime reader as the batch arrives
(pynames.py), its answers taken in the same loop; a frame still unnamed when
its window is built gets a placeholder, never loses its sample.

Must not: load BPF, write outside its state directory, or talk to the network.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq

from shared import config as config_mod
from shared import counters, endpoints, handoff, identity, lifecycle, ready, remote_config, stopping
from shared import log as log_mod
from shared.labels import process_labels
from shared.stopping import stop_on_signals
from shared.window import ClosedWindow, ServiceWindow, Windows
from shared.wire import RECEIVE_LIMIT_BYTES, Process, ProfileUpload, Sample, StackBatch, WireError, decode
from symbolizer import profile as profile_mod
from symbolizer import pystacks
from symbolizer.files import FileClient
from symbolizer.frames import Frame, FrameResolver
from symbolizer.pynames import PythonNameClient
from symbolizer.pystacks import AnyFrame
from symbolizer.unwind import UnwindServer

# Batches from the collector's last drain of a window arrive within about a
# drain interval after it ends; windows close this long after their end.
WINDOW_GRACE_S = 2.5
# Batches taken in one wake-up before due windows and stop are looked at again.
MAX_BATCHES_PER_WAKE = 64
# Batches whose unwind requests wait for the inbox to empty; past this the oldest are dropped (their
# processes are asked for again by later drains).
MAX_QUEUED_UNWIND_BATCHES = 64
# Address space of a worker: Python, ZeroMQ's threads and the caches need a
# few hundred MB of it (mostly untouched reservations); more is a runaway parse.
ADDRESS_SPACE_BYTES = 2 << 30
# On stop, how long the last batches' Python frames may wait for their names (else placeholders).
NAMES_AT_CLOSE_S = 0.5
# Batches queued in the socket before the collector's sends fail (it counts them).
BATCH_QUEUE = 64

log = logging.getLogger("ebpfprofiler.symbolizer")


@dataclass
class _BatchStacks:
    """The frames of one batch's stacks, each resolved once, and the Python frames to ask names for."""

    kernel: dict[int, tuple[Frame, ...]] = field(default_factory=dict)
    user: dict[tuple[int, int], tuple[Frame, ...]] = field(default_factory=dict)  # (pid, user stack)
    mixed: dict[tuple[int, int, int], tuple[tuple[AnyFrame, ...], str]] = field(default_factory=dict)
    python_keys: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)


def parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Symbolizer worker of ebpfprofiler: receives stack batches from the collector, "
        "names frames (ELF symbols and build ids, /proc/kallsyms names, "
        "/tmp/perf-<pid>.map for JIT code), and builds one gzip pprof per service per "
        "upload window, which it hands to the uploader. Needs no privileges.",
    )
    lifecycle.add_stage_arguments(p, state_dir_holds="the per-host secret for pid labels")
    p.add_argument("--worker", type=int, default=0, help="this worker's index, 0-based (default: 0)")
    return p.parse_args(argv)


class Worker:
    def __init__(
        self,
        cfg: config_mod.ProfilerConfig,
        worker: int,
        run_dir: str,
        state_dir: str,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cfg = cfg
        self.worker = worker
        self.secret = b"" if cfg.plain_pid else identity.load_or_create_secret(state_dir)
        files = FileClient(run_dir)
        self.resolver = FrameResolver(files)
        # Names of the Python frames of mixed stacks, asked of the runtime reader (issue 42).
        self.python = PythonNameClient(run_dir)
        # Answers the collector's unwind requests (docs/unwinding.md); same broker connection.
        self.unwind = UnwindServer(files, run_dir, state_dir) if cfg.dwarf_unwind else None
        self.windows = Windows(cfg.upload_interval_s)
        # The period of a profile type whose batches do not set it (cpu takes the batch's
        # sample_hz: the collector's overhead guard changes the rate while it runs).
        self.period = {
            "cpu": 1_000_000_000 // cfg.sample_hz,
            "offcpu": 1,
            "lock": 1,
            "alloc": max(1, cfg.alloc_sample_bytes),
        }
        ctx: zmq.Context = zmq.Context.instance()
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, RECEIVE_LIMIT_BYTES)
        self.inbox.setsockopt(zmq.RCVHWM, BATCH_QUEUE)
        self.inbox.bind(endpoints.symbolizer(run_dir, worker))
        # Profiles go to the uploader over a DEALER; the uploader acks each one once it is
        # on disk, and the sender keeps it until then (bounded; flush blocks when full).
        self.outbox = ctx.socket(zmq.DEALER)
        self.outbox.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued towards an absent uploader
        self.outbox.setsockopt(zmq.SNDHWM, handoff.MAX_UNACKED_PROFILES)
        self.outbox.setsockopt(zmq.LINGER, 0)  # unacked profiles are the sender's, not the socket's
        self.outbox.setsockopt(zmq.MAXMSGSIZE, handoff.MAX_ACK_BYTES)
        self.outbox.connect(endpoints.uploader(run_dir))
        # A flush blocked on the uploader must still notice a stop.
        self.sender = handoff.ProfileSender(self.outbox, log, should_stop=should_stop)
        self.stats = {
            "batches": 0,
            "bad_messages": 0,
            "samples": 0,
            "profiles": 0,
            "lost_in_kernel": 0,
            "unwind_batches_dropped": 0,
            "samples_over_row_cap": 0,
            # samples whose Python calls and native eval frames did not pair one to one (pystacks.splice)
            **{f"python_splice_{kind}": 0 for kind in pystacks.SPLICE_MISMATCHES},
            # the messages dropped whole, by the check that refused them (WireError.reason)
            **{f"bad_messages_{reason}": 0 for reason in WireError.REASONS},
        }
        # the checks that fired, for status (RUN_DIR/symbolizer-N.counters.json)
        self.counters = counters.CounterFile(run_dir, f"symbolizer-{worker}")
        self._unwind_queue: deque[StackBatch] = deque()
        self._labels: dict[tuple[int, int], tuple[tuple[str, str], ...]] = {}

    # ------------------------------------------------------------ input

    def handle(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
            if not isinstance(msg, StackBatch):
                raise WireError(f"a symbolizer takes stack batches, not {type(msg).__name__}")
        except WireError as e:
            self.stats["bad_messages"] += 1
            self.stats[f"bad_messages_{e.reason}"] = self.stats.get(f"bad_messages_{e.reason}", 0) + 1
            log.warning("dropped a malformed message (%d so far): %s", self.stats["bad_messages"], e)
            return
        self.stats["batches"] += 1
        if msg.lost:
            self.stats["lost_in_kernel"] += sum(msg.lost.values())
        self.add_batch(msg)
        if self.unwind is not None and msg.unwind_requests:
            # Built once the inbox is empty (serve_unwind): names need the process alive, tables can wait.
            if len(self._unwind_queue) >= MAX_QUEUED_UNWIND_BATCHES:
                self._unwind_queue.popleft()
                self.stats["unwind_batches_dropped"] += 1
            self._unwind_queue.append(msg)

    def serve_unwind(self) -> bool:
        """Answer the unwind requests of one queued batch, the newest first; whether more are queued.

        Newest first: a backlog (the host's modules at start-up took 2.6 s here) otherwise held up a
        process started meanwhile, and its first second of stacks went by before its tables (its
        first window 81% whole, against ~97% when served at once). The backlog's processes have been
        running a while, and the one new batch costs them milliseconds."""
        if self._unwind_queue:
            assert self.unwind is not None
            self.unwind.serve(self._unwind_queue.pop())
        return bool(self._unwind_queue)

    def add_batch(self, batch: StackBatch) -> None:
        procs = {p.pid: p for p in batch.processes}
        # Once per batch: its window; once per process: labels and service window;
        # once per distinct (process, stack): frames.
        by_service = self.windows.services(batch.profile_type, batch.time_ns)
        period = 1_000_000_000 // batch.sample_hz if batch.profile_type == "cpu" else 0
        targets: dict[int, tuple[tuple[tuple[str, str], ...], ServiceWindow]] = {}
        stacks = _BatchStacks()
        for s in batch.samples:
            proc = procs.get(s.pid)
            if proc is None:
                self.stats["bad_messages"] += 1
                continue
            target = targets.get(s.pid)
            if target is None:
                window = self.windows.service_in(by_service, proc.service)
                target = targets[s.pid] = (self.labels(batch.host, proc), window)
            frames: tuple[AnyFrame, ...] = ()
            if s.kernel_stack >= 0:
                kf = stacks.kernel.get(s.kernel_stack)
                if kf is None:
                    kf = stacks.kernel[s.kernel_stack] = tuple(
                        self.resolver.kernel(batch.kernel_stacks[s.kernel_stack], batch.kernel_symbols)
                    )
                frames += kf
            frames += self.user_frames(batch, proc, s, stacks)
            labels, window = target
            window.add(labels, frames, s.count, s.value, s.extra)
            window.period = period or window.period
            self.stats["samples"] += s.count
        for (pid, start_ticks), keys in stacks.python_keys.items():
            self.python.ask(pid, start_ticks, keys)

    def user_frames(self, batch: StackBatch, proc: Process, s: Sample, stacks: _BatchStacks) -> tuple[AnyFrame, ...]:
        """A sample's user frames, leaf first, with its Python frames spliced in (symbolizer/pystacks.py)."""
        key = (s.pid, s.user_stack)
        uf = stacks.user.get(key)
        if uf is None:
            uf = ()
            if s.user_stack >= 0:
                uf = tuple(self.resolver.user(proc, batch.user_stacks[s.user_stack]))
            stacks.user[key] = uf
        if s.python_stack < 0:
            return uf
        got = stacks.mixed.get((s.pid, s.user_stack, s.python_stack))
        if got is None:
            py = batch.python_stacks[s.python_stack]
            got = stacks.mixed[(s.pid, s.user_stack, s.python_stack)] = pystacks.splice(
                uf, py, proc.pid, proc.start_ticks
            )
            stacks.python_keys.setdefault((proc.pid, proc.start_ticks), []).extend(pystacks.frame_keys(py))
        if got[1]:
            self.stats[f"python_splice_{got[1]}"] += 1
        return got[0]

    def labels(self, host: str, p: Process) -> tuple[tuple[str, str], ...]:
        key = (p.pid, p.start_ticks)
        got = self._labels.get(key)
        if got is None:
            got = process_labels(
                host, p, self.secret, plain_pid=self.cfg.plain_pid, strip_process_args=self.cfg.strip_process_args
            )
            if len(self._labels) >= 65536:  # bounded: labels are cheap to rebuild
                self._labels.clear()
            self._labels[key] = got
        return got

    # ------------------------------------------------------------ output

    def flush(self, closed: list[ClosedWindow]) -> None:
        self.sender.poll()  # acks in, overdue resends out; never blocks
        if closed:
            self.python.poll()  # the names that arrived, before the windows that need them are built
        for w in closed:
            gz, n = profile_mod.build(w, w.data.period or self.period[w.profile_type], self.python.name)
            upload = ProfileUpload(
                profile_id=str(uuid.uuid4()),
                host=os.uname().nodename,
                service=w.service,
                profile_type=w.profile_type,
                window_start_ns=w.start_ns,
                window_end_ns=w.end_ns,
                samples=n,
                pprof_gz=gz,
            )
            # Blocks while the uploader has not acked MAX_UNACKED_*: backpressure, not growth.
            self.sender.send(upload)
            self.stats["profiles"] += 1
            if w.data.truncated:
                self.stats["samples_over_row_cap"] += w.data.truncated
                log.warning(
                    "service %s window %d: %d samples summed into [truncated] (row cap)",
                    w.service,
                    w.start_ns,
                    w.data.truncated,
                )
            log.info(
                "profile %s %s of service %s, window %s: %d samples, %d bytes",
                upload.profile_id,
                w.profile_type,
                w.service,
                handoff.window_text(upload),
                sum(r[0] for r in w.data.rows.values()),
                len(gz),
            )
        self.counters.update(self.checks())

    def checks(self) -> dict[str, int]:
        """The checks on hostile input that fired since start, by reason."""
        return {
            "bad_messages": self.stats["bad_messages"],
            "unwind_batches_dropped": self.stats["unwind_batches_dropped"],
            "samples_over_row_cap": self.stats["samples_over_row_cap"],
            "samples_over_service_cap": self.windows.samples_over_service_cap,
            **{k: v for k, v in self.stats.items() if k.startswith("bad_messages_")},
            **self.sender.checks(),
            **{k: v for k, v in self.stats.items() if k.startswith("python_splice_")},
            **self.python.checks(),
            **({f"unwind_failed_{k}": v for k, v in self.unwind.failed_by_reason.items()} if self.unwind else {}),
        }

    def set_interval(self, interval_s: int, why: str) -> None:
        """Windows of interval_s from now on; the windows in progress are handed out now."""
        old = self.windows.interval_s
        if interval_s == old:
            return
        closed = self.windows.set_interval(interval_s, time.time_ns())
        log.info(
            "%s: windows of %d s instead of %d s from now on; handing out the windows in progress now (%d profile(s))",
            why,
            interval_s,
            old,
            len(closed),
        )
        self.flush(closed)

    def close(self) -> None:
        self.python.settle(NAMES_AT_CLOSE_S)  # the names of the last batches, before their windows are built
        self.flush(list(self.windows.close_all()))
        self.counters.update(self.checks(), force=True)
        self.sender.close(handoff.CLOSE_TIMEOUT_S)  # waits for the last acks; logs what it could not hand off
        if self.unwind is not None:
            self.unwind.close()
        self.python.close()
        self.inbox.close()
        self.outbox.close()
        log.info("symbolizer worker %d stopped: %s, frames %s", self.worker, self.stats, self.resolver.stats)


def serve(
    worker: Worker, watcher: remote_config.Watcher, cfg: config_mod.ProfilerConfig, stopped: Callable[[], bool]
) -> None:
    """The worker's loop, until asked to stop: batches in, name answers in, windows out."""
    grace_ns = int(WINDOW_GRACE_S * 1e9)
    poller = zmq.Poller()
    poller.register(worker.inbox, zmq.POLLIN)
    poller.register(worker.python.sock, zmq.POLLIN)
    poller.register(stopping.wakeup_fd(), zmq.POLLIN)
    while not stopped():
        # Asleep until a batch, a name answer, a signal, the next window to hand out or a name to ask
        # again: an idle worker costs nothing.
        due_ns = worker.windows.next_close_ns(grace_ns)
        now = time.monotonic()
        deadline = now + watcher.wake_s if due_ns is None else now + (due_ns - time.time_ns()) / 1e9
        deadline = min(deadline, worker.python.next_due() or deadline)
        busy = bool(worker._unwind_queue)
        events = dict(poller.poll(0 if busy else stopping.poll_timeout_ms(deadline, now, watcher.wake_s)))
        stopping.drain_wakeups()
        if worker.inbox in events:
            for _ in range(MAX_BATCHES_PER_WAKE):
                worker.handle(worker.inbox.recv_multipart(copy=True))
                if not worker.inbox.poll(0):
                    break
        elif busy:
            worker.serve_unwind()
        worker.python.poll()
        if watcher.check():
            worker.set_interval(remote_config.effective(cfg, watcher.overrides).upload_interval_s, "remote config")
        worker.flush(list(worker.windows.close_due(time.time_ns(), grace_ns)))
    # The collector drains once more when it stops; take what is queued.
    while worker.inbox.poll(0):
        worker.handle(worker.inbox.recv_multipart())
    worker._unwind_queue.clear()  # not built on stop: the collector is going


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler-symbolizer") -> int:
    args = parse_args(argv, prog)
    log_mod.setup(f"symbolizer-{args.worker}")
    lifecycle.become(prog, "symbolizer", "the symbolizer's")  # first: nothing below runs with privileges
    # A hostile ELF may make the parser allocate; past this it gets MemoryError,
    # which elf.py turns into a counted skip, instead of the host's memory.
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    cfg = lifecycle.load_config(prog, args.config)
    if not 0 <= args.worker < cfg.symbolizer_workers:
        print(
            f"{prog}: --worker {args.worker} is outside 0..{cfg.symbolizer_workers - 1} "
            f"(symbolizer_workers: {cfg.symbolizer_workers})",
            file=sys.stderr,
        )
        return 2

    lifecycle.hold_run_dir(prog, args.run_dir, f"symbolizer-{args.worker}")
    stop = stop_on_signals(log)
    worker = Worker(cfg, args.worker, args.run_dir, args.state_dir, should_stop=stop.is_set)
    watcher = remote_config.Watcher.for_config(args.run_dir, cfg, log)
    if watcher.check():
        worker.set_interval(remote_config.effective(cfg, watcher.overrides).upload_interval_s, "remote config")
    stage = f"symbolizer-{args.worker}"
    ready.announce(args.run_dir, stage)
    log.info("symbolizer worker %d ready: windows of %d s", args.worker, worker.windows.interval_s)
    try:
        serve(worker, watcher, cfg, stop.is_set)
    finally:
        lifecycle.shut_down(args.run_dir, stage, worker.close)
    return 0


if __name__ == "__main__":
    sys.exit(main())
