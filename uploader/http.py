"""HTTP delivery: one POST of one profile to the backend, and the retry policy.

What is posted (path, query parameters, headers, body) is the upload format's
(formats.py: pprof's `{endpoint}/v1/profiles`, OTLP, Pyroscope); everything
else here is the same for every format. Also the one GET of the agent config
(shared.config's agent_config_url), with the same TLS, token and timeouts.

Owns: the client side of the upload (docs/upload-api.md, docs/backends.md): the
bearer token, TLS verification, connect and read timeouts and the overall
deadline of a request (request_deadline_s: a timer shuts the client's sockets
when it passes, so a backend that trickles its reply, or reads the body a byte
at a time, cannot hold a request open), how an answer is
classified (delivered, with what the format read from a 2xx reply; retry
later; never), and how long to wait before the next attempt (exponential
backoff with jitter, a numeric Retry-After honoured up to a cap). Also reading
the bearer token file.

Must not: log or alter profile bytes (a format may re-encode them, formats.py), log the token, read more than
MAX_RESPONSE_BYTES of a response, or decide what happens to a profile after a
failure (the sender and the spool do).

Environment: EBPFPROFILER_UPLOAD_BACKOFF_S overrides the backoff base
(seconds, default DEFAULT_BACKOFF_BASE_S); tests set it small.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import random
import socket
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import requests
import requests.adapters
import requests.auth
import urllib3
import urllib3.connection

from shared.config import AGENT_CONFIG_PATH
from shared.handoff import cut
from shared.wire import ProfileUpload
from uploader.format_pprof import PprofFormat
from uploader.formats import FormatError, Request, UploadFormat

log = logging.getLogger("ebpfprofiler.uploader.http")

BACKOFF_ENV = "EBPFPROFILER_UPLOAD_BACKOFF_S"

# A backend that cannot accept a TCP connection in this long is down for us.
CONNECT_TIMEOUT_S = 5.0
# A whole request (connect, sending the body, the reply) ends within the connect timeout plus this many
# read timeouts (upload_timeout_s). The read timeout bounds each recv only: a backend that sent a byte a
# second held an upload open forever. An honest backend answers within one read timeout of the body's
# end; the rest is for sending the body (a 32 MiB profile at ~3 Mbit/s at the default 30 s).
DEADLINE_READ_TIMEOUTS = 4
# First wait between attempts; it doubles per attempt (1 s, 2 s, 4 s …) with jitter.
DEFAULT_BACKOFF_BASE_S = 1.0
# No single wait between attempts is longer than this, whatever the backoff says.
MAX_BACKOFF_S = 30.0
# A server's numeric Retry-After is honoured up to this, so it cannot stall the uploader.
MAX_RETRY_AFTER_S = 60.0
# Enough of a response for a JSON {"error": ...} reason; the rest is not read.
MAX_RESPONSE_BYTES = 4096
# Reasons quoted in logs are cut to this many characters.
MAX_REASON_CHARS = 300
# A bearer token (a JWT included) is a few KB; a larger file is not a token file.
MAX_TOKEN_BYTES = 16 << 10
# An agent config document is a few hundred bytes; a larger reply is not one, and is not read.
MAX_AGENT_CONFIG_BYTES = 64 << 10

RETRY_STATUSES = frozenset({408, 429})  # and every 5xx


def request_deadline_s(read_timeout_s: float) -> float:
    """Seconds a whole request may take, for a read timeout of `read_timeout_s`."""
    return CONNECT_TIMEOUT_S + DEADLINE_READ_TIMEOUTS * read_timeout_s


class TokenError(ValueError):
    """A token file that cannot be used; the message names the file, never its content."""


def user_agent() -> str:
    try:
        version = importlib.metadata.version("ebpfprofiler")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"ebpfprofiler/{version}"


def backoff_base_s() -> float:
    """The backoff base: EBPFPROFILER_UPLOAD_BACKOFF_S if set to seconds in [0, MAX_BACKOFF_S], else the default."""
    raw = os.environ.get(BACKOFF_ENV)
    if raw is None:
        return DEFAULT_BACKOFF_BASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_BACKOFF_S:
        log.warning(
            "ignoring %s=%r: expected seconds from 0 to %g; using %g",
            BACKOFF_ENV,
            raw,
            MAX_BACKOFF_S,
            DEFAULT_BACKOFF_BASE_S,
        )
        return DEFAULT_BACKOFF_BASE_S
    return value


def backoff_delay(base_s: float, attempt: int, retry_after_s: float | None = None) -> float:
    """Seconds to wait after failed attempt number `attempt` (1-based).

    A server's Retry-After wins (capped); otherwise base × 2^(attempt−1), capped,
    times a random factor in [0.5, 1] so that many hosts do not retry in step.
    """
    if retry_after_s is not None:
        return min(retry_after_s, MAX_RETRY_AFTER_S)
    step = min(base_s * 2 ** min(attempt - 1, 62), MAX_BACKOFF_S)
    return step * random.uniform(0.5, 1.0)


def read_token(path: str) -> str:
    """The bearer token in `path` (surrounding whitespace stripped); TokenError if unusable."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as e:
        raise TokenError(f"cannot read token file {path}: {e.strerror}") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise TokenError(f"token file {path} is larger than {MAX_TOKEN_BYTES} bytes; not a token file")
    token = raw.strip()
    if not token:
        raise TokenError(f"token file {path} is empty")
    # Only visible ASCII: anything else could split or corrupt the header.
    if not all(0x21 <= b <= 0x7E for b in token):
        raise TokenError(f"token file {path} holds characters other than visible ASCII inside the token")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "token file %s is accessible by group or others (mode %04o): make it the uploader's user's "
            "alone (chown it to that user, chmod 600)",
            path,
            stat.S_IMODE(st.st_mode),
        )
    return token.decode("ascii")


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to."""

    ok: bool  # a 2xx: the backend has it
    retry: bool  # worth another attempt later
    reason: str  # for logs and the dead-letter record
    status: int | None = None  # HTTP status, None when there was no answer
    retry_after_s: float | None = None
    reached: bool = True  # False: no connection (nothing about this profile was learnt)
    rejected: int = 0  # a 2xx whose reply says this many profiles were refused for good (OTLP)
    note: str = ""  # what the 2xx reply said beyond "stored"
    # Why it failed, as a status counter: deadline, connect_timeout, read_timeout, unreachable,
    # http_retry (a 408, 429 or 5xx), refused (another status), unsendable, bad_request.
    cause: str = ""


@dataclass(frozen=True)
class ConfigReply:
    """What one GET of the agent config came to."""

    ok: bool  # an answer to use: 200 with JSON, or 404 (no remote settings)
    doc: object = None  # the parsed JSON of a 200; None for a 404
    reason: str = ""  # why not ok, for logs
    status: int | None = None


class _Bearer(requests.auth.AuthBase):
    """Authorization: Bearer <token>. Given as the request's auth, so no ~/.netrc entry replaces it."""

    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        r.headers["Authorization"] = f"Bearer {self._token}"
        return r

    def __repr__(self) -> str:
        return "_Bearer(<hidden>)"


