"""On-CPU samples with registers, for the runtime readers that walk JIT frames from them (the JVM).

Owns: which processes bpf/oncpu.c sends registers for (oncpu_regs_pids: a
process that maps a file the registry names for a runtime that
runtime_stacks turns on, such as libjvm.so, found in the mappings of the
processes a drain saw; dropped when the process exits; a slot whose process
had no on-CPU sample for IDLE_EVICT_S goes to a process that waits for one
and has had on-CPU samples since, the eviction counted as squatting and
logged once per process), taking the
oncpu_regs ring buffer's records (RECORD: the C struct oncpu_regs_record),
and publishing them to the runtime readers as RegsBatch messages on the
announcer's socket, once a drain and whenever the program wakes the
collector (every ONCPU_REGS_WAKE_EVERY-th record). A record of a process no
longer marked, or of a pid now naming another process, is dropped.

Must not: read process memory or walk stacks (the runtime reader does, as
the runtime user), mark a process for any reason but its mappings' names, or
change the BPF program (slots are given and taken back in its map, from here).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

from shared.log import LogOnce
from shared.procstat import start_ticks
from shared.wire import Process, RegsBatch, RegsSample

# Processes marked at once: JVMs on one host; past it, a new one waits for a slot (logged, counted).
ONCPU_REGS_PIDS = 1024
# A marked process with no on-CPU sample for this long is squatting: its slot goes to a waiting process
# that has had on-CPU samples since (a JVM at work is sampled many times a second; a newly marked process
# gets this long to show it).
IDLE_EVICT_S = 30.0
# Stack bytes a record copies from sp up: a few compiled Java frames (48-200 bytes each) and the
# interpreter's; deeper frames are read from the process later, by the runtime reader.
ONCPU_REGS_STACK_BYTES = 1024
# The copy when the full one would cross the top of the stack (a thread's first frames).
ONCPU_REGS_SHORT_STACK_BYTES = 256
# The ring: 128 pages (512 KiB) hold ~480 records, so waking at every 32nd loses none while the
# collector's loop keeps up.
ONCPU_REGS_RING_PAGES = 128
ONCPU_REGS_WAKE_EVERY = 32
# Records held between two sends at most, ~9 MB (the loop sends every 32nd record; a burst past it while
# the loop is held up is dropped and counted).
MAX_PENDING = 8192
# Samples in one RegsBatch (~4.3 MB with their stacks, far under the readers' message cap).
SAMPLES_PER_MESSAGE = 4096
# How often marked processes are checked for exit (one /proc/<pid>/stat read each).
EXIT_CHECK_S = 2.0

# struct oncpu_regs_record in bpf/oncpu.c, up to its stack copy: pid, tid, time_ns, ip, sp, fp, stack_len, pad.
RECORD = struct.Struct("<IIQQQQII")

log = logging.getLogger(__name__)


def bpf_defines() -> dict[str, int]:
    """The -D flags of bpf/oncpu.c's register path."""
    d = {
        "ONCPU_REGS": 1,
        "ONCPU_REGS_PIDS": ONCPU_REGS_PIDS,
        "ONCPU_REGS_STACK_BYTES": ONCPU_REGS_STACK_BYTES,
        "ONCPU_REGS_SHORT_STACK_BYTES": ONCPU_REGS_SHORT_STACK_BYTES,
        "ONCPU_REGS_RING_PAGES": ONCPU_REGS_RING_PAGES,
        "ONCPU_REGS_WAKE_EVERY": ONCPU_REGS_WAKE_EVERY,
    }
    return d


def marked_by(process: Process, names: frozenset[str]) -> str | None:
    """The first mapping of `process` whose file name is one of `names` (a name ending in "*": one that
    starts with what precedes it), or None."""
    prefixes = tuple(n[:-1] for n in names if n.endswith("*"))
    for m in process.mappings:
        base = m.path.rsplit("/", 1)[-1]
        if base in names or (prefixes and base.startswith(prefixes)):
            return m.path
    return None


