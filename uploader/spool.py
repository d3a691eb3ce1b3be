"""The uploader's disk spool: a profile accepted for HTTP delivery lives here until a 2xx.

Owns: the spool directory (<state-dir>/spool) and the dead-letter directory
(<state-dir>/dead-letter), their file layout, the size bound (spool_max_mb:
oldest dropped first, each drop counted and logged with service and window),
what happens when the filesystem is full, and the in-memory index of what is
spooled (names, ids, sizes and retry times; never profile bytes).

Layout: one file per profile, `{seq:020d}-{profile_id}.prof`; seq is the
arrival time in unix ns, made strictly increasing, so names sort oldest first
across restarts. A file is MAGIC, a 4-byte big-endian length, the profile's
shared.wire header frame (versioned JSON), then the gzip pprof; it is read
back through shared.wire.decode. Files are written with
shared.files.write_atomic (temporary file, fsync, rename, directory fsync)
before the worker is acknowledged, and removed only after a 2xx, a dead
letter, or a counted drop. A temporary file left by a crash was never
acknowledged and is removed at start.

Dead letters: `{name}.pb.gz` (the profile exactly as posted; `go tool pprof`
reads it) and `{name}.json` (id, service, type, host, window, HTTP status,
reason, attempts, time), both written before the spool file is removed.

Must not: talk to the network, decide which answers are retried (the sender
does), or hold profile bytes beyond one call.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import struct
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from shared.files import write_atomic
from shared.handoff import REFUSED, RETRY, STORED, window_text
from shared.wire import MAX_PROFILE_BYTES, ProfileUpload, WireError, decode, encode

MAGIC = b"EBPFSPOOL\x01"
SUFFIX = ".prof"
NAME_PATTERN = re.compile(r"(\d{20})-([A-Za-z0-9._-]{1,128})\.prof")
# A profile's JSON header carries a host and a service of at most 4096
# characters each; escaping included, this is far more than it needs.
MAX_HEADER_BYTES = 64 << 10
MAX_FILE_BYTES = len(MAGIC) + 4 + MAX_HEADER_BYTES + MAX_PROFILE_BYTES
# Files in the spool whatever their size: bounds the in-memory index (~10 MB)
# and the start-up scan when tiny profiles pile up during a long outage.
MAX_SPOOL_FILES = 65536
# Dead letters kept: a backend that refuses everything must not fill the disk;
# the newest keep the evidence.
MAX_DEAD_LETTERS = 1000
# Spool and dead letters hold profiles of every service: the uploader's user only.
DIR_MODE = 0o700
# Filesystem-full errors: the spool makes room by dropping its oldest profiles.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
# Ids of profiles that left the spool (sent, dropped, quarantined) remembered: a
# worker resends a profile whose ack is late, and a copy that arrives after the
# first left must not be spooled again (and, on a full disk, evict a newer one).
MAX_SETTLED_IDS = 4096


class SpoolFormatError(ValueError):
    """A spool file that is not a spooled profile."""


@dataclass(slots=True)
class Entry:
    """One spooled profile as the index knows it."""

    name: str
    profile_id: str
    size: int
    attempts: int = 0
    failures: int = 0  # retryable failures of this profile the backend answered
    next_attempt: float = 0.0  # time.monotonic(); 0: due now
    in_flight: bool = False  # taken by the sender: not dropped under it


def encode_file(upload: ProfileUpload) -> bytes:
    header, pprof_gz = encode(upload)
    return MAGIC + struct.pack(">I", len(header)) + header + pprof_gz


def decode_file(data: bytes, header_only: bool = False) -> ProfileUpload:
    """The profile in a spool file's bytes (with empty pprof_gz when header_only)."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise SpoolFormatError("not a spool file (bad magic)")
    (n,) = struct.unpack_from(">I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if n > MAX_HEADER_BYTES or start + n > len(data):
        raise SpoolFormatError(f"header length {n} does not fit the file")
    header, body = data[start : start + n], b"" if header_only else data[start + n :]
    try:
        msg = decode([header, body])
    except WireError as e:
        raise SpoolFormatError(f"wire: {e}") from None
    if not isinstance(msg, ProfileUpload):
        raise SpoolFormatError(f"holds a {type(msg).__name__}, not a profile")
    return msg


class Spool:
    """The spool directory and its index; safe to use from the receive loop and the sender thread."""

    def __init__(
        self,
        directory: str,
        dead_letter_dir: str,
        max_bytes: int,
        log: logging.Logger,
        max_files: int = MAX_SPOOL_FILES,
    ) -> None:
        self.directory = directory
        self.dead_letter_dir = dead_letter_dir
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.log = log
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # name → entry, oldest first
        self._by_id: dict[str, str] = {}
        self._settled: OrderedDict[str, None] = OrderedDict()  # ids that left the spool, newest last
        self._bytes = 0
        self._last_seq = 0
        self._cond = threading.Condition()
        self._no_space_since: float | None = None
        self.counts: Counter[str] = Counter()
        self._dead_letters = DeadLetters(dead_letter_dir, log, self.counts)

    # ------------------------------------------------------------ figures

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    @property
    def bytes(self) -> int:
        with self._cond:
            return self._bytes

    def ids(self) -> list[str]:
        with self._cond:
            return [e.profile_id for e in self._entries.values()]

    # ------------------------------------------------------------ start

    def open(self) -> None:
        """Create the directories and index what an earlier run left, oldest first."""
        os.makedirs(self.directory, mode=DIR_MODE, exist_ok=True)
        os.makedirs(self.dead_letter_dir, mode=DIR_MODE, exist_ok=True)
        with self._cond:
            for entry, seq in scan(self.directory, self.log, self.counts):
                self._index(entry)
                self._last_seq = max(self._last_seq, seq)
            if self._entries:
                self.log.info(
                    "spool %s holds %d profile(s), %.1f MB, from an earlier run: sending them first, oldest first",
                    self.directory,
                    len(self._entries),
                    self._bytes / 1e6,
                )
            self._make_room(0, f"over spool_max_mb ({self.max_bytes >> 20} MB)", adding=False)

    # ------------------------------------------------------------ the receive loop's side

    def accept(self, upload: ProfileUpload) -> tuple[str, str]:
        """Spool one profile durably: (STORED | RETRY | REFUSED, reason). STORED means fsync'd."""
        data = encode_file(upload)
        size = len(data)
        with self._cond:
            if upload.profile_id in self._by_id or upload.profile_id in self._settled:
                self.counts["duplicates"] += 1
                return STORED, "already spooled"
            if size > self.max_bytes:
                self.counts["refused_too_large"] += 1
                reason = f"profile of {size} bytes is larger than the whole spool (spool_max_mb {self.max_bytes >> 20})"
                self.log.error(
                    "dropped profile %s service=%r type=%s window=%s: %s (%d dropped so far)",
                    upload.profile_id,
                    upload.service,
                    upload.profile_type,
                    window_text(upload),
                    reason,
                    self.counts["refused_too_large"],
                )
                return REFUSED, reason
            self._make_room(size, f"spool full (spool_max_mb {self.max_bytes >> 20})")
            name = self._next_name(upload.profile_id)
            path = os.path.join(self.directory, name)
            while True:
                try:
                    write_atomic(path, data)
                    break
                except OSError as e:
                    if e.errno not in NO_SPACE:
                        self.counts["write_errors"] += 1
                        self.log.error(
                            "cannot write profile %s (service=%r window=%s) to the spool %s: %s; "
                            "the worker keeps it and offers it again",
                            upload.profile_id,
                            upload.service,
                            window_text(upload),
                            self.directory,
                            e,
                        )
                        return RETRY, f"cannot write to the spool: {e}"
                    if not self._on_no_space(upload, size, e):
                        return RETRY, "no space left on the spool's filesystem"
            self._index(Entry(name, upload.profile_id, size))
            self.counts["spooled"] += 1
            if self._no_space_since is not None:
                self.log.info(
                    "the spool has room again after %.0f s (%d profile(s) refused for lack of space so far)",
                    time.monotonic() - self._no_space_since,
                    self.counts["refused_no_space"],
                )
                self._no_space_since = None
            self._cond.notify_all()
        return STORED, ""

    def _on_no_space(self, upload: ProfileUpload, size: int, error: OSError) -> bool:
        """The filesystem is full: drop the oldest until `size` bytes are freed; False if nothing can go."""
        self.counts["no_space_errors"] += 1
        if self._oldest_droppable() is None:
            self.counts["refused_no_space"] += 1
            first = self._no_space_since is None
            if first:
                self._no_space_since = time.monotonic()
            # One clear line per episode; the worker offers the profile again every few seconds.
            self.log.log(
                logging.ERROR if first else logging.DEBUG,
                "no space left for the spool in %s (%s) and nothing left to drop (%d profile(s) in the "
                "spool, being sent): refused profile %s (service=%r window=%s) for now; the worker keeps "
                "it and offers it again (%d refused so far)",
                self.directory,
                error.strerror,
                len(self._entries),
                upload.profile_id,
                upload.service,
                window_text(upload),
                self.counts["refused_no_space"],
            )
            return False
        self.log.error(
            "no space left for the spool in %s (%s) writing profile %s (service=%r window=%s, %d "
            "bytes): dropping the oldest spooled profiles to make room",
            self.directory,
            error.strerror,
            upload.profile_id,
            upload.service,
            window_text(upload),
            size,
        )
        freed = 0
        while freed < size and (victim := self._oldest_droppable()) is not None:
            freed += victim.size
            self._drop(victim, "no space left on the spool's filesystem")
        return True

    # ------------------------------------------------------------ the sender's side

    def take(self, now: float) -> tuple[Entry, ProfileUpload] | None:
        """The oldest profile due for an attempt, marked in flight; None if none is due."""
        while True:
            with self._cond:
                entry = next((e for e in self._entries.values() if not e.in_flight and e.next_attempt <= now), None)
                if entry is None:
                    return None
                entry.in_flight = True
            path = os.path.join(self.directory, entry.name)
            try:
                with open(path, "rb") as f:
                    data = f.read(MAX_FILE_BYTES + 1)
                if len(data) > MAX_FILE_BYTES:
                    raise SpoolFormatError(f"larger than {MAX_FILE_BYTES} bytes")
                return entry, decode_file(data)
            except FileNotFoundError:
                self.log.warning(
                    "spooled profile %s vanished from %s (removed by hand?)", entry.profile_id, self.directory
                )
                with self._cond:
                    self._unindex(entry)
            except (OSError, SpoolFormatError) as e:
                self._quarantine(entry, f"unreadable spool file: {e}")

    def next_due_in(self, now: float) -> float | None:
        """Seconds until the next profile is due (0 if one is); None if the spool is empty or all in flight."""
        with self._cond:
            times = [e.next_attempt for e in self._entries.values() if not e.in_flight]
        return max(0.0, min(times) - now) if times else None

    def wait(self, timeout: float) -> None:
        """Sleep until a profile is added, wake() is called, or `timeout` seconds pass."""
        with self._cond:
            self._cond.wait(timeout)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def make_all_due(self) -> None:
        """Every profile becomes due now (the final attempt at stop)."""
        with self._cond:
            for e in self._entries.values():
                e.next_attempt = 0.0
            self._cond.notify_all()

    def release(self, entry: Entry) -> None:
        with self._cond:
            entry.in_flight = False

    def retry_later(self, entry: Entry, at: float) -> None:
        with self._cond:
            entry.next_attempt = at
            entry.in_flight = False

    def delivered(self, entry: Entry) -> None:
        """The backend has it (2xx): remove it. Not fsync'd: a delete lost in a crash is a harmless resend."""
        with self._cond:
            self._unindex(entry)
        try:
            os.unlink(os.path.join(self.directory, entry.name))
        except FileNotFoundError:
            pass
        except OSError as e:
            self.log.warning(
                "cannot remove delivered profile %s from the spool: %s (it may be sent again; the "
                "backend stores it once)",
                entry.profile_id,
                e,
            )
        self.counts["delivered"] += 1

    def dead_letter(self, entry: Entry, upload: ProfileUpload, status: int | None, reason: str) -> None:
        """The backend refused it for good: move it to the dead-letter directory with status and reason."""
        self._dead_letters.refused(entry, upload, status, reason)
        with self._cond:
            self._unindex(entry)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, entry.name))
        self._dead_letters.trim()

    # ------------------------------------------------------------ internals (callers hold the lock)

    def _index(self, entry: Entry) -> None:
        self._entries[entry.name] = entry
        self._by_id[entry.profile_id] = entry.name
        self._bytes += entry.size

    def _unindex(self, entry: Entry) -> None:
        if self._entries.pop(entry.name, None) is None:
            return
        self._bytes -= entry.size
        if self._by_id.get(entry.profile_id) == entry.name:
            del self._by_id[entry.profile_id]
        self._settled[entry.profile_id] = None
        if len(self._settled) > MAX_SETTLED_IDS:
            self._settled.popitem(last=False)

    def _next_name(self, profile_id: str) -> str:
        self._last_seq = max(time.time_ns(), self._last_seq + 1)
        return f"{self._last_seq:020d}-{profile_id}{SUFFIX}"

    def _oldest_droppable(self) -> Entry | None:
        return next((e for e in self._entries.values() if not e.in_flight), None)

    def _make_room(self, size: int, why: str, adding: bool = True) -> None:
        """Drop the oldest until `size` more bytes (and, when adding, one more file) fit the caps."""
        while self._entries and (self._bytes + size > self.max_bytes or len(self._entries) + adding > self.max_files):
            victim = self._oldest_droppable()
            if victim is None:
                return  # only the profile being sent is left; it leaves soon
            self._drop(victim, why)

    def _drop(self, entry: Entry, why: str) -> None:
        path = os.path.join(self.directory, entry.name)
        what = describe(path, entry)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self.log.warning("cannot remove %s: %s", path, e)
        self._unindex(entry)
        self.counts["dropped"] += 1
        self.log.warning(
            "dropped the oldest spooled profile %s: %s (%d dropped so far)", what, why, self.counts["dropped"]
        )

    def _quarantine(self, entry: Entry, reason: str) -> None:
        """A spool file that cannot be read back goes to the dead letters as it is, with the reason."""
        self._dead_letters.quarantine(os.path.join(self.directory, entry.name), entry, reason)
        with self._cond:
            self._unindex(entry)


