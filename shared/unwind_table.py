"""The unwind table format of docs/unwinding.md, in one place.

Owns: the kind constants, the header and row layouts, encode() (what a
symbolizer builds), decode() (the bounds check: what the collector runs on
every table a symbolizer sends and the symbolizer runs on every table it reads
back from its disk cache), and bias() (the per-mapping constant BPF subtracts
from a pc to get a row address).

decode() treats its input as hostile: anything that is not a table exactly as
the format says raises UnwindTableError, and a Table that comes out of it can
be copied row for row into BPF maps without further checks. Rows stay raw
bytes (Table.rows): the collector copies them as they are, without a Python
object per row.

Must not: parse ELF or DWARF (symbolizer/cfi.py does), or know about BPF maps.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

MAGIC = b"EPUT"
VERSION = 1

ARCH_X86_64 = 1
ARCH_AARCH64 = 2
ARCHES = (ARCH_X86_64, ARCH_AARCH64)
ARCH_NAMES = {ARCH_X86_64: "x86_64", ARCH_AARCH64: "aarch64"}

# cfa_kind
CFA_SP = 0  # CFA = SP + cfa_off
CFA_FP = 1  # CFA = FP + cfa_off
CFA_PLT = 2  # x86-64 PLT entries: CFA = SP + cfa_off + (((pc & 15) >= 11) ? 8 : 0)
CFA_FALLBACK = 3  # no usable rule: take a frame-pointer step
CFA_END = 4  # outermost frame: the return address is undefined; stop
# fp_kind
FP_SAME = 0  # the caller's frame pointer is the current one
FP_SAVED = 1  # saved at CFA + fp_off
# ra_kind
RA_SAVED = 0  # saved at CFA + ra_off
RA_LR = 1  # aarch64: still in the link register x30

HEADER = struct.Struct("<4sHHIIQQQQ")  # magic, version, arch, rows, span, pc_base, text_offset/vaddr/size
ROW = struct.Struct("<IihhBBBB")  # pc, cfa_off, fp_off, ra_off, cfa_kind, fp_kind, ra_kind, 0
assert HEADER.size == 48 and ROW.size == 16

# node, the largest module on a typical host, has ~400K rows; 2M (32 MiB) leaves room and bounds
# what one table can make the collector copy into BPF maps.
MAX_ROWS = 1 << 21

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class UnwindTableError(ValueError):
    """Bytes that are not a valid unwind table."""


class Row(NamedTuple):
    pc: int  # row address: ELF virtual address - pc_base
    cfa_off: int
    fp_off: int
    ra_off: int
    cfa_kind: int
    fp_kind: int
    ra_kind: int


FALLBACK_ROW_FIELDS = (0, 0, 0, CFA_FALLBACK, FP_SAME, RA_SAVED)  # Row minus pc: the canonical FALLBACK row


@dataclass(frozen=True, slots=True)
class Header:
    arch: int  # ARCH_X86_64 or ARCH_AARCH64
    span: int  # every row.pc is < span
    pc_base: int  # ELF virtual address of row.pc 0
    text_offset: int  # file offset of the executable PT_LOAD segment the rows cover
    text_vaddr: int  # its p_vaddr
    text_size: int  # its p_filesz


@dataclass(frozen=True, slots=True)
class Table:
    """A validated table: its header and its rows as raw bytes (ROW.size each, sorted by pc)."""

    header: Header
    rows: bytes

    @property
    def arch(self) -> int:
        return self.header.arch

    @property
    def row_count(self) -> int:
        return len(self.rows) // ROW.size

    def iter_rows(self) -> Iterator[Row]:
        return (Row(pc, cfa, fp, ra, ck, fk, rk) for pc, cfa, fp, ra, ck, fk, rk, _ in ROW.iter_unpack(self.rows))

    def pcs(self) -> list[int]:
        """Every row's pc, in order (for lookups; builds a list)."""
        return [t[0] for t in ROW.iter_unpack(self.rows)]

    def row_for(self, pc: int, pcs: list[int] | None = None) -> Row | None:
        """The row whose rules hold at row address `pc` (the last with row.pc <= pc), as BPF finds it;
        None before the first row or at and beyond span. Pass pcs() when looking up many."""
        if not 0 <= pc < self.header.span:
            return None
        i = bisect_right(self.pcs() if pcs is None else pcs, pc) - 1
        if i < 0:
            return None
        pc0, cfa, fp, ra, ck, fk, rk, _ = ROW.unpack_from(self.rows, i * ROW.size)
        return Row(pc0, cfa, fp, ra, ck, fk, rk)


