"""The reference receiver's upload formats besides /v1/profiles: what each POST path accepts.

Owns: the IngestFormat protocol (receiver/otlp.py: OTLP/HTTP profiles;
receiver/pyroscope.py: Pyroscope's /ingest), the Parsed result every format
gives the server (an id that is the format's idempotency key, the metadata
every stored profile has, the bytes to store), BadRequest, and the table of
formats by path.

Every format stores alike (receiver/store.py): DIR/<id><suffix> and
DIR/<id>.json with the keys id, format, type, service, host, start, end
(unix ns), samples, bytes, received_at, plus the format's own.

Must not: speak HTTP (the server reads bodies, injects faults and replies) or
store anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class BadRequest(Exception):
    """A request answered with `status` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Parsed:
    """A valid upload: what to store, under which id."""

    profile_id: str  # the format's idempotency key, as a file-name-safe id
    meta: dict[str, Any]  # type, service, host, start, end, samples and the format's own keys
    body: bytes  # stored as DIR/<id><suffix>
    suffix: str
    profiles: int = 1  # profiles in the request (OTLP: one per resource and sample type)


class Headers(Protocol):
    """A request's headers as a format reads them: the server's email.message.Message (case-insensitive) or a dict."""

    def get(self, name: str, /) -> str | None: ...


class IngestFormat(Protocol):
    name: str
    path: str

    def parse(self, query: str, headers: Headers, body: bytes) -> Parsed:
        """Validate one upload; BadRequest says why it is refused."""
        ...

    def reply(self, parsed: Parsed, stored: bool, rejected_message: str = "") -> tuple[bytes, str]:
        """(body, content type) of the 200 answer; rejected_message: refuse every profile as a partial success."""
        ...


def by_path() -> dict[str, IngestFormat]:
    from receiver.otlp import OtlpIngest
    from receiver.pyroscope import PyroscopeIngest

    formats: list[IngestFormat] = [OtlpIngest(), PyroscopeIngest()]
    return {f.path: f for f in formats}
