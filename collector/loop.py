"""The collector's main loop: an object whose steps have names.

Owns: waiting for what wakes the collector (a stop, unwind tables arriving, the register records,
new processes: listened to only while no process waits for its early-drain look), taking what
woke it, following SIGHUP (reload_budget) and remote config's `enabled` (follow_remote_config)
each wake-up, deciding whether a drain is due (regular, or early for a new process that still
lives), the drain step (drain, snapshots and the window's end, the next regular drain), and on stop
the last drain and snapshots.

Must not: load, attach or detach anything itself (collector/stage.py's Collector does), or decide
how far apart regular drains are (collector/drains.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import zmq

from collector.drains import DRAIN_INTERVAL_S
from collector.stage import Collector
from shared import config as config_mod
from shared import remote_config, stopping

log = logging.getLogger("ebpfprofiler.collector")


class MainLoop:
    """Runs `collector` until `stop` is set: wait, take what came, follow config, drain when due."""

    def __init__(
        self,
        collector: Collector,
        cfg: config_mod.ProfilerConfig,
        watcher: remote_config.Watcher,
        stop: threading.Event,
        hup: threading.Event,
        config_path: str,
    ) -> None:
        self.collector = collector
        self.cfg = cfg  # the config in force (SIGHUP may change its overhead budget)
        self.watcher = watcher
        self.stop = stop
        self.hup = hup
        self.config_path = config_path
        self.poller = zmq.Poller()
        self.wakeup = stopping.wakeup_fd()
        self.poller.register(self.wakeup, zmq.POLLIN)
        if collector.unwind is not None:  # tables are loaded as they arrive, not at the next drain
            self.poller.register(collector.unwind.sock, zmq.POLLIN)
        self.regs_fd = collector.regs.fd() if collector.regs is not None else None
        if self.regs_fd is not None:  # woken every ONCPU_REGS_WAKE_EVERY-th record, not at each
            self.poller.register(self.regs_fd, zmq.POLLIN)
        self.new_processes = collector.new_processes.fd()
        self.listening = False
        self.listen(True)
        self.last_drain = time.monotonic()
        self.regular_drain = self.last_drain + DRAIN_INTERVAL_S

    def run(self) -> None:
        """Until stopped; then what was sampled since the last drain, and the last snapshots."""
        while not self.stop.is_set():
            events = self.wait()
            if self.stop.is_set():
                break
            self.take(events)
            self.follow_config()
            due = self.next_drain()
            if time.monotonic() < due:
                self.listen(due >= self.regular_drain)
                continue
            early = due < self.regular_drain
            if early and not self.early_drain_stands():
                continue
            self.drain(early)
        self.finish()

    def listen(self, on: bool) -> None:
        """The new-process events wake the loop only while no process waits for its early-drain look
        (collector/drains.py): the look takes the events that came meanwhile. A host starting
        processes all the time then wakes the collector once per look, not once per event and look
        (each wake-up costs it ~0.2 ms: the poll, the ring buffer, the checks)."""
        if self.new_processes is None:  # no ring buffers: new processes wait for the regular drains
            return
        if on and not self.listening:
            self.poller.register(self.new_processes, zmq.POLLIN)
        elif self.listening and not on:
            self.poller.unregister(self.new_processes)
        self.listening = on

    def next_drain(self) -> float:
        """When the next drain is due (monotonic): the regular one, or an early one before it."""
        early = self.collector.early.due_at(self.last_drain)
        return self.regular_drain if early is None else min(self.regular_drain, early)

    def wait(self) -> dict[object, int]:
        """Until something is ready or the next deadline: with remote config on, at least every
        IDLE_WAKE_S for the overrides file (drains may be a window apart); without it, only for its
        own deadlines."""
        timeout_ms = stopping.poll_timeout_ms(self.next_drain(), time.monotonic(), self.watcher.wake_s)
        events: dict[object, int] = dict(self.poller.poll(timeout_ms))
        if self.wakeup in events:
            stopping.drain_wakeups()
        return events

    def take(self, events: dict[object, int]) -> None:
        """What woke the loop: new-process events, unwind tables, register records."""
        c = self.collector
        if self.new_processes is not None and self.new_processes in events:
            c.new_processes.take()
        if c.unwind is not None and c.unwind.sock in events:
            c.unwind.receive()
        if self.regs_fd is not None and self.regs_fd in events and c.regs is not None:
            c.regs.flush(c.oncpu.period_ns)

    def follow_config(self) -> None:
        """SIGHUP's overhead budget, and remote config's `enabled`."""
        if self.hup.is_set():
            self.hup.clear()
            self.cfg = reload_budget(self.collector, self.cfg, self.config_path)
        follow_remote_config(self.collector, self.cfg, self.watcher)

    def early_drain_stands(self) -> bool:
        """At an early drain's time: the events that came while the loop was not listening taken,
        whether a process it was for still lives (if none does, the regular drain stands)."""
        c = self.collector
        c.new_processes.take()
        if c.early.drain_now():
            return True
        self.listen(c.early.due_at(self.last_drain) is None)
        return False

    def drain(self, early: bool) -> None:
        """One drain; then the window's snapshots and end if due, and the next regular drain's time."""
        c = self.collector
        c.drain_once()
        c.early.drained()
        self.listen(True)
        self.last_drain = time.monotonic()
        log.debug(
            "drained (%s): %d keys, %d new processes, %d pids made in %.1f s",
            "early" if early else "regular",
            c.pace.keys,
            c.pace.new_processes,
            c.pace.pids,
            c.pace.stretch_s,
        )
        interval_s = c.interval_s = self.upload_interval_s()
        c.snapshots_if_due(interval_s)
        c.end_window_if_due(interval_s)
        self.regular_drain = self.last_drain + c.next_drain_delay(time.time(), interval_s)

    def finish(self) -> None:
        """On stop: what was sampled since the last drain, and the last snapshots."""
        self.collector.drain_once()
        self.collector.snapshots_if_due(self.upload_interval_s(), final=True)

    def upload_interval_s(self) -> int:
        """The window length in force (remote config may change it)."""
        return remote_config.effective(self.cfg, self.watcher.overrides).upload_interval_s


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
