"""What the collector compiles for a config on a kernel: the program families, their -D flags, which
walks are DWARF, and what the kernel refuses.

Owns: that decision (plan()), and the sizes of the maps every family is compiled with. The
collector builds its programs from the plan; tests/integration/test_header_layouts.py compiles the
same plan against other kernels' header trees and loads it, so that what the verifier sees there is
what the collector would load.

Must not: import bcc, compile, load or attach anything, or log (the collector logs the refusals).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from collector import alloc, drains, features, pywalk, regs, unwind
from collector.btfprog import BtfProgramError
from collector.intervals import START_ENTRIES
from collector.lock import LOCK_PIDS
from collector.offcpu import bpf_defines as offcpu_defines
from collector.offcpu import sample_ns as offcpu_sample_ns
from shared import config as config_mod
from shared import runtime_registry

# Distinct (pid, tid, user stack, kernel stack) keys per drain and family; a
# 64-CPU host at 999 Hz takes ~64K samples a second, most of them repeats.
COUNTS_ENTRIES = 40960
# Distinct stacks per stack map; each entry is 127 x 8 bytes of kernel memory
# (three maps when off-CPU is on: ~50 MB).
STACK_ENTRIES = 16384
# The programs send at most one new-process event (collector/drains.py) per NEW_PID_NOTIFY_NS.
NEW_PID_NOTIFY_NS = 100_000_000
# Processes the programs remember having notified (an LRU map).
SEEN_PIDS = 65536


@dataclass(frozen=True)
class ProgramPlan:
    families: tuple[str, ...]
    defines: dict[str, int]
    offcpu: bool  # off-CPU profiles: the config asks and the kernel can
    alloc: bool  # likewise allocation profiles
    dwarf: bool  # on-CPU user stacks walked with unwind tables
    offcpu_dwarf: bool
    lock_dwarf: bool
    regs_names: frozenset[str]  # mappings whose processes' samples carry registers (collector/regs.py)
    python_walk: bool = False  # CPython frames walked in BPF at the on-CPU sample (collector/pywalk.py)
    python_walk_offcpu: bool = False  # ... and at an off-CPU block's end (bpf/offcpu.c, -DPY_WALK_OFFCPU)
    refused: tuple[tuple[str, str], ...] = field(default=())  # (what the config asked for, why not)
    notes: tuple[str, ...] = field(default=())  # what else was turned off, and why


@dataclass(frozen=True)
class WalkRefusals:
    """Why an earlier load refused the Python walker ("": it did not): in the off-CPU programs alone (a
    verifier that takes the on-CPU walk can find the off-CPU program, with its own loops, too complex:
    sid's 7.2), or in all of them. collector/main.py loads again with what was refused left out."""

    offcpu: str = ""
    all: str = ""


NO_REFUSALS = WalkRefusals()


class _Refusals:
    """What the config asked for and the kernel cannot give, in the order asked."""

    def __init__(self, kernel: features.KernelFeatures) -> None:
        self.kernel = kernel
        self.refused: list[tuple[str, str]] = []

    def can(self, what: str, feature: str) -> bool:
        if self.kernel.has(feature):
            return True
        f = self.kernel.features[feature]
        self.refused.append((what, f"needs {f.spec.what} ({f.spec.since}): {f.why}"))
        return False


def _defines(cfg: config_mod.ProfilerConfig, kernel: features.KernelFeatures, offcpu_on: bool) -> dict[str, int]:
    """The -D flags every plan has, and off-CPU's when it is on."""
    defines = {
        "COUNTS_ENTRIES": COUNTS_ENTRIES,
        "STACK_ENTRIES": STACK_ENTRIES,
        "START_ENTRIES": START_ENTRIES,
        "OFFCPU_MIN_NS": cfg.offcpu_min_ms * 1_000_000,
        "OFFCPU_SAMPLE_NS": offcpu_sample_ns(cfg.offcpu_min_ms, cfg.offcpu_sample_ms),
        "LOCK_PIDS": LOCK_PIDS,
        "NEW_PID_NOTIFY_NS": NEW_PID_NOTIFY_NS,
        "SEEN_PIDS": SEEN_PIDS,
        "NEW_PID_ALIVE_NS": round(drains.EARLY_ALIVE_S * 1e9),
        "NEW_PID_STALE_NS": round(drains.EARLY_STALE_S * 1e9),
        **alloc.bpf_defines(cfg.alloc_sample_bytes, cfg.alloc_duty_pct),
        **features.bpf_defines(kernel),
    }
    if offcpu_on:
        defines.update(
            offcpu_defines(task_storage=kernel.has("task_storage"), prev_state=kernel.has("switch_prev_state"))
        )
    return defines


def _dwarf(
    cfg: config_mod.ProfilerConfig, offcpu_on: bool, asked: _Refusals, notes: list[str]
) -> tuple[bool, bool, bool]:
    """(on-CPU, off-CPU, lock waits): which user stacks are walked with unwind tables."""
    dwarf = cfg.dwarf_unwind
    if dwarf and unwind.supported():
        notes.append(f"dwarf_unwind: {unwind.supported()}; user stacks use frame pointers")
        dwarf = False
    # the off-CPU walk starts from the blocked thread's saved user registers (bpf_task_pt_regs)
    offcpu_dwarf = (
        dwarf
        and offcpu_on
        and cfg.offcpu_dwarf
        and asked.can("DWARF unwinding of off-CPU stacks (offcpu_dwarf)", "task_pt_regs")
    )
    return dwarf, offcpu_dwarf, dwarf and bool(cfg.lock_targets)


def wants_python_walk(cfg: config_mod.ProfilerConfig) -> bool:
    """Whether the config asks for CPython stacks (python_stacks, or python_legacy): their frames are then
    walked in BPF where the kernel can."""
    return cfg.python_stacks or "python_legacy" in cfg.runtime_stacks


def _python_walk(
    cfg: config_mod.ProfilerConfig, asked: _Refusals, refused: WalkRefusals, offcpu_on: bool
) -> dict[str, int]:
    """bpf/python.h's -D flags when CPython stacks are asked for and the kernel can give them; else none
    (`refused`: what the kernel did not take at an earlier load)."""
    if not wants_python_walk(cfg):
        return {}
    what = "Python frames in cpu profiles"
    if refused.all:
        asked.refused.append((what, refused.all))
        return {}
    if not asked.can(what, "btf"):
        return {}
    try:
        defines = pywalk.bpf_defines(offcpu=offcpu_on and not refused.offcpu)
    except BtfProgramError as e:
        asked.refused.append((what, str(e)))
        return {}
    if refused.offcpu:
        asked.refused.append(("Python frames in offcpu profiles", refused.offcpu))
    return defines


def plan(
    cfg: config_mod.ProfilerConfig, kernel: features.KernelFeatures, python_refused: WalkRefusals = NO_REFUSALS
) -> ProgramPlan:
    asked = _Refusals(kernel)
    notes: list[str] = []
    offcpu_on = cfg.offcpu and asked.can("off-CPU profiles (offcpu)", "btf")
    alloc_on = bool(cfg.alloc_targets) and asked.can("allocation profiles (alloc_targets)", "uprobe_multi")
    families = (
        ["oncpu"]
        + (["offcpu"] if offcpu_on else [])
        + (["lock"] if cfg.lock_targets else [])
        + (["alloc"] if alloc_on else [])
    )
    defines = _defines(cfg, kernel, offcpu_on)
    dwarf, offcpu_dwarf, lock_dwarf = _dwarf(cfg, offcpu_on, asked, notes)
    if dwarf:
        defines.update(unwind.bpf_defines(offcpu_dwarf, lock_dwarf))
    # runtime_stacks naming a runtime that walks its JIT frames from registers (the JVM): its
    # processes' on-CPU samples carry them (collector/regs.py)
    regs_names = runtime_registry.regs_mappings(cfg.runtime_stacks)
    if regs_names and not asked.can("JIT frames from registers (jvm_cpu)", "ringbuf"):
        regs_names = frozenset()
    if regs_names:
        defines.update(regs.bpf_defines())
    python_walk = _python_walk(cfg, asked, python_refused, offcpu_on)
    if python_walk:
        defines.update(python_walk)
    return ProgramPlan(
        tuple(families),
        defines,
        offcpu_on,
        alloc_on,
        dwarf,
        offcpu_dwarf,
        lock_dwarf,
        regs_names,
        bool(python_walk),
        "PY_WALK_OFFCPU" in python_walk,
        tuple(asked.refused),
        tuple(notes),
    )
