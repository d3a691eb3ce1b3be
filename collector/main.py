"""The collector stage: the one privileged stage. Loads BPF, drains it, ships stack batches.

Owns: the stage's command line, its main loop (drain every source — on-CPU,
off-CPU unless offcpu: false, lock waits and allocations of the configured
targets — 1 to 60 s apart (collector/drains.py), join with /proc, route to workers, send;
follow the targets as they come and go; once per upload window the live
allocations, into that window's alloc profiles), following remote config's `enabled` (each drain it
checks the overrides file the uploader writes, shared/remote_config.py:
`enabled: false` detaches the perf events and tracepoints and keeps the BPF
programs loaded; `enabled: true` attaches them again), the overhead guard's
rate (collector/overhead.py decides it each upload window; changing it
detaches the perf event, drains at the old period, and attaches at the new
one), SIGHUP (reads overhead_budget_pct from the config file again), and a
clean stop: on SIGTERM or SIGINT it drains once more, sends, and detaches
every program and perf event.

Must not: parse ELF files or process memory, or talk to the network.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

import zmq

from collector import alloc, bpftime, drains, features, overhead, plan, preflight, regs, unwind
from collector.announce import Announcer
from collector.bpfmaps import RawDrain
from collector.drains import EarlyDrains
from collector.filebroker import FileBroker
from collector.kallsyms import KernelSymbols
from collector.links import BATCH_QUEUE_PER_WORKER, WorkerLinks
from collector.lock import LockTracer
from collector.programs import capture_stderr, explain
from collector.routing import worker_for
from collector.sources import EventSource, TargetedSource
from collector.targets import TargetWatcher
from shared import config as config_mod
from shared import counters, endpoints, lifecycle, privileges, ready, remote_config, stopping
from shared import log as log_mod
from shared.stage_code import default_bpf_dir
from shared.stopping import stop_on_signals
from shared.wire import MAX_BATCH_BYTES, Process, StackBatch, UnwindRequest, encode_within

# The shortest stretch between regular drains (a busy host; and while alloc or lock targets are watched).
DRAIN_INTERVAL_S = 1.0
# Drains are at most this far apart (collector/drains.py regular_delay brings them closer for many
# keys or a fast pid churn, down to DRAIN_INTERVAL_S), and one follows each window boundary
# (BOUNDARY_LAG_S after it): with the default 60-s windows a quiet host drains once a window. A
# drain costs ~3.5 ms of the collector's CPU (bcc map calls, /proc joins, batches) and ~1.3 ms of the
# symbolizer's, plus the wake-ups of both (0.1-4 ms each on these VMs): on an idle host drains
# every 15 s were the largest part of the agent's cost. A process that starts meanwhile and lives
# brings a drain forward (collector/drains.py), so that its metadata is read while it lives.
IDLE_DRAIN_INTERVAL_S = 60.0
# New-process events looked at per wake-up (a backlog after a stall needs only a few).
MAX_NOTIFIED_PER_TAKE = 64
# A quiet drain is this long after a window boundary: what was sampled up to the boundary is then
# drained, and stamped into the window it was taken in (drain_stamp_ns).
BOUNDARY_LAG_S = 0.05
# A worker that keeps refusing batches is reported at most this often.
DROP_LOG_EVERY_S = 60
# At start, how long to wait for the workers' connections before sampling:
# the first batches then go to the right workers, not all to the first one.
CONNECT_WAIT_MS = 2000

log = logging.getLogger("ebpfprofiler.collector")


def parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Root stage of ebpfprofiler: samples on-CPU stacks of every process with BPF "
        "(cpu-clock perf event at sample_hz on every CPU) and, with offcpu: true, where "
        "threads block (sched:sched_switch, intervals of offcpu_min_ms and more); drains "
        "the in-kernel counts (1 to 60 s apart: closer for many stacks or many new processes, and "
        "just after each window boundary) and sends them, with process metadata and "
        "mappings, to the symbolizer workers over ZeroMQ. With alloc_targets or lock_targets it also "
        "records, for those processes only, allocations (uprobes on libc malloc/calloc/realloc/free, "
        "sampled one per alloc_sample_bytes) and futex waits (lock contention). Each upload window "
        "it counts what "
        "the profiler cost (every stage's CPU plus the kernel's BPF run time of its programs) "
        "and halves sample_hz while that is over overhead_budget_pct of one CPU (doubling it "
        "back after three windows under half the budget); the figures go to the log and to "
        "RUN_DIR/status.json (`ebpfprofiler status`). SIGHUP reads overhead_budget_pct from "
        "--config again. Stops cleanly on SIGTERM/SIGINT, detaching every BPF program and "
        "perf event.",
    )
    p.add_argument("--config", help="agent YAML file (modules.ebpf_profiler block); required unless --preflight")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="check that this host can run the collector (kernel >= 5.8, capabilities, "
        "kernel.perf_event_paranoid against them, the memlock limit, BTF, tracefs, kernel "
        "headers, bcc) and which kernel features it will do without; name what is missing and "
        "how to fix it, and exit 0 if ready, 1 if not; the collector also runs these checks at "
        "every start, and `ebpfprofiler run` before it starts any stage",
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        help="with --preflight: also write into DIR the files the checks read and the kernel features "
        "probed, so that the same checks can be replayed elsewhere (a bug report, a test)",
    )
    p.add_argument(
        "--bpf-dir", default=default_bpf_dir(), help="directory of the BPF C programs (default: %(default)s)"
    )
    p.add_argument(
        "--run-dir",
        default=endpoints.DEFAULT_RUN_DIR,
        help="runtime directory holding the stages' sockets (default: %(default)s)",
    )
    args = p.parse_args(argv)
    if not args.preflight and not args.config:
        p.error("--config is required")
    return args


def drain_stamp_ns(last_ns: int, now_ns: int, interval_ns: int) -> int:
    """The time a drain's samples are stamped with: they were taken between the last drain (last_ns)
    and this one (now_ns), and go to the window that holds most of that stretch. With no window
    boundary between the two, that is now; across one, the side with more of the stretch (the
    window before the boundary when the drain follows it closely, as a quiet drain does)."""
    boundary = now_ns - now_ns % interval_ns
    if last_ns >= boundary or now_ns - boundary >= boundary - last_ns:
        return now_ns
    return boundary - 1


class Collector:
    def __init__(
        self, cfg: config_mod.ProfilerConfig, bpf_dir: str, run_dir: str, kernel: features.KernelFeatures
    ) -> None:
        # bcc is imported here, not at the top: only this stage pays for it.
        from collector.offcpu import OffCpuTracer
        from collector.oncpu import OnCpuSampler
        from collector.procfs import ProcessTable
        from collector.programs import Programs

        self.cfg = cfg
        self.run_dir = run_dir
        self.kernel = kernel
        self.host = socket.gethostname()
        self.procs = ProcessTable(with_cmdline=not cfg.strip_process_args)
        self.ksyms = KernelSymbols()
        # What to compile for this config on this kernel (collector/plan.py); what the kernel cannot
        # give is refused alone: in the log, and in status (kernel.json).
        p = plan.plan(cfg, kernel)
        self.refused = list(p.refused)
        for what, why in p.refused:
            log.warning("%s refused: %s; the rest of the agent runs", what, why)
        for note in p.notes:
            log.warning("%s", note)
        dwarf, offcpu_dwarf, lock_dwarf, regs_names = p.dwarf, p.offcpu_dwarf, p.lock_dwarf, p.regs_names
        self.programs = Programs(bpf_dir, p.families, p.defines)
        # The event sources (collector/sources.py): every one is attached, drained, paused and
        # closed alike; on-CPU is also the one whose rate the overhead guard sets.
        self.oncpu = OnCpuSampler(self.programs.bpf, cfg.sample_hz, dwarf=dwarf)
        self.sources: list[EventSource] = [self.oncpu]
        if p.offcpu:
            self.sources.append(OffCpuTracer(self.programs.bpf, cfg.offcpu_min_ms, dwarf=offcpu_dwarf))
        # Opt-in, per target process: lock waits (futex tracepoints) and allocations (uprobes).
        self.watchers: list[tuple[TargetWatcher, TargetedSource]] = []
        if cfg.lock_targets:
            self.watchers.append((TargetWatcher(cfg.lock_targets), LockTracer(self.programs.bpf, dwarf=lock_dwarf)))
        if p.alloc:
            self.watchers.append(
                (
                    TargetWatcher(cfg.alloc_targets),
                    alloc.AllocTracer(self.programs.bpf, cfg.alloc_sample_bytes, cfg.alloc_duty_pct),
                )
            )
        self.sources += [source for _, source in self.watchers]
        self._snapshot_window: int | None = None
        # (profile type, target pid) → modules with tables, as last logged
        self._target_tables: dict[tuple[str, int], int] = {}
        ctx: zmq.Context = zmq.Context.instance()
        self.unwind = None
        if dwarf:
            # (off-CPU's step program is a tp_btf program: OffCpuTracer loads it)
            self.unwind = unwind.UnwindTables(
                self.programs.bpf, ["oncpu"] + (["lock"] if lock_dwarf else []), run_dir, ctx
            )
            log.info(
                "DWARF unwinding on: on-CPU%s stacks of processes with unwind tables; tables from "
                "the symbolizers at %s",
                " and off-CPU" if offcpu_dwarf else "",
                endpoints.unwind(run_dir),
            )
        self.links = WorkerLinks(ctx, run_dir, cfg.symbolizer_workers)
        self.broker = FileBroker(run_dir, allowed_uids=privileges.uids_with("symbolizer"))
        self.announcer = Announcer(zmq.Context.instance(), run_dir, self.host)  # to runtime readers
        self.regs = (
            regs.RegsForwarder(self.programs.bpf, regs_names, self.announcer.publish, self.host) if regs_names else None
        )
        # batches_split: batches over MAX_BATCH_BYTES, sent in parts; parts_unsendable: a part that could
        # not be made to fit (its samples counted lost as <type>.oversize).
        self.totals = {"batches": 0, "batches_dropped": 0, "batches_split": 0, "parts_unsendable": 0}
        self.counters = counters.CounterFile(run_dir, "collector")  # the checks that fired, for status
        self._log_once = log_mod.LogOnce(log)
        self.early = EarlyDrains()
        self._dropped_since_ok: dict[int, int] = {}  # worker → samples dropped in this episode
        self._drop_logged: dict[int, float] = {}
        self.samples = {src.profile_type: 0 for src in self.sources}
        self.lost: dict[str, int] = {}
        self.sampling = False  # perf events and tracepoints attached
        self._drain_keys = 0  # keys the last drain took, all families
        self._drain_new_processes = 0  # processes it read from /proc for the first time (for the log)
        self._drain_pids = 0  # pids the host made between the last two drains
        self._drain_stretch_s = 0.0  # seconds between them
        self._pid_max = drains.pid_max()
        self._forks = drains.forks()
        self._last_drain_ns = time.time_ns()  # wall clock: the samples of a drain were taken since then
        self.interval_s = cfg.upload_interval_s  # the window length in force (remote config may change it)
        self.unwind_counters: dict[str, int] = {}
        self._trimmed_at = time.monotonic()
        self.guard = overhead.OverheadGuard(
            run_dir,
            cfg.sample_hz,
            cfg.overhead_budget_pct,
            bpftime.describe_method(),
            lambda: bpftime.read(self.programs.bpf),
        )

    def start(self) -> None:
        """Open the perf events and start sampling: after this the collector opens no perf event again
        (collector/perfevents.py), so a capability it held only to open them may go."""
        self.links.wait_connected(CONNECT_WAIT_MS)
        self.oncpu.attach()
        self.sampling = True  # (bcc attached the off-CPU tracepoints when it loaded them)
        _malloc_trim()  # give back what LLVM left behind after compiling
        _page_out_compiler()

    def pause(self) -> None:
        """Stop sampling: detach the perf events and tracepoints; the programs and maps stay loaded."""
        if not self.sampling:
            return
        for src in self.sources:
            src.detach()
        self.sampling = False

    def resume(self) -> None:
        """Sample again after pause()."""
        if self.sampling:
            return
        for src in self.sources:
            src.attach()
        self.sampling = True

    def new_process_fd(self) -> int | None:
        """A descriptor that is readable when a process the programs had not seen is first counted; None
        without ring buffers (bpf/common.h: new processes then wait for the regular drains)."""
        self._notified: list[int] = []
        if not self.kernel.has("ringbuf"):
            return None
        self._new_pids = self.programs.bpf["new_pids"]
        self._new_pids.open_ring_buffer(self._on_new_pid)
        return int(self._new_pids.map_fd)

    def _on_new_pid(self, _ctx: object, data: int, size: int) -> None:
        if size >= 4 and len(self._notified) < MAX_NOTIFIED_PER_TAKE:
            self._notified.append(ctypes.cast(data, ctypes.POINTER(ctypes.c_uint32)).contents.value)

    def take_new_processes(self) -> None:
        """Consume the new-process events; their pids wait in self.early (collector/drains.py). The
        process is not read here: its first count is often that of a child forked to exec, whose
        mappings are about to be replaced (an executable's table asked for then was the parent's,
        and its answer made /proc/PID/map_files unreadable for the new image)."""
        if self.kernel.has("ringbuf"):
            self.programs.bpf.ring_buffer_consume()
        pids, self._notified = self._notified, []
        self.early.notified(pids)

    def next_drain_delay(self, now_wall: float, interval_s: int) -> float:
        """Seconds until the next drain: DRAIN_INTERVAL_S while alloc or lock targets are watched (their
        processes are scanned at drains); else up to IDLE_DRAIN_INTERVAL_S, brought closer by the
        last drain's keys and the host's pid churn (collector/drains.py regular_delay), and never
        past BOUNDARY_LAG_S after the next window boundary."""
        if self.watchers:
            return DRAIN_INTERVAL_S
        return drains.regular_delay(
            keys=self._drain_keys,
            pids_made=self._drain_pids,
            stretch_s=self._drain_stretch_s,
            pid_max=self._pid_max,
            until_boundary_s=interval_s - now_wall % interval_s + BOUNDARY_LAG_S,
            shortest_s=DRAIN_INTERVAL_S,
            longest_s=IDLE_DRAIN_INTERVAL_S,
        )

    def drain_once(self) -> None:
        now_ns = time.time_ns()
        stamp_ns = drain_stamp_ns(self._last_drain_ns, now_ns, self.interval_s * 1_000_000_000)
        self._drain_stretch_s = (now_ns - self._last_drain_ns) / 1e9
        self._last_drain_ns = now_ns
        forks = drains.forks()
        self._drain_pids = forks - self._forks if forks is not None and self._forks is not None else 0
        self._forks = forks
        read_before = self.procs.stats["read"]
        self._drain_keys = 0
        live = self.links.live()
        if self.unwind is not None:
            self.unwind.receive()
            self.unwind.sweep()
        if self.sampling:
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
                    self.track_targets(tracer, live)
        for src in self.sources:
            raw = src.drain()
            self._drain_keys += len(raw.samples)
            self.ship(raw, src.profile_type, stamp_ns, live)
        self._drain_new_processes = self.procs.stats["read"] - read_before
        self.procs.forget_exited()
        self.announcer.flush()
        if self.regs is not None:
            self.regs.flush(self.oncpu.period_ns)
        if self.unwind is not None:
            counters = self.unwind.counters()
            if counters.get("tail_call_failed") or counters.get("stack_map_full"):
                log.warning("DWARF unwinder this drain: %s", counters)
            for name, n in counters.items():
                self.unwind_counters[name] = self.unwind_counters.get(name, 0) + n
        self.counters.update(self.checks())
        if time.monotonic() - self._trimmed_at >= MALLOC_TRIM_GAP_S:
            _malloc_trim()  # the drain's buffers, freed, would otherwise stay resident (growth suite)
            self._trimmed_at = time.monotonic()

    def ship(self, raw: RawDrain, profile_type: str, time_ns: int, live: Sequence[int]) -> None:
        """One drain of one family: joined with /proc, batched per worker, sent; its losses counted."""
        from collector.batcher import build_batches

        batches = build_batches(
            raw,
            self.procs,
            self.ksyms.name,
            host=self.host,
            profile_type=profile_type,
            sample_hz=self.oncpu.sample_hz,
            time_ns=time_ns,
            live_workers=live,
        )
        self.samples[profile_type] += sum(s[4] for s in raw.samples)
        for reason, n in raw.lost.items():
            key = f"{profile_type}.{reason}"
            self.lost[key] = self.lost.get(key, 0) + n
        if raw.lost:
            log.warning("%s: lost in kernel this drain: %s (totals %s)", profile_type, raw.lost, self.lost)
        for worker, batch in batches.items():
            if self.unwind is not None:
                batch = self.unwind.annotate(batch)  # noqa: PLW2901
            self.send(worker, batch)
            self.announcer.observe(batch.processes)
            if self.regs is not None:
                self.regs.observe(batch.processes, on_cpu=profile_type == self.oncpu.profile_type)

    def track_targets(self, source: TargetedSource, live: Sequence[int]) -> None:
        """Unwind tables for every module of each target of a DWARF-unwound source (lock waits),
        asked for in a batch of no samples."""
        assert self.unwind is not None
        by_worker: dict[int, tuple[list[Process], list[UnwindRequest]]] = {}
        for pid in sorted(source.target_pids()):
            proc = self.procs.get(pid)
            if proc is None:
                continue
            requests = self.unwind.track(proc)
            covered = self.unwind.covered(proc)
            key = (source.profile_type, pid)
            if len(covered) > self._target_tables.get(key, 0):
                self._target_tables[key] = len(covered)
                log.info(
                    "%s profiling: pid %d unwound with the tables of %s",
                    source.profile_type,
                    pid,
                    ", ".join(os.path.basename(c) for c in covered),
                )
            if requests:
                procs, reqs = by_worker.setdefault(worker_for(proc.service, live), ([], []))
                procs.append(proc)
                reqs.extend(requests)
        for worker, (procs, reqs) in by_worker.items():
            self.send(
                worker,
                StackBatch(
                    host=self.host,
                    profile_type=source.profile_type,
                    sample_hz=self.oncpu.sample_hz,
                    time_ns=time.time_ns(),
                    processes=tuple(procs),
                    user_stacks=(),
                    kernel_stacks=(),
                    samples=(),
                    unwind_requests=tuple(reqs),
                ),
            )

    def snapshots_if_due(self, interval_s: int, final: bool = False) -> None:
        """Once an upload window has ended (or on stop): each source's snapshot (alloc: the live
        allocations), into that window's profile."""
        now = time.time_ns()
        start = now - now % (interval_s * 1_000_000_000)
        if self._snapshot_window is None and not final:
            self._snapshot_window = start
            return
        if start == self._snapshot_window and not final:
            return
        self._snapshot_window = start
        for src in self.sources:
            raw = src.snapshot()
            if raw is not None:
                # Stamped inside the window that ended (a drain runs within a second of its end; the
                # symbolizers close a window WINDOW_GRACE_S after it), or now on stop.
                self.ship(raw, src.profile_type, now if final else start - 1, self.links.live())

    def set_rate(self, sample_hz: int) -> None:
        """Sample at `sample_hz`: detach, drain what was taken at the old period, attach at the new one."""
        from collector.oncpu import NSEC_PER_SEC

        attached = self.sampling  # the on-CPU perf events are attached exactly while sampling
        if attached:
            self.oncpu.detach()
            self.drain_once()
        # OnCpuSampler reads both at its next attach() and drain()
        self.oncpu.sample_hz = sample_hz
        self.oncpu.period_ns = NSEC_PER_SEC // sample_hz
        if attached:
            self.oncpu.attach()

    def end_window_if_due(self, interval_s: int) -> None:
        """At the end of an upload window: its overhead figures logged and in the status file, the rate decided."""
        if not self.guard.window_due(interval_s, slack_s=DRAIN_INTERVAL_S / 2):
            return
        w = self.guard.end_window(self.samples, self.lost, self.procs.stats["read"])
        budget_ms = w.budget_pct / 100 * w.window_s * 1e3
        if w.decision == "halve":
            log.warning(
                "overhead over budget: %.1f ms used > %.1f ms allowed (%g%% of one CPU); halving "
                "sample_hz %d -> %d Hz. Window: %s",
                w.used_pct / 100 * w.window_s * 1e3,
                budget_ms,
                w.budget_pct,
                w.rate_hz,
                w.next_rate_hz,
                overhead.describe(w),
            )
        elif w.decision == "over at floor":
            log.warning(
                "overhead over budget at %d Hz already: %.1f ms used > %.1f ms allowed; the rest is not the "
                "sampling rate's (stage CPU, off-CPU tracepoints): raise overhead_budget_pct, or turn off "
                "what costs. Window: %s",
                w.rate_hz,
                w.used_pct / 100 * w.window_s * 1e3,
                budget_ms,
                overhead.describe(w),
            )
        elif w.decision == overhead.START_UP:
            log.info(
                "overhead of the start-up window (one-off costs: compiling BPF, building unwind tables; "
                "reported, not judged against the budget): %s",
                overhead.describe(w),
            )
        elif w.decision == "double":
            log.info(
                "overhead under half the budget for %d windows: doubling sample_hz %d -> %d Hz. Window: %s",
                overhead.RECOVER_AFTER_WINDOWS,
                w.rate_hz,
                w.next_rate_hz,
                overhead.describe(w),
            )
        else:
            log.info("overhead: %s", overhead.describe(w))
        if w.next_rate_hz != self.oncpu.sample_hz:
            self.set_rate(w.next_rate_hz)
        try:
            overhead.write_status(self.run_dir, w)
        except OSError as e:
            log.warning("cannot write %s: %s", overhead.status_path(self.run_dir), e.strerror)

    def checks(self) -> dict[str, int]:
        """The checks on hostile input that fired since start, by reason (RUN_DIR/collector.counters.json)."""
        a = self.announcer.stats
        return {
            "mappings_cut": self.procs.stats["mappings_cut"],
            "mapping_tables_cut": self.procs.stats["tables_cut"],
            "batches_split": self.totals["batches_split"],
            "batch_parts_unsendable": self.totals["parts_unsendable"],
            "announcements_split": a["split"],
            "announcement_parts_unsendable": a["unsendable"],
            **(self.regs.checks() if self.regs is not None else {}),
        }

    def send(self, worker: int, batch: StackBatch) -> None:
        """`batch` to `worker`: in parts of at most MAX_BATCH_BYTES when it is larger, never dropped whole."""
        parts, unfit = encode_within(batch)
        if len(parts) + len(unfit) > 1:
            self.totals["batches_split"] += 1
            big = max(batch.processes, key=lambda p: len(p.mappings), default=None)
            if big is not None:
                self._log_once(
                    ("batch_split", big.pid, big.start_ticks),
                    logging.WARNING,
                    "a %s batch for symbolizer worker %d was over %d bytes: sent in %d parts (its "
                    "largest mapping table: pid %d (%s), %d mappings); counted as batches_split in "
                    "status; logged once for that process",
                    batch.profile_type,
                    worker,
                    MAX_BATCH_BYTES,
                    len(parts),
                    big.pid,
                    big.comm,
                    len(big.mappings),
                )
        for part in unfit:
            self.totals["parts_unsendable"] += 1
            key = f"{batch.profile_type}.oversize"
            self.lost[key] = self.lost.get(key, 0) + sum(s.count for s in part.samples)
            for p in part.processes:
                self._log_once(
                    ("batch_part_unsendable", p.pid, p.start_ticks),
                    logging.WARNING,
                    "pid %d (%s): a sample of it with its process does not fit %d bytes; its samples "
                    "in that part are lost (counted as %s); logged once for this process",
                    p.pid,
                    p.comm,
                    MAX_BATCH_BYTES,
                    key,
                )
        for part, frames in parts:
            self._send_frames(worker, part, frames)

    def _send_frames(self, worker: int, batch: StackBatch, frames: list[bytes]) -> None:
        dropped = self._dropped_since_ok
        if not self.links.send(worker, frames):
            self.totals["batches_dropped"] += 1
            n = sum(s.count for s in batch.samples)
            dropped[worker] = dropped.get(worker, 0) + n
            now = time.monotonic()
            if now - self._drop_logged.get(worker, -DROP_LOG_EVERY_S) >= DROP_LOG_EVERY_S:
                self._drop_logged[worker] = now
                log.warning(
                    "symbolizer worker %d is not taking batches (down, or its queue of %d "
                    "is full): dropped %d samples so far in this episode; next report in %d s",
                    worker,
                    BATCH_QUEUE_PER_WORKER,
                    dropped[worker],
                    DROP_LOG_EVERY_S,
                )
            return
        self.totals["batches"] += 1
        if dropped.get(worker):
            log.warning(
                "symbolizer worker %d takes batches again; %d samples were dropped meanwhile",
                worker,
                dropped.pop(worker),
            )
            self._drop_logged.pop(worker, None)

    def close(self) -> None:
        for src in self.sources:
            try:
                src.detach()
            except Exception as e:  # what the kernel already dropped cannot be detached
                log.warning("detaching %s: %s", src.profile_type, e)
        if self.unwind is not None:
            self.unwind.close()
            log.info("DWARF unwinding: %s; in kernel: %s", self.unwind.stats, self.unwind_counters)
        for src in self.sources:
            src.close()
            counts = src.counts()
            if counts:
                log.info("%s profiling: %s", src.profile_type, counts)
        if self.regs is not None:
            self.regs.close()
        self.programs.close()
        overhead.remove_status(self.run_dir)
        self.links.close()
        self.broker.close()
        self.announcer.close()
        self.counters.update(self.checks(), force=True)
        log.info(
            "collector stopped: samples %s, lost %s, %s, files %s",
            self.samples,
            self.lost or "none",
            {**self.totals, "early_drains_not_made": self.early.gone},
            self.broker.stats,
        )


