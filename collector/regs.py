"""On-CPU samples with registers, for the runtime readers that walk JIT frames from them (the JVM).

Owns: which processes bpf/oncpu.c sends registers for (oncpu_regs_pids: a
process that maps a file the registry names for a runtime that
runtime_stacks turns on, such as libjvm.so, found in the mappings of the
processes a drain saw; dropped when the process exits), taking the
oncpu_regs ring buffer's records (RECORD: the C struct oncpu_regs_record),
and publishing them to the runtime readers as RegsBatch messages on the
announcer's socket, once a drain and whenever the program wakes the
collector (every ONCPU_REGS_WAKE_EVERY-th record). A record of a process no
longer marked, or of a pid now naming another process, is dropped.

Must not: read process memory or walk stacks (the runtime reader does, as
the runtime user), or mark a process for any reason but its mappings' names.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

from ebpfprofiler.shared.procstat import start_ticks
from ebpfprofiler.shared.wire import Process, RegsBatch, RegsSample

# Processes marked at once: JVMs on one host; past it, a new one is not marked (logged, counted).
ONCPU_REGS_PIDS = 1024
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
    d = {"ONCPU_REGS": 1, "ONCPU_REGS_PIDS": ONCPU_REGS_PIDS, "ONCPU_REGS_STACK_BYTES": ONCPU_REGS_STACK_BYTES,
         "ONCPU_REGS_SHORT_STACK_BYTES": ONCPU_REGS_SHORT_STACK_BYTES,
         "ONCPU_REGS_RING_PAGES": ONCPU_REGS_RING_PAGES, "ONCPU_REGS_WAKE_EVERY": ONCPU_REGS_WAKE_EVERY}
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
        self._marked: dict[int, int] = {}           # pid → start_ticks of the process marked
        self._seen: dict[int, tuple[int, int]] = {}  # pid → (start_ticks, mappings) last looked at, unmarked
        self._pending: list[RegsSample] = []
        self._next_exit_check = time.monotonic() + EXIT_CHECK_S
        self.stats = {"marked": 0, "unmarked": 0, "not_marked_full": 0, "records": 0, "sent": 0,
                      "dropped_unmarked": 0, "dropped_pending": 0, "malformed": 0}
        bpf["oncpu_regs"].open_ring_buffer(self._on_record)

    def fd(self) -> int:
        """The ring buffer's descriptor: readable when the program woke the collector."""
        return int(self._bpf["oncpu_regs"].map_fd)

    def observe(self, processes: Iterable[Process]) -> None:
        """Processes of a drain: mark the new ones that map a file of the runtimes asked for."""
        for p in processes:
            if self._marked.get(p.pid) == p.start_ticks or not p.mappings:
                continue
            if self._seen.get(p.pid) == (p.start_ticks, len(p.mappings)):
                continue
            path = marked_by(p, self._names)
            if path is None:
                self._seen[p.pid] = (p.start_ticks, len(p.mappings))
                if len(self._seen) > 4 * ONCPU_REGS_PIDS:   # only a memo: forgotten whole
                    self._seen.clear()
                continue
            self._seen.pop(p.pid, None)
            if p.pid not in self._marked and len(self._marked) >= ONCPU_REGS_PIDS:
                self.stats["not_marked_full"] += 1
                if self.stats["not_marked_full"] == 1:
                    log.warning("registers with on-CPU samples: %d processes marked already; pid %d (%s) is not "
                                "(its JIT frames stay unnamed in the cpu profile)", ONCPU_REGS_PIDS, p.pid, path)
                continue
            self._pids[ctypes.c_uint32(p.pid)] = ctypes.c_uint8(1)
            self._marked[p.pid] = p.start_ticks
            self.stats["marked"] += 1
            log.info("registers with on-CPU samples: pid %d (maps %s)", p.pid, path)

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
        if n > size - RECORD.size:
            self.stats["malformed"] += 1
            return
        if len(self._pending) >= MAX_PENDING:
            self.stats["dropped_pending"] += 1
            return
        self._pending.append(RegsSample(pid=pid, start_ticks=ticks, tid=tid, time_ns=t_ns, ip=ip, sp=sp, fp=fp,
                                        stack=raw[RECORD.size:RECORD.size + n]))

    def flush(self, period_ns: int) -> None:
        """Take the ring's records and send them; unmark the processes that exited."""
        self._bpf.ring_buffer_consume()
        now = time.monotonic()
        if now >= self._next_exit_check:
            self._next_exit_check = now + EXIT_CHECK_S
            for pid, ticks in list(self._marked.items()):
                if start_ticks(pid) != ticks:
                    self._unmark(pid)
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), SAMPLES_PER_MESSAGE):
            self._publish(RegsBatch(host=self.host, time_ns=time.time_ns(), period_ns=period_ns,
                                    samples=tuple(pending[i:i + SAMPLES_PER_MESSAGE])))
        self.stats["sent"] += len(pending)

    def _unmark(self, pid: int) -> None:
        try:
            del self._pids[ctypes.c_uint32(pid)]
        except KeyError:
            pass
        del self._marked[pid]
        self.stats["unmarked"] += 1

    def close(self) -> None:
        """Unmark every process (the maps go with the programs; this keeps the record straight)."""
        for pid in list(self._marked):
            self._unmark(pid)
        if self.stats["records"]:
            log.info("registers with on-CPU samples: %s", self.stats)

