"""The hand-off of profiles from symbolizer workers to the uploader, with acknowledgements.

Owns: the small protocol on the uploader socket (shared.endpoints.uploader):
a worker's ZeroMQ DEALER sends each profile as

    [envelope, *shared.wire.encode(ProfileUpload)]

where the envelope is JSON {"handoff": HANDOFF_VERSION, "id": profile_id}, and
the uploader's ROUTER answers each one with one ack frame, JSON
{"handoff": HANDOFF_VERSION, "id": profile_id, "status": S, "reason": "..."}:

- "stored":  the profile is durable (fsync'd in the spool, or written under
  local_dir); the worker forgets it.
- "retry":   the uploader cannot take it now (no room on disk); the worker
  keeps it and offers it again after RETRY_AFTER_NACK_S.
- "refused": the uploader will never take it (malformed, another version, over
  a cap); the worker drops it, counted and logged with the reason.

The envelope names the profile outside the versioned wire message, so even a
message the uploader cannot decode is answered by id instead of being resent
forever. Also owns ProfileSender, the worker's side: a bounded queue of
unacknowledged profiles, resends after ACK_TIMEOUT_S (an uploader that
restarted lost what it had not stored; its spool keys on profile_id, so a
duplicate is harmless), backpressure (when the queue is full, send() blocks
until acknowledgements make room, logging once per episode, and returns when
the stage is asked to stop), and a bounded close that reports what could not
be handed off.

Must not: touch disk, decide what the uploader does with a profile, or change
the wire message (shared.wire owns it).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import zmq

from shared.safestr import quote
from shared.wire import ProfileUpload, WireError, decode, encode, json_object

HANDOFF_VERSION = 1

STORED, RETRY, REFUSED = "stored", "retry", "refused"
STATUSES = frozenset({STORED, RETRY, REFUSED})

# Profile ids travel as X-Profile-Id and become spool and receiver file names:
# a safe alphabet, no "/", bounded length.
PROFILE_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
# An envelope is {"handoff":1,"id":<=128 chars}: well under this.
MAX_ENVELOPE_BYTES = 512
# A reason is a one-line explanation for a log; longer ones are cut.
MAX_REASON_CHARS = 400
# An ack is an id and a reason (JSON escaping can at most sextuple the reason).
MAX_ACK_BYTES = 4096

# Worker side. Profiles waiting for an ack, by count and by bytes: a window
# closes one profile per service and type at once, and acks take milliseconds,
# so the queue is only full when the uploader is down or stuck. 16 MiB keeps a
# worker within its tens-of-MB budget; a single profile larger than that (the
# wire allows 32 MiB) is still taken when the queue is empty.
MAX_UNACKED_PROFILES = 256
MAX_UNACKED_BYTES = 16 << 20
# Spooling takes milliseconds; an uploader silent this long restarted or is
# stuck, so unacknowledged profiles are offered again (a duplicate is harmless).
ACK_TIMEOUT_S = 10.0
# Each further resend of the same profile waits twice as long, up to this, so a
# long outage does not pile copies into the socket.
MAX_ACK_TIMEOUT_S = 60.0
# An uploader that answered "retry" (its disk is full) is asked again after this.
RETRY_AFTER_NACK_S = 2.0
# While blocked on a full queue, how often the sender wakes to read acks and
# notice a stop request.
WAIT_POLL_MS = 200
# Worker.close() waits this long for the last acks: `ebpfprofiler run` kills a
# stage 20 s after SIGTERM, and closing the open windows needs some of that.
CLOSE_TIMEOUT_S = 10.0


class HandoffError(ValueError):
    """A hand-off message that is not valid; profile_id is set when the envelope named one."""

    def __init__(self, message: str, profile_id: str | None = None) -> None:
        super().__init__(message)
        self.profile_id = profile_id


@dataclass(frozen=True, slots=True)
class Ack:
    profile_id: str
    status: str  # STORED, RETRY or REFUSED
    reason: str = ""


def is_valid_profile_id(profile_id: str) -> bool:
    return PROFILE_ID_PATTERN.fullmatch(profile_id) is not None


def cut(reason: str, limit: int = MAX_REASON_CHARS) -> str:
    """A reason cut to `limit` characters, for logs and acks."""
    return reason if len(reason) <= limit else reason[: limit - 1] + "…"


# ---------------------------------------------------------------- profile messages


def encode_profile(upload: ProfileUpload) -> list[bytes]:
    """The frames a worker sends for one profile: envelope, then the wire message."""
    if not is_valid_profile_id(upload.profile_id):
        raise ValueError(f"profile id {upload.profile_id[:200]!r} is not 1 to 128 characters of [A-Za-z0-9._-]")
    envelope = json.dumps({"handoff": HANDOFF_VERSION, "id": upload.profile_id}, separators=(",", ":"))
    return [envelope.encode(), *encode(upload)]


def decode_profile(frames: Sequence[bytes]) -> ProfileUpload:
    """The profile in `frames`; HandoffError (with the id when known) if it is not a valid one."""
    if len(frames) < 2:
        raise HandoffError(f"expected an envelope and a wire message, got {len(frames)} frame(s)")
    profile_id = _envelope_id(frames[0])
    try:
        msg = decode(frames[1:])
    except WireError as e:
        raise HandoffError(f"wire: {e}", profile_id) from None
    if not isinstance(msg, ProfileUpload):
        raise HandoffError(f"a {type(msg).__name__} message was sent to the uploader", profile_id)
    if msg.profile_id != profile_id:
        raise HandoffError(
            f"envelope id {quote(profile_id)} differs from the profile's {quote(msg.profile_id)}", profile_id
        )
    return msg


def _envelope_id(frame: bytes) -> str:
    doc = json_object(frame, MAX_ENVELOPE_BYTES, "envelope", HandoffError)
    profile_id = doc.get("id")
    if not isinstance(profile_id, str) or not is_valid_profile_id(profile_id):
        raise HandoffError("envelope has no valid profile id")
    if doc.get("handoff") != HANDOFF_VERSION:
        raise HandoffError(
            f"hand-off version {quote(doc.get('handoff'))}, this build speaks {HANDOFF_VERSION}", profile_id
        )
    return profile_id


# ---------------------------------------------------------------- acks


def encode_ack(profile_id: str, status: str, reason: str = "") -> bytes:
    """The one ack frame the uploader sends back for a profile."""
    if status not in STATUSES:
        raise ValueError(f"ack status {quote(status)} is not one of {sorted(STATUSES)}")
    return json.dumps(
        {"handoff": HANDOFF_VERSION, "id": profile_id, "status": status, "reason": cut(reason)}, separators=(",", ":")
    ).encode()


def decode_ack(frame: bytes) -> Ack:
    """The ack in `frame`; HandoffError if it is not a valid one."""
    doc = json_object(frame, MAX_ACK_BYTES, "ack", HandoffError)
    if doc.get("handoff") != HANDOFF_VERSION:
        raise HandoffError(f"not an ack of hand-off version {HANDOFF_VERSION}")
    profile_id, status, reason = doc.get("id"), doc.get("status"), doc.get("reason", "")
    if not isinstance(profile_id, str) or not is_valid_profile_id(profile_id):
        raise HandoffError("ack has no valid profile id")
    if status not in STATUSES or not isinstance(reason, str):
        raise HandoffError(f"ack status {quote(status)} is not one of {sorted(STATUSES)}")
    return Ack(profile_id, status, cut(reason))


# ---------------------------------------------------------------- the worker's side


def window_text(upload: ProfileUpload) -> str:
    """A profile's window for log lines: UTC start and length."""
    start = datetime.fromtimestamp(upload.window_start_ns / 1e9, tz=UTC)
    return f"{start:%Y-%m-%dT%H:%M:%S}Z+{(upload.window_end_ns - upload.window_start_ns) / 1e9:g}s"


