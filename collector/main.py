"""The collector stage: the one privileged stage. Loads BPF, drains it, ships stack batches.

Owns: the stage's command line and its start-up, in order: the kernel's features probed and
RLIMIT_MEMLOCK raised while the process may, the privilege drop to the stage's capabilities (and
CAP_SYS_ADMIN kept for alloc_targets, or held until the perf events are open), the preflight
checks, the config, idling while profiling is disabled (remote config may enable it), loading the
BPF programs (collector/stage.py's Collector), starting sampling and dropping what was held for it,
the status and ready files; then the main loop (collector/loop.py: drain every source — on-CPU,
off-CPU unless offcpu: false, lock waits and allocations of the configured targets — 1 to 60 s
apart (collector/drains.py), join with /proc, route to workers, send; follow the targets as they
come and go; once per upload window the live allocations, into that window's alloc profiles;
remote config's `enabled`: `enabled: false` detaches the perf events and tracepoints and keeps the
BPF programs loaded, `enabled: true` attaches them again; the overhead guard's rate,
collector/overhead.py; SIGHUP reads overhead_budget_pct from the config file again), and a clean
stop: on SIGTERM or SIGINT it drains once more, sends, and detaches every program and perf event.

Must not: parse ELF files or process memory, or talk to the network.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import resource
import signal
import sys
import threading
from collections.abc import Sequence

from collector import bpftime, features, plan, preflight
from collector.btfprog import BtfProgramError
from collector.drains import DRAIN_INTERVAL_S, IDLE_DRAIN_INTERVAL_S
from collector.loop import MainLoop
from collector.programs import capture_stderr, explain, is_refusal
from collector.stage import Collector
from shared import config as config_mod
from shared import lifecycle, privileges, ready, remote_config, stopping
from shared import log as log_mod
from shared.safestr import cut
from shared.stage_code import default_bpf_dir
from shared.stopping import stop_on_signals

__all__ = ["DRAIN_INTERVAL_S", "main", "parse_args", "raise_memlock", "start_caps"]

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
    lifecycle.add_stage_arguments(p, config_required=False)
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
    args = p.parse_args(argv)
    if not args.preflight and not args.config:
        p.error("--config is required")
    return args


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


def _main(args: argparse.Namespace, prog: str, hup: threading.Event) -> int:
    """The stage's life: start-up in order (the privilege drop first of all the checks and steps),
    the main loop (collector/loop.py), and on every way out of it the clean stop."""
    kernel = _probe_kernel(prog)
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
    if not _wait_until_enabled(args.run_dir, cfg, watcher, stop):
        return 0
    collector = _load(cfg, args.bpf_dir, args.run_dir, kernel)
    if collector is None:
        return 1
    try:
        collector.start()
        _drop_start_caps(keep, for_start)
        _announce_ready(args.run_dir, cfg, kernel, collector, _sys_admin_status(keep, for_start))
        MainLoop(collector, cfg, watcher, stop, hup, args.config).run()
    finally:
        lifecycle.shut_down(args.run_dir, "collector", collector.close, lambda: features.remove_status(args.run_dir))
    return 0


def _probe_kernel(prog: str) -> features.KernelFeatures:
    """The kernel's features, probed before the privilege drop (each probe loads a tiny program)."""
    try:
        return features.probe()
    except ValueError as e:  # EBPFPROFILER_DISABLE_FEATURES names a feature that does not exist
        lifecycle.refuse(prog, str(e), lifecycle.EXIT_BAD_CONFIG)


