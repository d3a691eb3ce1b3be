"""The processes a runtime reader reads: announced by the collector, checked, detected, refused.

Owns: the set of announced processes keyed by (pid, start time), so a reused
pid is a new process and an exited one is dropped; detection of each (at most
DETECTS_PER_TICK per tick) by asking each configured runtime plug-in in turn
(runtimes/runtime.py's contract) until one says "mine": a reader, or a
refusal (logged once at info level with the runtime's name and its reason,
then the process is left alone), or served (the plug-in did what it does for
it; its message logged once the same way); none: "other"; the per-file cache the
plug-ins share; the check, before every read of a process, that its pid
still names the same process (else no stack is read for it); thread names
(/proc/<pid>/task/<tid>/comm) and, for processes in a pid namespace, the map
from the thread ids a runtime records to this host's tids; on_reading, told
of each process once a plug-in reads it.

Must not: read process memory itself (the plug-ins do), or build profiles.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runtimes.memory import MemoryReadError, ProcessMemory, ReadBudget
from runtimes.runtime import (
    Detected,
    FileCache,
    Pending,
    ProcessContext,
    Refusal,
    Runtime,
    Served,
    StackReader,
)
from shared.log import LogOnce
from shared.procstat import start_ticks
from shared.wire import Process, ProcessAnnouncement

# Processes remembered (read, refused or of no runtime); the oldest are forgotten beyond this.
MAX_PROCESSES = 16384
# Detections per tick: each reads the process's maps, and the first of a file reads its symbols (~1 ms).
DETECTS_PER_TICK = 4
# Seconds of detection per tick at most (a detection is ~1 ms; the first of a file reads its symbols).
MAX_DETECT_SECONDS_PER_TICK = 0.02
# A detection slower than this pauses detection (a real file's symbols take ~50 ms; a crafted file's are
# cut at elfsyms.READ_SECONDS).
SLOW_DETECT_S = 0.25
# After a slow detection, detection pauses so that it takes at most this share of the reader's time.
DETECT_SHARE = 0.25
# Pending requests polled per tick (each a non-blocking read, or a retry's connect).
MAX_POLLS_PER_TICK = 64
# Threads named per process (a comm read each); more threads are labelled by id only.
MAX_THREAD_NAMES = 4096

log = logging.getLogger("ebpfprofiler.runtime")


@dataclass
class Entry:
    process: Process
    state: str = "new"  # new, pending, reading, refused, served, other
    reader: StackReader | None = None
    pending: Pending | None = None
    runtime: Runtime | None = None
    thread_names: dict[int, str] = field(default_factory=dict)
    host_tids: dict[int, int] = field(default_factory=dict)  # the runtime's thread id → this host's tid


class Targets:
    def __init__(
        self,
        runtimes: list[Runtime],
        *,
        proc: str = "/proc",
        own_uids: frozenset[int] = frozenset(),
        on_reading: Callable[[Entry], None] = lambda e: None,
    ) -> None:
        self.runtimes, self.proc = runtimes, proc
        self.on_reading = on_reading  # told of each process once it is read (bpf_walks.py: its walk data out)
        # The agent's own stages (by their users) are not read: their stacks are the agent's, not the
        # host's work (their native samples stay in `cpu`), and reading them cost the reader ~1% of one
        # CPU of an idle host where the agent runs on a CPython it reads (Debian 12's 3.11, python_legacy).
        self.own_uids = own_uids
        self.files = FileCache()
        self.entries: dict[int, Entry] = {}
        self._log_once = LogOnce(log)
        self.stats = {
            "announced": 0,
            "exited": 0,
            "refused": 0,
            "served": 0,
            "reading": 0,
            "pending": 0,
            "reused_pid": 0,
            "gone_while_reading": 0,
            "detect_failed": 0,
            "detect_slow": 0,
            "read_errors": 0,
        }
        self._detect_after = 0.0  # time.monotonic() before which no detection starts (after a slow one)

    def announce(self, msg: ProcessAnnouncement) -> None:
        for pid, ticks in msg.exited:
            e = self.entries.get(pid)
            if e is not None and e.process.start_ticks == ticks:
                del self.entries[pid]
                self.stats["exited"] += 1
        for p in msg.processes:
            if p.uid in self.own_uids:
                continue
            e = self.entries.get(p.pid)
            if e is not None and e.process.start_ticks == p.start_ticks:
                continue
            if len(self.entries) >= MAX_PROCESSES:
                self.entries.pop(next(iter(self.entries)))
            self.entries[p.pid] = Entry(p)
            self.stats["announced"] += 1

    def current(self, e: Entry) -> bool:
        """Whether e's pid still names e's process; forgets it if not."""
        ticks = start_ticks(e.process.pid, self.proc)
        if ticks == e.process.start_ticks:
            return True
        self.entries.pop(e.process.pid, None)
        self.stats["reused_pid" if ticks is not None else "exited"] += 1
        return False

    def detect_some(self, budget: ReadBudget) -> None:
        """Detect up to DETECTS_PER_TICK new processes, within MAX_DETECT_SECONDS_PER_TICK; after a slow
        one, detection pauses so that it takes at most DETECT_SHARE of the reader's time."""
        now = time.monotonic()
        if now < self._detect_after:
            return
        done = 0
        stop_at = now + MAX_DETECT_SECONDS_PER_TICK
        for e in list(self.entries.values()):
            if e.state != "new":
                continue
            if done >= DETECTS_PER_TICK or time.monotonic() > stop_at:
                break
            done += 1
            if not self.current(e):
                continue
            began = time.monotonic()
            self._detect(e, budget)
            took = time.monotonic() - began
            if took > SLOW_DETECT_S:
                self.stats["detect_slow"] += 1
                self._detect_after = time.monotonic() + took * (1 / DETECT_SHARE - 1)
                self._log_once(
                    (e.process.pid, e.process.start_ticks, "slow"),
                    logging.INFO,
                    "pid %d (%s): detecting its runtime took %.2f s; detection pauses %.1f s so that "
                    "the processes being read keep their ticks",
                    e.process.pid,
                    e.process.executable,
                    took,
                    took * (1 / DETECT_SHARE - 1),
                )
                break

    def _detect(self, e: Entry, budget: ReadBudget) -> None:
        pid = e.process.pid
        ctx = ProcessContext(pid, self.proc, ProcessMemory(pid, budget), self.files, e.process.start_ticks)
        got: Detected = None
        runtime: Runtime | None = None
        try:
            for runtime in self.runtimes:
                got = runtime.detect(ctx)
                if got is not None:
                    break
        except (MemoryReadError, OSError) as err:
            self.stats["detect_failed"] += 1
            log.debug("pid %d: detection failed: %s", pid, err)
            e.state = "other"
            return
        except Exception as err:  # what a process maps or holds must never end the reader
            e.runtime = runtime
            self.give_up(e, err)
            return
        if got is None or runtime is None:
            e.state = "other"
            return
        e.runtime = runtime
        self._settle(e, got)

    def _settle(self, e: Entry, got: StackReader | Refusal | Served | Pending) -> None:
        """What detect (or a pending request) said of e's runtime: logged once, counted, e's new state."""
        assert e.runtime is not None
        pid, title = e.process.pid, e.runtime.spec.title
        if isinstance(got, Pending):
            e.state, e.pending = "pending", got
            self.stats["pending"] += 1
            log.debug("pid %d (%s): %s: %s", pid, e.process.executable, title, got.message)
        elif isinstance(got, Refusal):
            e.state, e.pending = "refused", None
            self.stats["refused"] += 1
            if got.kind:  # a check that fired: counted by its name
                key = f"refused_{got.kind}"
                self.stats[key] = self.stats.get(key, 0) + 1
            self._log_once(
                (pid, e.process.start_ticks),
                logging.INFO,
                "pid %d (%s) refused: %s: %s",
                pid,
                e.process.executable,
                title,
                got.reason,
            )
        elif isinstance(got, Served):
            e.state, e.pending = "served", None
            self.stats["served"] += 1
            self._log_once(
                (pid, e.process.start_ticks),
                logging.INFO,
                "pid %d (%s): %s: %s",
                pid,
                e.process.executable,
                title,
                got.message,
            )
        else:
            e.state, e.reader, e.pending = "reading", got, None
            self.stats["reading"] += 1
            log.info("pid %d (%s): reading %s %s stacks", pid, e.process.executable, title, got.version)
            self.on_reading(e)

    def poll_pending(self) -> None:
        """Every process with a request pending: its outcome, if known (each poll never blocks; at most
        MAX_POLLS_PER_TICK a tick, the longest waiting first)."""
        waiting = [e for e in self.entries.values() if e.state == "pending"]
        for e in waiting[:MAX_POLLS_PER_TICK]:
            assert e.pending is not None
            if not self.current(e):
                continue
            try:
                got = e.pending.poll()
            except Exception as err:  # what a process answers must never end the reader
                e.pending = None
                self.give_up(e, err)
                continue
            if got is not None:
                self._settle(e, got)
            else:
                # polled: to the end of the order, so that every pending process is polled in turn
                self.entries[e.process.pid] = self.entries.pop(e.process.pid)

    def readable(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == "reading"]

    def idle(self) -> bool:
        """Nothing to detect, to read or to wait for: the reader may sleep until an announcement."""
        return not any(e.state in ("new", "reading", "pending") for e in self.entries.values())

    def forget(self, e: Entry) -> None:
        self.entries.pop(e.process.pid, None)

    def give_up(self, e: Entry, err: Exception) -> None:
        """Detecting or reading e failed in a way the reader does not expect (its files or memory
        are not what they should be): log it once, read it no more (until a new process has its pid)."""
        e.state, e.reader = "refused", None
        self.stats["read_errors"] += 1
        self._log_once(
            (e.process.pid, e.process.start_ticks),
            logging.WARNING,
            "pid %d (%s): detecting or reading its %s stacks failed (%s: %s); it is left alone",
            e.process.pid,
            e.process.executable,
            e.runtime.spec.title if e.runtime else "runtime",
            type(err).__name__,
            err,
        )

    def thread(self, e: Entry, native_tid: int) -> tuple[int, str]:
        """(this host's tid, thread name) of a thread id the runtime recorded."""
        pid = e.process.pid
        if not native_tid:  # a runtime without threads of its own: the main thread
            native_tid = e.process.nspid
        tid = native_tid
        if e.process.nspid != pid:  # in a pid namespace: the runtime saw its own tids
            tid = e.host_tids.get(native_tid, 0)
            if not tid:
                e.host_tids = self._host_tids(pid)
                tid = e.host_tids.get(native_tid, native_tid)
        name = e.thread_names.get(tid)
        if name is None:
            try:
                with open(f"{self.proc}/{pid}/task/{tid}/comm", "rb") as f:
                    name = f.read(64).decode("utf-8", "replace").strip()
            except OSError:
                name = ""
            if len(e.thread_names) < MAX_THREAD_NAMES:
                e.thread_names[tid] = name
        return tid, name

    def native_tid(self, e: Entry, host_tid: int) -> int:
        """The runtime's own id of a thread of this host's tid (the same unless in a pid namespace)."""
        if e.process.nspid == e.process.pid:
            return host_tid
        for native, tid in e.host_tids.items():
            if tid == host_tid:
                return native
        e.host_tids = self._host_tids(e.process.pid)
        for native, tid in e.host_tids.items():
            if tid == host_tid:
                return native
        return 0

    def _host_tids(self, pid: int) -> dict[int, int]:
        out: dict[int, int] = {}
        try:
            tids = os.listdir(f"{self.proc}/{pid}/task")[:MAX_THREAD_NAMES]
        except OSError:
            return out
        for t in tids:
            try:
                with open(f"{self.proc}/{pid}/task/{t}/status", "rb") as f:
                    for line in f.read(8192).decode("utf-8", "replace").splitlines():
                        if line.startswith("NSpid:"):
                            out[int(line.split()[-1])] = int(t)
            except (OSError, ValueError):
                continue
        return out