def describe(path: str, entry: Entry) -> str:
    """The spooled profile at `path` for a log line: its id, and its service, type and window as its header says."""
    what = f"id={entry.profile_id}"
    try:
        with open(path, "rb") as f:
            head = decode_file(f.read(len(MAGIC) + 4 + MAX_HEADER_BYTES), header_only=True)
        what += f" service={head.service!r} type={head.profile_type} window={window_text(head)}"
    except (OSError, SpoolFormatError) as e:
        what += f" (header unreadable: {e})"
    return what


def scan(directory: str, log: logging.Logger, counts: Counter[str]) -> list[tuple[Entry, int]]:
    """The profiles an earlier run left in `directory`, oldest first, each with its seq. A temporary
    file left by a crash is removed; a file that is not a spooled profile is left alone; both are logged
    and counted in `counts` ("partial_removed", "strangers": what the start-up scan did, for status)."""
    found, stale, unknown = [], 0, []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(".") and name.endswith(".tmp"):
            # A write cut short by a crash: never acknowledged, so the worker still had it.
            try:
                os.unlink(path)
                stale += 1
            except OSError as e:
                log.warning("cannot remove partial spool file %s: %s", path, e)
            continue
        m = NAME_PATTERN.fullmatch(name)
        if m is None:
            unknown.append(name)
            continue
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            continue
        found.append((Entry(name, m.group(2), size), int(m.group(1))))
    if stale:
        counts["partial_removed"] += stale
        log.info("removed %d partial spool file(s) left by a crash (never acknowledged)", stale)
    if unknown:
        counts["strangers"] += len(unknown)
        log.warning(
            "ignoring %d file(s) in %s that are not spooled profiles, e.g. %r",
            len(unknown),
            directory,
            unknown[0],
        )
    return found


