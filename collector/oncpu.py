"""On-CPU sampling: load bpf/oncpu.c, attach it to cpu-clock on every CPU, drain it.

Owns: the BPF program's lifetime (load, attach, detach) and the drain of its
double-buffered maps into a RawDrain. Each drain flips the active buffer,
waits a grace period for programs still running on the old one, reads it and
clears it, so no sample is counted twice or dropped between reads.

Must not: read /proc or talk to other stages (the collector's main loop does),
or be imported outside the collector: importing bcc costs ~100 MB.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass, field

from bcc import BPF, PerfSWConfig, PerfType  # type: ignore[import-not-found]

log = logging.getLogger(__name__)

# Distinct (pid, tid, user stack, kernel stack) keys per drain; a 64-CPU host
# at 999 Hz takes ~64K samples a second, most of them repeats.
COUNTS_ENTRIES = 40960
# Distinct stacks per drain per kind (user and kernel share the map); each
# entry is 127 × 8 bytes of kernel memory, two buffers: ~33 MB in all.
STACK_ENTRIES = 16384
# Programs running on the old buffer when it is flipped finish within
# microseconds (they run with interrupts off); this is ample.
FLIP_GRACE_S = 0.005
# Names of the `lost` slots in bpf/oncpu.c, in order.
LOST_REASONS = ("counts_map_full", "user_stack_not_recorded", "kernel_stack_not_recorded")

PROGRAM_NAME = "on_cpu_sample"
NSEC_PER_SEC = 1_000_000_000


@dataclass
class RawDrain:
    """One drain: counts by key, and the stacks the keys refer to (leaf first)."""
    samples: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # pid, tid, ustack, kstack, count
    user_stacks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    kernel_stacks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)


class OnCpuSampler:
    def __init__(self, bpf_dir: str, sample_hz: int) -> None:
        self.sample_hz = sample_hz
        self.period_ns = NSEC_PER_SEC // sample_hz
        src = os.path.join(bpf_dir, "oncpu.c")
        self._bpf = BPF(src_file=src.encode(), cflags=[
            f"-DCOUNTS_ENTRIES={COUNTS_ENTRIES}", f"-DSTACK_ENTRIES={STACK_ENTRIES}"])
        self._attached = False
        self._active = 0
        self._lost_seen = [0] * len(LOST_REASONS)
        self._bpf["active"][ctypes.c_int(0)] = ctypes.c_uint32(0)

    def attach(self) -> None:
        """Start sampling every CPU at sample_hz (a fixed period of cpu-clock)."""
        self._bpf.attach_perf_event(
            ev_type=PerfType.SOFTWARE, ev_config=PerfSWConfig.CPU_CLOCK,
            fn_name=PROGRAM_NAME.encode(), sample_period=self.period_ns, cpu=-1)
        self._attached = True
        log.info("on-CPU sampling attached: cpu-clock every %d ns (%d Hz) on %d CPUs",
                 self.period_ns, self.sample_hz, os.cpu_count() or 0)

    def drain(self) -> RawDrain:
        """Flip buffers, read the one just retired, clear it."""
        old = self._active
        self._active ^= 1
        self._bpf["active"][ctypes.c_int(0)] = ctypes.c_uint32(self._active)
        time.sleep(FLIP_GRACE_S)
        counts = self._bpf[f"counts_{old}"]
        stacks = self._bpf[f"stacks_{old}"]
        out = RawDrain()
        user_ids: set[int] = set()
        kernel_ids: set[int] = set()
        for k, v in counts.items():
            out.samples.append((k.pid, k.tid, k.user_stack, k.kernel_stack, v.value))
            if k.user_stack >= 0:
                user_ids.add(k.user_stack)
            if k.kernel_stack >= 0:
                kernel_ids.add(k.kernel_stack)
        counts.clear()
        for ids, dest in ((user_ids, out.user_stacks), (kernel_ids, out.kernel_stacks)):
            for sid in ids:
                try:
                    dest[sid] = tuple(stacks.walk(sid))
                except KeyError:
                    pass
        for sid in user_ids | kernel_ids:
            try:
                del stacks[ctypes.c_int(sid)]
            except KeyError:
                pass
        out.lost = self._lost_delta()
        return out

    def _lost_delta(self) -> dict[str, int]:
        table = self._bpf["lost"]
        delta: dict[str, int] = {}
        for i, reason in enumerate(LOST_REASONS):
            total = sum(table[ctypes.c_int(i)])
            if total > self._lost_seen[i]:
                delta[reason] = total - self._lost_seen[i]
            self._lost_seen[i] = total
        return delta

    def ksym(self, address: int) -> str:
        """The kernel symbol containing `address` (bcc caches /proc/kallsyms)."""
        return BPF.ksym(address).decode("utf-8", "replace")

    def close(self) -> None:
        """Detach the perf events and unload the program; safe to call twice."""
        if self._bpf is None:
            return
        if self._attached:
            try:
                self._bpf.detach_perf_event(ev_type=PerfType.SOFTWARE, ev_config=PerfSWConfig.CPU_CLOCK)
            except Exception as e:  # detaching what the kernel already dropped
                log.warning("detaching perf events: %s", e)
            self._attached = False
        self._bpf.cleanup()
        self._bpf = None
        log.info("on-CPU sampling detached")

