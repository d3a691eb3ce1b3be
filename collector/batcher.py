"""Turns one drain of BPF maps into StackBatch messages, one per symbolizer worker.

Owns: joining samples with process metadata and mappings, naming kernel
frames (kernel symbols are trusted: /proc/kallsyms through bcc's cache),
routing each service to its worker and renumbering stacks per batch.

Must not: read BPF maps or sockets; it gets a RawDrain and returns messages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace

from collector.bpfmaps import RawDrain
from collector.procfs import ProcessTable
from collector.routing import worker_for
from shared.wire import Process, PythonStack, Sample, StackBatch

# Service of samples whose process exited before the collector could read it.
UNKNOWN_SERVICE = "[unknown]"
# The one process those samples are merged into, per batch: such a pid (and its threads) names
# nothing anyone can look up any more, and a host starting hundreds of short processes a second
# spent more on carrying each of them apart (a process record, labels, a pid hash) than on the rest
# of the drain.
UNKNOWN_PID = 0
UNKNOWN_PROCESS = Process(
    pid=UNKNOWN_PID,
    start_ticks=0,
    uid=0,
    nspid=UNKNOWN_PID,
    comm=UNKNOWN_SERVICE.strip("[]"),
    executable="",
    service=UNKNOWN_SERVICE,
)


class _Builder:
    """One worker's batch as it is built: its processes, and stacks renumbered in the order first used."""

    def __init__(self) -> None:
        self.processes: dict[int, Process] = {}
        self.user: dict[int, int] = {}  # drain stack id → index in this batch
        self.kernel: dict[int, int] = {}
        self.user_stacks: list[tuple[int, ...]] = []
        self.kernel_stacks: list[tuple[int, ...]] = []
        self.samples: list[Sample] = []
        self.python: dict[int, int] = {}  # drain Python stack hash → index in this batch
        self.python_stacks: list[PythonStack] = []

    def stack(
        self, sid: int, stacks: dict[int, tuple[int, ...]], index: dict[int, int], out: list[tuple[int, ...]]
    ) -> int:
        if sid < 0 or sid not in stacks:
            return -1
        i = index.get(sid)
        if i is None:
            i = index[sid] = len(out)
            out.append(stacks[sid])
        return i

    def add(self, drain: RawDrain, s: tuple) -> None:
        """One sample of `drain` (pid, tid, user stack, kernel stack, count, value[, extra]), its stacks renumbered."""
        self.samples.append(
            Sample(
                pid=s[0],
                tid=s[1],
                user_stack=self.stack(s[2], drain.user_stacks, self.user, self.user_stacks),
                kernel_stack=self.stack(s[3], drain.kernel_stacks, self.kernel, self.kernel_stacks),
                count=s[4],
                value=s[5],
                extra=tuple(s[6]) if len(s) > 6 else (),
                python_stack=self.python_stack(s[7], drain.python_stacks) if len(s) > 7 else -1,
            )
        )

    def python_stack(self, h: int, stacks: dict[int, PythonStack]) -> int:
        if h not in stacks:
            return -1
        i = self.python.get(h)
        if i is None:
            i = self.python[h] = len(self.python_stacks)
            self.python_stacks.append(stacks[h])
        return i

    def batch(self, drain: RawDrain, ksym: Callable[[int], str], head: StackBatch, with_lost: bool) -> StackBatch:
        """The message: `head`'s host, type, rate and time; the host-wide losses only `with_lost`."""
        kaddrs = {a for st in self.kernel_stacks for a in st}
        return replace(
            head,
            processes=tuple(self.processes.values()),
            user_stacks=tuple(self.user_stacks),
            kernel_stacks=tuple(self.kernel_stacks),
            samples=tuple(self.samples),
            python_stacks=tuple(self.python_stacks),
            kernel_symbols={a: ksym(a) for a in kaddrs},
            lost=dict(drain.lost) if with_lost else {},
        )


def _merge_unknown(samples: list[tuple], unknown: dict[tuple, list[int]]) -> None:
    """Samples of a process that exited before it was read, summed by (user stack, kernel stack, extra)."""
    for s in samples:
        key = (s[2], s[3], tuple(s[6]) if len(s) > 6 else ())
        got = unknown.get(key)
        if got is None:
            unknown[key] = [s[4], s[5]]
        else:
            got[0] += s[4]
            got[1] += s[5]


def build_batches(
    drain: RawDrain,
    procs: ProcessTable,
    ksym: Callable[[int], str],
    *,
    host: str,
    profile_type: str,
    sample_hz: int,
    time_ns: int,
    live_workers: Sequence[int],
) -> dict[int, StackBatch]:
    """Batches by worker index; workers with nothing to do get none."""
    by_pid: dict[int, list[tuple]] = defaultdict(list)
    for s in drain.samples:
        by_pid[s[0]].append(s)

    builders: dict[int, _Builder] = defaultdict(_Builder)
    unknown: dict[tuple, list[int]] = {}  # (user stack, kernel stack, extra) → [count, value]
    for pid, samples in by_pid.items():
        addresses = {a for s in samples if s[2] in drain.user_stacks for a in drain.user_stacks[s[2]]}
        proc = procs.get(pid, addresses)
        if proc is None:
            _merge_unknown(samples, unknown)
            continue
        b = builders[worker_for(proc.service, live_workers)]
        b.processes[pid] = proc
        for s in samples:
            b.add(drain, s)
    if unknown:
        b = builders[worker_for(UNKNOWN_SERVICE, live_workers)]
        b.processes[UNKNOWN_PID] = UNKNOWN_PROCESS
        for (user, kernel, extra), (count, value) in unknown.items():
            b.add(drain, (UNKNOWN_PID, UNKNOWN_PID, user, kernel, count, value, extra))

    # Host-wide loss counts travel once, with the lowest live worker's batch.
    if drain.lost:
        builders[min(live_workers)]

    head = StackBatch(
        host=host,
        profile_type=profile_type,
        sample_hz=sample_hz,
        time_ns=time_ns,
        processes=(),
        user_stacks=(),
        kernel_stacks=(),
        samples=(),
    )
    return {worker: b.batch(drain, ksym, head, worker == min(live_workers)) for worker, b in builders.items()}
