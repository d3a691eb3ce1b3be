"""When the collector drains its BPF maps next.

Owns: the regular schedule (regular_delay: how far apart drains may be, from what the last drain
took and how fast the host makes new pids; DrainPace: those figures, kept from drain to drain, and
the window a drain's samples are stamped into), and the early drains of new processes: how long a
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

# The shortest stretch between regular drains (a busy host; and while alloc or lock targets are watched).
DRAIN_INTERVAL_S = 1.0
# Drains are at most this far apart (regular_delay brings them closer for many keys or a fast pid
# churn, down to DRAIN_INTERVAL_S), and one follows each window boundary (BOUNDARY_LAG_S after it):
# with the default 60-s windows a quiet host drains once a window. A drain costs ~3.5 ms of the
# collector's CPU (bcc map calls, /proc joins, batches) and ~1.3 ms of the symbolizer's, plus the
# wake-ups of both (0.1-4 ms each on these VMs): on an idle host drains every 15 s were the largest
# part of the agent's cost. A process that starts meanwhile and lives brings a drain forward
# (EarlyDrains), so that its metadata is read while it lives.
IDLE_DRAIN_INTERVAL_S = 60.0
# A quiet drain is this long after a window boundary: what was sampled up to the boundary is then
# drained, and stamped into the window it was taken in (drain_stamp_ns).
BOUNDARY_LAG_S = 0.05
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
# compilers) would have it look up to five times a second; at two, ~0.07% of a CPU. Not more: a look
# for one process holds back the next new process's by up to this gap, and its stacks stay broken
# until its tables load (at 1.0 s, CI twice saw a new process's first window at 94% whole, 0.58 s
# from its start to its tables, against 0.32 s here).
EARLY_LOOK_GAP_S = 0.5
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


def drain_stamp_ns(last_ns: int, now_ns: int, interval_ns: int) -> int:
    """The time a drain's samples are stamped with: they were taken between the last drain (last_ns)
    and this one (now_ns), and go to the window that holds most of that stretch. With no window
    boundary between the two, that is now; across one, the side with more of the stretch (the
    window before the boundary when the drain follows it closely, as a quiet drain does)."""
    boundary = now_ns - now_ns % interval_ns
    if last_ns >= boundary or now_ns - boundary >= boundary - last_ns:
        return now_ns
    return boundary - 1


class DrainPace:
    """What the last drain took and the stretch it covered, kept for the next regular drain's delay
    (regular_delay) and for the log; begin() starts a drain and says what its samples are stamped with."""

    def __init__(self) -> None:
        self.keys = 0  # keys the last drain took, all families
        self.new_processes = 0  # processes it read from /proc for the first time (for the log)
        self.pids = 0  # pids the host made between the last two drains
        self.stretch_s = 0.0  # seconds between them
        self._pid_max = pid_max()
        self._forks = forks()
        self._last_ns = time.time_ns()  # wall clock: the samples of a drain were taken since then

    def begin(self, interval_s: int) -> int:
        """A drain starts now: the stretch since the last one and the pids made in it are taken; the
        time its samples are stamped with (drain_stamp_ns, windows of `interval_s`)."""
        now_ns = time.time_ns()
        stamp_ns = drain_stamp_ns(self._last_ns, now_ns, interval_s * 1_000_000_000)
        self.stretch_s = (now_ns - self._last_ns) / 1e9
        self._last_ns = now_ns
        made = forks()
        self.pids = made - self._forks if made is not None and self._forks is not None else 0
        self._forks = made
        self.keys = 0
        return stamp_ns

    def regular_delay(self, now_wall: float, interval_s: int) -> float:
        """Seconds to the next regular drain (regular_delay, from DRAIN_INTERVAL_S to
        IDLE_DRAIN_INTERVAL_S), never past BOUNDARY_LAG_S after the next window boundary."""
        return regular_delay(
            keys=self.keys,
            pids_made=self.pids,
            stretch_s=self.stretch_s,
            pid_max=self._pid_max,
            until_boundary_s=interval_s - now_wall % interval_s + BOUNDARY_LAG_S,
            shortest_s=DRAIN_INTERVAL_S,
            longest_s=IDLE_DRAIN_INTERVAL_S,
        )


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