@dataclass(slots=True)
class _Pending:
    upload: ProfileUpload
    frames: list[bytes]
    size: int
    queued_at: float
    on_socket: bool = False  # False: the socket refused it (no uploader connected); try again
    resend_at: float = 0.0
    sends: int = 0


class ProfileSender:
    """Hands profiles to the uploader over a connected DEALER socket and keeps each until it is acked.

    Single-threaded: call send() and poll() from the worker's loop. The socket
    should have ZMQ_IMMEDIATE set (no queueing towards an absent uploader) and
    a send HWM of max_profiles.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        log: logging.Logger,
        *,
        max_profiles: int = MAX_UNACKED_PROFILES,
        max_bytes: int = MAX_UNACKED_BYTES,
        ack_timeout_s: float = ACK_TIMEOUT_S,
        should_stop: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sock = sock
        self.log = log
        self.max_profiles = max_profiles
        self.max_bytes = max_bytes
        self.ack_timeout_s = ack_timeout_s
        self.should_stop = should_stop
        self.clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._bytes = 0
        self._nacked_since: float | None = None
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------ figures

    @property
    def pending_profiles(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def pending(self) -> list[ProfileUpload]:
        """The unacknowledged profiles, oldest first."""
        return [p.upload for p in self._pending.values()]

    # ------------------------------------------------------------ sending

    def checks(self) -> dict[str, int]:
        """What status shows of the hand-off: waits on a full uploader, and malformed acks ignored."""
        return {"uploader_waits": self.counts["waits"], "uploader_bad_acks": self.counts["bad_acks"]}

    def send(self, upload: ProfileUpload) -> None:
        """Queue one profile for the uploader; blocks while the queue is full (backpressure).

        A stop request (should_stop) ends the wait: the profile is then queued
        over the cap, for close() to hand off or report.
        """
        frames = encode_profile(upload)
        size = sum(len(f) for f in frames)
        self.poll(0)
        if self._full(size):
            self._wait_for_room(size)
        if upload.profile_id in self._pending:
            return
        p = _Pending(upload, frames, size, self.clock())
        self._pending[upload.profile_id] = p
        self._bytes += size
        self.counts["queued"] += 1
        self._put(p)

    def poll(self, timeout_ms: int = 0) -> None:
        """Take the acks that arrived (waiting up to timeout_ms for the first), then resend what is due."""
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_ack(frames)
        now = self.clock()
        resent = 0
        for p in self._pending.values():
            if not p.on_socket or now >= p.resend_at:
                if p.on_socket:
                    resent += 1
                if not self._put(p):
                    break  # no uploader connected: the rest would be refused too
        if resent:
            self.counts["resent"] += resent
            self.log.warning(
                "no acknowledgement from the uploader: offered %d profile(s) again "
                "(%d unacknowledged, %.1f MB); an uploader that restarted stores each once",
                resent,
                len(self._pending),
                self._bytes / 1e6,
            )

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> list[ProfileUpload]:
        """Wait up to timeout_s for every profile to be acked; log and return those that were not."""
        deadline = self.clock() + timeout_s
        while self._pending and self.clock() < deadline:
            self.poll(WAIT_POLL_MS)
        left = self.pending()
        if left:
            services = sorted({u.service for u in left})
            windows = sorted({window_text(u) for u in left})
            self.log.error(
                "could not hand %d profile(s) (%.1f MB) to the uploader within %.0f s; they are lost: "
                "services %s; windows %s",
                len(left),
                self._bytes / 1e6,
                timeout_s,
                ", ".join(repr(s) for s in services[:20]) + (" …" if len(services) > 20 else ""),
                ", ".join(windows[:20]) + (" …" if len(windows) > 20 else ""),
            )
            self.counts["lost_at_close"] += len(left)
        return left

    # ------------------------------------------------------------ internals

    def _full(self, size: int) -> bool:
        if not self._pending:
            return False
        return len(self._pending) >= self.max_profiles or self._bytes + size > self.max_bytes

    def _wait_for_room(self, size: int) -> None:
        started = self.clock()
        oldest = next(iter(self._pending.values()))
        self.counts["waits"] += 1
        self.log.warning(
            "waiting on the uploader: %d profiles (%.1f MB) not acknowledged, caps %d profiles / %.1f MB; "
            "oldest waiting %.0f s (service %r, window %s); not reading new batches until it catches up",
            len(self._pending),
            self._bytes / 1e6,
            self.max_profiles,
            self.max_bytes / 1e6,
            started - oldest.queued_at,
            oldest.upload.service,
            window_text(oldest.upload),
        )
        while self._full(size):
            if self.should_stop():
                self.counts["stopped_waiting"] += 1  # a wait a stop request ended, not the uploader
                self.log.warning(
                    "stop requested while waiting on the uploader: keeping this profile over the cap "
                    "for the final hand-off"
                )
                return
            self.poll(WAIT_POLL_MS)
        self.counts["caught_up"] += 1  # a wait the uploader's acks ended
        self.log.info(
            "the uploader caught up after %.1f s; %d profiles (%.1f MB) still unacknowledged",
            self.clock() - started,
            len(self._pending),
            self._bytes / 1e6,
        )

    def _put(self, p: _Pending) -> bool:
        """Offer one profile to the socket; False if no uploader is connected (try again later)."""
        try:
            self.sock.send_multipart(p.frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            p.on_socket = False
            return False
        p.on_socket = True
        p.sends += 1
        p.resend_at = self.clock() + min(self.ack_timeout_s * 2 ** (p.sends - 1), MAX_ACK_TIMEOUT_S)
        return True

    def _on_ack(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise HandoffError(f"an ack is one frame, got {len(frames)}")
            ack = decode_ack(frames[0])
        except HandoffError as e:
            self.counts["bad_acks"] += 1
            self.log.warning("ignored a malformed ack from the uploader (%d so far): %s", self.counts["bad_acks"], e)
            return
        p = self._pending.get(ack.profile_id)
        if p is None:
            return  # an ack for a resent duplicate, already settled
        if ack.status == RETRY:
            self.counts["nacked"] += 1
            p.resend_at = self.clock() + RETRY_AFTER_NACK_S
            if self._nacked_since is None:
                self._nacked_since = self.clock()
                self.log.warning(
                    "the uploader cannot take profiles now (%s); keeping %d profiles (%.1f MB) here "
                    "and offering them again every %.0f s",
                    ack.reason,
                    len(self._pending),
                    self._bytes / 1e6,
                    RETRY_AFTER_NACK_S,
                )
            return
        del self._pending[ack.profile_id]
        self._bytes -= p.size
        if ack.status == STORED:
            self.counts["acked"] += 1
            if self._nacked_since is not None:
                self.counts["retry_ended"] += 1  # an episode of "retry" answers the uploader ended
                self.log.info("the uploader takes profiles again after %.1f s", self.clock() - self._nacked_since)
                self._nacked_since = None
        else:
            self.counts["refused"] += 1
            self.log.error(
                "the uploader refused profile %s (service %r, type %s, window %s): %s; dropped (%d refused so far)",
                ack.profile_id,
                p.upload.service,
                p.upload.profile_type,
                window_text(p.upload),
                ack.reason,
                self.counts["refused"],
            )