class DeadLetters:
    """The dead-letter directory: what the backend refused for good and what cannot be read back, each
    with a JSON record of why; at most MAX_DEAD_LETTERS. Counts into the spool's counters."""

    def __init__(self, directory: str, log: logging.Logger, counts: Counter[str]) -> None:
        self.directory = directory
        self.log = log
        self.counts = counts

    def refused(self, entry: Entry, upload: ProfileUpload, status: int | None, reason: str) -> None:
        """Write the profile as posted and its record (counted dead_lettered), or count it dropped."""
        base = os.path.join(self.directory, entry.name[: -len(SUFFIX)])
        record = {
            "id": upload.profile_id,
            "service": upload.service,
            "type": upload.profile_type,
            "host": upload.host,
            "window_start_ns": upload.window_start_ns,
            "window_end_ns": upload.window_end_ns,
            "samples": upload.samples,
            "bytes": len(upload.pprof_gz),
            "status": status,
            "reason": reason,
            "attempts": entry.attempts,
            "dead_lettered_at_ns": time.time_ns(),
        }
        try:
            write_atomic(base + ".pb.gz", upload.pprof_gz)
            write_atomic(base + ".json", json.dumps(record, indent=1, sort_keys=True).encode() + b"\n")
        except OSError as e:
            self.counts["dropped"] += 1
            self.log.error(
                "profile %s service=%r type=%s window=%s was refused by the backend (%s) and cannot be "
                "written to %s (%s): dropped (%d dropped so far)",
                upload.profile_id,
                upload.service,
                upload.profile_type,
                window_text(upload),
                reason,
                self.directory,
                e,
                self.counts["dropped"],
            )
        else:
            self.counts["dead_lettered"] += 1
            self.log.error(
                "profile %s service=%r type=%s window=%s refused by the backend: %s; not retried, moved "
                "to %s.pb.gz with the reason in %s.json",
                upload.profile_id,
                upload.service,
                upload.profile_type,
                window_text(upload),
                reason,
                base,
                base,
            )

    def quarantine(self, src: str, entry: Entry, reason: str) -> None:
        """Move the spool file `src` here as it is, with the reason; if it cannot be moved, remove it."""
        dst = os.path.join(self.directory, entry.name)
        try:
            os.replace(src, dst)
            write_atomic(
                dst + ".json",
                json.dumps(
                    {"id": entry.profile_id, "status": None, "reason": reason, "dead_lettered_at_ns": time.time_ns()}
                ).encode()
                + b"\n",
            )
            self.counts["dead_lettered"] += 1
            self.log.error("spooled profile %s cannot be read back (%s): moved to %s", entry.profile_id, reason, dst)
        except OSError as e:
            self.counts["dropped"] += 1
            self.log.error(
                "spooled profile %s cannot be read back (%s) nor moved to %s (%s): dropped",
                entry.profile_id,
                reason,
                self.directory,
                e,
            )
            with contextlib.suppress(OSError):
                os.unlink(src)

    def trim(self) -> None:
        """Remove the oldest beyond MAX_DEAD_LETTERS."""
        try:
            records = sorted(n for n in os.listdir(self.directory) if n.endswith(".json"))
        except OSError:
            return
        extra = records[: max(0, len(records) - MAX_DEAD_LETTERS)]
        for name in extra:
            stem = name[: -len(".json")]
            for victim in (name, stem + ".pb.gz", stem):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, victim))
        if extra:
            self.log.warning("removed the %d oldest dead letter(s): at most %d are kept", len(extra), MAX_DEAD_LETTERS)
