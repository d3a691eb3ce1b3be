"""When the collector drains its BPF maps next.

Owns: the regular schedule (regular_delay: how far apart drains may be, from what the last drain
took and how fast the host makes new pids), and the early drains of new processes: how long a
new process must have lived before the programs wake the collector for it (EARLY_ALIVE_S and
EARLY_STALE_S, compiled into bpf/common.h's notify_new_pid), the pids of those events waiting for
an early drain, and the decision whether one is due: only while one of them still lives. A host that
starts hundreds of processes a second (a shell loop's children, each alive for a millisecond or
two) otherwise drained five times a second for processes already gone, each drain a whole round of
map reads, /proc joins and batches for the collector and the symbolizer; their samples lose
nothing by waiting for the regular drain.

Must not: read BPF maps, or /proc beyond whether a pid exists (the `alive` callable) and the
host's fork counter (/proc/stat) and kernel.pid_max.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

# An early drain is at least this long after the last drain (at most five a second).
EARLY_DRAIN_S = 0.2
# The programs wake the collector for a new process only when they count it again at least this
# long after its first count (bpf/common.h notify_new_pid, -DNEW_PID_ALIVE_NS): a shell loop's
# /bin/true or `sleep 0.001` lives 1-5 ms and never wakes it. (The collector used to be woken at a
# process's first count and look 0.25 s later whether it still lived: on a host that keeps starting
# processes, two wake-ups a second of ~0.2-0.35 ms each, for processes long gone.)
EARLY_ALIVE_S = 0.25
# ... and no longer after it than this: an older first count (a pid reused since its first process
# was counted, a process counted once long ago) starts over. A process counted twice within it
# after EARLY_ALIVE_S (at 19 Hz: one using 1% of a CPU or more, or blocking now and then) brings
# an early drain; one counted less often waits for the regular drain.
EARLY_STALE_S = 10.0
# Looks are at least this far apart: each costs the collector ~0.35 ms of CPU (a wake-up, the ring
# buffer, the /proc checks), and a host that keeps starting processes that live a second (a build's
# compilers) would have it look up to five times a second.
EARLY_LOOK_GAP_S = 1.0
# Pids kept waiting (at most one event per NEW_PID_NOTIFY_NS arrives; one that lives is enough).
MAX_EARLY_PIDS = 64
# A drain should take at most this many keys (all families): the next one is brought closer when
# the last one's rate would pass it. 5% of a counts map (COUNTS_ENTRIES), an eighth of a stack
# map (STACK_ENTRIES): far from full, whatever the load does before the next drain.
DRAIN_KEYS_TARGET = 2048
# Drains are at least this many times as frequent as the host's pids wrap around (pid_max / the
# rate new pids are made): samples carry a pid, not a start time, and a pid reused between a
# sample and its drain would give the sample to the new process (another tenant's profile). The
# rate is the last stretch's: a churn would have to grow fourfold at once to wrap within a stretch.
# (systemd sets pid_max to 4194304: there this never binds; a small pid_max of 32768 with a shell
# loop's 500 pids a second: a drain every ~16 s.)
DRAINS_PER_PID_WRAP = 4
# The kernel's pid_max default on a small host (PID_MAX_DEFAULT): assumed when it cannot be read.
PID_MAX_FLOOR = 32768
# /proc/stat is read up to this many bytes for its `processes` line, which follows a line per CPU
# and the interrupt counts (~1 KB on these 2-CPU VMs, ~100s of KB on the largest hosts).
PROC_STAT_CAP = 1 << 20


def regular_delay(
    *,
    keys: int,
    pids_made: int,
    stretch_s: float,
    pid_max: int,
    until_boundary_s: float,
    shortest_s: float,
    longest_s: float,
) -> float:
    """Seconds to the next regular drain, after one that took `keys` keys (all families) over the
    last `stretch_s` seconds, during which the host made `pids_made` pids: longest_s on a quiet
    host, shorter while the keys or the pid churn need it, never under shortest_s, and never past
    the next window boundary (`until_boundary_s`, lag included)."""
    delay = longest_s
    if stretch_s > 0 and keys > 0:
        delay = min(delay, DRAIN_KEYS_TARGET * stretch_s / keys)
    if stretch_s > 0 and pids_made > 0:
        delay = min(delay, pid_max * stretch_s / pids_made / DRAINS_PER_PID_WRAP)
    return max(0.05, min(max(delay, shortest_s), until_boundary_s))


def forks(proc: str = "/proc") -> int | None:
    """Tasks (processes and threads: each takes a pid) the kernel has created since boot: the
    `processes` line of /proc/stat, a counter that does not wrap."""
    try:
        with open(f"{proc}/stat", "rb") as f:
            data = f.read(PROC_STAT_CAP)
    except OSError:
        return None
    at = data.find(b"\nprocesses ")
    if at < 0:
        return None
    try:
        return int(data[at + len(b"\nprocesses ") :].split(b"\n", 1)[0])
    except ValueError:
        return None


def pid_max(proc: str = "/proc") -> int:
    """kernel.pid_max: where the pid counter wraps (the kernel's default if it cannot be read)."""
    try:
        with open(f"{proc}/sys/kernel/pid_max", "rb") as f:
            return max(PID_MAX_FLOOR, int(f.read(64)))
    except (OSError, ValueError):
        return PID_MAX_FLOOR


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


class EarlyDrains:
    """The new processes an early drain may be for, and when it is due."""

    def __init__(self, alive: Callable[[int], bool] = _alive, clock: Callable[[], float] = time.monotonic) -> None:
        self._alive = alive
        self._clock = clock
        self._pending: dict[int, float] = {}  # pid → when its event was taken
        self._last_look = float("-inf")
        self.gone = 0  # early drains not made: their processes had exited

    def notified(self, pids: Iterable[int]) -> None:
        now = self._clock()
        for pid in pids:
            if len(self._pending) >= MAX_EARLY_PIDS:
                break
            self._pending.setdefault(pid, now)

    def due_at(self, last_drain: float) -> float | None:
        """When to look: as the oldest waiting process's event came (it has lived EARLY_ALIVE_S by
        then), not before EARLY_DRAIN_S after the last drain nor EARLY_LOOK_GAP_S after the last
        look; None when no process waits."""
        if not self._pending:
            return None
        return max(last_drain + EARLY_DRAIN_S, self._last_look + EARLY_LOOK_GAP_S, min(self._pending.values()))

    def drain_now(self) -> bool:
        """At due_at(): whether a waiting process still lives. All of them are then forgotten."""
        pids, self._pending = list(self._pending), {}
        if not pids:
            return False
        self._last_look = self._clock()
        if any(self._alive(pid) for pid in pids):
            return True
        self.gone += 1
        return False

    def drained(self) -> None:
        """A drain was made: what the waiting processes were counted for went with it."""
        self._pending.clear()