def encode(header: Header, rows: Iterable[Row] | bytes) -> bytes:
    """The table of `header` and `rows` (Row tuples, or rows already packed with ROW).

    The result is checked with decode(): UnwindTableError if it would not be a valid table."""
    body = (
        rows
        if isinstance(rows, (bytes, bytearray, memoryview))
        else b"".join(ROW.pack(r.pc, r.cfa_off, r.fp_off, r.ra_off, r.cfa_kind, r.fp_kind, r.ra_kind, 0) for r in rows)
    )
    if len(body) % ROW.size:
        raise UnwindTableError(f"rows of {len(body)} bytes are not a whole number of {ROW.size}-byte rows")
    n = len(body) // ROW.size
    for name in ("span", "pc_base", "text_offset", "text_vaddr", "text_size"):
        value = getattr(header, name)
        if not 0 <= value <= (_U32 if name == "span" else _U64):
            raise UnwindTableError(f"{name} {value} does not fit its field")
    if not 0 <= n <= MAX_ROWS or header.arch not in ARCHES:
        raise UnwindTableError(f"{n} rows of arch {header.arch}: not encodable")
    data = b"".join(
        (
            HEADER.pack(
                MAGIC,
                VERSION,
                header.arch,
                n,
                header.span,
                header.pc_base,
                header.text_offset,
                header.text_vaddr,
                header.text_size,
            ),
            body,
        )
    )
    decode(data)
    return data


def decode(data: bytes, arch: int | None = None) -> Table:  # noqa: PLR0912
    """The table in `data`, every field checked; UnwindTableError otherwise.

    `arch`: the architecture the caller can use (None: either). Checked: magic, version, arch,
    row count (at least one, at most MAX_ROWS), total length, each row's pc (strictly increasing,
    below span), kinds in range and valid for the arch, the padding byte, the last row FALLBACK,
    and that pc_base + span and the text segment fit in 64 bits."""
    if len(data) < HEADER.size:
        raise UnwindTableError(f"{len(data)} bytes: shorter than the {HEADER.size}-byte header")
    magic, version, table_arch, n, span, pc_base, text_offset, text_vaddr, text_size = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise UnwindTableError(f"magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise UnwindTableError(f"version {version}, this build reads {VERSION}")
    if table_arch not in ARCHES:
        raise UnwindTableError(f"unknown arch {table_arch}")
    if arch is not None and table_arch != arch:
        raise UnwindTableError(f"a table for {ARCH_NAMES[table_arch]}, expected {ARCH_NAMES.get(arch, arch)}")
    if not 1 <= n <= MAX_ROWS:
        raise UnwindTableError(f"{n} rows: a table has 1 to {MAX_ROWS}")
    if len(data) != HEADER.size + n * ROW.size:
        raise UnwindTableError(f"{len(data)} bytes, expected {HEADER.size} + {n} rows of {ROW.size}")
    if pc_base + span > _U64 or text_offset + text_size > _U64 or text_vaddr + text_size > _U64:
        raise UnwindTableError("pc_base + span or the text segment does not fit in 64 bits")
    rows = bytes(data[HEADER.size :])
    prev = -1
    for i, (pc, _cfa, _fp, _ra, ck, fk, rk, pad) in enumerate(ROW.iter_unpack(rows)):
        if pc <= prev:
            raise UnwindTableError(f"row {i}: pc {pc:#x} not above the previous row's {prev:#x}")
        if ck > CFA_END or fk > FP_SAVED or rk > RA_LR or pad:
            raise UnwindTableError(f"row {i}: kinds ({ck}, {fk}, {rk}, {pad}) out of range")
        prev = pc
        if table_arch == ARCH_X86_64:
            if rk == RA_LR:
                raise UnwindTableError(f"row {i}: x86-64 has no link register")
        elif ck == CFA_PLT:
            raise UnwindTableError(f"row {i}: PLT rows are x86-64 only")
    if prev >= span:
        raise UnwindTableError(f"last row's pc {prev:#x} is not below span {span:#x}")
    if ROW.unpack_from(rows, len(rows) - ROW.size)[4] != CFA_FALLBACK:
        raise UnwindTableError("the last row is not FALLBACK")
    return Table(Header(table_arch, span, pc_base, text_offset, text_vaddr, text_size), rows)


validate = decode  # the name docs/unwinding.md uses for the collector's check


def bias(table: Table, start: int, offset: int) -> int:
    """What BPF subtracts from a pc in the mapping [start, …) at file `offset` to get a row address."""
    h = table.header
    return start - offset + h.text_offset - h.text_vaddr + h.pc_base
