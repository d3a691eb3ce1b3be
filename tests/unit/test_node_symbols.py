"""The Node plug-in's file reading and Isolate search, on the host's real node binary and on planted bytes.

elfsyms' prefix and .dynsym-only reads (the v8dbg_ set of an official build,
never its .symtab), data symbol values, the check of v8dbg_ values a crafted
file could hold, and the reader's self-pointer search; the frame pointer
chain of an on-CPU sample's registers and which samples are left to the timer,
on planted frames.
"""

from __future__ import annotations

import struct

from runtimes import elfsyms
from runtimes.memory import ProcessMemory, ReadBudget
from runtimes.node import _facts
from runtimes.node.isolate import IsolateFinder
from runtimes.node.layouts import LAYOUTS
from runtimes.node.reader import MAX_FRAMES, NodeProcess, V8Info
from shared.wire import RegsSample

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
    assert facts.values["off_fp_function"] == -16  # signed, as V8 wrote it


def test_isolate_search_finds_the_planted_self_pointer() -> None:
    base = 0x7F00_1234_0000
    data = bytearray(64 << 10)
    at = 0x1230  # the "isolate" at base + at points back at itself from +8
    struct.pack_into("<Q", data, at + 8, base + at)
    struct.pack_into("<Q", data, 0x4000 + 8, base + 0x9999)  # a near miss
    struct.pack_into("<Q", data, 0x6001, base + 0x5FF9)  # unaligned
    assert IsolateFinder.self_pointers(bytes(data), base, 8) == [base + at]


def test_isolate_search_across_a_64k_boundary() -> None:
    base = 0x7F00_1233_8000  # the window spans two 64 KiB blocks
    data = bytearray(64 << 10)
    at = 0x9000  # past the boundary at base + 0x8000
    struct.pack_into("<Q", data, at + 8, base + at)
    assert IsolateFinder.self_pointers(bytes(data), base, 8) == [base + at]


def test_implausible_v8dbg_values_are_named() -> None:
    with open(HOST_NODE, "rb") as f:
        values = dict(_facts(f).values)
    assert V8Info.from_values(values).check() is None
    values["off_fp_function"] = 4096  # a crafted file's slot, far from any frame
    assert V8Info.from_values(values).check() == "frame slot off_function 4096"
    values["off_fp_function"], values["scopeinfo_idx_first_vars"] = -16, 0
    assert "ScopeInfo indices" in (V8Info.from_values(values).check() or "")


# ------------------------------------------------------------------ on-CPU samples with registers

STACK_HI = 0x7FFD_0010_0000
STACK_LO = STACK_HI - (132 << 10)
JIT, V8_TEXT, LIBC = 0x2000_0000, 0x4000_0000, 0x6000_0000


class _PlantedMemory(ProcessMemory):
    """A process's memory as planted words (zeros elsewhere)."""

    def __init__(self, words: dict[int, int]) -> None:
        super().__init__(0, ReadBudget(1 << 30))
        self.words = words

    def read(self, address: int, size: int) -> bytes:
        return b"".join(struct.pack("<Q", self.words.get(a, 0)) for a in range(address, address + size, 8))[:size]


def _node() -> NodeProcess:
    with open(HOST_NODE, "rb") as f:
        info = V8Info.from_values(_facts(f).values)
    node = NodeProcess("11.3.0.0", LAYOUTS[(11, 3)], info, [], (STACK_LO, STACK_HI), module="/usr/bin/node")
    node.code_map.set([(JIT, JIT + 0x1000, "jit"), (V8_TEXT, V8_TEXT + 0x1000, "v8"), (LIBC, LIBC + 0x1000, "native")])
    return node


def _frames(node: NodeProcess, kinds: list[str], tail: int = 0) -> tuple[dict[int, int], list[int]]:
    """Planted frames, leaf first, 0x100 bytes apart from STACK_HI - 0x1000: "js" (a tagged context and
    function), "entry", "exit" (their type markers) or "cxx" (no V8 frame); the last one's saved frame
    pointer is `tail`."""
    v8, words, fps = node.v8, {}, []
    for i, kind in enumerate(kinds):
        fp = STACK_HI - 0x1000 + 0x100 * i
        fps.append(fp)
        words[fp] = fp + 0x100 if i + 1 < len(kinds) else tail
        words[fp + v8.off_context] = {
            "js": 0x1001,
            "entry": 2 * min(v8.ft_entry),
            "exit": 2 * v8.ft_exit,
            "cxx": 0x7FFD_DEAD_BEE8,
        }[kind]
        words[fp + v8.off_function] = 0x2001 if kind == "js" else 0
    return words, fps


def _window(words: dict[int, int], lo: int, hi: int) -> bytes:
    return b"".join(struct.pack("<Q", words.get(a, 0)) for a in range(lo, hi, 8))


