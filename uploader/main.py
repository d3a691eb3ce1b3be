"""The uploader stage: take profiles from symbolizer workers, keep them safe, deliver them.

Owns: the uploader's command line, its ZeroMQ ROUTER socket
(shared.endpoints.uploader) and the receive loop: decode each hand-off
(shared.handoff), store the profile durably, and only then acknowledge it to
its worker. With an endpoint, "durably" means the disk spool (spool.py) and a
sender thread (sender.py) posts from it; with endpoint "" it means the file
under local_dir. Also an orderly stop: on SIGTERM/SIGINT it stops taking new
profiles, stores and acknowledges what is already queued, makes a bounded
final delivery attempt, removes its ready file and exits 0. With an endpoint it
also fetches the backend's agent config (remote.py) and writes the overrides
file the other stages follow; with endpoint "" there is no backend and so no
remote config: a stale overrides file is removed. At exit the totals of its
exit line go to RUN_DIR/uploader.counters.json (shared/counters.py) as well.

The upload format (formats.py, chosen by upload_format) decides what each post
looks like; the spool, retries, TLS and token are the same for all. Remote
config comes from shared.config's agent_config_url: our backend's
{endpoint}/v1/agent-config with upload_format pprof, remote_config_url when it
is set, and otherwise (an OpenTelemetry Collector or Pyroscope) none.

Must not: read /proc of other processes, parse pprof contents other than to
convert them for the upload format (within shared.pprof's caps), log the
bearer token, or need any privilege.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Protocol

import zmq

from shared import counters, endpoints, lifecycle, ready, remote_config, stopping
from shared import log as shared_log
from shared.config import ProfilerConfig
from shared.handoff import MAX_ENVELOPE_BYTES, REFUSED, HandoffError, decode_profile, encode_ack
from shared.wire import MAX_PROFILE_BYTES, ProfileUpload
from uploader import formats
from uploader.local import LocalWriter
from uploader.spool import Spool

if TYPE_CHECKING:
    # Imported in main() only with an endpoint: requests and what it pulls in are ~13 MB of RSS
    # that the default, local_dir, never uses.
    from uploader.http import HttpClient
    from uploader.remote import RemoteConfigFetcher
    from uploader.sender import Sender

STAGE = "uploader"

# A ZeroMQ frame larger than a profile at its cap plus its small JSON header is
# refused by the socket itself (the sending peer is disconnected).
MAX_FRAME_BYTES = MAX_PROFILE_BYTES + (64 << 10) + MAX_ENVELOPE_BYTES
# Profiles queued in the socket per worker; the workers' own unacked caps
# (shared.handoff) bound it long before this.
RECEIVE_HWM = 256
# On stop, keep taking profiles until the socket has been empty this long, so
# profiles already in flight from a worker are still stored and acknowledged.
DRAIN_IDLE_MS = 100
# On stop, the sender's final attempt at delivering what is spooled lasts at
# most this long; the spool keeps the rest for the next start. With
# JOIN_SLACK_S it stays under `ebpfprofiler run`'s 20 s stop timeout.
FINAL_ATTEMPT_S = 5.0
# Extra time for a post in flight when the final attempt ends (connect timeout).
JOIN_SLACK_S = 5.0
# On stop, a remote config fetch in flight is not waited for longer than this.
REMOTE_CONFIG_JOIN_S = 1.0
SPOOL_DIR = "spool"
DEAD_LETTER_DIR = "dead-letter"


class Store(Protocol):
    """Where an accepted profile is made durable: LocalWriter (local_dir) or Spool."""

    def accept(self, upload: ProfileUpload) -> tuple[str, str]: ...


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Receive gzip pprof profiles from the symbolizer workers over ZeroMQ "
            "(ipc://RUN_DIR/uploader.sock) and deliver each one: POST it to "
            "ENDPOINT/v1/profiles when the config sets modules.ebpf_profiler.endpoint, "
            "else write it under local_dir. With an endpoint every profile is first "
            "written to the spool (STATE_DIR/spool, fsync'd) and acknowledged to its "
            "worker, and leaves the spool only after a 2xx; refused ones (a 4xx other "
            "than 408/429) go to STATE_DIR/dead-letter with the reason. upload_format otlp "
            "posts OTLP/HTTP profiles to ENDPOINT/v1development/profiles (an OpenTelemetry "
            "Collector), pyroscope posts to ENDPOINT/ingest (Pyroscope). Needs no "
            "privileges. On SIGTERM or SIGINT it stores what is queued, makes a short "
            "final delivery attempt and exits 0. It also fetches remote config (with upload_format "
            "pprof GET ENDPOINT/v1/agent-config, else only from remote_config_url; every "
            "remote_config_interval_s), keeps only enabled and upload_interval_s, and writes them "
            "to RUN_DIR/remote-config.json for the other stages."
        ),
    )
    lifecycle.add_stage_arguments(p, state_dir_holds="the spool and dead-letter directories")
    return p.parse_args(argv)


class Uploader:
    """The receive loop around one ROUTER socket and one Store."""

    def __init__(
        self, sock: zmq.Socket, store: Store, log: logging.Logger, totals: Callable[[Counter[str]], None]
    ) -> None:
        self.sock = sock
        self.store = store
        self.log = log
        self.totals = totals  # given the receive counts, writes the running totals for status
        self.log_once = shared_log.LogOnce(log)
        self.stopping = False
        self.counts: Counter[str] = Counter()

    def request_stop(self, signum: int, _frame: FrameType | None = None) -> None:
        if not self.stopping:
            self.log.info("%s: storing what is queued, then exiting", signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        # A stop request is a signal: it ends the poll through the wake-up descriptor, so the loop
        # sleeps until a profile or a signal arrives instead of waking on a timer.
        poller.register(stopping.wakeup_fd(), zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(int(stopping.QUIET_WAKE_S * 1000)))
            stopping.drain_wakeups()
            if self.sock in events:
                self._handle(self.sock.recv_multipart())
                self.totals(self.counts)
        # Stop: no new waiting, but everything already queued is stored and acknowledged.
        poller.unregister(stopping.wakeup_fd())
        while poller.poll(DRAIN_IDLE_MS):
            self._handle(self.sock.recv_multipart())

    def _handle(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        try:
            upload = decode_profile(rest)
        except HandoffError as e:
            self.counts["refused"] += 1
            reason = str(e)
            self.log_once(
                ("refused", reason),
                logging.WARNING,
                "refused a message: %s (%d refused so far; this reason is logged once)",
                reason,
                self.counts["refused"],
            )
            if e.profile_id is not None:
                self._reply(identity, e.profile_id, REFUSED, reason)
            return
        status, reason = self.store.accept(upload)
        self.counts[status] += 1
        self._reply(identity, upload.profile_id, status, reason)

    def _reply(self, identity: bytes, profile_id: str, status: str, reason: str) -> None:
        # zmq.Again: that worker is gone or not reading; it offers the profile again and we ack it then
        with contextlib.suppress(zmq.Again):
            self.sock.send_multipart([identity, encode_ack(profile_id, status, reason)], zmq.NOBLOCK)


@dataclass
class Delivery:
    """Where accepted profiles go: the file under local_dir, or the spool and the sender posting from it."""

    store: Store
    where: str  # for the start line
    checks: counters.CounterFile  # RUN_DIR/uploader.counters.json: failed attempts by cause, and the totals
    client: HttpClient | None = None
    spool: Spool | None = None
    sender: Sender | None = None

    def totals(self, received: Counter[str], force: bool = False) -> None:
        """The exit line's totals so far, into the counters file: as they change while the stage runs
        (written at most every counters.WRITE_GAP_S, so `status` shows them), and at exit (`force`)."""
        if self.sender is None or self.spool is None:
            self.checks.update(exit_totals(received), force=force)
        else:
            self.checks.update(exit_totals(received, self.spool.counts, self.sender.counts["rejected"]), force=force)


def main(argv: list[str] | None = None, prog: str = "ebpfprofiler-uploader") -> int:
    args = parse_args(argv, prog)
    lifecycle.become(prog, STAGE, "the uploader's")  # first: nothing below runs with privileges
    cfg = lifecycle.load_config(prog, args.config)
    token = ""
    if not cfg.uploads_locally:
        credentials = read_credentials(prog, cfg)
        if credentials is None:
            return 2
        token = credentials
    lifecycle.hold_run_dir(prog, args.run_dir, STAGE)
    log = shared_log.setup(STAGE)
    delivery = open_delivery(cfg, args.state_dir, args.run_dir, token, log)
    if delivery is None:
        return 1

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    uploader = Uploader(sock, delivery.store, log, delivery.totals)
    if delivery.sender is not None:  # each post changes the spool's totals
        delivery.sender.after_attempt = lambda: delivery.totals(uploader.counts)
    # From here a stop request is remembered; the loop then drains and exits.
    signal.signal(signal.SIGTERM, uploader.request_stop)
    signal.signal(signal.SIGINT, uploader.request_stop)
    address = endpoints.uploader(args.run_dir)
    try:
        os.makedirs(args.run_dir, exist_ok=True)
        sock.bind(address)
    except (OSError, zmq.ZMQError) as e:
        log.error("cannot listen on %s: %s", address, e)
        sock.close()
        ctx.term()
        if delivery.client is not None:
            delivery.client.close()
        return 1
    fetcher = remote_config_fetcher(cfg, args.run_dir, token, log)
    if delivery.sender is not None:
        delivery.sender.start()
    if fetcher is not None:
        fetcher.start()
    try:
        # Logged before the ready file: whoever waits for it can read where profiles go.
        log.info("listening on %s; profiles go to %s", address, delivery.where)
        ready.announce(args.run_dir, STAGE)
        uploader.run()
    finally:
        lifecycle.shut_down(args.run_dir, STAGE, sock.close, ctx.term)
        if fetcher is not None:
            fetcher.stop(REMOTE_CONFIG_JOIN_S)
            fetcher.client.close()
        finish_delivery(delivery, uploader.counts, log)
    return 0


def read_credentials(prog: str, cfg: ProfilerConfig) -> str | None:
    """The bearer token ("" without token_file) for posting to the endpoint; None, said on stderr, when
    token_file or ca_file cannot be used."""
    from uploader.http import TokenError, read_token

    try:
        token = read_token(cfg.token_file) if cfg.token_file else ""
    except TokenError as e:
        print(f"{prog}: modules.ebpf_profiler.token_file: {e}", file=sys.stderr)
        return None
    if cfg.ca_file and not os.access(cfg.ca_file, os.R_OK):
        print(f"{prog}: modules.ebpf_profiler.ca_file: cannot read {cfg.ca_file}", file=sys.stderr)
        return None
    return token


def open_delivery(
    cfg: ProfilerConfig, state_dir: str, run_dir: str, token: str, log: logging.Logger
) -> Delivery | None:
    """The local writer, or the HTTP client with the spool opened and its sender (not started yet);
    None, logged, when the spool cannot be used."""
    checks = counters.CounterFile(run_dir, STAGE)
    if cfg.uploads_locally:
        writer = LocalWriter(cfg.local_dir)
        return Delivery(writer, f"the {writer.describe()}", checks)
    from uploader.http import HttpClient, backoff_base_s
    from uploader.sender import Sender

    client = HttpClient(
        cfg.endpoint,
        read_timeout_s=cfg.upload_timeout_s,
        ca_file=cfg.ca_file,
        token=token,
        upload_format=formats.for_config(cfg),
    )
    spool = Spool(
        os.path.join(state_dir, SPOOL_DIR),
        os.path.join(state_dir, DEAD_LETTER_DIR),
        cfg.spool_max_mb << 20,
        log,
    )
    try:
        spool.open()
    except OSError as e:
        log.error("cannot use the spool in %s: %s", spool.directory, e)
        return None
    sender = Sender(spool, client, log, backoff_base_s(), checks)
    where = (
        f"the {client.describe()} (TLS: {client.tls_note}; {client.auth_note}; read timeout "
        f"{cfg.upload_timeout_s} s, {client.deadline_s:g} s a request) through the spool {spool.directory} (cap {cfg.spool_max_mb} MB)"
    )
    if token and cfg.endpoint.startswith("http://"):
        log.warning("the bearer token is sent over plain http:// to %s; use https://", cfg.endpoint)
    return Delivery(spool, where, checks, client, spool, sender)


def remote_config_fetcher(
    cfg: ProfilerConfig, run_dir: str, token: str, log: logging.Logger
) -> RemoteConfigFetcher | None:
    """The fetcher of the backend's agent config (not started yet), or None when there is none to fetch;
    then an overrides file of an earlier run is removed."""
    if cfg.uploads_locally:
        if os.path.lexists(remote_config.path(run_dir)):
            log.info("no endpoint, so no remote config: removing the overrides file of an earlier run")
            _remove_overrides(run_dir, log)
        return None
    if cfg.agent_config_url:
        from uploader.http import HttpClient
        from uploader.remote import RemoteConfigFetcher

        return RemoteConfigFetcher(
            HttpClient(
                cfg.endpoint,
                read_timeout_s=cfg.upload_timeout_s,
                ca_file=cfg.ca_file,
                token=token,
                agent_config_url=cfg.agent_config_url,
            ),
            cfg,
            run_dir,
            socket.gethostname(),
            log,
        )
    if os.path.lexists(remote_config.path(run_dir)):
        _remove_overrides(run_dir, log)
    log.info(
        "remote config: off (upload_format %s sends to a backend that serves no agent config of ours; "
        "set remote_config_url to fetch one); no overrides file",
        cfg.upload_format,
    )
    return None


def _remove_overrides(run_dir: str, log: logging.Logger) -> None:
    try:
        remote_config.write_overrides(run_dir, {})
    except OSError as e:
        log.warning("cannot remove %s: %s", remote_config.path(run_dir), e)


def finish_delivery(delivery: Delivery, c: Counter[str], log: logging.Logger) -> None:
    """The sender's bounded final attempt (with an endpoint), then the exit line with what was done; its
    totals also go to the counters file (exit_totals), where they outlast the stage's log."""
    sender, client, spool = delivery.sender, delivery.client, delivery.spool
    if sender is None or client is None or spool is None:
        delivery.totals(c, force=True)
        log.info("exiting: %d written, %d refused, %d not written for now", c["stored"], c["refused"], c["retry"])
        return
    if not sender.stop(FINAL_ATTEMPT_S, JOIN_SLACK_S):
        log.warning("a post was still in flight at exit; its profile stays in the spool for the next start")
    client.close()
    s = spool.counts
    delivery.totals(c, force=True)
    log.info(
        "exiting: %d spooled, %d refused, %d not taken for now; %d delivered, %d dead-lettered, "
        "%d dropped; %d profile(s) (%.1f MB) left in the spool for the next start; %d rejected by "
        "the backend in a 2xx reply (partial success)",
        c["stored"],
        c["refused"],
        c["retry"],
        s["delivered"],
        s["dead_lettered"],
        s["dropped"],
        len(spool),
        spool.bytes / 1e6,
        sender.counts["rejected"],
    )


# What the spool counts (spool.py's Spool.counts), written at exit as spool_<name>: what became of
# the profiles, and why some were refused or dropped (the exit line has only the first).
SPOOL_TOTALS = (
    "spooled",
    "duplicates",
    "delivered",
    "dead_lettered",
    "dropped",
    "refused_too_large",
    "refused_no_space",
    "no_space_errors",
    "write_errors",
)


def exit_totals(received: Counter[str], spooled: Counter[str] | None = None, rejected: int = 0) -> dict[str, int]:
    """The exit line's counts as counters: the messages the receive loop answered stored, refused or
    retry (`messages_*`), and with an endpoint what the spool counted (`spool_*`, SPOOL_TOTALS) and the
    profiles a 2xx reply rejected (what is left in the spool is its files)."""
    out = {f"messages_{status}": received[status] for status in ("stored", "refused", "retry")}
    if spooled is not None:
        out |= {f"spool_{what}": spooled[what] for what in SPOOL_TOTALS}
        out["rejected_in_2xx"] = rejected
    return out


if __name__ == "__main__":
    sys.exit(main())
