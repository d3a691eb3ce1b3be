"""The runtime reader stage: runtime stacks of announced processes, one pprof per runtime per service per window.

Owns: the stage's command line and loop: become the runtime user
(CAP_SYS_PTRACE only) first; load the plug-ins the config asks for
(shared/runtime_registry.py, runtimes/runtime.py); subscribe to the
collector's process announcements; every 1/SAMPLE_HZ s (a tick) detect a few
new processes and read the thread stacks of the ones a plug-in reads
(targets.py), within this tick's caps, shared by every runtime — MAX_PROCESSES_PER_TICK processes and MAX_BYTES_PER_TICK
bytes read, halved for every window whose CPU time went over cpu_budget and
doubled back (up to the caps) for every window well under it, the figures
logged each window; and no tick at all while the reader's CPU time is over
cpu_budget (CpuPace: a token bucket; the next tick that reads stands for the
ticks skipped); MAX_SECONDS_PER_TICK of reading — each process within its
share of them (a PROCESS_SHARE_DIVISOR-th of the bytes, MAX_SECONDS_PER_PROCESS;
one over it is skipped that tick, counted by reason and logged once), and the
next tick starting after the last process this one tried (round robin that
always moves on; the caps and their accounting are Caps); sum the stacks per service per window
and profile type (shared/window.py) with the process labels plus
thread.name and thread.id; hand each closed window's profile (profile.py) to the uploader.
On-CPU samples with registers from the collector (RegsBatch, for runtimes
with a cpu profile type: the JVM) are walked by their process's plug-in
(sample_regs) as they arrive, into that runtime's cpu profile (jvm_cpu), at
most MAX_REGS_PER_S a second (RegsGate: past it a weighted subsample).
A stop (SIGTERM/SIGINT) hands out the window in progress, after each plug-in's
stop() has undone what it asked of processes (the .NET plug-in's perf maps).
Plug-ins with a helper (shared/runtime_registry.py helper_caps: the .NET
connector) are loaded while the stage holds its OPTIONAL_CAPS, which it drops
as soon as they are loaded.

Must not: write to, stop or ptrace-attach a target (process_vm_readv only; the
.NET plug-in's requests over a runtime's diagnostics socket are its API, not writes),
load BPF, or talk to the network.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import random
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

import zmq

from runtimes import profile as profile_mod
from runtimes.bpf_walks import BpfWalks
from runtimes.memory import MemoryReadError, ProcessMemory, ReadBudget
from runtimes.runtime import SAMPLE_HZ, RegsStackReader, Runtime, ThreadStack
from runtimes.targets import Entry, Targets
from runtimes.tokens import TokenBucket
from shared import config as config_mod
from shared import (
    counters,
    endpoints,
    handoff,
    identity,
    lifecycle,
    privileges,
    ready,
    remote_config,
    runtime_registry,
    stopping,
)
from shared import log as log_mod
from shared.labels import process_labels
from shared.log import LogOnce
from shared.stopping import stop_on_signals
from shared.window import ClosedWindow, Windows
from shared.wire import (
    MAX_BATCH_BYTES,
    ProcessAnnouncement,
    ProfileUpload,
    RegsBatch,
    RegsSample,
    WireError,
    decode,
)

# Processes read per tick at most; the others wait for the next tick (round robin).
MAX_PROCESSES_PER_TICK = 64
# Bytes read per tick at most: a thread of 30 frames costs ~3 KB once its code objects are cached.
MAX_BYTES_PER_TICK = 4 << 20
# One process's reads take at most this share (1/N) of the tick's bytes, so another process is read in every
# tick however much one process's stacks take.
PROCESS_SHARE_DIVISOR = 2
# Seconds one process's reads may take in a tick (a tick is 53 ms; an ordinary process takes well under
# 10 ms): past it that read is given up for this tick, and the others are read.
MAX_SECONDS_PER_PROCESS = 0.1
# Seconds all of a tick's reads may take: past it the tick ends, and the next starts where it stopped.
MAX_SECONDS_PER_TICK = 0.25
# The caps never fall below these, however far over budget a window is.
MIN_PROCESSES_PER_TICK = 1
MIN_BYTES_PER_TICK = 64 << 10
# On-CPU samples with registers walked a second at most (a 2-CPU host at 19 Hz sends 38; a 64-CPU host
# of busy JVMs 1,216): past it a uniform subsample is walked, each worth the samples it stands for.
MAX_REGS_PER_S = 256
MIN_REGS_PER_S = 8
# CPU seconds of cpu_budget a quiet reader may save up (CpuPace): this many seconds of wall time's worth,
# so a burst after a quiet spell (many new processes detected at once) is not cut short.
PACE_BURST_S = 5.0
# A window under this fraction of cpu_budget doubles the caps back.
RELAX_BELOW = 0.5
# Windows close this long after their end (as in the symbolizer; nothing arrives late here).
WINDOW_GRACE_S = 0.5

log = logging.getLogger("ebpfprofiler.runtime")


def parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Runtime reader of ebpfprofiler: reads the thread stacks of the runtime processes the "
        "collector announces (CPython 3.13+ with python_stacks; with runtime_stacks: "
        f"{runtime_registry.opt_in_help()}) with process_vm_readv at {SAMPLE_HZ} Hz, never "
        "stopping or writing them, and hands one pprof per runtime ("
        + ", ".join(runtime_registry.PROFILE_TYPES)
        + ") per service per window to the uploader. "
        "Needs CAP_SYS_PTRACE only.",
    )
    lifecycle.add_stage_arguments(p, state_dir_holds="the per-host secret for pid labels")
    return p.parse_args(argv)


def load_runtimes(cfg: config_mod.ProfilerConfig) -> list[Runtime]:
    """The plug-ins the config asks for, in the registry's order."""
    out = []
    for spec in runtime_registry.RUNTIMES:
        got = importlib.import_module(spec.package).runtime(cfg)
        if got is not None:
            out.append(got)
    return out


