"""Unwind tables from CFI (symbolizer/cfi.py), checked against binutils' readelf.

readelf --debug-dump=frames-interp is the independent decoder: for every FDE of
the module, the CFA, frame pointer and return address rules it prints at each
row address must map to the rows of our table (and each of our rows must agree
with readelf's state at its address). Corrupt sections must come out as a
CfiError (the whole module skipped) or FALLBACK rows (one FDE), never anything
else, never a hang.
"""

from __future__ import annotations

import io
import random
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared import unwind_table as ut
from symbolizer import cfi
from tests.harness import WORKLOADS

LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
ARM64_LIBC = Path("/usr/aarch64-linux-gnu/lib/libc.so.6")  # comes with gcc-aarch64-linux-gnu
SOURCE = WORKLOADS / "cfi_prog.c"
NOFP = ["-O2", "-fomit-frame-pointer"]

FALLBACK = (ut.CFA_FALLBACK, 0, ut.FP_SAME, 0, ut.RA_SAVED, 0)
END = (ut.CFA_END, 0, ut.FP_SAME, 0, ut.RA_SAVED, 0)


# ---------------------------------------------------------------- builds


@pytest.fixture(scope="module")
def x86_prog(build: Callable[..., Path]) -> Path:
    return build("cfi_prog", NOFP)


@pytest.fixture(scope="module")
def arm64_prog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same source cross-compiled for arm64 (a shared object: the cross toolchain has no target crt files)."""
    gcc = shutil.which("aarch64-linux-gnu-gcc")
    assert gcc, "aarch64-linux-gnu-gcc not found: deploy/setup.sh installs gcc-aarch64-linux-gnu"
    out = tmp_path_factory.mktemp("arm64") / "cfi_prog.so"
    subprocess.run([gcc, *NOFP, "-shared", "-fPIC", "-nostdlib", "-o", str(out), str(SOURCE)], check=True)
    return out


def build_file(path: Path | bytes) -> cfi.Built:
    f = io.BytesIO(path) if isinstance(path, bytes) else path.open("rb")
    with f:
        return cfi.build_table(f)


def symbol(path: Path, name: str) -> tuple[int, int]:
    """(address, size) of a function symbol, as nm sees it."""
    out = subprocess.run(["nm", "-S", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[3] == name:
            return int(parts[0], 16), int(parts[1], 16)
    raise AssertionError(f"{name} not in {path}")


# ---------------------------------------------------------------- readelf, the independent decoder


@dataclass
class RFde:
    offset: int
    cie: int
    begin: int
    end: int
    rows: list[tuple[int, dict[str, str]]] = field(default_factory=list)  # (loc, column -> cell)
    undefined_ra: bool = False


_ENTRY = re.compile(r"^([0-9a-f]{8,16}) [0-9a-f]+ [0-9a-f]+ (CIE|FDE)(.*)$")
_FDE_TAIL = re.compile(r" cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+)")
_CIE_RA = re.compile(r" ra=(\d+)")
_REGISTER_CELL = re.compile(r"\b(r\d+) \(([a-z0-9]+)\)")


def _readelf(option: str, path: Path) -> str:
    # readelf exits 1 on libc without saying why (its debug link?); the dump itself is whole.
    out = subprocess.run(
        ["readelf", option, str(path)], check=False, capture_output=True, text=True, timeout=120
    ).stdout
    assert "Contents of the" in out, f"readelf {option} {path} printed no frames"
    return out


def readelf_fdes(path: Path, ra_column: int) -> tuple[list[RFde], dict[int, RFde], dict[int, int]]:
    """FDEs and CIEs as readelf interprets them, and each CIE's return address column."""
    interp, raw = (_readelf(option, path) for option in ("--debug-dump=frames-interp", "--debug-dump=frames"))
    fdes: list[RFde] = []
    cies: dict[int, RFde] = {}
    ra_of: dict[int, int] = {}
    entry: RFde | None = None
    columns: list[str] = []
    for line in interp.splitlines():
        m = _ENTRY.match(line)
        if m:
            offset = int(m.group(1), 16)
            if m.group(2) == "CIE":
                entry = cies[offset] = RFde(offset, offset, 0, 0)
                ra = _CIE_RA.search(m.group(3))
                assert ra is not None
                ra_of[offset] = int(ra.group(1))
            else:
                t = _FDE_TAIL.match(m.group(3))
                assert t is not None
                entry = RFde(offset, int(t.group(1), 16), int(t.group(2), 16), int(t.group(3), 16))
                fdes.append(entry)
            columns = []
        elif line.startswith("   LOC"):
            columns = line.split()[1:]
        elif entry is not None and re.match(r"^[0-9a-f]{16} ", line):
            cells = _REGISTER_CELL.sub(r"\1(\2)", line).split()  # "r10 (r10)": a register rule, one cell
            entry.rows.append((int(cells[0], 16), dict(zip(columns, cells[1:]))))
    # readelf prints "u" both for a rule never set and for DW_CFA_undefined: the raw dump tells them apart.
    by_offset = {f.offset: f for f in fdes}
    current = None
    for line in raw.splitlines():
        m = _ENTRY.match(line)
        if m:
            current = by_offset.get(int(m.group(1), 16))
        elif current is not None and f"DW_CFA_undefined: r{ra_column} " in line:
            current.undefined_ra = True
    return fdes, cies, ra_of


