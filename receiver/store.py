"""The reference receiver's storage: one directory, two files per profile.

Owns: the layout `DIR/<id>.pb.gz` (the body as received; another suffix for
a format whose body is not a gzip pprof, e.g. `.otlp.pb`) and `DIR/<id>.json`
(its metadata, with "file" naming the body's file), writing both atomically, idempotency by id (the .json is
written last, so its presence means "stored"), and list_profiles(), which tests
use to read what arrived.

Must not: validate profiles or speak HTTP; the server does that.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from shared.files import write_atomic

# Profile ids become file names: the hand-off's safe alphabet and bounded length, no "/".
from shared.handoff import is_valid_profile_id as is_valid_id

# One writer at a time makes "already stored?" and "store" one step.
_lock = threading.Lock()


def save(directory: str, profile_id: str, body: bytes, meta: dict[str, Any], suffix: str = ".pb.gz") -> bool:
    """Store a profile and its metadata; False (nothing written) if `profile_id` is already stored."""
    if not is_valid_id(profile_id):
        raise ValueError(f"unsafe profile id {profile_id!r}")
    base = os.path.join(directory, profile_id)
    meta = {**meta, "file": profile_id + suffix}
    with _lock:
        if os.path.exists(base + ".json"):
            return False
        write_atomic(base + suffix, body)
        write_atomic(base + ".json", json.dumps(meta, indent=1, sort_keys=True).encode() + b"\n")
    return True


def list_profiles(directory: str) -> list[dict[str, Any]]:
    """The metadata of every stored profile, oldest first, each with "path" to its .pb.gz."""
    out = []
    for name in os.listdir(directory):
        if name.startswith(".") or not name.endswith(".json"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            meta = json.load(f)
        meta["path"] = os.path.join(directory, meta.get("file") or name[: -len(".json")] + ".pb.gz")
        out.append(meta)
    out.sort(key=lambda m: (m.get("received_at", 0), m.get("id", "")))
    return out
