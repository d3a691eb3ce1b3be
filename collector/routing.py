"""Which symbolizer worker aggregates a service.

Owns: the stable service → worker choice. Rendezvous (highest random weight)
hashing: every service goes to the live worker with the highest hash of
(service, worker), so all of a service's records meet in one worker's window,
and when a worker is missing only its own services move (and move back when
it returns).

Must not: know about sockets or liveness; the caller says which workers are live.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _weight(service: str, worker: int) -> int:
    # surrogatepass: a service name is valid UTF-8 (shared/safestr.py); routing must not die if one is not.
    h = hashlib.blake2b(f"{worker}\0{service}".encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def worker_for(service: str, live_workers: Sequence[int]) -> int:
    """The worker (one of `live_workers`) that owns `service`."""
    if not live_workers:
        raise ValueError("no live worker")
    return max(live_workers, key=lambda w: _weight(service, w))
