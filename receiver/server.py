"""A reference backend: the server side of POST /v1/profiles (docs/upload-api.md).

It also takes the other upload formats (docs/backends.md), each in a module of
its own behind receiver/formats.py: OTLP/HTTP profiles (receiver/otlp.py) and
Pyroscope's /ingest (receiver/pyroscope.py), and stores them alike.

Owns: the HTTP handling of the upload API (query parameters, X-Profile-Id,
body cap, pprof validation, status codes and JSON replies), GET /healthz,
GET /v1/agent-config (the agent config document of --agent-config FILE, read
again on every request so a test or demo can change it; 404 without it), and
the `ebpfprofiler receiver` command, and fault injection for tests and demos
(Faults: --fail-ratio, --hang-s, --reject-status), applied after the body is
read and before anything is stored. make_server() is the same server for tests
that want it in a thread.

Must not: be mistaken for a production backend (no auth, no TLS, no quotas),
or store a body that shared.pprof.read() rejects.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, urlsplit

from receiver import formats, otlp, pyroscope, store
from shared import log as shared_log
from shared.pprof import PprofError
from shared.pprof import read as read_pprof
from shared.wire import MAX_PROFILE_BYTES, MAX_STRING

STAGE = "receiver"
UPLOAD_PATH = "/v1/profiles"
HEALTH_PATH = "/healthz"
AGENT_CONFIG_PATH = "/v1/agent-config"
# Each path and the one method it takes.
# The other upload formats, by their POST path.
FORMATS = formats.by_path()
METHODS = {UPLOAD_PATH: "POST", HEALTH_PATH: "GET", AGENT_CONFIG_PATH: "GET", **{p: "POST" for p in FORMATS}}

# The largest body accepted: the same cap the wire puts on a profile.
MAX_BODY_BYTES = MAX_PROFILE_BYTES
# A client silent for this long mid-request is dropped, so shutdown cannot hang on it.
REQUEST_TIMEOUT_S = 30
# A whole request (headers and body) must arrive within this (plus --hang-s): a sender that trickles a
# byte every few seconds cannot hold a thread for ever.
REQUEST_DEADLINE_S = 60
# Requests handled at once (one thread each); more are answered 503 at once.
MAX_CONCURRENT_REQUESTS = 32
# A profile is inflated (as a stream) to at most this, and to at most INFLATE_RATIO times its gzip size
# (agent profiles inflate 3-10x; a gzip bomb 1000x): parsing holds ~40 bytes per inflated byte.
MAX_INFLATED_BYTES = 16 << 20
INFLATE_RATIO = 32
# Digits of a Content-Length: MAX_BODY_BYTES has 8.
MAX_LENGTH_DIGITS = 12
# How often the serving loop checks for shutdown; bounds how long SIGTERM takes.
SHUTDOWN_POLL_S = 0.1
# Query parameter values are bounded like strings on the wire.
MAX_PARAM_CHARS = MAX_STRING

# --hang-s is for outlasting a client's read timeout; an hour is plenty.
MAX_HANG_S = 3600.0
# An agent config document is a few hundred bytes; the agent reads at most 64 KiB of one.
MAX_AGENT_CONFIG_BYTES = 64 << 10

REQUIRED_PARAMS = ("source", "type", "service", "start", "end")
OPTIONAL_PARAMS = ("host",)

log = logging.getLogger("ebpfprofiler.receiver")


class RequestError(Exception):
    """A request answered with `status` and JSON {"error": message}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Faults:
    """Test aids: how the receiver misbehaves on purpose (all off by default)."""

    fail_ratio: float = 0.0  # answer 500 to this share of posts, at random, before storing
    hang_s: float = 0.0  # wait this long before handling each post
    reject_status: int = 0  # answer this status to every post (0: off)
    reject_reason: str = "rejected by --reject-status"
    partial_reject: str = ""  # OTLP: answer 200 with partial_success rejecting every profile, storing nothing

    def describe(self) -> str:
        parts = []
        if self.fail_ratio:
            parts.append(f"500 to {self.fail_ratio:.0%} of posts")
        if self.hang_s:
            parts.append(f"a {self.hang_s:g} s hang before each answer")
        if self.reject_status:
            parts.append(f"{self.reject_status} to every post")
        if self.partial_reject:
            parts.append("OTLP partial success rejecting every profile")
        return ", ".join(parts)


class ReceiverServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that stores into `directory`; in-flight requests finish on close."""

    daemon_threads = False
    block_on_close = True

    def __init__(
        self, address: tuple[str, int], directory: str, faults: Faults = Faults(), agent_config: str | None = None
    ) -> None:
        self.directory = directory
        self.faults = faults
        self.agent_config = agent_config  # file served at GET /v1/agent-config; None: 404
        self.stopping = threading.Event()  # set before shutdown(): cuts a --hang-s wait short
        self._random = random.Random()
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT_REQUESTS)
        self.parsing = threading.Lock()  # one profile parsed at a time: bounds the memory parsing takes
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per request, at most MAX_CONCURRENT_REQUESTS of them; past that, 503 at once."""
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                    b"Retry-After: 1\r\nConnection: close\r\n\r\n"
                )
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        assert isinstance(host, str)  # an AF_INET/AF_INET6 server's address: (host, port, ...)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def shutdown(self) -> None:
        self.stopping.set()
        super().shutdown()

    def roll(self) -> float:
        return self._random.random()


class Handler(BaseHTTPRequestHandler):
    server: ReceiverServer
    timeout = REQUEST_TIMEOUT_S
    server_version = "ebpfprofiler-receiver"

    def handle_one_request(self) -> None:
        # The whole request within its deadline: past it the socket is shut down, which ends any read.
        timer = threading.Timer(REQUEST_DEADLINE_S + self.server.faults.hang_s, self._cut)
        timer.daemon = True
        timer.start()
        try:
            super().handle_one_request()
        finally:
            timer.cancel()

    def _cut(self) -> None:
        log.info(
            "client %s: request not done within %g s; connection closed",
            self.address_string(),
            REQUEST_DEADLINE_S + self.server.faults.hang_s,
        )
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == HEALTH_PATH:
            self._send(200, b"ok", "text/plain; charset=utf-8")
        elif url.path == AGENT_CONFIG_PATH:
            try:
                status, body = self._agent_config(url.query)
            except RequestError as e:
                self._error(e.status, str(e))
            else:
                self._send(status, body, "application/json")
        else:
            self._method_not_allowed()

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        if url.path in FORMATS:
            self._upload_format(FORMATS[url.path], url.query)
            return
        if url.path != UPLOAD_PATH:
            self._method_not_allowed()
            return
        try:
            status, reply = self._upload(url.query)
        except RequestError as e:
            self._error(e.status, str(e))
        except Exception:
            log.exception("error handling %s %s", self.command, url.path)
            self._error(500, "internal error")
        else:
            self._send(status, json.dumps(reply).encode(), "application/json")

    def __getattr__(self, name: str) -> Callable[[], None]:
        # Every other method (PUT, DELETE, HEAD, …) is refused with 405, not http.server's 501.
        if name.startswith("do_"):
            return self._method_not_allowed
        raise AttributeError(name)

    def _method_not_allowed(self) -> None:
        path = urlsplit(self.path).path
        allow = METHODS.get(path)
        if allow:
            self._error(405, f"{self.command} is not allowed on {path}; use {allow}", allow=allow)
        else:
            self._error(404, f"no such path: {path}")

    # ------------------------------------------------------------ agent config

    def _agent_config(self, query: str) -> tuple[int, bytes]:
        """The --agent-config file's bytes as they are (the agent checks them), or 404 without one."""
        try:
            host = parse_qs(query, max_num_fields=100).get("host", [""])[0][:MAX_PARAM_CHARS]
        except ValueError as e:
            raise RequestError(400, f"bad query string: {e}") from None
        name = self.server.agent_config
        if name is None:
            raise RequestError(404, "no agent config: the receiver runs without --agent-config")
        try:
            with open(name, "rb") as f:
                body = f.read(MAX_AGENT_CONFIG_BYTES + 1)
        except FileNotFoundError:
            log.info("agent config asked for by host=%r: %s does not exist (404)", host, name)
            raise RequestError(404, f"no agent config: {name} does not exist") from None
        except OSError as e:
            log.error("cannot read the agent config %s: %s", name, e)
            raise RequestError(500, f"cannot read the agent config: {e.strerror}") from None
        if len(body) > MAX_AGENT_CONFIG_BYTES:
            raise RequestError(500, f"the agent config {name} is larger than {MAX_AGENT_CONFIG_BYTES} bytes")
        log.info("served the agent config to host=%r (%d bytes)", host, len(body))
        return 200, body

    # ------------------------------------------------------------ upload

    def _upload(self, query: str) -> tuple[int, dict[str, Any]]:
        body = self._read_body()
        self._inject_faults()
        params = query_params(query)
        profile_id = self.headers.get("X-Profile-Id")
        if profile_id is None:
            profile_id = uuid.uuid4().hex
        elif not store.is_valid_id(profile_id):
            raise RequestError(400, f"X-Profile-Id {profile_id[:200]!r} is not 1 to 128 characters of [A-Za-z0-9._-]")
        try:
            with self.server.parsing:
                profile = read_pprof(body, min(MAX_INFLATED_BYTES, max(1 << 20, INFLATE_RATIO * len(body))))
        except PprofError as e:
            raise RequestError(400, str(e)) from None
        meta = {
            "id": profile_id,
            "format": "pprof",
            **params,
            "received_at": time.time_ns(),
            "bytes": len(body),
            "samples": len(profile.samples),
        }
        if not store.save(self.server.directory, profile_id, body, meta):
            log.info(
                "duplicate profile %s (service=%r type=%s): already stored",
                profile_id,
                params["service"],
                params["type"],
            )
            return 200, {"id": profile_id, "stored": False, "duplicate": True}
        log.info(
            "stored profile %s service=%r type=%s host=%r samples=%d bytes=%d",
            profile_id,
            params["service"],
            params["type"],
            params["host"],
            meta["samples"],
            meta["bytes"],
        )
        return 200, {"id": profile_id, "stored": True}

    def _upload_format(self, fmt: formats.IngestFormat, query: str) -> None:
        """POST of another upload format: read, inject faults, validate, store once by the format's key, reply."""
        try:
            body = self._read_body()
            self._inject_faults()
            try:
                parsed = fmt.parse(query, self.headers, body)
            except formats.BadRequest as e:
                raise RequestError(e.status, str(e)) from None
            rejected = self.server.faults.partial_reject if fmt.name == "otlp" else ""
            stored = False
            if rejected:
                log.info(
                    "rejected the %d profile(s) of %s upload %s as a partial success (--partial-reject)",
                    parsed.profiles,
                    fmt.name,
                    parsed.profile_id,
                )
            else:
                meta = {"id": parsed.profile_id, **parsed.meta, "received_at": time.time_ns(), "bytes": len(body)}
                stored = store.save(self.server.directory, parsed.profile_id, parsed.body, meta, parsed.suffix)
                if stored:
                    log.info(
                        "stored %s profile %s service=%r type=%s host=%r samples=%d bytes=%d",
                        fmt.name,
                        parsed.profile_id,
                        meta["service"],
                        meta["type"],
                        meta["host"],
                        meta["samples"],
                        len(body),
                    )
                else:
                    log.info(
                        "duplicate %s profile %s (service=%r type=%s): already stored",
                        fmt.name,
                        parsed.profile_id,
                        meta["service"],
                        meta["type"],
                    )
            reply, content_type = fmt.reply(parsed, stored, rejected)
        except RequestError as e:
            self._error(e.status, str(e))
        except Exception:
            log.exception("error handling %s %s", self.command, fmt.path)
            self._error(500, "internal error")
        else:
            self._send(200, reply, content_type)

    def _inject_faults(self) -> None:
        """Hang, reject or fail this post as the Faults ask; the body was read, nothing is stored yet."""
        faults, profile_id = self.server.faults, self.headers.get("X-Profile-Id", "")[:128]
        if faults.hang_s:
            log.info("hanging %g s before answering profile %s (--hang-s)", faults.hang_s, profile_id)
            if self.server.stopping.wait(faults.hang_s):
                raise RequestError(503, "receiver is shutting down")
        if faults.reject_status:
            log.info("rejected profile %s with %d (--reject-status)", profile_id, faults.reject_status)
            raise RequestError(faults.reject_status, faults.reject_reason)
        if faults.fail_ratio and self.server.roll() < faults.fail_ratio:
            log.info("injected 500 for profile %s (--fail-ratio %g)", profile_id, faults.fail_ratio)
            raise RequestError(500, f"injected failure (--fail-ratio {faults.fail_ratio:g})")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(411, "a Content-Length is required (chunked bodies are not accepted)")
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise RequestError(411, "a Content-Length is required")
        length = content_length(raw)
        if length > MAX_BODY_BYTES:
            raise RequestError(413, f"body of {length} bytes is over the cap of {MAX_BODY_BYTES} bytes")
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(408, f"body not received within {REQUEST_TIMEOUT_S}s") from None
        if len(body) != length:
            raise RequestError(400, f"body ended after {len(body)} of {length} bytes")
        return body

    # ------------------------------------------------------------ replies

    def _error(self, status: int, message: str, allow: str | None = None) -> None:
        # A refused request's unread body would make the reply a connection reset; don't reuse it.
        self.close_connection = True
        headers = {"Allow": allow} if allow else {}
        self._send(status, json.dumps({"error": message}).encode(), "application/json", headers)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            # The client gave up (its read timeout) before the answer; it will retry with the same id.
            self.close_connection = True
            log.info("client %s went away before the %d answer", self.address_string(), status)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def content_length(raw: str) -> int:
    """The value of a Content-Length header; RequestError (400) unless it is ASCII digits only."""
    digits = raw.strip()
    # isdigit() alone takes "²" and other Unicode digits, which int() then refuses.
    if not (digits.isascii() and digits.isdigit() and len(digits) <= MAX_LENGTH_DIGITS):
        raise RequestError(400, f"Content-Length {raw[:40]!r} is not a non-negative integer")
    return int(digits)


