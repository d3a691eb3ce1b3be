"""Off-CPU profiling: bpf/offcpu.c's tp_btf programs on sched_switch and rseq_update.

Owns: the family's -D flags (bpf_defines), loading and attaching its programs (collector/btfprog.py),
its DWARF step program (a tp_btf program too, so that the rseq_update program
may tail-call it), the attach generation that makes records of a paused
interval stale, and draining the double-buffered counts and stack maps into a
RawDrain: flip, read the retired buffer, clear it.

Must not: read /proc or talk to other stages.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from collector.bpfmaps import DWARF_STACK_ID_BASE, DoubleBuffer, LostCounters, RawDrain, take_all, take_dwarf_stacks
from collector.btfprog import BtfProgram, BtfProgramError, member_offsets
from collector.pywalk import PyWalker
from collector.sources import EventSource

__all__ = ["LOST_REASONS", "PROFILE_TYPE", "TRACEPOINTS", "OffCpuTracer", "bpf_defines"]

log = logging.getLogger(__name__)

PROFILE_TYPE = "offcpu"
# bpf/offcpu.c's programs and the raw tracepoints they attach to, in attach order.
PROGRAMS = (("offcpu_resume", "rseq_update"), ("offcpu_switch", "sched_switch"))
TRACEPOINTS = tuple(tp for _, tp in PROGRAMS)
# The DWARF walk's programs, in the slots of offcpu_unwind_progs (tail-called, never attached).
STEP_PROGRAMS = (("offcpu_unwind_step", "rseq_update"), ("offcpu_unwind_finish", "rseq_update"))
# Names of the offcpu_lost slots in bpf/offcpu.c, in order.
LOST_REASONS = ("counts_map_full", "user_stack_not_recorded", "kernel_stack_not_recorded", "no_task_record")


# Without task storage (kernels before 5.11): threads whose records are kept at once, and threads without
# rseq whose user stack taken at the block is kept (512 bytes each, 8 MB; the LRU forgets the longest
# idle first, and a forgotten one costs that interval its record or its user stack, counted).
THREAD_RECORDS = 65536
USER_STACK_RECORDS = 16384

# -D flag of bpf/offcpu.c → task_struct member it reads, and what is lost without it (no BTF).
TASK_FIELDS = {
    # the code addresses above a sleeping task's saved stack pointer: whether it blocks where it did
    "OFFCPU_TASK_SP_OFFSET": (
        ("thread", "sp"),
        "the kernel stack of every blocking interval over "
        "offcpu_min_ms is read, also where a thread blocks as it did before",
    ),
    # whether a thread will pass rseq_update: registered now, not once before an exec
    "OFFCPU_TASK_RSEQ_OFFSET": (
        ("rseq",),
        "the main thread of a program without rseq (Go, static, musl) exec'd by one with it is not charged",
    ),
}
# -D flag → (struct, member path) of the run-queue wait a woken thread spends before it runs, which
# is not blocked time (bpf/offcpu.c offcpu_waited); all of them or none.
WAIT_FIELDS = {
    "OFFCPU_TASK_RUN_DELAY_OFFSET": ("task_struct", ("sched_info", "run_delay")),
    "OFFCPU_TASK_LAST_QUEUED_OFFSET": ("task_struct", ("sched_info", "last_queued")),
    "OFFCPU_TASK_CFS_RQ_OFFSET": ("task_struct", ("se", "cfs_rq")),
    "OFFCPU_CFS_RQ_RQ_OFFSET": ("cfs_rq", ("rq",)),
    "OFFCPU_RQ_CLOCK_OFFSET": ("rq", ("clock",)),
    "OFFCPU_RQ_CPU_OFFSET": ("rq", ("cpu",)),
}


def sample_ns(min_ms: int, sample_ms: int) -> int:
    """bpf/offcpu.c's OFFCPU_SAMPLE_NS: long blocks shorter than sample_ms are sampled (and weighted
    up); 0, every block in full, when sample_ms is 0 or not above min_ms."""
    return sample_ms * 1_000_000 if sample_ms > min_ms else 0


def bpf_defines(task_storage: bool = True, prev_state: bool = True) -> dict[str, int]:
    """The offsets bpf/offcpu.c needs of task_struct, cfs_rq and rq members, from the running kernel's BTF;
    where its per-thread records live: task storage, or (a kernel before 5.11, collector/features.py)
    LRU hash maps by thread id, which need task_struct.pid's offset; and where a blocking task's state
    is: sched_switch's prev_state (5.18), or the task's own field.

    bcc's headers may be another kernel's (/lib/modules/<release>/build), so its own offsets of
    these fields cannot be trusted; a field not found is left out and the loss logged."""
    out: dict[str, int] = {}
    if prev_state:
        out["OFFCPU_SWITCH_PREV_STATE"] = 1
    else:
        state_offset, state_size = state_field()
        out.update(OFFCPU_TASK_STATE_OFFSET=state_offset, OFFCPU_TASK_STATE_SIZE=state_size)
    if task_storage:
        out["OFFCPU_TASK_STORAGE"] = 1
    else:
        pid_offset = member_offsets("task_struct", [("pid",)])[0]
        if pid_offset is None:
            raise BtfProgramError("off-CPU records by thread id need task_struct.pid, which the kernel's BTF lacks")
        out.update(
            OFFCPU_TASK_PID_OFFSET=pid_offset,
            OFFCPU_THREADS=THREAD_RECORDS,
            OFFCPU_USER_STACK_THREADS=USER_STACK_RECORDS,
        )
    offsets = member_offsets("task_struct", [path for path, _ in TASK_FIELDS.values()])
    for (define, (path, loss)), offset in zip(TASK_FIELDS.items(), offsets):
        if offset is None:
            log.warning("off-CPU: task_struct.%s is not in the kernel's BTF; %s", ".".join(path), loss)
        else:
            out[define] = offset
    waits: dict[str, int | None] = {}
    for struct in dict.fromkeys(st for st, _ in WAIT_FIELDS.values()):  # one BTF load per struct
        defines = [d for d, (st, _) in WAIT_FIELDS.items() if st == struct]
        waits.update(zip(defines, member_offsets(struct, [WAIT_FIELDS[d][1] for d in defines])))
    missing = [".".join((WAIT_FIELDS[d][0], *WAIT_FIELDS[d][1])) for d, off in waits.items() if off is None]
    if missing:
        log.warning(
            "off-CPU: %s not in the kernel's BTF; a woken thread's wait for a CPU counts as blocked time",
            ", ".join(missing),
        )
    else:
        out.update({d: off for d, off in waits.items() if off is not None})
    return out


# The task's state as sched_switch's prev_state reports it, by kernel: an argument since 5.18; before,
# the task's own field, `unsigned int __state` since 5.14 and `long state` before (a member of BTF).
STATE_FIELDS = (("__state", 4), ("state", 8))


def state_field() -> tuple[int, int]:
    """(offset, size) of task_struct's state field in the running kernel's BTF."""
    offsets = member_offsets("task_struct", [(name,) for name, _ in STATE_FIELDS])
    for (_, size), offset in zip(STATE_FIELDS, offsets):
        if offset is not None:
            return offset, size
    raise BtfProgramError("task_struct has no state field in the kernel's BTF")


class OffCpuTracer(EventSource):
    profile_type = PROFILE_TYPE

    def __init__(self, bpf: Any, min_ms: int, dwarf: bool = False, python: PyWalker | None = None) -> None:
        self.min_ms = min_ms
        self.dwarf = dwarf
        self.python = python  # bpf/offcpu.c compiled with PY_WALK: Python stacks in py_stacks_offcpu_<buf>
        self._bpf = bpf
        self._buffers = DoubleBuffer(bpf, "offcpu")
        self._lost = LostCounters(bpf["offcpu_lost"], LOST_REASONS)
        self._gen = bpf["offcpu_gen"]
        self._programs: list[BtfProgram] = []
        self._steps: list[BtfProgram] = []
        try:
            for fn, tp in PROGRAMS:
                self._programs.append(BtfProgram(bpf, fn, tp))
            self._steps = [BtfProgram(bpf, fn, tp) for fn, tp in STEP_PROGRAMS] if dwarf else []
        except Exception:
            self.close()
            raise
        for slot, step in enumerate(self._steps):
            bpf["offcpu_unwind_progs"][ctypes.c_int(slot)] = ctypes.c_int(step.fd)
        self.attach()
        log.info(
            "off-CPU profiling attached to %s: blocked intervals of %d ms and more; stacks read only "
            "for those, when the thread returns to user space%s",
            ", ".join(TRACEPOINTS),
            min_ms,
            " (DWARF tables where loaded)" if dwarf else "",
        )

    def attach(self) -> None:
        """Attach (again): records written before are stale from now on (their switch-ins went unseen)."""
        if all(p.attached for p in self._programs):
            return
        again = self._gen[ctypes.c_int(0)].value > 0
        self._gen[ctypes.c_int(0)] = ctypes.c_uint32(self._gen[ctypes.c_int(0)].value + 1)
        for p in self._programs:
            p.attach()
        if again:
            log.info("off-CPU profiling attached again to %s", ", ".join(TRACEPOINTS))

    def detach(self) -> None:
        if any(p.attached for p in self._programs):
            for p in reversed(self._programs):
                p.detach()
            log.info("off-CPU profiling detached")

    def close(self) -> None:
        for p in self._programs + getattr(self, "_steps", []):
            p.close()
        self._programs = []
        self._steps = []

    def drain(self) -> RawDrain:
        old, counts = self._buffers.retire()
        stacks = self._bpf[f"offcpu_stacks_{old}"]
        out = RawDrain()
        user: set[int] = set()
        kernel: set[int] = set()
        python: set[int] = set()
        for k, v in take_all(counts):
            u = DWARF_STACK_ID_BASE + k.user_hash if k.user_hash else -1
            kk = DWARF_STACK_ID_BASE + k.kernel_hash if k.kernel_hash else -1
            if k.user_hash:
                user.add(k.user_hash)
            if k.kernel_hash:
                kernel.add(k.kernel_hash)
            if k.py_hash:
                python.add(k.py_hash)
                out.samples.append((k.pid, k.tid, u, kk, v.count, v.ns, (), k.py_hash))
            else:
                out.samples.append((k.pid, k.tid, u, kk, v.count, v.ns))
        gone = take_dwarf_stacks(stacks, [(user, out.user_stacks), (kernel, out.kernel_stacks)])
        if self.python is not None:
            out.python_stacks, missing = self.python.take("offcpu", old, python)
            gone += missing
        out.lost = self._lost.delta()
        if gone:
            out.lost["stack_gone"] = gone
        return out
