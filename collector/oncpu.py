"""On-CPU sampling: bpf/oncpu.c on a cpu-clock perf event on every CPU.

Owns: the program's perf events (collector/perfevents.py: opened once, then enabled, disabled and
given a new period), and draining the
double-buffered counts and stack maps into a RawDrain: flip, read the retired
buffer, clear it, so no sample is counted twice or dropped between reads.

Must not: read /proc or talk to other stages (the collector's main loop does).
"""

from __future__ import annotations

import logging
from typing import Any

from collector.bpfmaps import (
    DoubleBuffer,
    LostCounters,
    RawDrain,
    delete_stacks,
    read_stacks,
    take_counts,
    take_dwarf_stacks,
)
from collector.perfevents import CpuClockEvents
from collector.pywalk import PyWalker
from collector.sources import EventSource

log = logging.getLogger(__name__)

PROFILE_TYPE = "cpu"
PROGRAM_NAME = "on_cpu_sample"
# Names of the oncpu_lost slots in bpf/oncpu.c, in order.
LOST_REASONS = (
    "counts_map_full",
    "user_stack_not_recorded",
    "kernel_stack_not_recorded",
    "regs_ring_full",
    "stack_gone",
)
NSEC_PER_SEC = 1_000_000_000


class OnCpuSampler(EventSource):
    profile_type = PROFILE_TYPE

    def __init__(self, bpf: Any, sample_hz: int, dwarf: bool = False, python: PyWalker | None = None) -> None:
        self.sample_hz = sample_hz
        self.dwarf = dwarf  # bpf/oncpu.c compiled with DWARF_UNWIND: oncpu_dwarf_stacks_<buf> exist
        self.python = python  # bpf/oncpu.c compiled with PY_WALK: Python stacks in py_stacks_oncpu_<buf>
        self.period_ns = NSEC_PER_SEC // sample_hz
        self._bpf = bpf
        self._buffers = DoubleBuffer(bpf, "oncpu")
        self._lost = LostCounters(bpf["oncpu_lost"], LOST_REASONS[:4])
        from bcc import BPF  # only the collector imports bcc, and only where it loads: its unit tests need none

        self._prog_fd = bpf.load_func(PROGRAM_NAME.encode(), BPF.PERF_EVENT).fd
        self.events: CpuClockEvents | None = None

    def open(self) -> None:
        """Open the perf events, stopped (collector/perfevents.py: once, while the collector may)."""
        if self.events is None:
            self.events = CpuClockEvents(self._prog_fd, self.period_ns)
            if self.events.uncovered:
                log.warning(
                    "on-CPU sampling: CPUs %s are offline now and get no perf event: they are not "
                    "sampled if they come online, until the collector restarts",
                    ",".join(map(str, self.events.uncovered)),
                )

    def attach(self) -> None:
        """Start sampling every CPU at sample_hz (a fixed period of cpu-clock)."""
        self.open()
        assert self.events is not None
        if self.events.enabled:
            return
        if self.events.period_ns != self.period_ns:
            self.events.set_period(self.period_ns)
        self.events.enable()
        log.info(
            "on-CPU sampling attached: cpu-clock every %d ns (%d Hz) on %d CPUs",
            self.period_ns,
            self.sample_hz,
            len(self.events.cpus),
        )

    def drain(self) -> RawDrain:
        old, counts = self._buffers.retire()
        stacks = self._bpf[f"oncpu_stacks_{old}"]
        out = RawDrain()
        refs = take_counts(counts, out, lambda v: (v.value, v.value * self.period_ns))
        gone = read_stacks(stacks, refs.user, out.user_stacks) + read_stacks(stacks, refs.kernel, out.kernel_stacks)
        delete_stacks(stacks, refs.user | refs.kernel)
        if self.dwarf:
            dwarf_stacks = self._bpf[f"oncpu_dwarf_stacks_{old}"]
            gone += take_dwarf_stacks(dwarf_stacks, [(refs.hashes, out.user_stacks)])
        if self.python is not None:
            out.python_stacks, missing = self.python.take("oncpu", old, refs.python)
            gone += missing
        out.lost = self._lost.delta()
        if gone:
            out.lost["stack_gone"] = gone
        return out

    def detach(self) -> None:
        if self.events is not None and self.events.enabled:
            self.events.disable()
            log.info("on-CPU sampling detached")

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None
