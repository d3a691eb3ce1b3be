"""The collector's loaded state: its BPF programs, event sources and links, and one drain of them.

Owns: making what the plan (collector/plan.py) turns on, in order (the programs, the event sources
and the targets they follow, the unwind tables, the links to the workers, the file broker, the
announcer and the /proc sweep that feeds it, the register forwarder, the Python walks, the overhead guard); starting sampling, pausing and resuming it;
the new-process events; one drain (targets followed, every source drained, joined with /proc and
shipped, what fired counted); once per upload window each source's snapshot and the overhead
guard's verdict and rate; and, on stop, detaching and closing all of it, with the totals logged.

Must not: decide when to drain (collector/loop.py, collector/drains.py), parse ELF files or
process memory, or talk to the network.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

import zmq

from collector import alloc, bpftime, features, heap, overhead, plan, regs, unwind
from collector.announce import Announcer
from collector.bpfmaps import RawDrain
from collector.discovery import ProcessSweep
from collector.drains import DRAIN_INTERVAL_S, DrainPace, EarlyDrains
from collector.filebroker import FileBroker
from collector.following import TargetFollower
from collector.kallsyms import KernelSymbols
from collector.links import WorkerLinks
from collector.lock import LockTracer
from collector.newprocs import NewProcessEvents
from collector.pythonwalks import PythonWalks
from collector.sender import BatchSender
from collector.sources import EventSource, TargetedSource
from collector.targets import TargetWatcher
from shared import config as config_mod
from shared import counters, endpoints, privileges

# At start, how long to wait for the workers' connections before sampling:
# the first batches then go to the right workers, not all to the first one.
CONNECT_WAIT_MS = 2000

log = logging.getLogger("ebpfprofiler.collector")


class Collector:
    """What the collector holds once its programs are loaded, and what it does with it: start, pause and
    resume sampling, drain, close the windows, close."""

    def __init__(
        self,
        cfg: config_mod.ProfilerConfig,
        bpf_dir: str,
        run_dir: str,
        kernel: features.KernelFeatures,
        python_refused: plan.WalkRefusals = plan.NO_REFUSALS,
    ) -> None:
        # bcc is imported here, not at the top: only this stage pays for it.
        from collector.procfs import ProcessTable
        from collector.programs import Programs

        self.cfg = cfg
        self.run_dir = run_dir
        self.kernel = kernel
        self.host = socket.gethostname()
        self.procs = ProcessTable(with_cmdline=not cfg.strip_process_args)
        self.ksyms = KernelSymbols()
        p = self._plan(cfg, kernel, python_refused)
        self.programs = Programs(bpf_dir, p.families, p.defines)
        ctx: zmq.Context = zmq.Context.instance()
        self.python = PythonWalks(self.programs.bpf, run_dir, ctx) if p.python_walk else None
        try:  # a program the kernel refuses leaves nothing loaded (collector/main.py may load again)
            self._make_sources(cfg, p)
        except BaseException:
            if self.python is not None:  # first: its last reading needs the maps the programs hold
                self.python.close()
            self.programs.close()
            raise
        self.unwind = _make_unwind(p, self.programs.bpf, run_dir, ctx)
        self.links = WorkerLinks(ctx, run_dir, cfg.symbolizer_workers)
        self.broker = FileBroker(run_dir, allowed_uids=privileges.uids_with("symbolizer"))
        self.announcer = Announcer(zmq.Context.instance(), run_dir, self.host)  # to runtime readers
        # Processes that never run, found for the runtime readers (none run without a runtime asked for).
        self.sweep = ProcessSweep(with_cmdline=not cfg.strip_process_args) if cfg.runtime_reader_wanted else None
        self.regs = (
            regs.RegsForwarder(self.programs.bpf, p.regs_names, self.announcer.publish, self.host)
            if p.regs_names
            else None
        )
        self.counters = counters.CounterFile(run_dir, "collector")  # the checks that fired, for status
        self.early = EarlyDrains()
        self.new_processes = NewProcessEvents(self.programs.bpf, self.early, kernel.has("ringbuf"), self.procs.known)
        self.samples = {src.profile_type: 0 for src in self.sources}
        self.lost: dict[str, int] = {}
        self.sender = BatchSender(self.links, self.lost)
        self.targets = TargetFollower(self.watchers, self.procs, self.unwind, self.sender, self.host)
        self._snapshot_window: int | None = None
        self.sampling = False  # perf events and tracepoints attached
        self.pace = DrainPace()  # what the last drain took, for the next one's delay
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

    # ------------------------------------------------------------ start-up

    def _plan(
        self, cfg: config_mod.ProfilerConfig, kernel: features.KernelFeatures, python_refused: plan.WalkRefusals
    ) -> plan.ProgramPlan:
        """What to compile for this config on this kernel (collector/plan.py); what the kernel cannot
        give is refused alone: in the log, and in status (kernel.json)."""
        p = plan.plan(cfg, kernel, python_refused)
        self.refused = list(p.refused)
        for what, why in p.refused:
            log.warning("%s refused: %s; the rest of the agent runs", what, why)
        for note in p.notes:
            log.warning("%s", note)
        return p

    def _make_sources(self, cfg: config_mod.ProfilerConfig, p: plan.ProgramPlan) -> None:
        """The event sources (collector/sources.py): every one is attached, drained, paused and
        closed alike; on-CPU is also the one whose rate the overhead guard sets."""
        from collector.offcpu import OffCpuTracer
        from collector.oncpu import OnCpuSampler

        bpf = self.programs.bpf
        walker = self.python.walker if self.python else None
        self.oncpu = OnCpuSampler(bpf, cfg.sample_hz, dwarf=p.dwarf, python=walker)
        self.sources: list[EventSource] = [self.oncpu]
        if p.offcpu:
            off_walker = walker if p.python_walk_offcpu else None
            self.sources.append(OffCpuTracer(bpf, cfg.offcpu_min_ms, dwarf=p.offcpu_dwarf, python=off_walker))
        # Opt-in, per target process: lock waits (futex tracepoints) and allocations (uprobes).
        self.watchers: list[tuple[TargetWatcher, TargetedSource]] = []
        if cfg.lock_targets:
            self.watchers.append((TargetWatcher(cfg.lock_targets), LockTracer(bpf, dwarf=p.lock_dwarf)))
        if p.alloc:
            tracer = alloc.AllocTracer(bpf, cfg.alloc_sample_bytes, cfg.alloc_duty_pct)
            self.watchers.append((TargetWatcher(cfg.alloc_targets), tracer))
        self.sources += [source for _, source in self.watchers]

    def start(self) -> None:
        """Open the perf events and start sampling: after this the collector opens no perf event again
        (collector/perfevents.py), so a capability it held only to open them may go."""
        self.links.wait_connected(CONNECT_WAIT_MS)
        self.oncpu.attach()
        self.sampling = True  # (bcc attached the off-CPU tracepoints when it loaded them)
        heap.malloc_trim()  # give back what LLVM left behind after compiling
        heap.page_out_compiler()

    # ------------------------------------------------------------ sampling on and off

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

    # ------------------------------------------------------------ a drain

    def next_drain_delay(self, now_wall: float, interval_s: int) -> float:
        """Seconds until the next drain: DRAIN_INTERVAL_S while alloc or lock targets are watched (their
        processes are scanned at drains); else as the last drain's keys and the host's pid churn
        allow (collector/drains.py DrainPace)."""
        if self.watchers:
            return DRAIN_INTERVAL_S
        return self.pace.regular_delay(now_wall, interval_s)

    def drain_once(self) -> None:
        """Every source drained, joined with /proc and shipped; the targets followed first."""
        stamp_ns = self.pace.begin(self.interval_s)
        read_before = self.procs.stats["read"]
        live = self.links.live()
        if self.unwind is not None:
            self.unwind.receive()
            self.unwind.sweep()
        self.targets.follow(live, self.sampling, self.oncpu.sample_hz)
        for src in self.sources:
            raw = src.drain()
            self.pace.keys += len(raw.samples)
            self.ship(raw, src.profile_type, stamp_ns, live)
        self.pace.new_processes = self.procs.stats["read"] - read_before
        self._after_drain()

    def _after_drain(self) -> None:
        """What follows a drain: exited processes forgotten, announcements and registers flushed, the
        unwinder's and the checks' counters, the heap trimmed."""
        self.procs.forget_exited()
        if self.sweep is not None and self.sweep.due():
            self.announcer.observe(self.sweep.run(known=self.announcer.knows))
        self.announcer.flush()
        if self.python is not None:
            self.python.after_drain(self.announcer)
        if self.regs is not None:
            self.regs.flush(self.oncpu.period_ns)
        if self.unwind is not None:
            counters = self.unwind.counters()
            if counters.get("tail_call_failed") or counters.get("stack_map_full"):
                log.warning("DWARF unwinder this drain: %s", counters)
            for name, n in counters.items():
                self.unwind_counters[name] = self.unwind_counters.get(name, 0) + n
        self.counters.update(self.checks())
        if time.monotonic() - self._trimmed_at >= heap.MALLOC_TRIM_GAP_S:
            heap.malloc_trim()  # the drain's buffers, freed, would otherwise stay resident (growth suite)
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
        for worker, sent in batches.items():
            batch = sent if self.unwind is None else self.unwind.annotate(sent)
            self.sender.send(worker, batch)
            self.announcer.observe(batch.processes)
            if self.regs is not None:
                self.regs.observe(batch.processes, on_cpu=profile_type == self.oncpu.profile_type)

    # ------------------------------------------------------------ upload windows

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

    def end_window_if_due(self, interval_s: int) -> None:
        """At the end of an upload window: its overhead figures logged and in the status file, the rate decided."""
        if not self.guard.window_due(interval_s, slack_s=DRAIN_INTERVAL_S / 2):
            return
        w = self.guard.end_window(self.samples, self.lost, self.procs.stats["read"])
        overhead.log_window(w, log)
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
            "batches_split": self.sender.totals["batches_split"],
            "batch_parts_unsendable": self.sender.totals["parts_unsendable"],
            "announcements_split": a["split"],
            **({"processes_swept": self.sweep.stats["read"]} if self.sweep is not None else {}),
            "announcement_parts_unsendable": a["unsendable"],
            **(self.regs.checks() if self.regs is not None else {}),
            **(self.python.counters() if self.python is not None else {}),
            **(self.unwind.checks() if self.unwind is not None else {}),
        }

    # ------------------------------------------------------------ stop

    def close(self) -> None:
        """Every source detached, then everything closed; the run's totals logged."""
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
        if self.python is not None:
            self.python.close()
        self.programs.close()
        overhead.remove_status(self.run_dir)
        self.links.close()
        self.broker.close()
        self.announcer.close()
        self.counters.update(self.checks(), force=True)
        _log_stopped(self)


def _log_stopped(c: Collector) -> None:
    """The run's totals, as the collector stops."""
    log.info(
        "collector stopped: samples %s, lost %s, %s, files %s",
        c.samples,
        c.lost or "none",
        {
            **c.sender.totals,
            "early_drains_not_made": c.early.gone,
            "new_process_events_known": c.new_processes.known_dropped,
        },
        c.broker.stats,
    )


def _make_unwind(p: plan.ProgramPlan, bpf: Any, run_dir: str, ctx: zmq.Context[Any]) -> unwind.UnwindTables | None:
    """The unwind tables of DWARF unwinding, or None without it (off-CPU's step program is a
    tp_btf program: OffCpuTracer loads it)."""
    if not p.dwarf:
        return None
    tables = unwind.UnwindTables(bpf, ["oncpu"] + (["lock"] if p.lock_dwarf else []), run_dir, ctx)
    log.info(
        "DWARF unwinding on: on-CPU%s stacks of processes with unwind tables; tables from the symbolizers at %s",
        " and off-CPU" if p.offcpu_dwarf else "",
        endpoints.unwind(run_dir),
    )
    return tables
