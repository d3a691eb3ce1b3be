"""The reference receiver's Pyroscope ingest: POST /ingest?name=APP{labels}&from=&until=&format=pprof.

Owns: parsing the query (the application name and its labels out of name;
from and until in unix seconds; format must be pprof), validating the body
with shared.pprof.read(), and the id: Pyroscope's /ingest has no idempotency
key, so a profile is known by its series and window, sha256(name|from|until).
A resend of the same window of the same series is stored once. An
X-Profile-Id header (the agent sends its profile id) is kept in the metadata
as x_profile_id, for tests to tell which profile arrived; it is not the key.

Must not: accept a body that shared.pprof.read() rejects, or a format other
than pprof.
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import parse_qs

from receiver.formats import BadRequest, Headers, Parsed
from shared.pprof import PprofError
from shared.pprof import read as read_pprof
from shared.wire import MAX_STRING

PATH = "/ingest"
_NAME = re.compile(r"([^{}]+)(?:\{([^{}]*)\})?")
# Labels in one name: Pyroscope's series carry a handful; this bounds what a name can make us hold.
MAX_LABELS = 64


def parse_name(name: str) -> tuple[str, dict[str, str]]:
    """ "app{k=v,k2=v2}" → ("app", {"k": "v", "k2": "v2"}); BadRequest if it is not of that form."""
    m = _NAME.fullmatch(name)
    if not m:
        raise BadRequest(400, f"name {name[:200]!r} is not APP or APP{{key=value,...}}")
    labels: dict[str, str] = {}
    for part in filter(None, (m[2] or "").split(",")):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise BadRequest(400, f"label {part[:200]!r} in name is not key=value")
        labels[key.strip()] = value.strip()
    if len(labels) > MAX_LABELS:
        raise BadRequest(400, f"name has {len(labels)} labels, more than {MAX_LABELS}")
    return m[1].strip(), labels


class PyroscopeIngest:
    name = "pyroscope"
    path = PATH

    def parse(self, query: str, headers: Headers, body: bytes) -> Parsed:
        try:
            q = parse_qs(query, keep_blank_values=True, max_num_fields=100, errors="strict")
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(400, f"bad query string: {e}") from None
        values: dict[str, str] = {}
        for key in ("name", "from", "until", "format"):
            got = q.get(key)
            if not got or len(got) != 1 or not got[0]:
                raise BadRequest(400, f"query parameter {key!r} is missing, empty or given more than once")
            if len(got[0]) > MAX_STRING:
                raise BadRequest(400, f"query parameter {key!r} is longer than {MAX_STRING} characters")
            values[key] = got[0]
        if values["format"] != "pprof":
            raise BadRequest(415, f"format {values['format'][:40]!r}: this receiver takes format=pprof only")
        for key in ("from", "until"):
            if not (values[key].isascii() and values[key].isdigit()):
                raise BadRequest(400, f"{key} = {values[key][:40]!r} is not unix seconds")
        start, end = int(values["from"]), int(values["until"])
        if end < start:
            raise BadRequest(400, f"until {end} is before from {start}")
        app, labels = parse_name(values["name"])
        try:
            profile = read_pprof(body)
        except PprofError as e:
            raise BadRequest(400, str(e)) from None
        key = hashlib.sha256(f"{values['name']}|{start}|{end}".encode()).hexdigest()[:32]
        meta = {
            "format": self.name,
            "name": values["name"],
            "labels": labels,
            "service": app,
            "type": labels.get("profile_type", ""),
            "host": labels.get("host", ""),
            "start": start * 10**9,
            "end": end * 10**9,
            "samples": len(profile.samples),
            "x_profile_id": (headers.get("X-Profile-Id") or "")[:128],
        }
        return Parsed(key, meta, body, ".pb.gz")

    def reply(self, parsed: Parsed, stored: bool, rejected_message: str = "") -> tuple[bytes, str]:
        return b"", "text/plain; charset=utf-8"