def follow_remote_config(collector: Collector, cfg: config_mod.ProfilerConfig, watcher: remote_config.Watcher) -> None:
    """Pause or resume sampling when the overrides file changed `enabled`."""
    if not watcher.check():
        return
    enabled = remote_config.effective(cfg, watcher.overrides).enabled
    if enabled and not collector.sampling:
        collector.resume()
        log.info(
            "remote config: profiling enabled again: on-CPU%s sampling attached", " and off-CPU" if cfg.offcpu else ""
        )
    elif not enabled and collector.sampling:
        collector.pause()
        log.info(
            "remote config: profiling disabled (enabled: false): sampling detached, BPF programs stay "
            "loaded; nothing is sampled until remote config enables it again"
        )


def reload_budget(collector: Collector, cfg: config_mod.ProfilerConfig, path: str) -> config_mod.ProfilerConfig:
    """SIGHUP: take overhead_budget_pct from the config file again; other keys need a restart."""
    try:
        new = config_mod.load(path)
    except config_mod.ConfigError as e:
        log.error("SIGHUP: config not reloaded, the old one stays: %s", e)
        return cfg
    others = sorted(
        k for k, v in dataclasses.asdict(new).items() if k != "overhead_budget_pct" and getattr(cfg, k) != v
    )
    if others:
        log.warning("SIGHUP: only overhead_budget_pct is reloaded; restart the collector for %s", ", ".join(others))
    if new.overhead_budget_pct != cfg.overhead_budget_pct:
        log.info(
            "SIGHUP: overhead_budget_pct %g -> %g (the window in progress is judged by it)",
            cfg.overhead_budget_pct,
            new.overhead_budget_pct,
        )
        collector.guard.set_budget(new.overhead_budget_pct)
    else:
        log.info("SIGHUP: overhead_budget_pct stays %g", cfg.overhead_budget_pct)
    return cfg.replace(overhead_budget_pct=new.overhead_budget_pct)


