"""What our BPF programs cost, as they count it themselves (bpf/common.h, "Self-timing").

Owns: the slot of each program in the prog_times map (the -DTIMED_* flags: the one definition C and
Python share), reading the map, and turning its sums into run counts and nanoseconds: each program
counts every run and times about one in TIMING_PERIOD, so a window's time is the timed runs'
nanoseconds scaled to all its runs. The kernel's own statistics (BPF_ENABLE_STATS) would give the
same figure exactly, but while on they cost every BPF program on the host two clock reads a run
(bpf/common.h says how much); `make bench` turns them on for its measurements from outside and
compares (bench/budget.py).

Must not: load, attach or choose programs, or judge the figures (collector/overhead.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Every timed program, by the name the guard reports (bcc's function name), in slot order. A program
# of a family that is not compiled keeps its slot and counts nothing.
TIMED_PROGRAMS = (
    "on_cpu_sample",
    "oncpu_unwind_step",
    "offcpu_switch",
    "offcpu_resume",
    "offcpu_unwind_step",
    "offcpu_unwind_finish",
    "tracepoint__syscalls__sys_enter_futex",
    "tracepoint__syscalls__sys_exit_futex",
    "lock_unwind_step",
    "alloc_malloc_enter",
    "alloc_calloc_enter",
    "alloc_realloc_enter",
    "alloc_return_probe",
    "alloc_free_enter",
)
# The C name of a slot's -D flag: TIMED_<function>, shortened for the futex tracepoints' bodies.
_C_NAMES = {
    "tracepoint__syscalls__sys_enter_futex": "sys_enter_futex",
    "tracepoint__syscalls__sys_exit_futex": "sys_exit_futex",
}
# One run in this many is timed (on average): two clock reads (~50 ns here) spread over 16 runs, and
# ~1 in 16 of a window's runs timed (a busy host's 3,500 switches a second: 13,000 a window).
TIMING_PERIOD = 16


def bpf_defines() -> dict[str, int]:
    """The -D flags of the slots (and the period) every compile gets."""
    out = {f"TIMED_{_C_NAMES.get(n, n)}": i for i, n in enumerate(TIMED_PROGRAMS)}
    out["TIMED_SLOTS"] = len(TIMED_PROGRAMS)
    out["TIMING_PERIOD"] = TIMING_PERIOD
    return out


@dataclass(frozen=True)
class ProgTime:
    """A program's counts since it was loaded: every run, the timed ones, and their nanoseconds."""

    runs: int = 0
    timed: int = 0
    timed_ns: int = 0

    def since(self, before: ProgTime) -> ProgTime:
        return ProgTime(
            max(0, self.runs - before.runs), max(0, self.timed - before.timed), max(0, self.timed_ns - before.timed_ns)
        )

    @property
    def run_time_ns(self) -> int:
        """The time of all runs: the timed runs' mean times every run (0 with none timed)."""
        return self.timed_ns * self.runs // self.timed if self.timed else 0


def read(bpf: Any) -> dict[str, ProgTime]:
    """Name → counts of every timed program that ran, summed over the CPUs (prog_times is per CPU)."""
    table = bpf["prog_times"]
    out: dict[str, ProgTime] = {}
    for slot, name in enumerate(TIMED_PROGRAMS):
        runs = timed = ns = 0
        for cpu in table.getvalue(table.Key(slot)):
            runs += cpu.runs
            timed += cpu.timed
            ns += cpu.ns
        if runs:
            out[name] = ProgTime(runs, timed, ns)
    return out


def describe_method() -> str:
    return f"counted by the programs, one run in ~{TIMING_PERIOD} timed"
