"""The delivery loop: a thread that posts spooled profiles, oldest first, until each gets a 2xx.

Owns: the order of attempts (the oldest due profile first), what each outcome
does to a spooled profile (2xx: removed; retryable: due again after a backoff;
anything else: dead-lettered with status and reason), the pause after a
retryable failure (exponential with jitter, Retry-After honoured; it resets on
a success), and the bounded final attempt at stop. A 2xx whose reply says that
some profiles were rejected for good (OTLP's partial_success) leaves the spool
like any 2xx: the rejection is logged and counted (counts["rejected"]), never
retried, as the OTLP specification asks. While the backend cannot be
reached, the oldest profile stays first in line, so when it is back the
backlog flows oldest first; a profile the backend answered with a retryable
error (or did not answer in time) also waits out its own backoff, so one bad
profile cannot hold up the rest. Every failed attempt is counted by its cause
(http.Outcome.cause: deadline, read_timeout, ...) in the uploader's counters
file (shared/counters.py), which `ebpfprofiler status` prints.

Retry state (attempts, next attempt time) lives in memory only; the spool
itself survives restarts, so a profile is retried by the next run too.

Must not: read the receive socket, write spool files itself (spool.py does),
or block a stop for longer than the final attempt allows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from shared.counters import CounterFile
from shared.handoff import window_text
from shared.wire import ProfileUpload
from uploader.http import HttpClient, Outcome, backoff_delay
from uploader.spool import Entry, Spool

# An idle sender still wakes this often (to notice a stop, or a due time that moved).
IDLE_WAKE_S = 1.0
# After an unexpected error (a bug) the loop pauses this long rather than spin.
ERROR_PAUSE_S = 5.0


class Sender:
    """Posts what is in the spool from its own thread."""

    def __init__(
        self,
        spool: Spool,
        client: HttpClient,
        log: logging.Logger,
        backoff_base_s: float,
        checks: CounterFile | None = None,
    ) -> None:
        self.spool = spool
        self.client = client
        self.log = log
        self.backoff_base_s = backoff_base_s
        self.counts: Counter[str] = Counter()
        self.checks = checks  # failed attempts by cause, for status
        self.after_attempt: Callable[[], None] = lambda: None  # the uploader's running totals, for status
        self._stopping = threading.Event()
        self._final_deadline = 0.0
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, final_s: float, join_slack_s: float) -> bool:
        """Make one bounded final attempt at what is spooled, then end; True if the thread ended in time.

        Everything spooled becomes due at once and is posted, oldest first,
        until the spool is empty or final_s have passed; a backoff pause that
        would end after that ends the attempt early (the backend is failing:
        the spool keeps everything safe for the next start). A post still in
        flight at the end is abandoned; its profile stays spooled and is sent
        again by the next run (same id, stored once).
        """
        self._final_deadline = time.monotonic() + final_s
        self.spool.make_all_due()
        self._stopping.set()
        self.spool.wake()
        self._thread.join(final_s + join_slack_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        failures = 0  # consecutive retryable failures, any profile
        pause_until = 0.0
        while True:
            if self.checks is not None:
                self.checks.flush()
            now = time.monotonic()
            stopping = self._stopping.is_set()
            if stopping and now >= self._final_deadline:
                return
            if now < pause_until:
                if stopping and pause_until >= self._final_deadline:
                    return  # the backend is failing: no point holding the stop
                self.spool.wait(min(pause_until - now, IDLE_WAKE_S))
                continue
            item = self.spool.take(now)
            if item is None:
                if stopping:
                    return
                due = self.spool.next_due_in(now)
                self.spool.wait(IDLE_WAKE_S if due is None else min(max(due, 0.01), IDLE_WAKE_S))
                continue
            entry, upload = item
            try:
                failures, pause_until = self._attempt(entry, upload, failures, pause_until)
                self.after_attempt()
            except Exception:
                self.log.exception("unexpected error sending profile %s; it stays in the spool", entry.profile_id)
                self.spool.retry_later(entry, time.monotonic() + ERROR_PAUSE_S)
                pause_until = time.monotonic() + ERROR_PAUSE_S

    def _attempt(self, entry: Entry, upload: ProfileUpload, failures: int, pause_until: float) -> tuple[int, float]:
        """One post of `upload`, and what its outcome does: (consecutive failures, pause until) after it."""
        outcome = self.client.post(upload)
        entry.attempts += 1
        if outcome.ok:
            self._delivered(entry, upload, outcome, failures)
            return 0, pause_until
        if outcome.cause:
            self.counts[outcome.cause] += 1
            if self.checks is not None:
                self.checks.count(outcome.cause)
        if outcome.retry:
            failures += 1
            return failures, self._retry(entry, upload, outcome, failures)
        self.counts["dead_lettered"] += 1
        self.spool.dead_letter(entry, upload, outcome.status, outcome.reason)
        return failures, pause_until

    def _delivered(self, entry: Entry, upload: ProfileUpload, outcome: Outcome, failures: int) -> None:
        """A 2xx: the profile leaves the spool; a partial rejection is logged and counted."""
        self.spool.delivered(entry)
        self.counts["delivered"] += 1
        if outcome.rejected:
            self.counts["rejected"] += outcome.rejected
            self.log.warning(
                "the backend accepted the upload of profile %s service=%r type=%s window=%s but "
                "rejected %d profile(s) of it: %r (not retried; %d rejected so far)",
                upload.profile_id,
                upload.service,
                upload.profile_type,
                window_text(upload),
                outcome.rejected,
                outcome.note,
                self.counts["rejected"],
            )
        elif outcome.note:
            self.log.debug("profile %s: %s", upload.profile_id, outcome.note)
        if failures:
            self.log.info(
                "the backend accepts profiles again after %d failed attempt(s); %d profile(s) left in the spool",
                failures,
                len(self.spool),
            )
        self.log.debug(
            "uploaded profile %s service=%r type=%s window=%s on attempt %d",
            upload.profile_id,
            upload.service,
            upload.profile_type,
            window_text(upload),
            entry.attempts,
        )

    def _retry(self, entry: Entry, upload: ProfileUpload, outcome: Outcome, failures: int) -> float:
        """A retryable failure: the profile is due again after its backoff; the time the sender pauses until."""
        self.counts["failed_attempts"] += 1
        pause = backoff_delay(self.backoff_base_s, failures, outcome.retry_after_s)
        # A backend that was not reached says nothing about this profile: it stays first in line,
        # and the pause alone spaces the attempts. One that answered (or timed out reading) may
        # be failing on this profile: it also waits out its own backoff, so others go meanwhile.
        if outcome.reached:
            entry.failures += 1
            again = max(pause, backoff_delay(self.backoff_base_s, entry.failures, outcome.retry_after_s))
        else:
            again = pause
        now = time.monotonic()
        self.spool.retry_later(entry, now + again)
        self.log.warning(
            "upload of profile %s service=%r type=%s window=%s failed (attempt %d): %s; next "
            "attempt in %.2f s; %d profile(s) waiting in the spool",
            upload.profile_id,
            upload.service,
            upload.profile_type,
            window_text(upload),
            entry.attempts,
            outcome.reason,
            again,
            len(self.spool),
        )
        return now + pause