class _Sockets:
    """The sockets of one client's connections (weakly held), so that a deadline can end a request
    blocked in a send or a recv on one of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: weakref.WeakSet[socket.socket] = weakref.WeakSet()

    def add(self, sock: socket.socket | None) -> None:
        if sock is not None:
            with self._lock:
                self._socks.add(sock)

    def shut(self) -> None:
        """Shut every one down: a blocked send or recv returns at once (the connection is not reused)."""
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            with contextlib.suppress(OSError):  # closed already
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the descriptor's, under TLS too


def _adapter(sockets: _Sockets) -> requests.adapters.HTTPAdapter:
    """requests' adapter, with connections that hand their sockets to `sockets` as they connect."""

    class Http(urllib3.connection.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            sockets.add(self.sock)

    class Https(urllib3.connection.HTTPSConnection):
        def connect(self) -> None:
            super().connect()
            sockets.add(self.sock)

    class HttpPool(urllib3.HTTPConnectionPool):
        ConnectionCls = Http

    class HttpsPool(urllib3.HTTPSConnectionPool):
        ConnectionCls = Https

    class Adapter(requests.adapters.HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = {"http": HttpPool, "https": HttpsPool}

    return Adapter()


class _Deadline:
    """The deadline of one request: when it passes, the client's sockets are shut."""

    def __init__(self, seconds: float, sockets: _Sockets) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.passed = threading.Event()
        self._sockets = sockets
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def _expire(self) -> None:
        self.passed.set()
        self._sockets.shut()

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._timer.cancel()

    def over(self) -> bool:
        return self.passed.is_set() or time.monotonic() >= self.at


class HttpClient:
    """Posts profiles to one backend; one attempt per post() call.

    One requests.Session per client, used from one thread: the sender and the
    remote config fetcher each have a client of their own. Every request ends
    within deadline_s (request_deadline_s of the read timeout unless given)."""

    def __init__(
        self,
        endpoint: str,
        *,
        read_timeout_s: float,
        ca_file: str = "",
        token: str = "",
        upload_format: UploadFormat | None = None,
        agent_config_url: str | None = None,
        deadline_s: float | None = None,
    ) -> None:
        self.format: UploadFormat = upload_format or PprofFormat()
        self.url = endpoint.rstrip("/") + self.format.path
        # None: our backend's document under the endpoint (shared.config.agent_config_url decides for a stage).
        self.agent_config_url = (
            endpoint.rstrip("/") + AGENT_CONFIG_PATH if agent_config_url is None else agent_config_url
        )
        self.read_timeout_s = read_timeout_s
        self.deadline_s = request_deadline_s(read_timeout_s) if deadline_s is None else deadline_s
        self._session = requests.Session()
        self._sockets = _Sockets()
        adapter = _adapter(self._sockets)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._session.headers["User-Agent"] = user_agent()
        # Certificates are always verified; a CA file replaces the system's CAs. It is passed
        # with each request: a session-wide verify loses to REQUESTS_CA_BUNDLE in the environment.
        self._verify: str | bool = ca_file or True
        self._auth = _Bearer(token) if token else None
        self.tls_note = f"CA file {ca_file}" if ca_file else "system CAs"
        self.auth_note = "a bearer token" if token else "no token"

    def describe(self) -> str:
        return f"endpoint {self.url} (upload_format {self.format.name})"

    def close(self) -> None:
        self._session.close()

    def post(self, upload: ProfileUpload) -> Outcome:
        """One attempt at delivering `upload`."""
        try:
            req = self.format.request(upload)
        except FormatError as e:  # the same profile gives the same error on every attempt
            return Outcome(False, False, f"cannot be sent as {self.format.name}: {_cut(str(e))}", cause="unsendable")
        with _Deadline(self.deadline_s, self._sockets) as deadline:
            resp = self._send(req, deadline)
            if isinstance(resp, Outcome):
                return resp
            head = bytearray()
            try:
                # A body read to its end lets the session reuse the connection; a longer one is cut off.
                for chunk in resp.iter_content(chunk_size=1024):
                    head += chunk
                    if len(head) >= MAX_RESPONSE_BYTES or deadline.over():
                        break
            except (requests.RequestException, OSError):
                pass  # a broken reply body does not change its status
            finally:
                resp.close()
            if deadline.over():
                # Whatever the status said: a reply not read whole in time is retried (the backend stores
                # a profile once by its id), and the profile stays spooled meanwhile.
                return self._over(deadline, resp.status_code)
        return self._answered(resp, head)

    def _send(self, req: Request, deadline: _Deadline) -> requests.Response | Outcome:
        """The POST of `req` up to its reply's status and headers, or the Outcome of a post that got none."""
        try:
            return self._session.post(
                self.url,
                params=req.params,
                headers=req.headers,
                data=req.body,
                timeout=(CONNECT_TIMEOUT_S, self.read_timeout_s),
                stream=True,
                allow_redirects=False,
                verify=self._verify,
                auth=self._auth,
            )
        except requests.Timeout as e:
            if deadline.over():
                return self._over(deadline)
            what = "connect" if isinstance(e, requests.ConnectTimeout) else "read"
            limit = CONNECT_TIMEOUT_S if what == "connect" else self.read_timeout_s
            return Outcome(
                False,
                True,
                f"no {what} within {limit:g}s ({type(e).__name__})",
                reached=what == "read",
                cause=f"{what}_timeout",
            )
        except requests.ConnectionError as e:  # refused, reset, DNS, TLS verification
            if deadline.over():
                return self._over(deadline)
            return Outcome(False, True, f"{type(e).__name__}: {_cut(_cause(e))}", reached=False, cause="unreachable")
        except requests.RequestException as e:  # bad header value, bad URL: retrying cannot help
            if deadline.over():
                return self._over(deadline)
            return Outcome(False, False, f"{type(e).__name__}: {_cut(_cause(e))}", cause="bad_request")

    def _answered(self, resp: requests.Response, head: bytearray) -> Outcome:
        """What a reply read in time comes to, by its status (and, for a 2xx, what the format reads in it)."""
        status = resp.status_code
        if 200 <= status < 300:
            accepted = self.format.accepted(bytes(head), resp.headers.get("Content-Type", ""))
            return Outcome(True, False, f"HTTP {status}", status, rejected=accepted.rejected, note=accepted.message)
        reason = f"HTTP {status} {_reason(head, resp.reason)}"
        if 300 <= status < 400:
            reason += f" (redirect to {resp.headers.get('Location', '?')!r}; set endpoint to the final URL)"
        retry = status in RETRY_STATUSES or 500 <= status < 600
        retry_after = _retry_after(resp.headers.get("Retry-After")) if retry else None
        return Outcome(False, retry, reason, status, retry_after, cause="http_retry" if retry else "refused")

    def _over(self, deadline: _Deadline, status: int | None = None) -> Outcome:
        said = f" (it had answered HTTP {status}, then sent its reply too slowly)" if status is not None else ""
        return Outcome(False, True, f"over the request deadline of {deadline.seconds:g}s{said}", cause="deadline")

    def get_agent_config(self, host: str) -> ConfigReply:
        """One GET of {endpoint}/v1/agent-config?host=H: its JSON document, no remote settings (404), or why not."""
        with _Deadline(self.deadline_s, self._sockets) as deadline:
            try:
                resp = self._session.get(
                    self.agent_config_url,
                    params={"host": host},
                    headers={"Accept": "application/json"},
                    timeout=(CONNECT_TIMEOUT_S, self.read_timeout_s),
                    stream=True,
                    allow_redirects=False,
                    verify=self._verify,
                    auth=self._auth,
                )
            except requests.Timeout as e:
                if deadline.over():
                    return ConfigReply(False, reason=self._over(deadline).reason)
                what = "connect" if isinstance(e, requests.ConnectTimeout) else "read"
                limit = CONNECT_TIMEOUT_S if what == "connect" else self.read_timeout_s
                return ConfigReply(False, reason=f"no {what} within {limit:g}s ({type(e).__name__})")
            except requests.RequestException as e:
                if deadline.over():
                    return ConfigReply(False, reason=self._over(deadline).reason)
                return ConfigReply(False, reason=f"{type(e).__name__}: {_cut(_cause(e))}")
            body = bytearray()
            try:
                for chunk in resp.iter_content(chunk_size=4096):
                    body += chunk
                    if len(body) > MAX_AGENT_CONFIG_BYTES or deadline.over():
                        break
            except (requests.RequestException, OSError) as e:
                if not deadline.over():
                    return ConfigReply(False, reason=f"reply broken off: {type(e).__name__}", status=resp.status_code)
            finally:
                resp.close()
            if deadline.over():
                return ConfigReply(False, reason=self._over(deadline, resp.status_code).reason, status=resp.status_code)
        status = resp.status_code
        if status == 404:
            return ConfigReply(True, None, "HTTP 404: no remote settings", status)
        if status != 200:
            reason = f"HTTP {status} {_reason(body, resp.reason)}"
            if 300 <= status < 400:
                reason += f" (redirect to {resp.headers.get('Location', '?')!r}; set endpoint to the final URL)"
            return ConfigReply(False, reason=reason, status=status)
        if len(body) > MAX_AGENT_CONFIG_BYTES:
            return ConfigReply(
                False, reason=f"reply larger than {MAX_AGENT_CONFIG_BYTES} bytes; not an agent config", status=status
            )
        try:
            doc = json.loads(bytes(body))
        except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the interpreter goes
            return ConfigReply(False, reason=f"reply is not JSON: {_cut(str(e))}", status=status)
        return ConfigReply(True, doc, "HTTP 200", status)


def _reason(head: bytes | bytearray, http_reason: str | None) -> str:
    """The backend's {"error": ...} if it sent one, else the HTTP reason phrase."""
    try:
        doc = json.loads(bytes(head[:MAX_RESPONSE_BYTES]))
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return repr(_cut(doc["error"]))
    return repr(_cut(http_reason or ""))


def _cause(e: Exception) -> str:
    """The useful end of a requests error: what urllib3 says caused it, without the long URL before it."""
    text = str(e)
    _, sep, cause = text.partition("(Caused by ")
    return cause.removesuffix(")") if sep else text


def _retry_after(value: str | None) -> float | None:
    """Seconds from a delay-seconds Retry-After; the HTTP-date form is ignored (backoff applies)."""
    value = (value or "").strip()
    return float(value) if value.isascii() and value.isdigit() else None


def _cut(s: str) -> str:
    return cut(s, MAX_REASON_CHARS)