def expected(cells: dict[str, str], arch: int, ra_ok: bool, undefined_ra: bool) -> set[tuple[int, ...]]:
    """The rows a table may have where readelf shows `cells`: our mapping of docs/unwinding.md,
    written again here from readelf's notation."""
    sp, fp_name = ("rsp", "rbp") if arch == ut.ARCH_X86_64 else ("sp", "x29")
    if cells.get("ra", "u") == "u":
        if arch == ut.ARCH_X86_64:
            return {END}  # x86-64 CIEs set the RA rule: "u" is DW_CFA_undefined
        if undefined_ra:
            return {END} | _arm_rows(cells, sp, fp_name, ra_ok)
    if arch == ut.ARCH_X86_64:
        return _x86_rows(cells, sp, fp_name, ra_ok)
    return _arm_rows(cells, sp, fp_name, ra_ok)


def _cfa(cell: str, sp: str, fp: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"([a-z0-9]+)([+-]\d+)", cell)
    if not m or m.group(1) not in (sp, fp):
        return None
    return (ut.CFA_SP if m.group(1) == sp else ut.CFA_FP), int(m.group(2))


def _saved(cell: str) -> tuple[int, int] | None:
    """FP rule: (kind, offset) or None when the table cannot express it."""
    if cell in ("u", "s"):
        return ut.FP_SAME, 0
    m = re.fullmatch(r"c([+-]\d+)", cell)
    return (ut.FP_SAVED, int(m.group(1))) if m and _s16(int(m.group(1))) else None


def _s16(v: int) -> bool:
    """Offsets from the CFA are s16 fields in the table: larger ones cannot be expressed."""
    return -0x8000 <= v <= 0x7FFF


def _x86_rows(cells: dict[str, str], sp: str, fp_name: str, ra_ok: bool) -> set[tuple[int, ...]]:
    fp = _saved(cells.get(fp_name, "u"))
    if not ra_ok or cells.get("ra") != "c-8" or fp is None:
        return {FALLBACK}
    if cells["CFA"] == "exp":  # readelf does not print which expression: PLT, or FALLBACK for any other
        return {FALLBACK} | {(ut.CFA_PLT, off, *fp, ut.RA_SAVED, -8) for off in range(0, 64, 8)}
    cfa = _cfa(cells["CFA"], sp, fp_name)
    return {FALLBACK} if cfa is None else {(*cfa, *fp, ut.RA_SAVED, -8)}


def _arm_rows(cells: dict[str, str], sp: str, fp_name: str, ra_ok: bool) -> set[tuple[int, ...]]:
    fp = _saved(cells.get(fp_name, "u"))
    ra_cell = cells.get("ra", "u")
    m = re.fullmatch(r"c([+-]\d+)", ra_cell)
    ra = (
        (ut.RA_LR, 0)
        if ra_cell in ("u", "s")
        else ((ut.RA_SAVED, int(m.group(1))) if m and _s16(int(m.group(1))) else None)
    )
    cfa = _cfa(cells["CFA"], sp, fp_name)
    if not ra_ok or fp is None or ra is None or cfa is None:
        return {FALLBACK}
    return {(*cfa, *fp, *ra)}


def fields(row: ut.Row | None) -> tuple[int, ...]:
    assert row is not None  # every pc the tests ask about is inside the table
    return (row.cfa_kind, row.cfa_off, row.fp_kind, row.fp_off, row.ra_kind, row.ra_off)