# Between the collector's heap trims after drains: early drains for new processes may come every
# second, and a trim costs 0.6-0.8 ms; regular drains (12-60 s apart) each get one.
MALLOC_TRIM_GAP_S = 10.0

# The compiler's libraries, mapped by bcc and not run again once the programs are loaded: their clean
# file pages (~80 MB of RSS) are dropped (MADV_DONTNEED) and fault back in from the file if ever needed.
# Only mappings with no page of their own (smaps Anonymous 0: not written, not RELRO) are dropped:
# a written private page dropped would come back as the file's bytes.
COMPILER_LIBRARIES = ("libLLVM", "libclang", "libbcc")
MADV_DONTNEED = 4


def _page_out_compiler() -> None:
    libc = _libc()
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return
    current: tuple[int, int] | None = None
    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
            lib = len(head) == 6 and any(name in head[5] for name in COMPILER_LIBRARIES)
            lo, hi = head[0].split("-")
            current = (int(lo, 16), int(hi, 16)) if lib and "w" not in head[1] else None
        elif current is not None and line.startswith("Anonymous:"):
            if int(line.split()[1]) == 0:
                libc.madvise(current[0], current[1] - current[0], MADV_DONTNEED)
            current = None


def _malloc_trim() -> None:
    """Give the free pages of glibc's heaps back to the kernel (malloc_trim(0)).

    After compiling, and after drains (at most one a MALLOC_TRIM_GAP_S): a drain's batch buffers and
    /proc reads, freed, leave free chunks whose pages stay resident. Without this, on the growth suite's busy load, glibc's bytes in
    use stayed at ~14 MB (mallinfo2) while the collector's RSS grew from 70 to 75 MB in 10 minutes,
    and one trim then gave back 14 MB. A call costs 0.6-0.8 ms of CPU."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once: the heap trims after drains and the compiler's page-out use it."""
    return ctypes.CDLL("libc.so.6", use_errno=True)


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler-collector") -> int:
    args = parse_args(argv, prog)
    # Before anything else: SIGHUP's default action would end the process.
    hup = threading.Event()
    signal.signal(signal.SIGHUP, lambda _s, _f: hup.set())
    return _main(args, prog, hup)


