"""The unwind table format (shared/unwind_table.py): what decode() accepts is exactly docs/unwinding.md."""

from __future__ import annotations

import struct

import pytest

from shared import unwind_table as ut

HEADER = ut.Header(
    arch=ut.ARCH_X86_64, span=0x1000, pc_base=0x26000, text_offset=0x26000, text_vaddr=0x26000, text_size=0x1000
)
ROWS = [
    ut.Row(0x0, 8, 0, -8, ut.CFA_SP, ut.FP_SAME, ut.RA_SAVED),
    ut.Row(0x4, 16, -16, -8, ut.CFA_SP, ut.FP_SAVED, ut.RA_SAVED),
    ut.Row(0x8, 16, -16, -8, ut.CFA_FP, ut.FP_SAVED, ut.RA_SAVED),
    ut.Row(0x20, 8, 0, -8, ut.CFA_PLT, ut.FP_SAME, ut.RA_SAVED),
    ut.Row(0x30, 0, 0, 0, ut.CFA_END, ut.FP_SAME, ut.RA_SAVED),
    ut.Row(0x40, 0, 0, 0, ut.CFA_FALLBACK, ut.FP_SAME, ut.RA_SAVED),
]


def good() -> bytearray:
    return bytearray(ut.encode(HEADER, ROWS))


def test_round_trip_keeps_header_and_rows() -> None:
    data = ut.encode(HEADER, ROWS)
    table = ut.decode(data, ut.ARCH_X86_64)
    assert len(data) == 48 + 16 * len(ROWS)
    assert table.header == HEADER and table.row_count == len(ROWS)
    assert list(table.iter_rows()) == ROWS
    assert table.rows == data[48:]  # raw rows, as the collector copies them


def test_encode_takes_packed_rows_too() -> None:
    packed = b"".join(ut.ROW.pack(*r, 0) for r in ROWS)
    assert ut.encode(HEADER, packed) == ut.encode(HEADER, ROWS)


def test_row_for_finds_the_row_bpf_would() -> None:
    table = ut.decode(ut.encode(HEADER, ROWS))
    assert table.row_for(0x5) == ROWS[1]
    assert table.row_for(0x8) == ROWS[2]
    assert table.row_for(0xFFF) == ROWS[-1]
    assert table.row_for(0x1000) is None and table.row_for(-1) is None


def test_arm64_rows_with_the_link_register() -> None:
    h = ut.Header(ut.ARCH_AARCH64, 0x100, 0, 0, 0, 0x100)
    rows = [ut.Row(0, 0, 0, 0, ut.CFA_SP, ut.FP_SAME, ut.RA_LR), ut.Row(8, 0, 0, 0, ut.CFA_FALLBACK, 0, 0)]
    assert ut.decode(ut.encode(h, rows), ut.ARCH_AARCH64).arch == ut.ARCH_AARCH64


def test_bias_maps_a_pc_to_its_row_address() -> None:
    # given libc's text segment (offset 0x26000, vaddr 0x26000) mapped at 0x7f0000026000 with offset 0x26000
    table = ut.decode(ut.encode(HEADER, ROWS))
    b = ut.bias(table, 0x7F0000026000, 0x26000)
    # then the pc of text's first byte is row address 0
    assert 0x7F0000026000 - b == 0
    # and for a non-PIE executable with vaddr != offset (node: offset 0x772000 at vaddr 0xb72000)
    h = ut.Header(ut.ARCH_X86_64, 0x100, pc_base=0xB72000, text_offset=0x772000, text_vaddr=0xB72000, text_size=0x100)
    node = ut.decode(ut.encode(h, [ut.Row(0, 0, 0, 0, ut.CFA_FALLBACK, 0, 0)]))
    assert 0xB72010 - ut.bias(node, 0xB72000, 0x772000) == 0x10


def corrupt(offset: int, fmt: str, value: int) -> bytes:
    data = good()
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


ROW0 = 48


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "shorter than"),
        (bytes(good()[:47]), "shorter than"),
        (b"XXXX" + bytes(good()[4:]), "magic"),
        (corrupt(4, "<H", 2), "version"),
        (corrupt(6, "<H", 3), "unknown arch"),
        (corrupt(8, "<I", 0), "rows"),
        (corrupt(8, "<I", ut.MAX_ROWS + 1), "rows"),
        (corrupt(8, "<I", len(ROWS) + 1), "bytes, expected"),
        (bytes(good()) + b"\0" * 16, "bytes, expected"),
        (bytes(good()[:-1]), "bytes, expected"),
        (corrupt(12, "<I", 0x40), "not below span"),
        (corrupt(16, "<Q", (1 << 64) - 0x10), "64 bits"),
        (corrupt(ROW0 + 16, "<I", 0), "not above"),  # pcs equal
        (corrupt(ROW0 + 32, "<I", 0x2), "not above"),  # pcs decreasing
        (corrupt(ROW0 + 12, "<B", 5), "kinds"),  # cfa_kind out of range
        (corrupt(ROW0 + 13, "<B", 2), "kinds"),  # fp_kind
        (corrupt(ROW0 + 14, "<B", 2), "kinds"),  # ra_kind
        (corrupt(ROW0 + 15, "<B", 1), "kinds"),  # padding
        (corrupt(ROW0 + 14, "<B", ut.RA_LR), "link register"),  # x86-64 has none
        (corrupt(ROW0 + 16 * 5 + 12, "<B", ut.CFA_SP), "not FALLBACK"),  # the last row
    ],
)
def test_decode_rejects(data: bytes, message: str) -> None:
    with pytest.raises(ut.UnwindTableError, match=message):
        ut.decode(data)


def test_decode_rejects_another_arch_than_asked() -> None:
    with pytest.raises(ut.UnwindTableError, match="expected aarch64"):
        ut.decode(bytes(good()), ut.ARCH_AARCH64)


def test_plt_rows_are_x86_only() -> None:
    h = ut.Header(ut.ARCH_AARCH64, 0x100, 0, 0, 0, 0x100)
    rows = [ut.Row(0, 8, 0, 0, ut.CFA_PLT, 0, 0), ut.Row(8, 0, 0, 0, ut.CFA_FALLBACK, 0, 0)]
    with pytest.raises(ut.UnwindTableError, match="x86-64 only"):
        ut.encode(h, rows)


def test_encode_refuses_what_decode_would() -> None:
    with pytest.raises(ut.UnwindTableError):
        ut.encode(HEADER, ROWS[:-1])  # last row not FALLBACK
    with pytest.raises(ut.UnwindTableError):
        ut.encode(ut.Header(ut.ARCH_X86_64, 1 << 32, 0, 0, 0, 0), ROWS)  # span over u32
