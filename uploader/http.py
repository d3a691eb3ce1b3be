"""HTTP delivery: POST each profile to `{endpoint}/v1/profiles`, with bounded retries.

Owns: the client side of the upload API (docs/upload-api.md): URL, query
parameters, headers, timeouts, which outcomes are retried and how long to wait
between attempts. deliver() returns True only for a 2xx, so a spool can wrap it
and keep a profile until then.

Must not: log or alter profile bytes, read more than MAX_RESPONSE_BYTES of a
response, or decide what happens to a profile after a final failure.

Environment: EBPFPROFILER_UPLOAD_BACKOFF_S overrides the backoff base
(seconds, default DEFAULT_BACKOFF_BASE_S); tests set it small.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import random
import time
from dataclasses import dataclass

import requests

from ebpfprofiler.shared.wire import ProfileUpload
from ebpfprofiler.uploader.local import window_text

log = logging.getLogger("ebpfprofiler.uploader.http")

PATH = "/v1/profiles"
SOURCE = "ebpf"
BACKOFF_ENV = "EBPFPROFILER_UPLOAD_BACKOFF_S"

# A backend that cannot accept a TCP connection in this long is down for us.
CONNECT_TIMEOUT_S = 5.0
# Time allowed between bytes of the response; a backend may parse a large profile first.
READ_TIMEOUT_S = 30.0
# Attempts per profile (1 + 3 retries): rides out a backend restart without
# holding the queue behind one profile for long.
MAX_ATTEMPTS = 4
# First wait between attempts; it doubles per attempt (1 s, 2 s, 4 s) with jitter.
DEFAULT_BACKOFF_BASE_S = 1.0
# No single wait between attempts is longer than this, whatever the backoff says.
MAX_BACKOFF_S = 30.0
# A server's numeric Retry-After is honoured up to this, so it cannot stall the uploader.
MAX_RETRY_AFTER_S = 60.0
# Enough of a response for a JSON {"error": ...} reason; the rest is not read.
MAX_RESPONSE_BYTES = 4096
# Reasons quoted in logs are cut to this many characters.
MAX_REASON_CHARS = 300

RETRY_STATUSES = frozenset({408, 429})   # and every 5xx


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
        log.warning("ignoring %s=%r: expected seconds from 0 to %g; using %g",
                    BACKOFF_ENV, raw, MAX_BACKOFF_S, DEFAULT_BACKOFF_BASE_S)
        return DEFAULT_BACKOFF_BASE_S
    return value


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    retry: bool
    reason: str
    retry_after_s: float | None = None


class HttpClient:
    """Delivers profiles to a backend implementing POST /v1/profiles."""

    def __init__(self, endpoint: str, backoff_s: float | None = None) -> None:
        self.url = endpoint.rstrip("/") + PATH
        self.backoff_s = backoff_base_s() if backoff_s is None else backoff_s
        self._session = requests.Session()
        self._session.headers["User-Agent"] = user_agent()

    def describe(self) -> str:
        return f"endpoint {self.url}"

    def deliver(self, upload: ProfileUpload) -> bool:
        """Post one profile, retrying transient failures; True once the backend answered 2xx."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            outcome = self._post(upload)
            if outcome.ok:
                log.debug("uploaded profile %s service=%r type=%s window=%s on attempt %d",
                          upload.profile_id, upload.service, upload.profile_type, window_text(upload), attempt)
                return True
            if not outcome.retry or attempt == MAX_ATTEMPTS:
                log.error("upload failed after %d attempt(s): service=%r type=%s window=%s id=%s: %s",
                          attempt, upload.service, upload.profile_type, window_text(upload),
                          upload.profile_id, outcome.reason)
                return False
            delay = self._delay(attempt, outcome.retry_after_s)
            log.warning("upload attempt %d/%d for service=%r type=%s failed (%s); retrying in %.2fs",
                        attempt, MAX_ATTEMPTS, upload.service, upload.profile_type, outcome.reason, delay)
            time.sleep(delay)
        return False   # not reached: the last attempt returns above

    def close(self) -> None:
        self._session.close()

    def _delay(self, attempt: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(retry_after_s, MAX_RETRY_AFTER_S)
        # Jitter in [50%, 100%] of the exponential step keeps many hosts from retrying in step.
        step = min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
        return step * random.uniform(0.5, 1.0)

    def _post(self, upload: ProfileUpload) -> _Outcome:
        params = {
            "source": SOURCE,
            "type": upload.profile_type,
            "service": upload.service,
            "host": upload.host,
            "start": str(upload.window_start_ns),
            "end": str(upload.window_end_ns),
        }
        headers = {"Content-Type": "application/octet-stream", "X-Profile-Id": upload.profile_id}
        try:
            resp = self._session.post(
                self.url, params=params, headers=headers, data=upload.pprof_gz,
                timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S), stream=True, allow_redirects=False,
            )
        except (requests.ConnectionError, requests.Timeout) as e:
            return _Outcome(False, True, f"{type(e).__name__}: {_cut(str(e))}")
        except requests.RequestException as e:   # bad header value, bad URL: retrying cannot help
            return _Outcome(False, False, f"{type(e).__name__}: {_cut(str(e))}")
        head = bytearray()
        try:
            # A body read to its end lets the session reuse the connection; a longer one is cut off.
            for chunk in resp.iter_content(chunk_size=1024):
                head += chunk
                if len(head) >= MAX_RESPONSE_BYTES:
                    break
        except (requests.RequestException, OSError):
            pass   # a broken reply body does not change its status
        finally:
            resp.close()
        status = resp.status_code
        if 200 <= status < 300:
            return _Outcome(True, False, f"HTTP {status}")
        reason = f"HTTP {status} {_reason(head, resp.reason)}"
        if 300 <= status < 400:
            reason += f" (redirect to {resp.headers.get('Location', '?')!r}; set endpoint to the final URL)"
        retry = status in RETRY_STATUSES or 500 <= status < 600
        return _Outcome(False, retry, reason, _retry_after(resp.headers.get("Retry-After")) if retry else None)


def _reason(head: bytes | bytearray, http_reason: str | None) -> str:
    """The backend's {"error": ...} if it sent one, else the HTTP reason phrase."""
    try:
        doc = json.loads(bytes(head[:MAX_RESPONSE_BYTES]))
    except (ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return repr(_cut(doc["error"]))
    return repr(_cut(http_reason or ""))


def _retry_after(value: str | None) -> float | None:
    """Seconds from a delay-seconds Retry-After; the HTTP-date form is ignored (backoff applies)."""
    value = (value or "").strip()
    return float(value) if value.isascii() and value.isdigit() else None


def _cut(s: str) -> str:
    return s if len(s) <= MAX_REASON_CHARS else s[:MAX_REASON_CHARS] + "…"