def start_caps(config_path: str | None, paranoid: int | None) -> tuple[frozenset[int], frozenset[int]]:
    """(capabilities beyond the stage's that it keeps, those it holds only until its perf events are open).

    CAP_SYS_ADMIN: kept for allocation profiling (creating a uprobe takes it since Linux 6.16), only when
    the config asks for it (a config that cannot be read is reported later, as the stage); else held
    through start-up only when kernel.perf_event_paranoid is above 2 (Debian's default 3), under which
    perf_event_open(2) takes it (collector/perfevents.py)."""
    sys_admin = privileges.OPTIONAL_CAPS["collector"]
    if config_path:
        try:
            if config_mod.load(config_path).alloc_targets:
                return sys_admin, frozenset()
        except config_mod.ConfigError:
            pass
    if paranoid is not None and paranoid > preflight.PARANOID_MAX_WITHOUT_SYS_ADMIN:
        return frozenset(), sys_admin
    return frozenset(), frozenset()


def raise_memlock(kernel: features.KernelFeatures) -> str:
    """On a kernel that charges BPF maps to RLIMIT_MEMLOCK (before 5.11), raise it to unlimited while the
    process may (before the privilege drop); what was done, for the log ("": nothing to do)."""
    if kernel.has("memcg_accounting"):
        return ""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return ""
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        return f"RLIMIT_MEMLOCK raised from {soft} bytes to unlimited: this kernel charges BPF maps to it"
    except (ValueError, OSError):
        return f"RLIMIT_MEMLOCK is {soft} bytes and cannot be raised (hard limit {hard})"