def test_register_chain_ends_at_the_entry_frame_or_where_it_breaks() -> None:
    node = _node()
    lo, hi = STACK_HI - 0x1100, STACK_HI
    words, fps = _frames(node, ["js", "js", "entry", "cxx", "cxx"])
    window = _window(words, lo, hi)
    assert node.chains.from_regs(window, lo, fps[0], 0) == fps[:3]  # past the entry: C++ frames, cut
    assert node.chains.from_regs(window, lo, fps[1], fps[2]) == fps[1:3]  # the js_entry_sp now ends it
    words, fps = _frames(node, ["js", "js", "entry", "cxx", "js", "entry"])  # nested: up to the outermost
    assert node.chains.from_regs(_window(words, lo, hi), lo, fps[0], 0) == fps
    words, fps = _frames(node, ["js", "js"])  # no entry frame, and no isolate found to tell
    assert node.chains.from_regs(_window(words, lo, hi), lo, fps[0], None) == fps
    assert node.dropped == {"regs_chain_cut": 1}


def test_register_chain_that_breaks_below_the_running_entry_is_another_moments_and_dropped() -> None:
    """The slots above a sample's stack copy are read later: when the thread has moved on (its frames
    there written over: a call into C++, the process writing its profile at exit), the chain breaks
    before any entry frame. Kept, it would put the leaf at the root of the profile, its callers lost."""
    node = _node()
    lo, hi = STACK_HI - 0x1100, STACK_HI
    # given two JavaScript frames whose caller's slots now hold what C++ wrote there, under an entry
    # frame the isolate names as running
    words, fps = _frames(node, ["js", "js", "cxx", "entry"])
    words[fps[1]] = 0x10  # the saved rbp, written over: below itself
    # when the chain is followed from the leaf, then nothing is kept, and the drop is counted
    assert node.chains.from_regs(_window(words, lo, hi), lo, fps[0], fps[3]) == []
    # and so when the isolate no longer names a running entry frame (0: the process leaving JavaScript)
    assert node.chains.from_regs(_window(words, lo, hi), lo, fps[0], 0) == []
    assert node.dropped == {"regs_stack_changed": 2}
    # but a chain deeper than is walked keeps its leaf end (counted as too deep)
    deep, deep_fps = _frames(node, ["js"] * (MAX_FRAMES + 1) + ["entry"])
    deep_lo = deep_fps[0] - 0x100
    chain = node.chains.from_regs(_window(deep, deep_lo, deep_fps[-1] + 0x100), deep_lo, deep_fps[0], deep_fps[-1])
    assert chain == deep_fps[:MAX_FRAMES]
    assert node.dropped == {"regs_stack_changed": 2, "too_deep": 1}


def test_register_chain_of_a_call_into_cxx_is_not_javascript() -> None:
    node = _node()
    lo, hi = STACK_HI - 0x1100, STACK_HI
    words, fps = _frames(node, ["exit", "js", "entry"])
    assert node.chains.from_regs(_window(words, lo, hi), lo, fps[0], 0) is None
    words, fps = _frames(node, ["cxx", "js", "entry"])
    assert node.chains.from_regs(_window(words, lo, hi), lo, fps[0], 0) is None


def test_samples_not_running_javascript_are_left_to_the_timer() -> None:
    """Another thread's, one in libc or in a call into C++, and one the timer's last scanned stack
    already counted, are dropped by reason; planted frames with no real JSFunction name nothing."""
    node = _node()
    words, fps = _frames(node, ["js", "js", "entry"])
    exit_words, exit_fps = _frames(node, ["exit", "js", "entry"])
    sp = fps[0] - 0x40

    def sample(t: int, ip: int, fp: int, at: int = sp) -> RegsSample:
        return RegsSample(pid=1, start_ticks=1, tid=1, time_ns=t, ip=ip, sp=at, fp=fp, stack=b"")

    node.scanned_ns = 1_000_000_000
    samples = [
        sample(1_010_000_000, JIT + 8, fps[0]),  # before the handover
        sample(2_000_000_000, JIT + 8, fps[0], at=0x7F00_0000_0000),  # a worker thread's stack
        sample(2_000_000_000, LIBC + 8, fps[0]),  # in libc
        sample(2_000_000_000, V8_TEXT + 8, fps[0]),
    ]  # a builtin: walked
    assert node.sample_regs(_PlantedMemory(words), samples) == []
    assert node.sample_regs(_PlantedMemory(exit_words), [sample(2_000_000_000, V8_TEXT + 8, exit_fps[0])]) == []
    assert node.regs_seen
    from runtimes import main
    from runtimes.node import reader

    assert reader.TIMER_PERIOD_NS == 1_000_000_000 // main.SAMPLE_HZ  # the handover's period is the timer's
    assert node.dropped == {
        "regs_before_handover": 1,
        "regs_not_main_thread": 1,
        "regs_not_js": 1,
        "not_function": 2,
        "regs_no_frames": 1,
        "regs_in_cxx": 1,
    }, node.dropped