def query_params(query: str) -> dict[str, Any]:
    """The validated query parameters: strings, except start and end (unix ns ints)."""
    try:
        parsed = parse_qs(query, keep_blank_values=True, strict_parsing=False, max_num_fields=100, errors="strict")
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"bad query string: {e}") from None
    out: dict[str, Any] = {}
    for name in REQUIRED_PARAMS + OPTIONAL_PARAMS:
        values = parsed.get(name)
        if values is None:
            if name in REQUIRED_PARAMS:
                raise RequestError(400, f"missing query parameter {name!r}")
            out[name] = ""
            continue
        if len(values) != 1:
            raise RequestError(400, f"query parameter {name!r} is given {len(values)} times")
        value = values[0]
        if len(value) > MAX_PARAM_CHARS:
            raise RequestError(400, f"query parameter {name!r} is longer than {MAX_PARAM_CHARS} characters")
        if name in REQUIRED_PARAMS and not value:
            raise RequestError(400, f"query parameter {name!r} is empty")
        out[name] = value
    for name in ("start", "end"):
        if not (out[name].isascii() and out[name].isdigit()):
            raise RequestError(400, f"query parameter {name!r} = {out[name][:40]!r} is not unix nanoseconds")
        out[name] = int(out[name])
    if out["end"] < out["start"]:
        raise RequestError(400, f"end {out['end']} is before start {out['start']}")
    return out


def parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) → (host, port); port 0 picks a free port."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8080; port 0 picks one)")
    return host.strip("[]"), int(port)


def make_server(
    listen: str, directory: str, faults: Faults = Faults(), agent_config: str | None = None
) -> ReceiverServer:
    """A bound (not yet serving) receiver; call serve_forever(), then shutdown() and server_close()."""
    os.makedirs(directory, exist_ok=True)
    return ReceiverServer(parse_listen(listen), directory, faults, agent_config)


def _ratio(value: str) -> float:
    try:
        r = float(value)
    except ValueError:
        r = -1.0
    if not 0.0 <= r <= 1.0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a ratio from 0 to 1")
    return r


def _hang(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = -1.0
    if not 0.0 <= s <= MAX_HANG_S:
        raise argparse.ArgumentTypeError(f"{value!r} is not seconds from 0 to {MAX_HANG_S:g}")
    return s


def _status(value: str) -> int:
    if not (value.isdigit() and 400 <= int(value) <= 599):
        raise argparse.ArgumentTypeError(f"{value!r} is not an HTTP error status from 400 to 599")
    return int(value)


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "A reference profile backend for tests and local demos: accepts "
            "POST /v1/profiles (see docs/upload-api.md), OTLP/HTTP profiles at POST "
            f"{otlp.PATH} and Pyroscope pushes at POST {pyroscope.PATH} (docs/backends.md), checks "
            "each body (a valid gzip pprof; OTLP: an ExportProfilesServiceRequest that "
            "opentelemetry-proto decodes) and stores it as DIR/<id>.pb.gz (OTLP: DIR/<id>.otlp.pb) "
            "with DIR/<id>.json metadata. "
            "GET /healthz answers ok. GET /v1/agent-config serves --agent-config FILE. "
            "No auth, no TLS."
        ),
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        type=str,
        help="address to listen on; port 0 picks a free one (default: %(default)s)",
    )
    p.add_argument("--dir", required=True, metavar="DIR", help="directory where profiles are stored")
    p.add_argument(
        "--agent-config",
        metavar="FILE",
        help="JSON agent config document served at GET /v1/agent-config, e.g. "
        '{"modules": {"ebpf_profiler": {"enabled": false}}}; read again on every request '
        "(so it can be changed while the receiver runs) and served as it is; a missing "
        "file, or no --agent-config, answers 404 (no remote settings)",
    )
    add_fault_options(p)
    args = p.parse_args(argv)
    try:
        parse_listen(args.listen)
    except argparse.ArgumentTypeError as e:
        p.error(f"--listen: {e}")
    return args


