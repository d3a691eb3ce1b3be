"""Upload formats: how one spooled profile becomes one HTTP request to a kind of backend.

Owns: the UploadFormat protocol that every format implements (format_pprof,
format_otlp, format_pyroscope: one module each), the Request it produces, the
Accepted note it reads from a 2xx reply (OTLP's partial_success), and choosing
the format by the config's upload_format.

The spool, the retries and backoff, TLS, the bearer token and the dead letters
are the same for every format (http.py, sender.py, spool.py): a format only
says what goes on the wire and what a 2xx reply says beyond "stored".

Must not: talk to the network, keep state between requests (a retry of a
profile must be the same request, byte for byte, so the backend's idempotency
key is the same), or read anything but the profile it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.config import ProfilerConfig
from shared.wire import ProfileUpload


class FormatError(ValueError):
    """A profile this format cannot express; retrying cannot help (it is dead-lettered)."""


@dataclass(frozen=True)
class Request:
    """What one attempt sends: query parameters, headers and the body."""

    params: dict[str, str]
    headers: dict[str, str]
    body: bytes
    key: str  # the backend's idempotency key for this profile, for logs and docs


@dataclass(frozen=True)
class Accepted:
    """What a 2xx reply says about the profiles in the request."""

    rejected: int = 0  # profiles the backend refused for good (OTLP partial_success)
    message: str = ""  # its reason, or a note on a reply that could not be read


class UploadFormat(Protocol):
    """One kind of backend's upload protocol."""

    name: str  # the upload_format value
    path: str  # appended to the endpoint

    def request(self, upload: ProfileUpload) -> Request:
        """The request that delivers `upload`; FormatError if it cannot be expressed."""
        ...

    def accepted(self, reply: bytes, content_type: str) -> Accepted:
        """What a 2xx reply's (first MAX_RESPONSE_BYTES of) body says beyond "stored"."""
        ...


def for_config(cfg: ProfilerConfig) -> UploadFormat:
    """The format the config names (validated by shared.config)."""
    if cfg.upload_format == "otlp":
        from uploader.format_otlp import OtlpFormat

        return OtlpFormat(plain_pid=cfg.plain_pid)
    if cfg.upload_format == "pyroscope":
        from uploader.format_pyroscope import PyroscopeFormat

        return PyroscopeFormat()
    from uploader.format_pprof import PprofFormat

    return PprofFormat()
