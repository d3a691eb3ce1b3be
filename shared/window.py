"""Per-service aggregation windows of one worker (a symbolizer or the runtime reader).

Owns: which upload window a batch belongs to (wall-clock aligned windows of
upload_interval_s), the per (profile type, window, service) sum of samples by
(labels, frames), its size bound, handing closed windows out once, and a
change of the window length while running (remote config): set_interval()
hands out every open window at once, the one in progress ending at the
moment of the change, and the next window runs from that moment to the next
boundary of the new length; windows after it are aligned as usual.

A batch that arrives after its window was handed out is counted into the
oldest window still open, never into a second profile of a closed window.

Services per window are capped (MAX_SERVICES_PER_WINDOW): a process whose
service would pass the cap has its samples summed into OTHER_SERVICES (with
their own process labels), counted (samples_over_service_cap, when the window
is handed out) and logged once per process.

Must not: resolve frames or encode profiles.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Distinct (labels, stack) rows per service per window. A service with more is
# pathological (or hostile); further rows are summed into one truncated row.
MAX_ROWS_PER_SERVICE_WINDOW = 100_000

TRUNCATED: tuple[Hashable, ...] = ("[truncated]",)
# Services in one window of one profile type (per symbolizer worker; in the runtime reader). A host
# runs a few hundred at most (Kubernetes' default is 110 pods a node), each one profile and one upload
# per window; a local user starting programs from many paths would otherwise grow both without bound.
MAX_SERVICES_PER_WINDOW = 1_000
# The service that stands for those past the cap; its samples keep their process labels.
OTHER_SERVICES = "[other services]"

log = logging.getLogger(__name__)


@dataclass
class ServiceWindow:
    rows: dict[tuple[Any, Any], list[int]] = field(default_factory=dict)  # (labels, frames) → [count, value, *extra]
    truncated: int = 0
    period: int = 0  # the pprof period: of the last batch added (the collector's rate may change)

    def add(self, labels: Hashable, frames: Hashable, count: int, value: int, extra: tuple[int, ...] = ()) -> None:
        """Sum one sample's values into its row; `extra`: values after (count, value) (alloc's inuse)."""
        key = (labels, frames)
        row = self.rows.get(key)
        if row is None:
            if len(self.rows) >= MAX_ROWS_PER_SERVICE_WINDOW:
                self.truncated += count
                key = (labels, TRUNCATED)
                row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = [0, 0]
        row[0] += count
        row[1] += value
        for i, x in enumerate(extra):
            if len(row) <= 2 + i:
                row.append(0)
            row[2 + i] += x


@dataclass(frozen=True)
class ClosedWindow:
    profile_type: str
    service: str
    start_ns: int
    end_ns: int
    data: ServiceWindow


class Windows:
    def __init__(self, interval_s: int) -> None:
        self.interval_s = interval_s
        self.interval_ns = interval_s * 1_000_000_000
        self._open: dict[tuple[str, int], dict[str, ServiceWindow]] = defaultdict(dict)
        self._closed_before = 0  # times before this belong to windows that were handed out
        self._since = 0  # the last change of length: no window starts before it
        self.late_batches = 0
        self.samples_over_service_cap = 0  # summed into OTHER_SERVICES, counted as their windows close
        self._cap_logged = False

    def window_start(self, time_ns: int) -> int:
        if time_ns < self._closed_before:
            self.late_batches += 1
            time_ns = self._closed_before
        return max(time_ns - time_ns % self.interval_ns, self._since)

    def window_end(self, start_ns: int) -> int:
        """The end of the window starting at start_ns: the next boundary of the current length."""
        return start_ns - start_ns % self.interval_ns + self.interval_ns

    def services(self, profile_type: str, time_ns: int) -> dict[str, ServiceWindow]:
        """The open window of a batch drained at time_ns, by service (look it up once per batch)."""
        return self._open[(profile_type, self.window_start(time_ns))]

    def service(self, profile_type: str, time_ns: int, service: str) -> ServiceWindow:
        return self.service_in(self.services(profile_type, time_ns), service)

    def service_in(self, by_service: dict[str, ServiceWindow], service: str) -> ServiceWindow:
        """`service`'s window in `by_service` (from services()), made if new; OTHER_SERVICES's once the
        window holds MAX_SERVICES_PER_WINDOW services."""
        w = by_service.get(service)
        if w is None:
            if len(by_service) >= MAX_SERVICES_PER_WINDOW:
                if not self._cap_logged:
                    self._cap_logged = True
                    log.warning(
                        "more than %d services in one window: the samples of the rest are summed "
                        "into %s (counted as samples_over_service_cap; logged once)",
                        MAX_SERVICES_PER_WINDOW,
                        OTHER_SERVICES,
                    )
                service = OTHER_SERVICES
                w = by_service.get(service)
            if w is None:
                w = by_service[service] = ServiceWindow()
        return w

    def close_due(self, now_ns: int, grace_ns: int) -> Iterator[ClosedWindow]:
        """Hand out every window that ended more than grace_ns ago."""
        yield from self._close(lambda start: self.window_end(start) + grace_ns <= now_ns)
        current = now_ns - grace_ns
        self._closed_before = max(self._closed_before, current - current % self.interval_ns)

    def next_close_ns(self, grace_ns: int) -> int | None:
        """When close_due() will next hand out a window (wall-clock ns), or None while none is open."""
        ends = [self.window_end(start) for _, start in self._open]
        return min(ends) + grace_ns if ends else None

    def close_all(self) -> Iterator[ClosedWindow]:
        """Hand out every open window, the one in progress included (on stop)."""
        yield from self._close(lambda start: True)

    def set_interval(self, interval_s: int, now_ns: int) -> list[ClosedWindow]:
        """Change the window length at now_ns: every open window is handed out (returned), the one in
        progress ending at now_ns; later batches go to windows of the new length. A batch timed
        before now_ns that arrives later counts into the first new window (a late batch)."""
        if interval_s == self.interval_s:
            return []
        closed = list(self._close(lambda start: True, cut_ns=now_ns))
        self.interval_s = interval_s
        self.interval_ns = interval_s * 1_000_000_000
        self._since = max(self._since, now_ns)
        self._closed_before = max(self._closed_before, now_ns)
        return closed

    def _close(self, due: Callable[[int], bool], cut_ns: int | None = None) -> Iterator[ClosedWindow]:
        for key in sorted(k for k in self._open if due(k[1])):
            profile_type, start = key
            end = self.window_end(start)
            if cut_ns is not None and start < cut_ns < end:
                end = cut_ns
            for service, data in self._open.pop(key).items():
                if service == OTHER_SERVICES:
                    self.samples_over_service_cap += sum(row[0] for row in data.rows.values())
                yield ClosedWindow(profile_type, service, start, end, data)
