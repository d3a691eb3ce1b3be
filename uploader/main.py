"""The uploader stage: receive profiles from symbolizer workers and deliver them.

Owns: the uploader's command line, its ZeroMQ PULL socket
(shared.endpoints.uploader), the receive loop that decodes and checks every
message, the choice between local delivery (config endpoint "") and HTTP
delivery, and an orderly stop: on SIGTERM/SIGINT it delivers what is already
queued, removes its ready file and exits 0.

Must not: read /proc of other processes, parse pprof contents, or need any
privilege.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections import Counter
from types import FrameType
from typing import Protocol

import zmq

from ebpfprofiler.shared import config as config_mod
from ebpfprofiler.shared import endpoints
from ebpfprofiler.shared import log as shared_log
from ebpfprofiler.shared.wire import MAX_PROFILE_BYTES, ProfileUpload, WireError, decode
from ebpfprofiler.uploader.http import HttpClient
from ebpfprofiler.uploader.local import LocalWriter

STAGE = "uploader"

# A ZeroMQ frame larger than a profile at its cap plus its small JSON header is
# refused by the socket itself (the sending peer is disconnected).
MAX_FRAME_BYTES = MAX_PROFILE_BYTES + (64 << 10)
# Profiles held in the socket's queue; beyond it symbolizers' sends wait
# (back-pressure) instead of the uploader's memory growing.
RECEIVE_HWM = 256
# How often the receive loop wakes to notice a stop request.
POLL_MS = 200
# On stop, keep draining until the socket has been empty this long, so profiles
# already in flight from a worker's socket are still delivered.
DRAIN_IDLE_MS = 100


class Delivery(Protocol):
    """Where profiles go: LocalWriter or HttpClient (a spool can wrap either)."""

    def describe(self) -> str: ...
    def deliver(self, upload: ProfileUpload) -> bool: ...
    def close(self) -> None: ...


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Receive gzip pprof profiles from the symbolizer workers over ZeroMQ "
            "(ipc://RUN_DIR/uploader.sock) and deliver each one: POST it to "
            "ENDPOINT/v1/profiles when the config sets modules.ebpf_profiler.endpoint, "
            "else write it under local_dir. Needs no privileges. On SIGTERM or SIGINT "
            "it delivers what is already queued and exits 0."),
    )
    p.add_argument("--config", required=True, metavar="FILE",
                   help="agent YAML config file (the modules.ebpf_profiler block is used)")
    p.add_argument("--run-dir", default=endpoints.DEFAULT_RUN_DIR, metavar="DIR",
                   help="runtime directory holding the stage sockets and ready files (default: %(default)s)")
    return p.parse_args(argv)


def make_delivery(cfg: config_mod.ProfilerConfig) -> Delivery:
    return LocalWriter(cfg.local_dir) if cfg.uploads_locally else HttpClient(cfg.endpoint)


class Uploader:
    """The receive loop around one socket and one Delivery."""

    def __init__(self, sock: zmq.Socket, delivery: Delivery, log: logging.Logger) -> None:
        self.sock = sock
        self.delivery = delivery
        self.log = log
        self.log_once = shared_log.LogOnce(log)
        self.stopping = False
        self.counts: Counter[str] = Counter()

    def request_stop(self, signum: int, _frame: FrameType | None = None) -> None:
        if not self.stopping:
            self.log.info("%s: delivering what is queued, then exiting", signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stopping:
            if poller.poll(POLL_MS):
                self._handle(self.sock.recv_multipart())
        # Stop: no new waiting, but everything already queued is delivered.
        while poller.poll(DRAIN_IDLE_MS):
            self._handle(self.sock.recv_multipart())

    def _handle(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
            if not isinstance(msg, ProfileUpload):
                raise WireError(f"a {type(msg).__name__} message was sent to the uploader")
        except WireError as e:
            self.counts["dropped"] += 1
            reason = str(e)
            self.log_once(("drop", reason), logging.WARNING,
                          "dropped a message: %s (%d dropped so far; this reason is logged once)",
                          reason, self.counts["dropped"])
            return
        self.counts["delivered" if self.delivery.deliver(msg) else "failed"] += 1


def main(argv: list[str] | None = None, prog: str = "ebpfprofiler-uploader") -> int:
    args = parse_args(argv, prog)
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    log = shared_log.setup(STAGE)
    delivery = make_delivery(cfg)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    uploader = Uploader(sock, delivery, log)
    # From here a stop request is remembered; the loop then drains and exits.
    signal.signal(signal.SIGTERM, uploader.request_stop)
    signal.signal(signal.SIGINT, uploader.request_stop)
    address = endpoints.uploader(args.run_dir)
    ready = endpoints.ready_file(args.run_dir, STAGE)
    try:
        os.makedirs(args.run_dir, exist_ok=True)
        sock.bind(address)
    except (OSError, zmq.ZMQError) as e:
        log.error("cannot listen on %s: %s", address, e)
        sock.close()
        ctx.term()
        delivery.close()
        return 1
    try:
        with open(ready, "w") as f:
            f.write(f"{os.getpid()}\n")
        log.info("listening on %s; profiles go to the %s", address, delivery.describe())
        uploader.run()
    finally:
        sock.close()
        ctx.term()
        delivery.close()
        try:
            os.unlink(ready)
        except FileNotFoundError:
            pass
        c = uploader.counts
        log.info("exiting: %d delivered, %d failed, %d dropped", c["delivered"], c["failed"], c["dropped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