def _wait_until_enabled(
    run_dir: str, cfg: config_mod.ProfilerConfig, watcher: remote_config.Watcher, stop: threading.Event
) -> bool:
    """Nothing is loaded until profiling is enabled: remote config can do that unless the local
    config turned it off (shared/remote_config.effective). False: stopped while disabled."""
    if remote_config.effective(cfg, watcher.overrides).enabled:
        return True
    if cfg.enabled:
        log.info(
            "profiling is disabled by remote config (enabled: false); idle until remote config "
            "enables it, or until stopped"
        )
    else:
        log.info("profiling is disabled by config (enabled: false); idle until stopped")
    ready.announce(run_dir, "collector", f"disabled by {'remote ' if cfg.enabled else ''}config")
    while not stop.wait(DRAIN_INTERVAL_S if watcher.follows else stopping.QUIET_WAKE_S):
        if watcher.check() and remote_config.effective(cfg, watcher.overrides).enabled:
            log.info("remote config: profiling enabled: loading the BPF programs")
            return True
    ready.withdraw(run_dir, "collector")
    return False


def _load(
    cfg: config_mod.ProfilerConfig, bpf_dir: str, run_dir: str, kernel: features.KernelFeatures
) -> Collector | None:
    """The BPF programs compiled and loaded, with all the collector holds; None (logged) if refused. A
    kernel that refuses them with the Python walker (bpf/python.h) gets them without it: that feature is
    refused alone, with the verifier's words, and the rest of the agent runs."""
    refused = plan.WalkRefusals()
    while True:
        try:
            with (
                ready.progress(run_dir, "collector", "compiling and loading BPF programs"),  # heartbeat
                capture_stderr() as said,
            ):  # the compiler's and the verifier's words, quoted if refused
                return Collector(cfg, bpf_dir, run_dir, kernel, refused)
        except Exception as e:  # bcc raises bare Exception for compile and load failures
            if not is_refusal(e):  # not the compiler's nor the kernel's word: where it came from, for a report
                log.warning("loading the BPF programs raised %s", type(e).__name__, exc_info=True)
            why = explain(e, said)
            if refused.all or not plan.wants_python_walk(cfg):
                log.error("cannot load the BPF programs from %s: %s", bpf_dir, why)
                return None
            said_why = f"the kernel refused the programs with the walker: {cut(why.splitlines()[0])}"
            if isinstance(e, BtfProgramError) and cfg.offcpu and not refused.offcpu:  # the off-CPU programs'
                log.warning(
                    "the off-CPU programs with the Python walker were refused: %s; loading them without it", why
                )
                refused = dataclasses.replace(refused, offcpu=said_why)
            else:
                log.warning("the BPF programs with the Python walker were refused: %s; loading them without it", why)
                refused = dataclasses.replace(refused, all=said_why)


def _drop_start_caps(keep: frozenset[int], for_start: frozenset[int]) -> None:
    """The perf events are open: what was held only to open them goes (start_caps)."""
    if not for_start:
        return
    privileges.keep_only(privileges.STAGES["collector"].caps | keep)
    log.info(
        "kernel.perf_event_paranoid > %d: CAP_SYS_ADMIN was held to open the perf events at start, and is dropped now",
        preflight.PARANOID_MAX_WITHOUT_SYS_ADMIN,
    )


def _sys_admin_status(keep: frozenset[int], for_start: frozenset[int]) -> str:
    """CAP_SYS_ADMIN as status (kernel.json) shows it."""
    if keep:
        return "kept (alloc_targets)"
    if for_start:
        return "held at start only, to open perf events (kernel.perf_event_paranoid > 2)"
    return "not held"


def _announce_ready(
    run_dir: str, cfg: config_mod.ProfilerConfig, kernel: features.KernelFeatures, collector: Collector, sys_admin: str
) -> None:
    """The status file (kernel.json), the ready file, and the log lines that say what runs."""
    events = collector.oncpu.events
    features.write_status(
        run_dir,
        kernel,
        collector.refused,
        {
            "cap_sys_admin": sys_admin,
            "perf_event_cpus": events.cpus if events else [],
            "cpus_not_sampled": events.uncovered if events else [],
        },
    )
    ready.announce(run_dir, "collector")
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


if __name__ == "__main__":
    sys.exit(main())