class RegsForwarder:
    def __init__(self, bpf: Any, names: frozenset[str], publish: Callable[[RegsBatch], None], host: str) -> None:
        self._bpf = bpf
        self._names = names
        self._publish = publish
        self.host = host
        self._pids = bpf["oncpu_regs_pids"]
        self._marked: dict[int, int] = {}  # pid → start_ticks of the process marked
        self._used: dict[int, float] = {}  # marked pid → time.monotonic() of its last on-CPU sample
        self._paths: dict[int, str] = {}  # marked pid → the mapping it was marked for (the log)
        # pid → (start_ticks, mapping, time.monotonic() of its last on-CPU sample): processes waiting for a slot
        self._waiting: dict[int, tuple[int, str, float]] = {}
        self._log_once = LogOnce(log)
        self._seen: dict[int, tuple[int, int]] = {}  # pid → (start_ticks, mappings) last looked at, unmarked
        self._pending: list[RegsSample] = []
        self._next_exit_check = time.monotonic() + EXIT_CHECK_S
        self.stats = {
            "marked": 0,
            "unmarked": 0,
            "not_marked_full": 0,
            "evicted_idle": 0,
            "records": 0,
            "sent": 0,
            "dropped_unmarked": 0,
            "dropped_pending": 0,
            "malformed": 0,
        }
        bpf["oncpu_regs"].open_ring_buffer(self._on_record)

    def fd(self) -> int:
        """The ring buffer's descriptor: readable when the program woke the collector."""
        return int(self._bpf["oncpu_regs"].map_fd)

    def observe(self, processes: Iterable[Process], on_cpu: bool = True) -> None:
        """Processes of a drain (of on-CPU samples when `on_cpu`): mark the new ones that map a file of the
        runtimes asked for; when every slot is taken, such a process with on-CPU samples waits for one, and
        gets the slot of a marked process idle for IDLE_EVICT_S."""
        now = time.monotonic()
        for p in processes:
            if self._marked.get(p.pid) == p.start_ticks:
                if on_cpu:
                    self._used[p.pid] = now
                continue
            if not p.mappings:
                continue
            if self._seen.get(p.pid) == (p.start_ticks, len(p.mappings)):
                continue
            path = marked_by(p, self._names)
            if path is None:
                self._seen[p.pid] = (p.start_ticks, len(p.mappings))
                if len(self._seen) > 4 * ONCPU_REGS_PIDS:  # only a memo: forgotten whole
                    self._seen.clear()
                continue
            self._seen.pop(p.pid, None)
            if p.pid not in self._marked and len(self._marked) >= ONCPU_REGS_PIDS:
                self.stats["not_marked_full"] += 1
                if on_cpu and (p.pid in self._waiting or len(self._waiting) < ONCPU_REGS_PIDS):
                    self._waiting[p.pid] = (p.start_ticks, path, now)
                if self.stats["not_marked_full"] == 1:
                    log.warning(
                        "registers with on-CPU samples: %d processes marked already; pid %d (%s) waits "
                        "for the slot of one with no on-CPU sample for %.0f s (its JIT frames stay "
                        "unnamed in the cpu profile until then)",
                        ONCPU_REGS_PIDS,
                        p.pid,
                        path,
                        IDLE_EVICT_S,
                    )
                continue
            self._mark(p.pid, p.start_ticks, path, now)
        self._give_slots(now)

    def _mark(self, pid: int, ticks: int, path: str, now: float) -> None:
        self._waiting.pop(pid, None)
        self._pids[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        self._marked[pid] = ticks
        self._used[pid] = now  # IDLE_EVICT_S from now to show that it runs
        self._paths[pid] = path
        self.stats["marked"] += 1
        log.info("registers with on-CPU samples: pid %d (maps %s)", pid, path)

    def _give_slots(self, now: float) -> None:
        """Slots of squatting processes (no on-CPU sample for IDLE_EVICT_S) to waiting ones, the most
        recently busy first; a waiting process not seen on a CPU for IDLE_EVICT_S is forgotten."""
        for pid in [q for q, (_, _, seen) in self._waiting.items() if now - seen >= IDLE_EVICT_S]:
            del self._waiting[pid]
        for pid, (ticks, path, _) in sorted(self._waiting.items(), key=lambda kv: -kv[1][2]):
            if self._marked.get(pid) == ticks or start_ticks(pid) != ticks:
                del self._waiting[pid]  # marked already, or exited meanwhile
                continue
            if len(self._marked) >= ONCPU_REGS_PIDS:
                idle = min(self._used, key=self._used.__getitem__)
                if now - self._used[idle] < IDLE_EVICT_S:
                    return  # every holder ran within IDLE_EVICT_S: the others wait on
                self.stats["evicted_idle"] += 1
                self._log_once(
                    ("evicted", idle, self._marked[idle]),
                    logging.WARNING,
                    "registers with on-CPU samples: pid %d (maps %s) had no on-CPU sample for %.0f s: "
                    "its slot goes to pid %d (maps %s), which runs (%d slots taken back so far, "
                    "regs_evicted_idle in status)",
                    idle,
                    self._paths.get(idle, "?"),
                    now - self._used[idle],
                    pid,
                    path,
                    self.stats["evicted_idle"],
                )
                self._unmark(idle)
            self._mark(pid, ticks, path, now)

    def checks(self) -> dict[str, int]:
        """The checks that fired, for the collector's status counters."""
        return {"regs_not_marked_full": self.stats["not_marked_full"], "regs_evicted_idle": self.stats["evicted_idle"]}

    def _on_record(self, _ctx: object, data: int, size: int) -> None:
        self.stats["records"] += 1
        if size < RECORD.size:
            self.stats["malformed"] += 1
            return
        raw = ctypes.string_at(data, size)
        pid, tid, t_ns, ip, sp, fp, n, _ = RECORD.unpack_from(raw)
        ticks = self._marked.get(pid)
        if ticks is None:
            self.stats["dropped_unmarked"] += 1
            return
        self._used[pid] = time.monotonic()
        if n > size - RECORD.size:
            self.stats["malformed"] += 1
            return
        if len(self._pending) >= MAX_PENDING:
            self.stats["dropped_pending"] += 1
            return
        self._pending.append(
            RegsSample(
                pid=pid,
                start_ticks=ticks,
                tid=tid,
                time_ns=t_ns,
                ip=ip,
                sp=sp,
                fp=fp,
                stack=raw[RECORD.size : RECORD.size + n],
            )
        )

    def flush(self, period_ns: int) -> None:
        """Take the ring's records and send them; unmark the processes that exited."""
        self._bpf.ring_buffer_consume()
        now = time.monotonic()
        if now >= self._next_exit_check:
            self._next_exit_check = now + EXIT_CHECK_S
            for pid, ticks in list(self._marked.items()):
                if start_ticks(pid) != ticks:
                    self._unmark(pid)
        self._give_slots(now)
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), SAMPLES_PER_MESSAGE):
            self._publish(
                RegsBatch(
                    host=self.host,
                    time_ns=time.time_ns(),
                    period_ns=period_ns,
                    samples=tuple(pending[i : i + SAMPLES_PER_MESSAGE]),
                )
            )
        self.stats["sent"] += len(pending)

    def _unmark(self, pid: int) -> None:
        with contextlib.suppress(KeyError):
            del self._pids[ctypes.c_uint32(pid)]
        del self._marked[pid]
        self._used.pop(pid, None)
        self._paths.pop(pid, None)
        self.stats["unmarked"] += 1

    def close(self) -> None:
        """Unmark every process (the maps go with the programs; this keeps the record straight)."""
        for pid in list(self._marked):
            self._unmark(pid)
        if self.stats["records"]:
            log.info("registers with on-CPU samples: %s", self.stats)
