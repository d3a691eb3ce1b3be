"""The Node plug-in's file reading and Isolate search, on the host's real node binary and on planted bytes.

elfsyms' prefix and .dynsym-only reads (the v8dbg_ set of an official build,
never its .symtab), data symbol values, the check of v8dbg_ values a crafted
file could hold, and the reader's self-pointer search.
"""

from __future__ import annotations

import struct

from ebpfprofiler.runtimes import elfsyms
from ebpfprofiler.runtimes.node import _facts
from ebpfprofiler.runtimes.node.reader import NodeProcess, V8Info

HOST_NODE = "/usr/bin/node"
# Only in the host node's .symtab (a local symbol: never exported).
SYMTAB_ONLY = "_ZN2v88internal12_GLOBAL__N_124process_wide_code_range_E"


def test_v8dbg_symbols_come_from_dynsym_only() -> None:
    with open(HOST_NODE, "rb") as f:
        dyn = elfsyms.read_symbols(f, [SYMTAB_ONLY], prefix="v8dbg_", dynsym_only=True)
        both = elfsyms.read_symbols(f, [SYMTAB_ONLY], prefix="v8dbg_")
    assert sum(n.startswith("v8dbg_") for n in dyn.symbols) >= 400
    assert SYMTAB_ONLY not in dyn.symbols and SYMTAB_ONLY in both.symbols


def test_values_and_version_of_the_host_node() -> None:
    with open(HOST_NODE, "rb") as f:
        facts = _facts(f)
    assert facts.version is not None and facts.version[:2] == (11, 3)
    assert facts.values["TaggedSize"] == 8 and facts.values["SmiShiftSize"] == 31
    assert facts.values["off_fp_function"] == -16       # signed, as V8 wrote it


def test_isolate_search_finds_the_planted_self_pointer() -> None:
    base = 0x7F00_1234_0000
    data = bytearray(64 << 10)
    at = 0x1230                                           # the "isolate" at base + at points back at itself from +8
    struct.pack_into("<Q", data, at + 8, base + at)
    struct.pack_into("<Q", data, 0x4000 + 8, base + 0x9999)   # a near miss
    struct.pack_into("<Q", data, 0x6001, base + 0x5ff9)       # unaligned
    assert NodeProcess._self_pointers(bytes(data), base, 8) == [base + at]


def test_isolate_search_across_a_64k_boundary() -> None:
    base = 0x7F00_1233_8000                               # the window spans two 64 KiB blocks
    data = bytearray(64 << 10)
    at = 0x9000                                           # past the boundary at base + 0x8000
    struct.pack_into("<Q", data, at + 8, base + at)
    assert NodeProcess._self_pointers(bytes(data), base, 8) == [base + at]


def test_implausible_v8dbg_values_are_named() -> None:
    with open(HOST_NODE, "rb") as f:
        values = dict(_facts(f).values)
    assert V8Info.from_values(values).check() is None
    values["off_fp_function"] = 4096                       # a crafted file's slot, far from any frame
    assert V8Info.from_values(values).check() == "frame slot off_function 4096"
    values["off_fp_function"], values["scopeinfo_idx_first_vars"] = -16, 0
    assert "ScopeInfo indices" in (V8Info.from_values(values).check() or "")
