"""Turns one drain of BPF maps into StackBatch messages, one per symbolizer worker.

Owns: joining samples with process metadata and mappings, naming kernel
frames (kernel symbols are trusted: /proc/kallsyms through bcc's cache),
routing each service to its worker and renumbering stacks per batch.

Must not: read BPF maps or sockets; it gets a RawDrain and returns messages.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from ebpfprofiler.collector.bpfmaps import RawDrain
from ebpfprofiler.collector.procfs import ProcessTable
from ebpfprofiler.collector.routing import worker_for
from ebpfprofiler.shared.wire import Process, Sample, StackBatch

# Service of samples whose process exited before the collector could read it.
UNKNOWN_SERVICE = "[unknown]"


def _unknown(pid: int) -> Process:
    return Process(pid=pid, start_ticks=0, uid=0, nspid=pid, comm=UNKNOWN_SERVICE.strip("[]"),
                   executable="", service=UNKNOWN_SERVICE)


class _Builder:
    def __init__(self) -> None:
        self.processes: dict[int, Process] = {}
        self.user: dict[int, int] = {}      # drain stack id → index in this batch
        self.kernel: dict[int, int] = {}
        self.user_stacks: list[tuple[int, ...]] = []
        self.kernel_stacks: list[tuple[int, ...]] = []
        self.samples: list[Sample] = []

    def stack(self, sid: int, stacks: dict[int, tuple[int, ...]], index: dict[int, int],
              out: list[tuple[int, ...]]) -> int:
        if sid < 0 or sid not in stacks:
            return -1
        i = index.get(sid)
        if i is None:
            i = index[sid] = len(out)
            out.append(stacks[sid])
        return i


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
    for pid, samples in by_pid.items():
        addresses = {a for s in samples if s[2] in drain.user_stacks for a in drain.user_stacks[s[2]]}
        proc = procs.get(pid, addresses) or _unknown(pid)
        b = builders[worker_for(proc.service, live_workers)]
        b.processes[pid] = proc
        for s in samples:
            b.samples.append(Sample(
                pid=s[0], tid=s[1],
                user_stack=b.stack(s[2], drain.user_stacks, b.user, b.user_stacks),
                kernel_stack=b.stack(s[3], drain.kernel_stacks, b.kernel, b.kernel_stacks),
                count=s[4], value=s[5], extra=tuple(s[6]) if len(s) > 6 else (),
            ))

    # Host-wide loss counts travel once, with the lowest live worker's batch.
    if drain.lost:
        builders[min(live_workers)]

    out: dict[int, StackBatch] = {}
    for worker, b in builders.items():
        kaddrs = {a for st in b.kernel_stacks for a in st}
        out[worker] = StackBatch(
            host=host, profile_type=profile_type, sample_hz=sample_hz, time_ns=time_ns,
            processes=tuple(b.processes.values()),
            user_stacks=tuple(b.user_stacks), kernel_stacks=tuple(b.kernel_stacks),
            samples=tuple(b.samples),
            kernel_symbols={a: ksym(a) for a in kaddrs},
            lost=dict(drain.lost) if worker == min(live_workers) else {},
        )
    return out