class Caps:
    """The per-tick caps shared by every runtime: halved for a window over cpu_budget, doubled back (up to
    the maximums) for one well under it."""

    def __init__(self) -> None:
        self.max_processes, self.max_bytes = MAX_PROCESSES_PER_TICK, MAX_BYTES_PER_TICK
        self.max_regs_per_s = MAX_REGS_PER_S
        self._window_cpu = time.process_time()
        self._window_wall = time.monotonic()

    def account(self, cpu_budget: float) -> tuple[float, float, tuple[int, int]]:
        """At the end of a window: (% of a CPU used, CPU seconds used, the caps before), the caps halved or
        relaxed by it."""
        cpu, wall = time.process_time(), time.monotonic()
        used = cpu - self._window_cpu
        pct = 100.0 * used / max(wall - self._window_wall, 1e-6)
        self._window_cpu, self._window_wall = cpu, wall
        before = (self.max_processes, self.max_bytes)
        if pct > cpu_budget:
            self.max_processes = max(MIN_PROCESSES_PER_TICK, self.max_processes // 2)
            self.max_bytes = max(MIN_BYTES_PER_TICK, self.max_bytes // 2)
            self.max_regs_per_s = max(MIN_REGS_PER_S, self.max_regs_per_s // 2)
        elif pct < cpu_budget * RELAX_BELOW:
            self.max_processes = min(MAX_PROCESSES_PER_TICK, self.max_processes * 2)
            self.max_bytes = min(MAX_BYTES_PER_TICK, self.max_bytes * 2)
            self.max_regs_per_s = min(MAX_REGS_PER_S, self.max_regs_per_s * 2)
        return pct, used, before


class CpuPace:
    """Which ticks run, so that the reader keeps to cpu_budget within seconds, not only by the caps'
    halving once a window (a host of many threads per process, which the caps on processes do not
    reach, ran the reader at 4x its budget for minutes while they came down). A token bucket of CPU
    seconds, filled at cpu_budget of wall time (at most PACE_BURST_S of it saved) and spent by all the
    reader's CPU time, in ticks and between them; a tick that finds it empty reads nothing, and the next tick that runs weighs its
    stacks for the ticks skipped before it: skipped ticks are uniform, so wall-time totals and every
    split stay right, with fewer stacks."""

    def __init__(
        self,
        cpu_budget: float,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,  # the thread that ticks: the reader's own work
    ) -> None:
        rate = cpu_budget / 100.0
        self._cpu = cpu
        self.bucket = TokenBucket(rate, rate * PACE_BURST_S, clock)  # CPU seconds the reader may spend now
        self._cpu_seen = cpu()
        self._skipped = 0  # ticks skipped since the last that ran
        self._window_skipped = 0  # ticks skipped since take_window_skipped()

    def _spend(self) -> None:
        """Every CPU second the reader spent since the last look: ticks, and what runs between them
        (announcements, register samples, profiles built at a window's end)."""
        now = self._cpu()
        self.bucket.spend(now - self._cpu_seen)
        self._cpu_seen = now

    def start(self) -> int | None:
        """At a tick's start: None to skip it, else how many ticks it stands for (1 + those skipped)."""
        self._spend()
        if self.bucket.refill() <= 0:
            self._skipped += 1
            self._window_skipped += 1
            return None
        weight, self._skipped = self._skipped + 1, 0
        return weight

    def end(self) -> None:
        """At the end of a tick that ran."""
        self._spend()

    def take_window_skipped(self) -> int:
        """The ticks skipped since the last call (a window's, for its log line)."""
        n, self._window_skipped = self._window_skipped, 0
        return n


def _regs_note(stats: dict[str, int], max_regs_per_s: int) -> str:
    """The window log line's part on on-CPU samples with registers ("" when there were none)."""
    if not stats["regs_samples"] and not stats["regs_not_read"]:
        return ""
    return (
        f"; on-CPU samples with registers: {stats['regs_samples']} walked, "
        f"{stats['regs_subsampled']} left out of a subsample, {stats['regs_not_read']} of "
        f"processes not read (totals), at most {max_regs_per_s} a second"
    )


class RegsGate:
    """On-CPU samples with registers walked a second at most (a token bucket, refilled at the caps' rate):
    past it a uniform subsample, each worth the samples it stands for."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.bucket = TokenBucket(MAX_REGS_PER_S, MAX_REGS_PER_S)

    def choose(self, samples: Sequence[RegsSample], per_s: int) -> tuple[Sequence[RegsSample], float]:
        """(the samples to walk, what each is worth)."""
        self.bucket.rate = self.bucket.capacity = per_s
        tokens = self.bucket.refill()
        chosen, weight = samples, 1.0
        if len(samples) > tokens:
            k = max(1, int(tokens))
            chosen = self._rng.sample(samples, k)
            weight = len(samples) / k
        self.bucket.tokens = max(0.0, tokens - len(chosen))
        return chosen, weight


# The reader's own figures, logged each window and at the end (some are status counters: Reader.checks).
STATS = (
    "ticks",
    "stacks",
    "bad_messages",
    "profiles",
    "capped_processes",
    "budget_spent",
    "tick_time_spent",
    "process_over_bytes",
    "process_over_time",
    "regs_samples",
    "regs_not_read",
    "regs_subsampled",
)


def _sockets(run_dir: str) -> tuple[zmq.Socket, zmq.Socket]:
    """(the collector's announcements and register samples in, the uploader's handoff out)."""
    ctx: zmq.Context = zmq.Context.instance()
    inbox = ctx.socket(zmq.SUB)
    inbox.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
    inbox.setsockopt(zmq.SUBSCRIBE, b"")
    inbox.connect(endpoints.processes(run_dir))
    outbox = ctx.socket(zmq.DEALER)
    outbox.setsockopt(zmq.IMMEDIATE, 1)
    outbox.setsockopt(zmq.SNDHWM, handoff.MAX_UNACKED_PROFILES)
    outbox.setsockopt(zmq.LINGER, 0)
    outbox.setsockopt(zmq.MAXMSGSIZE, handoff.MAX_ACK_BYTES)
    outbox.connect(endpoints.uploader(run_dir))
    return inbox, outbox


class Reader:
    def __init__(
        self,
        cfg: config_mod.ProfilerConfig,
        run_dir: str,
        state_dir: str,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cfg = cfg
        self.host = socket.gethostname()
        self.secret = b"" if cfg.plain_pid else identity.load_or_create_secret(state_dir)
        self.runtimes = load_runtimes(cfg)
        self.walks = BpfWalks(run_dir)  # walk data to the collector, names to the symbolizers
        self.targets = Targets(self.runtimes, own_uids=privileges.agent_uids(), on_reading=self.walks.offer)
        self.windows = Windows(cfg.upload_interval_s)
        self.period_ns = 1_000_000_000 // SAMPLE_HZ
        self.inbox, self.outbox = _sockets(run_dir)
        self.sender = handoff.ProfileSender(self.outbox, log, should_stop=should_stop)
        self.caps = Caps()
        self.pace = CpuPace(cfg.cpu_budget)
        self._rng = random.Random()
        self._regs_gate = RegsGate(self._rng)
        self._rr = 0
        self.stats = dict.fromkeys(STATS, 0)
        self._log_once = LogOnce(log)
        self.counters = counters.CounterFile(run_dir, "runtime")  # the checks that fired, for status
        self.cpu_period_ns = 1_000_000_000 // cfg.sample_hz  # the collector's, as its last RegsBatch says
        self._window_stacks = 0

    # ------------------------------------------------------------ input

    def receive(self) -> None:
        while self.inbox.poll(0):
            frames = self.inbox.recv_multipart()
            try:
                msg = decode(frames)
                if not isinstance(msg, (ProcessAnnouncement, RegsBatch)):
                    raise WireError(
                        "a runtime reader takes process announcements and on-CPU samples with "
                        f"registers, not {type(msg).__name__}"
                    )
            except WireError as e:
                self.stats["bad_messages"] += 1
                log.warning("dropped a malformed message (%d so far): %s", self.stats["bad_messages"], e)
                continue
            if isinstance(msg, RegsBatch):
                self.regs(msg, time.time_ns())
            else:
                self.targets.announce(msg)
                if msg.full:  # the collector's periodic list: it may have restarted since it was told
                    self.walks.reoffer(self.targets)

    def regs(self, msg: RegsBatch, now_ns: int) -> None:
        """The collector's on-CPU samples with registers: each one walked by its process's plug-in, into
        the runtime's cpu profile (jvm_cpu) with the collector's period; a sample of a process not read
        (not announced yet, refused, another runtime's, its pid reused) is counted and dropped."""
        chosen, weight = self._regs_gate.choose(msg.samples, self.caps.max_regs_per_s)
        self.stats["regs_subsampled"] += len(msg.samples) - len(chosen)
        by_pid: dict[int, list[RegsSample]] = {}
        for r in chosen:
            by_pid.setdefault(r.pid, []).append(r)
        self.cpu_period_ns = msg.period_ns
        budget = ReadBudget(self.caps.max_bytes, time.monotonic() + MAX_SECONDS_PER_TICK)
        for pid, samples in by_pid.items():
            e = self.targets.entries.get(pid)
            reader = _regs_reader(e, samples[0].start_ticks)
            if e is None or e.runtime is None or reader is None:
                self.stats["regs_not_read"] += len(samples)
                continue
            own = (
                samples
                if e.process.nspid == e.process.pid
                else [  # in a pid namespace: the runtime's tids
                    replace(r, tid=self.targets.native_tid(e, r.tid)) for r in samples
                ]
            )
            stacks, spent = self._read(e, budget, partial(_sample_regs, reader, own))
            if spent:
                return
            if stacks is None:
                continue
            self.stats["regs_samples"] += len(samples)
            self._add(e, e.runtime.spec.cpu_profile_type, stacks, msg.period_ns, now_ns, weight)

    # ------------------------------------------------------------ sampling

    def tick(self, now_ns: int) -> None:
        """One tick, unless the reader is over cpu_budget (CpuPace): then nothing is read, and the next
        tick that reads stands for this one too."""
        self.stats["ticks"] += 1
        self.counters.update(self.checks())  # written at most every counters.WRITE_GAP_S
        weight = self.pace.start()
        if weight is None:
            return
        try:
            self._tick(now_ns, weight)
        finally:
            self.pace.end()

    def _tick(self, now_ns: int, weight: int) -> None:
        """Detect, poll, and read the processes of this tick's turn; each stack worth `weight` ticks."""
        budget = ReadBudget(self.caps.max_bytes, time.monotonic() + MAX_SECONDS_PER_TICK)
        self.targets.detect_some(budget)
        self.targets.poll_pending()
        entries = self.targets.readable()
        if not entries:
            return
        n = min(len(entries), self.caps.max_processes)
        if n < len(entries):
            self.stats["capped_processes"] += len(entries) - n
        start = self._rr % len(entries)
        chosen = (entries[start:] + entries[:start])[:n]
        # The next tick starts after the last process this one tried, however this one ends (its budget
        # spent, a process over its share or failing): one process can never hold the start.
        tried = 0
        for e in chosen:
            tried += 1
            if not self.targets.current(e):  # exited, or its pid names another process now
                continue
            assert e.reader is not None and e.runtime is not None
            stacks, spent = self._read(e, budget, e.reader.sample)
            if spent:
                break
            if stacks is None:
                continue
            if not self.targets.current(e):  # reused while we read: what we read is not e's
                continue
            self._add(e, e.runtime.spec.profile_type, stacks, self.period_ns, now_ns, weight)
        self._rr = start + tried

    def checks(self) -> dict[str, int]:
        """The checks on hostile input that fired since start, by reason (RUN_DIR/runtime.counters.json): the
        reader's caps, the targets' (detection, refusals by the cap that fired) and each plug-in's own."""
        out = {
            "bad_messages": self.stats["bad_messages"],
            "tick_bytes_spent": self.stats["budget_spent"],
            "tick_time_spent": self.stats["tick_time_spent"],
            "process_over_bytes": self.stats["process_over_bytes"],
            "process_over_time": self.stats["process_over_time"],
            "detect_slow": self.targets.stats["detect_slow"],
            "read_errors": self.targets.stats["read_errors"],
            "samples_over_service_cap": self.windows.samples_over_service_cap,
            "regs_subsampled": self.stats["regs_subsampled"],  # over MAX_REGS_PER_S: a subsample walked
            "regs_not_read": self.stats["regs_not_read"],
            **self.sender.checks(),
            **self.walks.checks(),
        }
        out.update({k: v for k, v in self.targets.stats.items() if k.startswith("refused_")})
        for r in self.runtimes:
            out.update(r.counters())
        return out

    def _read(
        self, e: Entry, tick: ReadBudget, read: Callable[[ProcessMemory], list[ThreadStack]]
    ) -> tuple[list[ThreadStack] | None, bool]:
        """(what read() gave with e's share of the tick's budget, or None: e could not be read; whether
        this tick's budget is spent). A process gone meanwhile is forgotten; one whose memory is not what
        its plug-in expects is given up (logged once); one over its share of the tick is skipped this
        tick (counted by reason, logged once)."""
        share = ReadBudget(
            max(1, self.caps.max_bytes // PROCESS_SHARE_DIVISOR),
            time.monotonic() + MAX_SECONDS_PER_PROCESS,
            parent=tick,
        )
        try:
            return read(ProcessMemory(e.process.pid, share)), False
        except MemoryReadError as err:
            if err.reason == "budget":
                if tick.spent:
                    self.stats["budget_spent" if tick.spent == "bytes" else "tick_time_spent"] += 1
                    return None, True
                reason = f"process_over_{share.spent or 'bytes'}"
                self.stats[reason] += 1
                self._log_once(
                    (e.process.pid, e.process.start_ticks, reason),
                    logging.INFO,
                    "pid %d (%s): reading its stacks takes more than its share of a tick (%d bytes, "
                    "%.0f ms): over in %s; at such ticks it is skipped and the next tick starts after "
                    "it",
                    e.process.pid,
                    e.process.executable,
                    share.max_bytes,
                    1e3 * MAX_SECONDS_PER_PROCESS,
                    share.spent or "bytes",
                )
                return None, False
            self.targets.stats["gone_while_reading"] += 1
            self.targets.forget(e)
        except Exception as err:  # what a target's memory holds must never end the reader
            self.targets.give_up(e, err)
        return None, False

    def _add(
        self, e: Entry, profile_type: str, stacks: list[ThreadStack], value: int, now_ns: int, weight: float = 1.0
    ) -> None:
        """A process's stacks into its service's window of profile_type, each worth `value` ns (and
        `weight` samples: a subsample's, or a tick's after ticks skipped over cpu_budget, stand for more)."""
        base = process_labels(
            self.host,
            e.process,
            self.secret,
            plain_pid=self.cfg.plain_pid,
            strip_process_args=self.cfg.strip_process_args,
        )
        by_service = self.windows.services(profile_type, now_ns)
        window = self.windows.service_in(by_service, e.process.service)
        for st in stacks:
            if not st.frames:
                continue
            tid, name = self.targets.thread(e, st.native_tid)
            labels = (*base, ("thread.name", name), ("thread.id", str(tid)))
            if weight == 1.0:
                window.add(labels, st.frames, 1, value)
            else:  # a subsample: whole samples on average, the nanoseconds exact in expectation
                n = int(weight) + (self._rng.random() < weight - int(weight))
                if n:
                    window.add(labels, st.frames, n, n * value)
            self.stats["stacks"] += 1
            self._window_stacks += 1

    # ------------------------------------------------------------ budget

    def account_window(self) -> None:
        """At the end of a window: CPU used against cpu_budget; halve or relax the caps; log the figures."""
        pct, used, before = self.caps.account(self.cfg.cpu_budget)
        caps = self.caps
        per_stack = 1e6 * used / self._window_stacks if self._window_stacks else 0.0
        log.info(
            "window: %.2f%% of a CPU (budget %.2f%%), %d stacks, %.0f us CPU per stack, %d ticks skipped "
            "over the budget (each stack then stands for them); caps per tick "
            "%d processes, %d bytes%s; targets %s; frames dropped %s%s%s",
            pct,
            self.cfg.cpu_budget,
            self._window_stacks,
            per_stack,
            self.pace.take_window_skipped(),
            caps.max_processes,
            caps.max_bytes,
            "" if before == (caps.max_processes, caps.max_bytes) else f" (were {before[0]}, {before[1]})",
            self.targets.stats,
            self.dropped() or "none",
            _regs_note(self.stats, caps.max_regs_per_s),
            self.walks.note(),
        )
        self._window_stacks = 0

    # ------------------------------------------------------------ output

    def flush(self, closed: list[ClosedWindow]) -> None:
        self.sender.poll()
        for w in closed:
            cpu = w.profile_type in runtime_registry.CPU_PROFILE_TYPES
            gz, n = profile_mod.build(w, self.cpu_period_ns if cpu else self.period_ns)
            upload = ProfileUpload(
                profile_id=str(uuid.uuid4()),
                host=self.host,
                service=w.service,
                profile_type=w.profile_type,
                window_start_ns=w.start_ns,
                window_end_ns=w.end_ns,
                samples=n,
                pprof_gz=gz,
            )
            self.sender.send(upload)
            self.stats["profiles"] += 1
            log.info(
                "profile %s %s of service %s, window %s: %d stacks, %d bytes",
                upload.profile_id,
                w.profile_type,
                w.service,
                handoff.window_text(upload),
                sum(r[0] for r in w.data.rows.values()),
                len(gz),
            )

    def dropped(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.targets.readable():
            assert e.reader is not None
            for k, v in e.reader.dropped.items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        self.stop_runtimes()
        self.counters.update(self.checks(), force=True)
        self.flush(list(self.windows.close_all()))
        self.sender.close(handoff.CLOSE_TIMEOUT_S)
        self.inbox.close()
        self.outbox.close()
        self.walks.close()
        log.info(
            "runtime reader stopped: %s, targets %s, frames dropped %s",
            self.stats,
            self.targets.stats,
            self.dropped() or "none",
        )

    def stop_runtimes(self) -> None:
        stop_runtimes(self.runtimes)


def stop_runtimes(runtimes: Sequence[Runtime]) -> None:
    """Each plug-in's stop(): undo what it asked of processes (its lines logged)."""
    for r in runtimes:
        try:
            for line in r.stop():
                log.info("%s", line)
        except Exception as e:  # any error: one plug-in's undoing must not stop the others'
            log.warning("%s: stopping failed: %s: %s", r.spec.title, type(e).__name__, e)


def _regs_reader(e: Entry | None, start_ticks: int) -> RegsStackReader | None:
    """The plug-in's reader that walks the process's register samples (of this start time), if any."""
    if e is None or e.runtime is None or not e.runtime.spec.cpu_profile_type or e.process.start_ticks != start_ticks:
        return None
    return e.reader if isinstance(e.reader, RegsStackReader) else None


def _sample_regs(reader: RegsStackReader, samples: Sequence[RegsSample], mem: ProcessMemory) -> list[ThreadStack]:
    return reader.sample_regs(mem, samples)


def wants_helper_caps(cfg: config_mod.ProfilerConfig) -> bool:
    """Whether a plug-in the config asks for forks a helper that needs the stage's OPTIONAL_CAPS."""
    return any(
        spec.helper_caps and any(name in cfg.runtime_stacks for name, _ in spec.opt_ins)
        for spec in runtime_registry.RUNTIMES
    )


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler-runtime") -> int:
    args = parse_args(argv, prog)
    log_mod.setup("runtime")
    extra = _helper_caps(args.config)
    # First: nothing below runs with more than CAP_SYS_PTRACE (and extra).
    lifecycle.become(prog, "runtime", "the runtime reader's", extra)
    cfg = lifecycle.load_config(prog, args.config)
    lifecycle.hold_run_dir(prog, args.run_dir, "runtime")
    stop = stop_on_signals(log)
    reader = Reader(cfg, args.run_dir, args.state_dir, should_stop=stop.is_set)
    if extra:  # the plug-ins' helpers are forked: the reader itself goes on with CAP_SYS_PTRACE only
        privileges.keep_only(privileges.STAGES["runtime"].caps)
    watcher = remote_config.Watcher.for_config(args.run_dir, cfg, log)
    watcher.check()
    ready.announce(args.run_dir, "runtime")
    log.info(
        "runtime reader ready: %d Hz, windows of %d s, CPython 3.13+ %s, runtime_stacks %s, runtimes %s, "
        "cpu_budget %.2f%%",
        SAMPLE_HZ,
        reader.windows.interval_s,
        "on" if cfg.python_stacks else "off",
        list(cfg.runtime_stacks) or "none",
        [r.spec.title for r in reader.runtimes] or "none",
        cfg.cpu_budget,
    )
    try:
        _loop(reader, cfg, watcher, stop.is_set)
    finally:
        lifecycle.shut_down(args.run_dir, "runtime", reader.close)
    return 0


def _helper_caps(config_path: str) -> frozenset[int]:
    """runtime_stacks: [dotnet]: CAP_SETUID and CAP_SETGID until its connector is forked (a config that
    cannot be read is reported later, as the stage)."""
    try:
        if wants_helper_caps(config_mod.load(config_path)):
            return privileges.OPTIONAL_CAPS["runtime"]
    except config_mod.ConfigError:
        pass
    return frozenset()


def _loop(
    reader: Reader, cfg: config_mod.ProfilerConfig, watcher: remote_config.Watcher, stopped: Callable[[], bool]
) -> None:
    """Ticks at SAMPLE_HZ while there is something to read (asleep until an announcement, a signal or a
    window to hand out otherwise), the windows handed out as they close, until a stop."""
    period = 1.0 / SAMPLE_HZ
    grace_ns = int(WINDOW_GRACE_S * 1e9)
    next_tick = time.monotonic()
    poller = zmq.Poller()
    poller.register(reader.inbox, zmq.POLLIN)
    poller.register(reader.walks.names, zmq.POLLIN)
    poller.register(stopping.wakeup_fd(), zmq.POLLIN)
    while not stopped():
        now = time.monotonic()
        if reader.targets.idle():
            # No process to read: asleep until an announcement, a signal or a window to hand out,
            # not ticking SAMPLE_HZ times a second for nothing.
            due_ns = reader.windows.next_close_ns(grace_ns)
            next_tick = now + watcher.wake_s if due_ns is None else now + (due_ns - time.time_ns()) / 1e9
        events = dict(poller.poll(stopping.poll_timeout_ms(next_tick, now, watcher.wake_s)))
        stopping.drain_wakeups()
        if reader.walks.names in events:  # symbolizers asking for names: within the reader's CPU pace
            reader.walks.serve(reader.targets, reader.caps.max_bytes)
        if reader.inbox in events:
            reader.receive()
            if reader.targets.idle():
                continue
            next_tick = min(next_tick, time.monotonic())
        if time.monotonic() < next_tick:
            continue
        next_tick += period
        if next_tick < time.monotonic():  # fell behind: skip, do not burst
            next_tick = time.monotonic() + period
        _step(reader, cfg, watcher, grace_ns)


def _step(reader: Reader, cfg: config_mod.ProfilerConfig, watcher: remote_config.Watcher, grace_ns: int) -> None:
    """One tick: a new remote config applied, the processes read (unless disabled), closed windows handed out."""
    if watcher.check():
        eff = remote_config.effective(cfg, watcher.overrides)
        reader.flush(reader.windows.set_interval(eff.upload_interval_s, time.time_ns()))
    if remote_config.effective(cfg, watcher.overrides).enabled:
        reader.tick(time.time_ns())
    closed = list(reader.windows.close_due(time.time_ns(), grace_ns))
    if closed:
        reader.account_window()
        reader.flush(closed)


if __name__ == "__main__":
    sys.exit(main())