def _main(args: argparse.Namespace, prog: str, hup: threading.Event) -> int:  # noqa: PLR0912
    # The kernel's features, probed before the privilege drop (each probe loads a tiny program).
    try:
        kernel = features.probe()
    except ValueError as e:  # EBPFPROFILER_DISABLE_FEATURES names a feature that does not exist
        lifecycle.refuse(prog, str(e), lifecycle.EXIT_BAD_CONFIG)
    memlock = raise_memlock(kernel)
    keep, for_start = start_caps(args.config if not args.preflight else None, preflight.Host().paranoid())
    # First: every check and every step below runs as the stage.
    lifecycle.become(prog, "collector", "the collector's", keep | for_start)
    checks = preflight.run_checks(kernel=kernel)
    if args.preflight:
        if args.record:
            preflight.record(args.record, kernel)
        print(preflight.report(checks))
        return 0 if preflight.passed(checks) else 1
    log_mod.setup("collector")
    cfg = lifecycle.load_config(prog, args.config)
    if not preflight.passed(checks):
        print(f"{prog}: this host cannot run the collector:\n{preflight.report(checks)}", file=sys.stderr)
        return 1
    log.info("kernel %s: %s", kernel.release, "; ".join(f.describe() for f in kernel.features.values()))
    if memlock:
        log.info("%s", memlock)

    lifecycle.hold_run_dir(prog, args.run_dir, "collector")
    stop = stop_on_signals(log, "stopping")

    watcher = remote_config.Watcher.for_config(args.run_dir, cfg, log)
    watcher.check()
    if not remote_config.effective(cfg, watcher.overrides).enabled:
        # Nothing is loaded until profiling is enabled: remote config can do that
        # unless the local config turned it off (shared/remote_config.effective).
        if cfg.enabled:
            log.info(
                "profiling is disabled by remote config (enabled: false); idle until remote config "
                "enables it, or until stopped"
            )
        else:
            log.info("profiling is disabled by config (enabled: false); idle until stopped")
        ready.announce(args.run_dir, "collector", f"disabled by {'remote ' if cfg.enabled else ''}config")
        while not stop.wait(DRAIN_INTERVAL_S if watcher.follows else stopping.QUIET_WAKE_S):
            if watcher.check() and remote_config.effective(cfg, watcher.overrides).enabled:
                break
        else:
            ready.withdraw(args.run_dir, "collector")
            return 0
        log.info("remote config: profiling enabled: loading the BPF programs")

    try:
        with (
            ready.progress(args.run_dir, "collector", "compiling and loading BPF programs"),  # heartbeat
            capture_stderr() as said,
        ):  # the compiler's and the verifier's words, quoted if refused
            collector = Collector(cfg, args.bpf_dir, args.run_dir, kernel)
    except Exception as e:  # bcc raises bare Exception for compile and load failures
        log.error("cannot load the BPF programs from %s: %s", args.bpf_dir, explain(e, said))
        return 1
    try:
        collector.start()
        if for_start:
            privileges.keep_only(privileges.STAGES["collector"].caps | keep)
            log.info(
                "kernel.perf_event_paranoid > %d: CAP_SYS_ADMIN was held to open the perf events at "
                "start, and is dropped now",
                preflight.PARANOID_MAX_WITHOUT_SYS_ADMIN,
            )
        features.write_status(
            args.run_dir,
            kernel,
            collector.refused,
            {
                "cap_sys_admin": (
                    "kept (alloc_targets)"
                    if keep
                    else "held at start only, to open perf events (kernel.perf_event_paranoid > 2)"
                    if for_start
                    else "not held"
                ),
                "perf_event_cpus": collector.oncpu.events.cpus if collector.oncpu.events else [],
                "cpus_not_sampled": collector.oncpu.events.uncovered if collector.oncpu.events else [],
            },
        )
        ready.announce(args.run_dir, "collector")
        offcpu = (
            "off"
            if not cfg.offcpu
            else f"from {cfg.offcpu_min_ms} ms"
            + (f", sampled below {cfg.offcpu_sample_ms} ms" if cfg.offcpu_sample_ms > cfg.offcpu_min_ms else "")
        )
        log.info(
            "collector ready: %d Hz on-CPU sampling, off-CPU %s, %d symbolizer worker(s), drains %.0f to %.0f s apart",
            cfg.sample_hz,
            offcpu,
            cfg.symbolizer_workers,
            DRAIN_INTERVAL_S,
            IDLE_DRAIN_INTERVAL_S,
        )
        log.info(
            "overhead budget %g%% of one CPU per upload window; BPF run time %s (the kernel's "
            "statistics are left as they are)",
            cfg.overhead_budget_pct,
            bpftime.describe_method(),
        )
        poller = zmq.Poller()
        wakeup = stopping.wakeup_fd()
        poller.register(wakeup, zmq.POLLIN)
        if collector.unwind is not None:  # tables are loaded as they arrive, not at the next drain
            poller.register(collector.unwind.sock, zmq.POLLIN)
        regs_fd = collector.regs.fd() if collector.regs is not None else None
        if regs_fd is not None:  # woken every ONCPU_REGS_WAKE_EVERY-th record, not at each
            poller.register(regs_fd, zmq.POLLIN)
        new_processes = collector.new_process_fd()
        # The new-process events wake the loop only while no process waits for its early-drain look
        # (collector/drains.py): the look takes the events that came meanwhile. A host starting
        # processes all the time then wakes the collector once per look, not once per event and look
        # (each wake-up costs it ~0.2 ms: the poll, the ring buffer, the checks).
        listening = False

        def listen(on: bool) -> None:
            nonlocal listening
            if new_processes is None:  # no ring buffers: new processes wait for the regular drains
                return
            if on and not listening:
                poller.register(new_processes, zmq.POLLIN)
            elif listening and not on:
                poller.unregister(new_processes)
            listening = on

        listen(True)
        last_drain = time.monotonic()
        regular_drain = last_drain + DRAIN_INTERVAL_S

        def next_drain() -> float:
            early = collector.early.due_at(last_drain)
            return regular_drain if early is None else min(regular_drain, early)

        while not stop.is_set():
            # with remote config on, at least every IDLE_WAKE_S for the overrides file (drains may
            # be a window apart); without it, only for its own deadlines
            events = dict(poller.poll(stopping.poll_timeout_ms(next_drain(), time.monotonic(), watcher.wake_s)))
            if wakeup in events:
                stopping.drain_wakeups()
            if stop.is_set():
                break
            if new_processes is not None and new_processes in events:
                collector.take_new_processes()
            if collector.unwind is not None and collector.unwind.sock in events:
                collector.unwind.receive()
            if regs_fd is not None and regs_fd in events and collector.regs is not None:
                collector.regs.flush(collector.oncpu.period_ns)
            if hup.is_set():
                hup.clear()
                cfg = reload_budget(collector, cfg, args.config)
            follow_remote_config(collector, cfg, watcher)
            due = next_drain()
            if time.monotonic() < due:
                listen(due >= regular_drain)
                continue
            if due < regular_drain:
                collector.take_new_processes()  # the events that came while it was not listening
                if not collector.early.drain_now():
                    listen(collector.early.due_at(last_drain) is None)
                    continue  # the processes it was for are gone: the regular drain stands
            collector.drain_once()
            collector.early.drained()
            listen(True)
            last_drain = time.monotonic()
            log.debug(
                "drained (%s): %d keys, %d new processes, %d pids made in %.1f s",
                "early" if due < regular_drain else "regular",
                collector._drain_keys,
                collector._drain_new_processes,
                collector._drain_pids,
                collector._drain_stretch_s,
            )
            interval_s = collector.interval_s = remote_config.effective(cfg, watcher.overrides).upload_interval_s
            collector.snapshots_if_due(interval_s)
            collector.end_window_if_due(interval_s)
            regular_drain = last_drain + collector.next_drain_delay(time.time(), interval_s)
        collector.drain_once()  # what was sampled since the last drain
        collector.snapshots_if_due(remote_config.effective(cfg, watcher.overrides).upload_interval_s, final=True)
    finally:
        lifecycle.shut_down(args.run_dir, "collector", collector.close, lambda: features.remove_status(args.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
