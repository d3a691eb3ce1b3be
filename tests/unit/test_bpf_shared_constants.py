"""Every constant the BPF programs and the Python side both use has the same value on both sides.

bcc compiles bpf/*.c at run time, so their #defines cannot be imported: this test reads them
from the C sources and compares them with the Python modules that decode what the programs
write (slot orders of the lost counters, the unwinder's counters and rule kinds, the per-process
mapping array). A value changed on one side only fails here, not as a wrong count in production.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from collector import alloc, intervals, offcpu, oncpu, unwind
from shared import unwind_table
from tests.harness import ROOT

BPF = Path(ROOT) / "bpf"

# What each C name of a lost-counter slot is called on the Python side (the names users see
# in the log and the status file: "cpu.counts_map_full").
LOST_NAMES = {
    "COUNTS_FULL": "counts_map_full",
    "USER_STACK": "user_stack_not_recorded",
    "KERNEL_STACK": "kernel_stack_not_recorded",
    "START_FULL": "start_map_full",
    "NO_RECORD": "no_task_record",
    "LIVE_FULL": "live_map_full",
    "PENDING_FULL": "pending_map_full",
    "REGS": "regs_ring_full",
}

# (BPF source, its slot prefix, the Python module naming the slots)
LOST_FAMILIES = [
    ("oncpu.c", "ONCPU_LOST", oncpu),
    ("offcpu.c", "OFFCPU_LOST", offcpu),
    ("lock.c", "LOCK_LOST", intervals),
    ("alloc.c", "ALLOC_LOST", alloc),
]


def defines(path: Path) -> dict[str, int]:
    """Every `#define NAME <integer>` of a C file (a trailing comment allowed)."""
    out: dict[str, int] = {}
    for m in re.finditer(r"^#define\s+(\w+)\s+(0x[0-9a-fA-F]+|\d+)U?L*\b", path.read_text(), re.MULTILINE):
        out[m.group(1)] = int(m.group(2), 0)
    return out


def kernel_slots(module: ModuleType) -> int:
    """How many of the module's LOST_REASONS its LostCounters reads from the kernel (the rest are
    counted in Python, as stack_gone): `LOST_REASONS[:n]`, or all of them."""
    assert module.__file__ is not None
    src = Path(module.__file__).read_text()
    m = re.search(r"LostCounters\([^)]*LOST_REASONS(?:\[:(\d+)\])?\)", src)
    assert m, f"{module.__name__} reads no LOST_REASONS"
    reasons = module.LOST_REASONS
    return int(m.group(1)) if m.group(1) else len(reasons)


@pytest.mark.parametrize("source,prefix,module", LOST_FAMILIES, ids=[f[0] for f in LOST_FAMILIES])
def test_lost_slots_are_named_in_the_order_the_programs_count_them(
    source: str, prefix: str, module: ModuleType
) -> None:
    d = defines(BPF / source)
    slots = d[f"{prefix}_SLOTS"]
    by_index = {v: k[len(prefix) + 1 :] for k, v in d.items() if k.startswith(prefix + "_") and k != f"{prefix}_SLOTS"}
    assert sorted(by_index) == list(range(slots)), f"{source}: {prefix}_* slots are not 0..{slots - 1}"
    c_names = [LOST_NAMES[by_index[i]] for i in range(slots)]
    reasons = module.LOST_REASONS
    n = kernel_slots(module)
    assert n == slots, f"{module.__name__} reads {n} kernel slots, {source} has {slots}"
    assert list(reasons[:n]) == c_names


def test_unwind_counters_are_named_in_slot_order() -> None:
    d = defines(BPF / "unwind.h")
    names = {
        "LOST_TAIL_CALL": "tail_call_failed",
        "LOST_STACK_FULL": "stack_map_full",
        "TRUNCATED": "truncated",
        "FP_STEPS": "fp_steps",
        "DWARF_STEPS": "dwarf_steps",
    }
    assert d["UNWIND_COUNTER_SLOTS"] == len(unwind.COUNTERS)
    assert [d[f"UNWIND_{c}"] for c in names] == list(range(len(names)))
    assert list(unwind.COUNTERS) == list(names.values())


def test_unwind_rule_kinds_and_mapping_cap_are_the_tables() -> None:
    d = defines(BPF / "unwind.h")
    for name in ("CFA_SP", "CFA_FP", "CFA_PLT", "CFA_FALLBACK", "CFA_END", "FP_SAME", "FP_SAVED"):
        assert d[name] == getattr(unwind_table, name), name
    # bpf/unwind.h names no RA kind: its x86-64 walk always reads the return address at
    # CFA + ra_off, which is RA_SAVED, the kind 0 a zeroed row has.
    assert unwind_table.RA_SAVED == 0
    assert d["UNWIND_MAPPINGS"] == unwind.UNWIND_MAPPINGS


def test_every_define_the_collector_passes_is_used_by_a_program() -> None:
    # A -D flag no program reads is a constant the Python side keeps for nothing.
    sources = "".join(p.read_text() for p in BPF.iterdir() if p.suffix in (".c", ".h"))
    passed = set(unwind.bpf_defines(offcpu_dwarf=True, lock_dwarf=True)) | set(alloc.bpf_defines(65536, 5.0))
    for name in passed:
        assert re.search(rf"\b{name}\b", sources), name


def test_register_records_are_decoded_as_the_program_lays_them_out() -> None:
    """collector/regs.py's RECORD is struct oncpu_regs_record of bpf/oncpu.c up to its stack copy, and the
    copy sizes the collector passes with -D are the ones the wire lets through."""
    from collector import regs
    from shared import wire

    body = re.search(r"struct oncpu_regs_record \{(.*?)\};", (BPF / "oncpu.c").read_text(), re.DOTALL)
    assert body, "bpf/oncpu.c has no struct oncpu_regs_record"
    fields = re.findall(r"^\s*(u8|u32|u64)\s+(\w+)(\[\w+\])?;", body.group(1), re.MULTILINE)
    assert fields[-1][1:] == ("stack", "[ONCPU_REGS_STACK_BYTES]"), fields
    codes = {"u32": "I", "u64": "Q"}
    assert "<" + "".join(codes[t] for t, _, _ in fields[:-1]) == regs.RECORD.format
    assert regs.RECORD.size % 8 == 0  # the stack copy that follows starts 8-aligned
    assert regs.ONCPU_REGS_SHORT_STACK_BYTES < regs.ONCPU_REGS_STACK_BYTES <= wire.MAX_REGS_STACK_BYTES
    # a message the collector sends is one the readers take
    assert regs.SAMPLES_PER_MESSAGE <= wire.MAX_REGS_SAMPLES
    assert regs.SAMPLES_PER_MESSAGE * (regs.RECORD.size + regs.ONCPU_REGS_STACK_BYTES) < wire.MAX_BATCH_BYTES


def test_the_perf_event_context_bpf_oncpu_declares_is_the_kernels() -> None:
    """bpf/oncpu.c declares struct bpf_perf_event_data itself rather than include its header (half of bcc's
    compile): its fields, in order, are those of the header tree's uapi header, and on x86-64 the registers
    are a struct pt_regs."""
    import os

    tree = Path(f"/lib/modules/{os.uname().release}/source")
    if not (tree / "include").is_dir():
        tree = Path(f"/lib/modules/{os.uname().release}/build")
    fields = r"struct bpf_perf_event_data \{(.*?)\};"
    ours = re.search(fields, (BPF / "oncpu.c").read_text(), re.DOTALL)
    theirs = re.search(fields, (tree / "include/uapi/linux/bpf_perf_event.h").read_text(), re.DOTALL)
    assert ours and theirs

    def names(body: str) -> list[tuple[str, str]]:
        return re.findall(r"^\s*(\w+(?:\s+\w+)?)\s+(\w+);", body, re.MULTILINE)

    ours_fields, their_fields = names(ours.group(1)), names(theirs.group(1))
    assert [n for _, n in ours_fields] == [n for _, n in their_fields] == ["regs", "sample_period", "addr"]
    assert [t for t, _ in ours_fields[1:]] == [t for t, _ in their_fields[1:]]
    # x86-64 has no header of its own: it takes the generic one's registers
    assert not (tree / "arch/x86/include/uapi/asm/bpf_perf_event.h").exists()
    generic = (tree / "include/uapi/asm-generic/bpf_perf_event.h").read_text()
    assert re.search(r"typedef struct pt_regs bpf_user_pt_regs_t;", generic)
    assert ours_fields[0][0] == "struct pt_regs"


def test_the_python_walkers_constants_and_proc_entry_are_the_programs() -> None:
    """collector/pywalk.py reads what bpf/python.h writes: its caps, flags and counter slots, and struct
    py_proc field for field (PyProc)."""
    import ctypes

    from collector import pywalk

    source = (BPF / "python.h").read_text()
    d = defines(BPF / "python.h")
    for name in (
        "PY_MAX_FRAMES",
        "PY_WALK_FRAMES",
        "PY_FRAME_BYTES",
        "PY_NO_OFFSET",
        "PY_NO_INSTR",
        "PY_FRAME_ENTRY",
        "PY_FRAME_SHIM",
        "PY_STACK_TRUNCATED",
        "PY_STACK_CUT",
    ):
        assert d[name] == getattr(pywalk, name), name
    slots = {v: k for k, v in d.items() if k.startswith("PY_") and k in {f"PY_{c.upper()}" for c in pywalk.COUNTERS}}
    assert d["PY_COUNTER_SLOTS"] == len(pywalk.COUNTERS)
    assert [slots[i] for i in range(len(pywalk.COUNTERS))] == [f"PY_{c.upper()}" for c in pywalk.COUNTERS]
    body = re.search(r"struct py_proc \{(.*?)\};", source, re.DOTALL)
    assert body
    fields = re.findall(r"^\s*(u8|u16|u32|u64)\s+([\w, ]+);", body.group(1), re.MULTILINE)
    c_fields = [(t, name.strip()) for t, names in fields for name in names.split(",")]
    sizes = {"u8": 1, "u16": 2, "u32": 4, "u64": 8}
    assert [(n, sizes[t]) for t, n in c_fields] == [(f[0], ctypes.sizeof(f[1])) for f in pywalk.PyProc._fields_]
    passed = set(pywalk.bpf_defines()) - {"PY_WALK"}
    for name in passed:
        assert re.search(rf"\b{name}\b", source), name