def compare_with_readelf(path: Path, arch: int) -> tuple[cfi.Built, int]:
    """Build the table of `path` and check it against readelf both ways; (the build, FDEs compared)."""
    built = build_file(path)
    table = ut.decode(built.table, arch)
    h = table.header
    pcs = table.pcs()
    ra_column = 16 if arch == ut.ARCH_X86_64 else 30
    fdes, cies, ra_of = readelf_fdes(path, ra_column)
    lo, hi = h.text_vaddr, h.text_vaddr + h.text_size
    compared = 0
    mismatches: list[str] = []
    for fde in fdes:
        if not (lo <= fde.begin < fde.end <= hi):
            continue
        compared += 1
        ra_ok = ra_of[fde.cie] == ra_column
        rows = [(loc, c) for loc, c in fde.rows if loc < fde.end] or [(fde.begin, cies[fde.cie].rows[0][1])]

        def state_at(pc: int, rows: list[tuple[int, dict[str, str]]] = rows) -> dict[str, str]:
            return [c for loc, c in rows if loc <= pc][-1]

        # every readelf row, and every row of ours inside the FDE, agree
        ours_inside = [pc + h.pc_base for pc in pcs if fde.begin <= pc + h.pc_base < fde.end]
        for pc in sorted({loc for loc, _ in rows} | set(ours_inside) | {fde.begin}):
            want = expected(state_at(pc), arch, ra_ok, fde.undefined_ra)
            got = fields(table.row_for(pc - h.pc_base, pcs))
            if got not in want:
                mismatches.append(f"FDE {fde.offset:#x} at {pc:#x}: readelf {state_at(pc)}, ours {got}")
    assert not mismatches, f"{len(mismatches)} rows differ, first: " + "; ".join(mismatches[:5])
    return built, compared


# ---------------------------------------------------------------- agreement with readelf


def test_libc_table_agrees_with_readelf_on_every_fde() -> None:
    # given Debian's libc (no frame pointers), when its table is built
    built, compared = compare_with_readelf(LIBC, ut.ARCH_X86_64)
    # then every FDE of its text was compared, none needed FALLBACK, and the PLT rows are PLT
    assert compared == built.fdes > 3000
    assert built.fallback_fdes == 0 and built.skipped_fdes == 0
    table = ut.decode(built.table)
    assert any(r.cfa_kind == ut.CFA_PLT for r in table.iter_rows())
    assert any(r.cfa_kind == ut.CFA_END for r in table.iter_rows())  # clone's child: RA undefined


def test_a_program_built_without_frame_pointers_agrees_with_readelf(x86_prog: Path) -> None:
    built, compared = compare_with_readelf(x86_prog, ut.ARCH_X86_64)
    assert compared == built.fdes >= 8
    table = ut.decode(built.table)
    kinds = {r.cfa_kind for r in table.iter_rows()}
    assert {ut.CFA_SP, ut.CFA_FP} <= kinds  # with_vla's frame is addressed from rbp


def test_main_starts_at_sp_plus_8_with_the_return_address_below_it(x86_prog: Path) -> None:
    table = ut.decode(build_file(x86_prog).table)
    main, _ = symbol(x86_prog, "main")
    row = table.row_for(main - table.header.pc_base)
    assert row is not None and fields(row) == (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)


def test_an_arm64_program_agrees_with_readelf(arm64_prog: Path) -> None:
    # given the same source cross-compiled for arm64, when its table is built
    built, compared = compare_with_readelf(arm64_prog, ut.ARCH_AARCH64)
    table = ut.decode(built.table, ut.ARCH_AARCH64)
    # then it is an arm64 table that agrees with readelf: functions start with RA in the link register
    # and save x29/x30 relative to the CFA
    assert compared == built.fdes >= 8
    rows = list(table.iter_rows())
    assert any(r.ra_kind == ut.RA_LR for r in rows)
    assert any(r.ra_kind == ut.RA_SAVED and r.fp_kind == ut.FP_SAVED for r in rows)
    assert any(r.cfa_kind == ut.CFA_FP for r in rows)


def test_arm64_libc_agrees_with_readelf() -> None:
    assert ARM64_LIBC.exists(), "the arm64 libc comes with gcc-aarch64-linux-gnu (deploy/setup.sh)"
    built, compared = compare_with_readelf(ARM64_LIBC, ut.ARCH_AARCH64)
    assert compared == built.fdes > 3000
    # glibc's hand-written FDEs with return address column 15 are FALLBACK, and only those
    assert built.fallback_fdes == 1