def add_fault_options(p: argparse.ArgumentParser) -> None:
    """The fault injection options (test aids)."""
    faults = p.add_argument_group(
        "fault injection (test aids: make the receiver misbehave on purpose; applied after the body is "
        "read and before anything is stored)"
    )
    faults.add_argument(
        "--fail-ratio",
        type=_ratio,
        default=0.0,
        metavar="R",
        help="answer 500 to this share of posts (0 to 1), chosen at random (default: 0)",
    )
    faults.add_argument(
        "--hang-s",
        type=_hang,
        default=0.0,
        metavar="S",
        help="wait S seconds before handling each post, e.g. longer than the client's read "
        "timeout; the post is then handled normally (default: 0)",
    )
    faults.add_argument(
        "--reject-status",
        type=_status,
        default=0,
        metavar="N",
        help="answer every post with HTTP status N (400 to 599) and a JSON reason, storing nothing",
    )
    faults.add_argument(
        "--reject-reason",
        default="rejected by --reject-status",
        metavar="TEXT",
        help="the reason sent with --reject-status (default: %(default)r)",
    )
    faults.add_argument(
        "--partial-reject",
        default="",
        metavar="TEXT",
        help="OTLP posts: answer 200 with partial_success rejecting every profile of the "
        "request, with TEXT as error_message, storing nothing",
    )


def main(argv: list[str] | None = None, prog: str = "ebpfprofiler receiver") -> int:
    args = parse_args(argv, prog)
    shared_log.setup(STAGE)
    try:
        server = make_server(
            args.listen,
            args.dir,
            Faults(
                args.fail_ratio,
                args.hang_s,
                args.reject_status,
                args.reject_reason[:MAX_PARAM_CHARS],
                args.partial_reject[:MAX_PARAM_CHARS],
            ),
            os.path.abspath(args.agent_config) if args.agent_config else None,
        )
    except OSError as e:
        log.error("cannot listen on %s or use %s: %s", args.listen, args.dir, e)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    line = f"receiver listening on {server.url}"
    print(line, flush=True)
    log.info("%s; storing profiles in %s", line, args.dir)
    if server.agent_config:
        log.info("serving the agent config in %s at %s", server.agent_config, AGENT_CONFIG_PATH)
    if server.faults.describe():
        log.warning("fault injection on: %s", server.faults.describe())
    thread = threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), name="receiver", daemon=True)
    thread.start()
    stop.wait()
    log.info("stopping")
    server.shutdown()
    server.server_close()
    thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
