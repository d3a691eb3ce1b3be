"""The collector's batches on their way to the symbolizer workers.

Owns: sending a StackBatch to its worker in parts of at most MAX_BATCH_BYTES (shared/wire.py
encode_within), counting what was split, what could not be made to fit (lost as
<type>.oversize) and what a worker refused, and the log lines of those episodes (a refusing worker
at most once a DROP_LOG_EVERY_S, again when it takes batches; a split once per process).

Must not: build batches (collector/batcher.py), choose the worker (collector/routing.py), or open
the sockets (collector/links.py).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from collector.links import BATCH_QUEUE_PER_WORKER
from shared import log as log_mod
from shared.wire import MAX_BATCH_BYTES, StackBatch, encode_within

# A worker that keeps refusing batches is reported at most this often.
DROP_LOG_EVERY_S = 60

log = logging.getLogger("ebpfprofiler.collector")


class Links(Protocol):
    """What the sender needs of collector/links.py's WorkerLinks."""

    def send(self, worker: int, frames: list[bytes]) -> bool: ...


class BatchSender:
    """Batches to workers over `links` (WorkerLinks); samples that cannot be sent are added to `lost`
    (shared with the collector's in-kernel losses)."""

    def __init__(self, links: Links, lost: dict[str, int]) -> None:
        self.links = links
        self.lost = lost
        # batches_split: batches over MAX_BATCH_BYTES, sent in parts; parts_unsendable: a part that could
        # not be made to fit (its samples counted lost as <type>.oversize).
        self.totals = {"batches": 0, "batches_dropped": 0, "batches_split": 0, "parts_unsendable": 0}
        self._log_once = log_mod.LogOnce(log)
        self._dropped_since_ok: dict[int, int] = {}  # worker → samples dropped in this episode
        self._drop_logged: dict[int, float] = {}

    def send(self, worker: int, batch: StackBatch) -> None:
        """`batch` to `worker`: in parts of at most MAX_BATCH_BYTES when it is larger, never dropped whole."""
        parts, unfit = encode_within(batch)
        if len(parts) + len(unfit) > 1:
            self._split(worker, batch, len(parts))
        for part in unfit:
            self._unsendable(part)
        for part, frames in parts:
            self._send_frames(worker, part, frames)

    def _split(self, worker: int, batch: StackBatch, n_parts: int) -> None:
        self.totals["batches_split"] += 1
        big = max(batch.processes, key=lambda p: len(p.mappings), default=None)
        if big is not None:
            self._log_once(
                ("batch_split", big.pid, big.start_ticks),
                logging.WARNING,
                "a %s batch for symbolizer worker %d was over %d bytes: sent in %d parts (its "
                "largest mapping table: pid %d (%s), %d mappings); counted as batches_split in "
                "status; logged once for that process",
                batch.profile_type,
                worker,
                MAX_BATCH_BYTES,
                n_parts,
                big.pid,
                big.comm,
                len(big.mappings),
            )

    def _unsendable(self, part: StackBatch) -> None:
        self.totals["parts_unsendable"] += 1
        key = f"{part.profile_type}.oversize"
        self.lost[key] = self.lost.get(key, 0) + sum(s.count for s in part.samples)
        for p in part.processes:
            self._log_once(
                ("batch_part_unsendable", p.pid, p.start_ticks),
                logging.WARNING,
                "pid %d (%s): a sample of it with its process does not fit %d bytes; its samples "
                "in that part are lost (counted as %s); logged once for this process",
                p.pid,
                p.comm,
                MAX_BATCH_BYTES,
                key,
            )

    def _send_frames(self, worker: int, batch: StackBatch, frames: list[bytes]) -> None:
        dropped = self._dropped_since_ok
        if not self.links.send(worker, frames):
            self.totals["batches_dropped"] += 1
            n = sum(s.count for s in batch.samples)
            dropped[worker] = dropped.get(worker, 0) + n
            now = time.monotonic()
            if now - self._drop_logged.get(worker, -DROP_LOG_EVERY_S) >= DROP_LOG_EVERY_S:
                self._drop_logged[worker] = now
                log.warning(
                    "symbolizer worker %d is not taking batches (down, or its queue of %d "
                    "is full): dropped %d samples so far in this episode; next report in %d s",
                    worker,
                    BATCH_QUEUE_PER_WORKER,
                    dropped[worker],
                    DROP_LOG_EVERY_S,
                )
            return
        self.totals["batches"] += 1
        if dropped.get(worker):
            log.warning(
                "symbolizer worker %d takes batches again; %d samples were dropped meanwhile",
                worker,
                dropped.pop(worker),
            )
            self._drop_logged.pop(worker, None)