def test_debug_frame_is_used_when_there_is_no_eh_frame(tmp_path: Path) -> None:
    # given a library built with -g and no unwind tables: an empty .eh_frame and a .debug_frame
    lib = tmp_path / "df.so"
    subprocess.run(
        [
            "gcc",
            *NOFP,
            "-g",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
            "-shared",
            "-fPIC",
            "-nostdlib",
            "-o",
            str(lib),
            str(SOURCE),
        ],
        check=True,
    )
    built, compared = compare_with_readelf(lib, ut.ARCH_X86_64)
    assert built.source == ".debug_frame" and compared == built.fdes >= 8


# ---------------------------------------------------------------- hand-written CFI


def uleb(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def sleb(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        done = (v == 0 and not b & 0x40) or (v == -1 and b & 0x40)
        out.append(b | (0 if done else 0x80))
        if done:
            return bytes(out)


def entry(body: bytes, dwarf64: bool = False) -> bytes:
    """A CIE or FDE: its length, then `body` (which starts with the CIE id or pointer)."""
    if dwarf64:
        return b"\xff\xff\xff\xff" + struct.pack("<Q", len(body)) + body
    return struct.pack("<I", len(body)) + body


X86_CIE_INSNS = b"\x0c\x07\x08" + b"\x90\x01"  # def_cfa rsp+8; offset r16 at cfa-8


def eh_cie(
    enc: int = 0x1B, insns: bytes = X86_CIE_INSNS, aug: bytes = b"zR", ra: int = 16, dwarf64: bool = False
) -> bytes:
    body = (b"\0" * (8 if dwarf64 else 4)) + b"\x01" + aug + b"\0" + uleb(1) + sleb(-8) + bytes([ra])
    if aug.startswith(b"z"):
        data = bytes([enc]) if b"R" in aug else b""
        body += uleb(len(data)) + data
    return entry(body + insns, dwarf64)


def pointer(enc: int, value: int) -> bytes:
    fmt = enc & 0x0F
    return {
        0x00: lambda: struct.pack("<Q", value & (1 << 64) - 1),
        0x01: lambda: uleb(value),
        0x02: lambda: struct.pack("<H", value),
        0x03: lambda: struct.pack("<I", value),
        0x04: lambda: struct.pack("<Q", value),
        0x09: lambda: sleb(value),
        0x0A: lambda: struct.pack("<h", value),
        0x0B: lambda: struct.pack("<i", value),
        0x0C: lambda: struct.pack("<q", value),
    }[fmt]()


@dataclass
class Patched:
    """A copy of a built program whose .eh_frame is replaced by hand-written CFI."""

    data: bytes
    sec_addr: int
    sec_offset: int
    sec_size: int
    main: int
    main_size: int

    def with_eh_frame(self, make: Callable[[int], bytes]) -> bytes:
        """make(section vaddr) -> the new section contents (no longer than the old one)."""
        new = make(self.sec_addr) + b"\0\0\0\0"  # the terminator
        assert len(new) <= self.sec_size, "hand-written CFI longer than the section it replaces"
        new += b"\0" * (self.sec_size - len(new))
        return self.data[: self.sec_offset] + new + self.data[self.sec_offset + self.sec_size :]


@pytest.fixture(scope="module")
def patched(x86_prog: Path) -> Patched:
    data = x86_prog.read_bytes()
    with x86_prog.open("rb") as f:
        m = cfi.read_module(f)
    assert m.eh_frame is not None
    main, size = symbol(x86_prog, "main")
    return Patched(data, m.eh_frame.addr, m.eh_frame.offset, m.eh_frame.size, main, size)


def one_fde(
    p: Patched,
    insns: bytes,
    enc: int = 0x1B,
    cie_insns: bytes = X86_CIE_INSNS,
    ra: int = 16,
    aug: bytes = b"zR",
    dwarf64: bool = False,
) -> bytes:
    """The program with one CIE and one FDE over main."""

    def make(addr: int) -> bytes:
        cie = eh_cie(enc, cie_insns, aug, ra, dwarf64)
        id_size = 8 if dwarf64 else 4
        id_pos = len(cie) + (12 if dwarf64 else 4)
        field_addr = addr + id_pos + id_size
        begin = p.main - field_addr if enc & 0x70 == 0x10 else p.main
        body = pointer(enc, begin) + pointer(enc & 0x0F, p.main_size)
        if aug.startswith(b"z"):
            body += uleb(0)
        ident = struct.pack("<Q" if dwarf64 else "<I", id_pos)
        return cie + entry(ident + body + insns, dwarf64)

    return p.with_eh_frame(make)


def row_at_main(data: bytes, p: Patched, delta: int = 0) -> tuple[int, ...]:
    table = ut.decode(build_file(data).table)
    return fields(table.row_for(p.main + delta - table.header.pc_base))


@pytest.mark.parametrize("enc", [0x1B, 0x1C, 0x10, 0x03, 0x04, 0x0B, 0x0C, 0x00, 0x01, 0x09, 0x02, 0x0A, 0x19])
def test_every_pointer_encoding_that_locates_an_fde(patched: Patched, enc: int) -> None:
    # given one FDE over main whose location is written with encoding `enc` (pcrel or absolute)
    data = one_fde(patched, b"\x41\x0e\x10", enc)  # advance 1; def_cfa_offset 16
    # then main's rows are found at main
    assert row_at_main(data, patched) == (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)
    assert row_at_main(data, patched, 1) == (ut.CFA_SP, 16, ut.FP_SAME, 0, ut.RA_SAVED, -8)


def test_64_bit_dwarf_lengths(patched: Patched) -> None:
    data = one_fde(patched, b"\x41\x0e\x10", dwarf64=True)
    assert row_at_main(data, patched, 1) == (ut.CFA_SP, 16, ut.FP_SAME, 0, ut.RA_SAVED, -8)


PLT_EXPR = bytes((0x77, 0x08)) + bytes((0x80, 0x00, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22))


@pytest.mark.parametrize(
    "insns, want",
    [
        # push rbp; mov rbp, rsp: CFA from rbp, rbp saved at CFA-16
        (b"\x41\x0e\x10\x86\x02\x41\x0d\x06", (ut.CFA_FP, 16, ut.FP_SAVED, -16, ut.RA_SAVED, -8)),
        (b"\x42\x0c\x06\x10", (ut.CFA_FP, 16, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # def_cfa
        (b"\x42\x12\x07\x7e", (ut.CFA_SP, 16, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # def_cfa_sf -2*-8
        (b"\x42\x13\x7c", (ut.CFA_SP, 32, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # def_cfa_offset_sf
        (b"\x42\x11\x06\x7e", (ut.CFA_SP, 8, ut.FP_SAVED, 16, ut.RA_SAVED, -8)),  # offset_extended_sf
        (b"\x42\x05\x06\x03", (ut.CFA_SP, 8, ut.FP_SAVED, -24, ut.RA_SAVED, -8)),  # offset_extended
        (b"\x42\x2f\x06\x02", (ut.CFA_SP, 8, ut.FP_SAVED, 16, ut.RA_SAVED, -8)),  # GNU_negative_offset_ext
        (b"\x42\x86\x02\xc6", (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # offset then restore
        (b"\x42\x86\x02\x06\x06", (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # restore_extended
        (b"\x42\x86\x02\x08\x06", (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # same_value
        (b"\x42\x86\x02\x07\x06", (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # undefined rbp
        (b"\x42\x2e\x10\x00", (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # args_size, nop
        (b"\x42\x0a\x0e\x40\x0b", (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # remember, restore
        (b"\x02\x02\x0e\x18", (ut.CFA_SP, 24, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # advance_loc1
        (b"\x03\x02\x00\x0e\x18", (ut.CFA_SP, 24, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # advance_loc2
        (b"\x04\x02\x00\x00\x00\x0e\x18", (ut.CFA_SP, 24, ut.FP_SAME, 0, ut.RA_SAVED, -8)),  # advance_loc4
        (b"\x42\x0f" + bytes([len(PLT_EXPR)]) + PLT_EXPR, (ut.CFA_PLT, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)),
        (b"\x42\x0f\x02\x77\x08", FALLBACK),  # any other CFA expression
        (b"\x42\x0c\x05\x00", FALLBACK),  # CFA from rdi
        (b"\x42\x09\x06\x09", FALLBACK),  # rbp in r9
        (b"\x42\x14\x06\x02", FALLBACK),  # val_offset rbp
        (b"\x42\x10\x06\x02\x77\x08", FALLBACK),  # expression rbp
        (b"\x42\x16\x10\x02\x77\x08", FALLBACK),  # val_expression ra
        (b"\x42\x90\x03", FALLBACK),  # ra at CFA-24
        (b"\x42\x07\x10", END),  # ra undefined: the outermost frame
    ],
)
def test_each_rule_maps_to_its_row(patched: Patched, insns: bytes, want: tuple[int, ...]) -> None:
    data = one_fde(patched, insns)
    assert row_at_main(data, patched) == (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)
    assert row_at_main(data, patched, 2) == want


def test_set_loc_moves_to_an_address(patched: Patched) -> None:
    # given an FDE with absolute pointers whose program sets the location to main + 4
    data = one_fde(patched, b"\x01" + struct.pack("<Q", patched.main + 4) + b"\x0e\x20", enc=0x00)
    # then the new rule holds from main + 4 on
    assert row_at_main(data, patched, 3) == (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)
    assert row_at_main(data, patched, 4) == (ut.CFA_SP, 32, ut.FP_SAME, 0, ut.RA_SAVED, -8)


@pytest.mark.parametrize(
    "insns",
    [
        b"\x42\x3f",  # an opcode nobody defined
        b"\x42\x0b",  # restore_state with nothing remembered
        b"\x42" + b"\x0a" * (cfi.MAX_REMEMBER_DEPTH + 1),
        b"\x42\x0e",  # operand past the end of the program
        b"\x42\x0f\x40\x77",  # expression longer than the program
    ],
)
def test_an_fde_the_table_cannot_express_is_fallback_over_its_range(patched: Patched, insns: bytes) -> None:
    built = build_file(one_fde(patched, insns))
    table = ut.decode(built.table)
    assert built.fallback_fdes == 1
    assert fields(table.row_for(patched.main - table.header.pc_base)) == FALLBACK
    assert fields(table.row_for(patched.main + patched.main_size - 1 - table.header.pc_base)) == FALLBACK


def test_a_cie_with_another_return_address_column_gives_fallback(patched: Patched) -> None:
    assert row_at_main(one_fde(patched, b"\x41\x0e\x10", ra=15), patched, 1) == FALLBACK


def test_augmentations_p_l_s_b_are_skipped_by_length(patched: Patched) -> None:
    def make(addr: int) -> bytes:
        # "zPLRSB": personality (indirect pcrel sdata4), LSDA encoding, FDE encoding, S, B
        aug_data = b"\x9b" + struct.pack("<i", 0) + b"\x1b" + b"\x1b"
        body = b"\0\0\0\0\x01zPLRSB\0" + uleb(1) + sleb(-8) + b"\x10" + uleb(len(aug_data)) + aug_data
        cie = entry(body + X86_CIE_INSNS)
        id_pos = len(cie) + 4
        fde_body = struct.pack("<i", patched.main - (addr + id_pos + 4)) + struct.pack("<i", patched.main_size)
        fde_body += uleb(4) + struct.pack("<i", 0)  # the LSDA pointer
        return cie + entry(struct.pack("<I", id_pos) + fde_body + b"\x41\x0e\x10")

    data = patched.with_eh_frame(make)
    assert row_at_main(data, patched, 1) == (ut.CFA_SP, 16, ut.FP_SAME, 0, ut.RA_SAVED, -8)


def test_a_cie_without_z_and_an_unknown_augmentation_leaves_nothing_to_build(patched: Patched) -> None:
    # its FDEs cannot even be located: skipped, and with no other FDE there is no table
    with pytest.raises(cfi.NoCfi):
        build_file(one_fde(patched, b"\x41\x0e\x10", enc=0x00, aug=b"xyz"))


def test_no_fde_in_the_segment_is_none(patched: Patched) -> None:
    with pytest.raises(cfi.NoCfi):
        build_file(patched.with_eh_frame(lambda addr: eh_cie()))


# ---------------------------------------------------------------- corrupt input


def test_an_entry_running_past_the_section_fails_the_module(patched: Patched) -> None:
    data = bytearray(patched.data)
    struct.pack_into("<I", data, patched.sec_offset, 0x7FFFFFF0)
    with pytest.raises(cfi.CfiError) as e:
        build_file(bytes(data))
    assert e.value.kind == "malformed" and "past the end" in str(e.value)


def test_a_bad_cie_pointer_fails_the_module(patched: Patched) -> None:
    data = bytearray(patched.data)
    first_len = struct.unpack_from("<I", data, patched.sec_offset)[0]
    fde = patched.sec_offset + 4 + first_len
    struct.pack_into("<I", data, fde + 4, 0x7FFFFFFF)  # before the start of the section
    with pytest.raises(cfi.CfiError, match="CIE pointer"):
        build_file(bytes(data))


def test_a_truncated_file_fails_the_module(patched: Patched) -> None:
    with pytest.raises(cfi.CfiError):
        build_file(patched.data[: patched.sec_offset + patched.sec_size // 2])


def test_a_file_without_cfi_is_none(tmp_path: Path) -> None:
    # given a library built without any unwind information
    lib = tmp_path / "nocfi.so"
    subprocess.run(
        [
            "gcc",
            *NOFP,
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
            "-shared",
            "-fPIC",
            "-nostdlib",
            "-o",
            str(lib),
            str(SOURCE),
        ],
        check=True,
    )
    with pytest.raises(cfi.NoCfi, match="no .eh_frame or .debug_frame"):  # noqa: RUF043
        build_file(lib)


def test_not_an_elf_file_is_a_cfi_error() -> None:
    with pytest.raises(cfi.CfiError):
        build_file(b"#!/bin/sh\necho hello\n" * 10)


def test_random_corruption_yields_a_table_or_a_cfi_error_and_nothing_else(patched: Patched) -> None:
    # given a few hundred copies of a real program with bytes of its .eh_frame flipped
    rng = random.Random(6)
    deadline = time.monotonic() + 60
    outcomes = {"table": 0, "error": 0}
    for _ in range(400):
        data = bytearray(patched.data)
        for _ in range(rng.randint(1, 8)):
            data[patched.sec_offset + rng.randrange(patched.sec_size)] = rng.randrange(256)
        # when its table is built
        try:
            built = build_file(bytes(data))
        except cfi.CfiError as e:
            # then a failure is a CfiError of a known kind, never one of ours leaking out
            assert e.kind != "internal", str(e)
            outcomes["error"] += 1
        else:
            ut.decode(built.table)  # and a table is always a valid one
            outcomes["table"] += 1
        assert time.monotonic() < deadline, "corrupt input took too long"
    assert outcomes["table"] and outcomes["error"]


def test_random_corruption_of_libc_is_survived_within_the_budget() -> None:
    data = LIBC.read_bytes()
    with LIBC.open("rb") as f:
        m = cfi.read_module(f)
    assert m.eh_frame is not None
    rng = random.Random(7)
    started = time.monotonic()
    for _ in range(20):
        copy = bytearray(data)
        for _ in range(32):
            copy[m.eh_frame.offset + rng.randrange(m.eh_frame.size)] = rng.randrange(256)
        try:
            ut.decode(build_file(bytes(copy)).table)
        except cfi.CfiError as e:
            assert e.kind != "internal", str(e)
    assert time.monotonic() - started < 30


# Functions in the library the budget test builds: its table takes ~0.1 s here, 10 times the budget.
MANY_FUNCTIONS = 3_000


def test_a_build_over_its_time_budget_is_a_too_slow_cfi_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # given a library of many functions (one FDE each) and a budget far below what its table takes
    src = tmp_path / "many.c"
    src.write_text(
        "".join(
            f"int f{i}(int x) {{ return x * {i} + f{i - 1}(x - 1); }}\n" if i else "int f0(int x) { return x; }\n"
            for i in range(MANY_FUNCTIONS)
        )
    )
    lib = tmp_path / "many.so"
    subprocess.run(["gcc", "-O0", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    monkeypatch.setattr(cfi, "CFI_BUILD_SECONDS", 0.01)
    # when its table is built
    with pytest.raises(cfi.CfiError) as e:
        build_file(lib)
    # then the build stops at the budget with a skip the caller counts as too slow
    # (how long builds take is a figure of `make bench`, suite tables, not of a test)
    assert e.value.kind == "too_slow"


def test_advance_loc_0_makes_the_last_row_at_that_pc_hold(patched: Patched) -> None:
    # DW_CFA_advance_loc 1; def_cfa_offset 16; DW_CFA_advance_loc 0; def_cfa_offset 24; advance 1; offset 32:
    # two rows at main+1, which failed the whole module; the last one holds there, as other unwinders take it.
    data = one_fde(patched, b"\x41\x0e\x10\x40\x0e\x18\x41\x0e\x20")
    assert row_at_main(data, patched) == (ut.CFA_SP, 8, ut.FP_SAME, 0, ut.RA_SAVED, -8)
    assert row_at_main(data, patched, 1) == (ut.CFA_SP, 24, ut.FP_SAME, 0, ut.RA_SAVED, -8)
    assert row_at_main(data, patched, 2) == (ut.CFA_SP, 32, ut.FP_SAME, 0, ut.RA_SAVED, -8)
    # and at the very start of the FDE too (advance 0 first)
    data = one_fde(patched, b"\x40\x0e\x10\x41\x0e\x18")
    assert row_at_main(data, patched) == (ut.CFA_SP, 16, ut.FP_SAME, 0, ut.RA_SAVED, -8)
    assert row_at_main(data, patched, 1) == (ut.CFA_SP, 24, ut.FP_SAME, 0, ut.RA_SAVED, -8)


def test_an_eh_frame_over_the_section_cap_fails_the_module_before_it_is_read(x86_prog: Path, tmp_path: Path) -> None:
    # Given a copy of a program whose .eh_frame section header claims one byte more than the cap
    # (the bytes are not there: a crafted file need not hold what it claims)
    from elftools.elf.elffile import ELFFile

    data = bytearray(x86_prog.read_bytes())
    with x86_prog.open("rb") as f:
        elf = ELFFile(f)
        index = next(i for i, s in enumerate(elf.iter_sections()) if s.name == ".eh_frame")
        shoff, shentsize = elf.header.e_shoff, elf.header.e_shentsize
    struct.pack_into("<Q", data, shoff + index * shentsize + 32, cfi.MAX_CFI_SECTION_BYTES + 1)  # sh_size
    crafted = tmp_path / "huge-eh-frame"
    crafted.write_bytes(data)
    # When its table is built / Then it is an over_cap error naming the section (had the 16 MiB
    # been read, the short file would have made it a truncation error)
    with crafted.open("rb") as f, pytest.raises(cfi.CfiError) as e:
        cfi.build_table(f)
    assert e.value.kind == "over_cap" and ".eh_frame" in str(e.value), (e.value.kind, str(e.value))


def test_a_module_over_the_row_cap_stops_as_the_rows_are_made(tmp_path: Path) -> None:
    # Given a copy of python3.11 whose .eh_frame is moved to the end of the file and replaced by
    # FDEs of 64 KiB programs that each make ~21,800 distinct rows over its text (2.2M rows in the
    # first 100), followed by an entry that runs past the end of the section
    src = Path(sys.executable).resolve()
    with src.open("rb") as f:
        m = cfi.read_module(f)
    assert m.eh_frame is not None and m.text_size > 64 << 10, m
    from elftools.elf.elffile import ELFFile

    with src.open("rb") as f:
        elf = ELFFile(f)
        index = next(i for i, s in enumerate(elf.iter_sections()) if s.name == ".eh_frame")
        shoff, shentsize = elf.header.e_shoff, elf.header.e_shentsize
    data = bytearray(src.read_bytes())
    program = b"\x41\x0e\x10\x41\x0e\x18" * ((cfi.MAX_CFA_PROGRAM_BYTES - 16) // 6)
    rows_per_fde = 2 * (len(program) // 6)
    fdes = ut.MAX_ROWS // rows_per_fde + 4
    section = bytearray(eh_cie())
    for _ in range(fdes):
        id_pos = len(section) + 4
        begin = m.text_vaddr - (m.eh_frame.addr + id_pos + 4)  # pc-relative, sdata4
        section += entry(
            struct.pack("<I", id_pos)
            + struct.pack("<i", begin)
            + struct.pack("<i", rows_per_fde + 1)
            + uleb(0)
            + program
        )
    section += struct.pack("<I", 1 << 20) + b"\0" * 8  # runs past the end
    assert len(section) <= cfi.MAX_CFI_SECTION_BYTES
    offset = len(data)
    data += section
    struct.pack_into("<QQ", data, shoff + index * shentsize + 24, offset, len(section))  # sh_offset, sh_size
    crafted = tmp_path / "many-rows"
    crafted.write_bytes(data)
    # When its table is built
    with crafted.open("rb") as f, pytest.raises(cfi.CfiError) as e:
        cfi.build_table(f)
    # Then it is an over_cap error on the row count (a parser that checked only after every FDE had
    # been interpreted would have met the malformed entry first)
    assert e.value.kind == "over_cap" and "rows" in str(e.value), (e.value.kind, str(e.value))
