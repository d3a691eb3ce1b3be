"""The collector stage: the one root process. Loads BPF, drains it, ships stack batches.

Owns: the stage's command line, its main loop (drain every DRAIN_INTERVAL_S,
join with /proc, route to workers, send), and a clean stop: on SIGTERM or
SIGINT it drains once more, sends, and detaches every program and perf event.

Must not: parse ELF files or process memory, or talk to the network.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Sequence

import zmq

from ebpfprofiler.shared import config as config_mod
from ebpfprofiler.shared import endpoints
from ebpfprofiler.shared import log as log_mod
from ebpfprofiler.shared.wire import encode

# How often BPF maps are drained into batches; the issue fixes it at one second.
DRAIN_INTERVAL_S = 1.0
# Batches queued per worker before new ones are dropped (and counted): a worker
# that is this far behind is down or overloaded, and the collector must not grow.
BATCH_QUEUE_PER_WORKER = 64
# On stop, how long queued batches may take to reach the workers.
STOP_LINGER_MS = 3000

log = logging.getLogger("ebpfprofiler.collector")


def default_bpf_dir() -> str:
    """bpf/ beside the source tree when run from a checkout, else the installed copy."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bpf")
    return os.environ.get("EBPFPROFILER_BPF_DIR") or (
        here if os.path.isfile(os.path.join(here, "oncpu.c")) else "/usr/lib/ebpfprofiler/bpf")


def parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Root stage of ebpfprofiler: samples on-CPU stacks of every process with BPF "
                    "(cpu-clock perf event at sample_hz on every CPU), drains the in-kernel counts "
                    "every second and sends them, with process metadata and mappings, to the "
                    "symbolizer workers over ZeroMQ. Stops cleanly on SIGTERM/SIGINT, detaching "
                    "every BPF program and perf event.")
    p.add_argument("--config", required=True, help="agent YAML file (modules.ebpf_profiler block)")
    p.add_argument("--bpf-dir", default=default_bpf_dir(), help="directory of the BPF C programs "
                   "(default: %(default)s)")
    p.add_argument("--run-dir", default=endpoints.DEFAULT_RUN_DIR,
                   help="runtime directory holding the stages' sockets (default: %(default)s)")
    return p.parse_args(argv)


class Collector:
    def __init__(self, cfg: config_mod.ProfilerConfig, bpf_dir: str, run_dir: str) -> None:
        from ebpfprofiler.collector.oncpu import OnCpuSampler   # imports bcc
        from ebpfprofiler.collector.procfs import ProcessTable

        self.cfg = cfg
        self.run_dir = run_dir
        self.host = socket.gethostname()
        self.procs = ProcessTable(with_cmdline=not cfg.strip_process_args)
        self.sampler = OnCpuSampler(bpf_dir, cfg.sample_hz)
        self.ctx = zmq.Context.instance()
        self.workers = list(range(cfg.symbolizer_workers))
        self.sockets: list[zmq.Socket] = []
        for w in self.workers:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, BATCH_QUEUE_PER_WORKER)
            s.setsockopt(zmq.LINGER, STOP_LINGER_MS)
            s.connect(endpoints.symbolizer(run_dir, w))
            self.sockets.append(s)
        self.totals = {"samples": 0, "batches": 0, "batches_dropped": 0, "lost": 0}

    def start(self) -> None:
        self.sampler.attach()
        _malloc_trim()   # give back what LLVM left behind after compiling

    def drain_once(self) -> None:
        from ebpfprofiler.collector.batcher import build_batches

        raw = self.sampler.drain()
        batches = build_batches(
            raw, self.procs, self.sampler.ksym, host=self.host, profile_type="cpu",
            sample_hz=self.cfg.sample_hz, time_ns=time.time_ns(),
            value_per_count=self.sampler.period_ns, live_workers=self.workers)
        self.totals["samples"] += sum(s[4] for s in raw.samples)
        self.totals["lost"] += sum(raw.lost.values())
        if raw.lost:
            log.warning("lost in kernel this drain: %s", raw.lost)
        for worker, batch in batches.items():
            try:
                self.sockets[worker].send_multipart(encode(batch), flags=zmq.NOBLOCK)
                self.totals["batches"] += 1
            except zmq.Again:
                self.totals["batches_dropped"] += 1
                log.warning("symbolizer worker %d is not keeping up: dropped a batch of %d samples "
                            "(%d dropped so far)", worker, sum(s.count for s in batch.samples),
                            self.totals["batches_dropped"])

    def close(self) -> None:
        self.sampler.close()
        for s in self.sockets:
            s.close()
        log.info("collector stopped: %s", self.totals)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler-collector") -> int:
    args = parse_args(argv, prog)
    log_mod.setup("collector")
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print(f"{prog}: must run as root (it loads BPF programs and opens perf events)", file=sys.stderr)
        return 1

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    os.makedirs(args.run_dir, exist_ok=True)
    ready = endpoints.ready_file(args.run_dir, "collector")

    if not cfg.enabled:
        log.info("profiling is disabled by config (enabled: false); idle until stopped")
        stop.wait()
        return 0

    try:
        collector = Collector(cfg, args.bpf_dir, args.run_dir)
    except Exception as e:  # bcc raises bare Exception for compile and load failures
        log.error("cannot load BPF programs from %s: %s", args.bpf_dir, e)
        return 1
    try:
        collector.start()
        with open(ready, "w") as f:
            f.write(f"{os.getpid()}\n")
        log.info("collector ready: %d Hz on-CPU sampling, %d symbolizer worker(s), drain every %.1f s",
                 cfg.sample_hz, cfg.symbolizer_workers, DRAIN_INTERVAL_S)
        next_drain = time.monotonic() + DRAIN_INTERVAL_S
        while not stop.wait(max(0.0, next_drain - time.monotonic())):
            collector.drain_once()
            next_drain += DRAIN_INTERVAL_S
            if next_drain < time.monotonic():   # fell behind (suspended?): do not burst
                next_drain = time.monotonic() + DRAIN_INTERVAL_S
        collector.drain_once()   # what was sampled since the last drain
    finally:
        collector.close()
        try:
            os.unlink(ready)
        except FileNotFoundError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
