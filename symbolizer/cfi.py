"""Call frame information (.eh_frame, else .debug_frame) → an unwind table (shared/unwind_table.py).

Owns: finding a module's CFI sections and executable segment (read_module),
and turning the CFI into the rows of docs/unwinding.md (build_table): our own
parser of CIEs and FDEs (32- and 64-bit DWARF lengths; augmentations z, R, P,
L, S, B; every pointer encoding that can locate an FDE: absptr, udata2/4/8,
sdata2/4/8, uleb128, sleb128, pcrel, textrel, datarel) and an interpreter of
CFA programs that tracks only what the table holds: the CFA rule, the frame
pointer's rule and the return address's rule.

Input is untrusted. Every entry length, pointer and instruction operand is
read inside its section or its FDE, and every count is capped (constants
below); the whole build runs under time_budget(CFI_BUILD_SECONDS). Policy:
- a structurally broken section (an entry running past the end, a CIE
  pointer that does not point at a CIE, a cap exceeded) fails the module:
  CfiError, which the caller turns into a counted, logged skip;
- one FDE the table cannot express (an unknown opcode, a rule other than the
  ones the table has, an operand running past its program) gets one FALLBACK
  row over its range and is counted in Built.fallback_fdes; an FDE whose CIE
  is unsupported (augmentation, version or pointer encoding) is skipped and
  counted in Built.skipped_fdes, which leaves a FALLBACK gap over its range.
The FDEs kept are those inside the largest executable PT_LOAD segment; rows
are relative to its p_vaddr (pc_base), gaps between FDEs get a FALLBACK row,
and identical adjacent rows are merged.

pyelftools' own CFI decoder is not used: it is ~30x slower and raises on
valid input (an FDE of Debian's libc). ELF headers, the build id and the
section names go through shared/elf.py, the one bounded ELF reader.

Must not: open files by path, read outside the file object it is given, or
keep anything between builds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from shared import elf as shared_elf
from shared import unwind_table as ut
from shared.elf import ElfError, Reader
from symbolizer.elf import ELF_PARSE_SECONDS, MAX_FILE_BYTES
from symbolizer.limits import BudgetExceeded, time_budget

# node's .eh_frame is 2.7 MB and libc's 150 KB; the section is read whole, so this bounds memory
# (and time: a crafted 63 MiB one took 14 s and 615 MB; 16 MiB is six times node's).
MAX_CFI_SECTION_BYTES = 16 << 20
# node has ~76K FDEs, libc 3.7K; more is not a real module and would only cost time.
MAX_FDES = 1_000_000
# An FDE's program is tens of bytes (node's longest are a few KB); longer ones get FALLBACK.
MAX_CFA_PROGRAM_BYTES = 64 << 10
# gcc nests remember_state one or two deep; a deeper stack gets FALLBACK and bounds memory.
MAX_REMEMBER_DEPTH = 64
# Real augmentation strings are "zR", "zPLR", "zRS", "zPLRB"; longer ones are junk.
MAX_AUGMENTATION_BYTES = 16
# The section name table of a linked binary is a few hundred bytes.
MAX_SHSTRTAB_BYTES = 1 << 20
# Row addresses are u32 (docs/unwinding.md); no real text segment comes near 4 GiB.
MAX_TEXT_BYTES = 1 << 32
# Wall-clock budget of one table: node takes about a second; a crafted file that needs more is skipped.
CFI_BUILD_SECONDS = 20.0

_U64 = (1 << 64) - 1

# Per arch: (FP register, RA column, SP register) in DWARF numbering.
_REGS = {ut.ARCH_X86_64: (6, 16, 7), ut.ARCH_AARCH64: (29, 30, 31)}
_MACHINES = {shared_elf.EM_X86_64: ut.ARCH_X86_64, shared_elf.EM_AARCH64: ut.ARCH_AARCH64}

# x86-64 PLT entries (binutils ld): DW_OP_breg7 <off>; DW_OP_breg16 0; lit15; and; lit11; ge; lit3; shl; plus.
_PLT_TAIL = bytes((0x80, 0x00, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22))

# Row contents (the ROW fields after pc) and their rule encodings.
_FALLBACK = (*ut.FALLBACK_ROW_FIELDS, 0)
_END = (0, 0, 0, ut.CFA_END, ut.FP_SAME, ut.RA_SAVED, 0)
# CFA expression: none (register + offset), the PLT expression, anything else
_EXPR_NONE, _EXPR_PLT, _EXPR_OTHER = 0, 1, 2
# Rules of FP and RA: unset or same value (FP: or undefined), offset(N), undefined (RA only), other
_SAME, _OFFSET, _UNDEFINED, _OTHER = 0, 1, 2, 3

_u16 = struct.Struct("<H").unpack_from
_u32 = struct.Struct("<I").unpack_from
_u64 = struct.Struct("<Q").unpack_from
_s16 = struct.Struct("<h").unpack_from
_s32 = struct.Struct("<i").unpack_from
_s64 = struct.Struct("<q").unpack_from
_pack = ut.ROW.pack
_Span = tuple[int, int, int]  # an FDE program's first pc, its end, and the program's address
_NO_ROW: tuple[int, ...] = ()


class CfiError(Exception):
    """The module's CFI cannot be used. kind: a short key to count by (malformed, over_cap,
    unsupported, too_slow, elf, none, internal)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class NoCfi(CfiError):
    """The module has nothing to build a table from: no CFI section, or no executable segment."""

    def __init__(self, message: str) -> None:
        super().__init__("none", message)


class _BadFde(Exception):
    """This FDE cannot be expressed: FALLBACK over its range."""


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    offset: int
    size: int
    addr: int
    compressed: bool


@dataclass(frozen=True, slots=True)
class Module:
    """What a build needs of an ELF file besides its CFI bytes."""

    arch: int
    build_id: str  # lowercase hex, "" if none
    text_offset: int  # the largest executable PT_LOAD: p_offset, p_vaddr, p_filesz
    text_vaddr: int
    text_size: int
    eh_frame: Section | None
    debug_frame: Section | None
    text_addr: int | None  # .text sh_addr: the base of textrel pointers
    got_addr: int | None  # .got sh_addr: the base of datarel pointers


@dataclass(frozen=True, slots=True)
class Built:
    table: bytes  # shared/unwind_table.py format, checked with decode()
    source: str  # ".eh_frame" or ".debug_frame"
    fdes: int  # FDEs in the table
    rows: int
    fallback_fdes: int  # FDEs with an unknown opcode or a rule the table lacks: FALLBACK
    skipped_fdes: int  # outside the segment, overlapping another, or of an unsupported CIE
    signed_ra_fdes: int  # aarch64 FDEs that toggle return address signing (recorded, not applied)


def read_module(f: BinaryIO) -> Module:
    """The arch, build id, executable segment and CFI sections of `f`. CfiError (NoCfi if there is
    no executable segment or an unsupported machine) for anything else."""
    try:
        with time_budget(ELF_PARSE_SECONDS):
            return _read_module(f)
    except CfiError:
        raise
    except Exception as e:  # hostile input: whatever it provokes becomes a CfiError
        raise _as_cfi_error(e) from None


def build_table(f: BinaryIO, module: Module | None = None, seconds: float = CFI_BUILD_SECONDS) -> Built:
    """The unwind table of `f` (read_module(f) if `module` is not given), built within `seconds`
    (at most CFI_BUILD_SECONDS): the caller passes what is left of its own budget.

    Raises NoCfi when there is nothing to build from, CfiError when the CFI is unusable, and
    nothing else. The time budget applies in the main thread only (see limits.time_budget)."""
    try:
        with time_budget(max(0.001, min(seconds, CFI_BUILD_SECONDS))):
            if module is None:
                module = _read_module(f)
            return _build(f, module)
    except CfiError:
        raise
    except Exception as e:  # hostile input: whatever it provokes becomes a CfiError
        raise _as_cfi_error(e) from None


def fde_ranges(f: BinaryIO, module: Module, seconds: float = CFI_BUILD_SECONDS) -> list[tuple[int, int]]:
    """The (begin, end) addresses of every FDE of `f`'s .eh_frame (or .debug_frame), in file order,
    their programs not run; CfiError (NoCfi) as build_table raises it."""
    try:
        with time_budget(max(0.001, min(seconds, CFI_BUILD_SECONDS))):
            sec = module.eh_frame if module.eh_frame is not None and module.eh_frame.size else module.debug_frame
            if sec is None or not sec.size:
                raise NoCfi("no .eh_frame or .debug_frame")
            if sec.compressed or sec.size > MAX_CFI_SECTION_BYTES:
                raise CfiError("unsupported", f"{sec.name} is compressed or over {MAX_CFI_SECTION_BYTES} bytes")
            parser = _Parser(Reader(f, MAX_FILE_BYTES).read(sec.offset, sec.size, sec.name), sec, module)
            parser.ranges_only = True
            return [(begin, end) for begin, end, _ in parser.fdes()]
    except CfiError:
        raise
    except Exception as e:  # hostile input: whatever it provokes becomes a CfiError
        raise _as_cfi_error(e) from None


def _as_cfi_error(e: Exception) -> CfiError:
    over = shared_elf.caused_by(e, BudgetExceeded)
    if over is not None:
        return CfiError("too_slow", str(over))
    if isinstance(e, ElfError):  # a count over its cap, or not 64-bit little-endian, is said so; the rest is "elf"
        return CfiError(e.kind if e.kind in ("over_cap", "unsupported") else "elf", str(e))
    if isinstance(e, MemoryError):
        return CfiError("over_cap", "out of memory")
    # Anything else is a bug of ours that hostile input found: still a skip, never a dead worker.
    return CfiError("internal", f"{type(e).__name__}: {e}"[:200])


# ---------------------------------------------------------------- ELF


def _read_module(f: BinaryIO) -> Module:
    r = Reader(f, MAX_FILE_BYTES)
    h = shared_elf.read_header(r)
    arch = _MACHINES.get(h.e_machine)
    if arch is None:
        raise NoCfi(f"machine {h.e_machine} has no unwind tables")
    phdrs = shared_elf.program_headers(r, h)
    shdrs = shared_elf.section_headers(r, h)
    texts = [p for p in phdrs if p.p_type == shared_elf.PT_LOAD and p.p_flags & shared_elf.PF_X and p.p_filesz]
    if not texts:
        raise NoCfi("no executable segment")
    text = max(texts, key=lambda p: p.p_filesz)
    if text.p_filesz >= MAX_TEXT_BYTES:
        raise CfiError("over_cap", f"executable segment of {text.p_filesz} bytes")
    build_id = shared_elf.build_id(r, phdrs)
    found: dict[str, Section] = {}
    wanted = (b".eh_frame", b".debug_frame", b".text", b".got")
    for sh, name in zip(shdrs, shared_elf.section_names(r, h, shdrs, MAX_SHSTRTAB_BYTES), strict=True):
        if name in wanted and sh.sh_type != shared_elf.SHT_NOBITS and name.decode() not in found:
            found[name.decode()] = Section(
                name.decode(), sh.sh_offset, sh.sh_size, sh.sh_addr, bool(sh.sh_flags & shared_elf.SHF_COMPRESSED)
            )
    return Module(
        arch,
        build_id,
        text.p_offset,
        text.p_vaddr,
        text.p_filesz,
        found.get(".eh_frame"),
        found.get(".debug_frame"),
        found[".text"].addr if ".text" in found else None,
        found[".got"].addr if ".got" in found else None,
    )


def _build(f: BinaryIO, m: Module) -> Built:
    sec = m.eh_frame if m.eh_frame is not None and m.eh_frame.size else m.debug_frame
    if sec is None or not sec.size:
        raise NoCfi("no .eh_frame or .debug_frame")
    if sec.compressed:
        raise CfiError("unsupported", f"{sec.name} is compressed")
    if sec.size > MAX_CFI_SECTION_BYTES:
        raise CfiError("over_cap", f"{sec.name} of {sec.size} bytes, more than {MAX_CFI_SECTION_BYTES}")
    data = Reader(f, MAX_FILE_BYTES).read(sec.offset, sec.size, sec.name)
    parser = _Parser(data, sec, m)
    fdes = parser.fdes()
    return _assemble(fdes, parser, sec.name, m)


# ---------------------------------------------------------------- CIE and FDE


class _Cie:
    __slots__ = ("addr_size", "caf", "daf", "fde_enc", "has_z", "initial", "ra_reg", "unsupported")

    def __init__(self) -> None:
        self.caf = self.daf = self.ra_reg = 0
        self.fde_enc = 0
        self.addr_size = 8
        self.has_z = False
        self.initial: tuple[int, ...] | None = None  # the state after its initial instructions; None: bad
        self.unsupported = ""  # why its FDEs cannot even be located


def _uleb(d: bytes, p: int) -> tuple[int, int]:
    """(value, position after) of the ULEB128 at p; IndexError past the end, _BadFde if over 10 bytes."""
    result = shift = 0
    while True:
        b = d[p]
        p += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, p
        shift += 7
        if shift >= 70:
            raise _BadFde("LEB128 longer than 10 bytes")


def _sleb(d: bytes, p: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = d[p]
        p += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if b & 0x40:
                result -= 1 << shift
            return result, p
        if shift >= 70:
            raise _BadFde("LEB128 longer than 10 bytes")


_FIXED = {0x02: (_u16, 2), 0x03: (_u32, 4), 0x04: (_u64, 8), 0x0A: (_s16, 2), 0x0B: (_s32, 4), 0x0C: (_s64, 8)}


class _Parser:
    """Walks one CFI section: CIEs on demand (cached by offset), FDEs in order; their CFA programs are
    run by a _Program."""

    def __init__(self, data: bytes, sec: Section, m: Module) -> None:
        self.data = data
        self.sec = sec
        self.eh = sec.name == ".eh_frame"
        self.m = m
        self.program = _Program(m)
        self.lo, self.hi = m.text_vaddr, m.text_vaddr + m.text_size
        self.cies: dict[int, _Cie] = {}
        self.stats = dict.fromkeys(("fdes", "fallback_fdes", "skipped_fdes", "signed_ra_fdes"), 0)
        self.ranges_only = False  # fde_ranges(): each FDE's addresses, its program not run

    # ------------------------------------------------ entries

    def _entry(self, pos: int) -> tuple[int, int, int, int]:
        """(id position, id size, end, id) of the entry at pos; CfiError if it runs past the section."""
        d, n = self.data, len(self.data)
        if pos + 4 > n:
            raise CfiError("malformed", f"{self.sec.name}: entry at {pos:#x} truncated")
        length = _u32(d, pos)[0]
        if length == 0xFFFFFFFF:
            if pos + 12 > n:
                raise CfiError("malformed", f"{self.sec.name}: entry at {pos:#x} truncated")
            length, id_pos, id_size = _u64(d, pos + 4)[0], pos + 12, 8
        elif length >= 0xFFFFFFF0:
            raise CfiError("malformed", f"{self.sec.name}: reserved length {length:#x} at {pos:#x}")
        else:
            id_pos, id_size = pos + 4, 4
        end = id_pos + length
        if length < id_size or end > n:
            raise CfiError("malformed", f"{self.sec.name}: entry at {pos:#x} runs past the end of the section")
        ident = (_u64 if id_size == 8 else _u32)(d, id_pos)[0]
        return id_pos, id_size, end, ident

    def _is_cie(self, ident: int, id_size: int) -> bool:
        if self.eh:
            return ident == 0
        return ident == (0xFFFFFFFF if id_size == 4 else _U64)

    def fdes(self) -> list[tuple[int, int, bytes]]:
        """(begin, end, packed rows) of each FDE kept."""
        d, n = self.data, len(self.data)
        out: list[tuple[int, int, bytes]] = []
        count = rows = 0
        pos = 0
        while pos < n:
            if pos + 4 <= n and _u32(d, pos)[0] == 0:
                if self.eh:
                    break  # the terminator
                pos += 4  # .debug_frame: padding
                continue
            id_pos, id_size, end, ident = self._entry(pos)
            if not self._is_cie(ident, id_size):
                count += 1
                if count > MAX_FDES:
                    raise CfiError("over_cap", f"more than {MAX_FDES} FDEs")
                cie_off = id_pos - ident if self.eh else ident
                cie = self.cies.get(cie_off)
                if cie is None:
                    cie = self._cie(cie_off)
                fde = self._fde(cie, id_pos + id_size, end)
                if fde is not None:
                    out.append(fde)
                    rows += len(fde[2]) // ut.ROW.size
                    if rows > ut.MAX_ROWS:  # as the rows are made, not once every FDE has been interpreted
                        raise CfiError("over_cap", f"more than {ut.MAX_ROWS} rows")
            pos = end
        return out

    # ------------------------------------------------ CIE

    def _cie(self, off: int) -> _Cie:
        """The CIE at `off`, cached: what its FDEs need, or why they cannot be read (cie.unsupported)."""
        if not 0 <= off < len(self.data):
            raise CfiError("malformed", f"{self.sec.name}: CIE pointer {off:#x} outside the section")
        id_pos, id_size, end, ident = self._entry(off)
        if not self._is_cie(ident, id_size):
            raise CfiError("malformed", f"{self.sec.name}: CIE pointer {off:#x} does not point at a CIE")
        cie = self.cies[off] = _Cie()
        try:
            p = self._cie_fields(cie, id_pos + id_size, end)
        except (IndexError, struct.error, _BadFde) as e:
            cie.unsupported = f"CIE at {off:#x}: {e or 'truncated'}"
            return cie
        if p is None:
            return cie
        if cie.ra_reg != self.program.ra_col:
            cie.initial = None  # a return address column the table does not know: FALLBACK rows
            return cie
        base = (0, 0, _EXPR_OTHER, _SAME, 0, _SAME, 0)  # CFA unknown until defined
        try:
            # Run over no range (0 to 0), its first advance makes a row: an advance, which the initial
            # instructions may not have, gives FALLBACK rows.
            state, rows = self.program.run(self.data[p:end], base, base, cie, (0, 0, 0))
            cie.initial = None if rows else state
        except (IndexError, struct.error, _BadFde, ValueError):
            cie.initial = None
        return cie

    def _cie_fields(self, cie: _Cie, p: int, end: int) -> int | None:
        """Read a CIE's fields from `p` into `cie`: the position of its initial instructions, or None
        with cie.unsupported saying why its FDEs cannot be read. _BadFde, IndexError or struct.error
        for fields that run past it."""
        d = self.data
        version = d[p]
        p += 1
        if version not in ((1, 3) if self.eh else (1, 3, 4)):
            cie.unsupported = f"CIE version {version}"
            return None
        nul = d.find(b"\0", p, min(end, p + MAX_AUGMENTATION_BYTES + 1))
        if nul < 0:
            cie.unsupported = "augmentation string too long or unterminated"
            return None
        aug = d[p:nul]
        p = nul + 1
        if version == 4:
            cie.addr_size, segment_size = d[p], d[p + 1]
            p += 2
            if cie.addr_size not in (4, 8) or segment_size:
                cie.unsupported = f"address size {cie.addr_size}, segment selector size {segment_size}"
                return None
        if aug.startswith(b"eh"):
            p += 8  # gcc 2.x: a pointer to exception data
            aug = aug[2:]
        cie.caf, p = _uleb(d, p)
        cie.daf, p = _sleb(d, p)
        if version == 1:
            cie.ra_reg = d[p]
            p += 1
        else:
            cie.ra_reg, p = _uleb(d, p)
        cie.fde_enc = 0x00  # absptr
        if aug[:1] == b"z":
            cie.has_z = True
            p = self._augmentation(cie, aug, p, end)
        elif aug:
            cie.unsupported = f"augmentation {aug!r}"
            return None
        enc = cie.fde_enc
        if (
            enc & 0x80
            or (enc & 0x70) not in (0x00, 0x10, 0x20, 0x30)
            or (enc & 0x0F) not in (0x00, 0x01, 0x02, 0x03, 0x04, 0x09, 0x0A, 0x0B, 0x0C)
        ):
            cie.unsupported = f"FDE pointer encoding {enc:#x}"
            return None
        if p > end:
            raise _BadFde("CIE fields past its end")
        return p

    def _augmentation(self, cie: _Cie, aug: bytes, p: int, end: int) -> int:
        """Read the augmentation data of a "z" CIE at `p` (its length first): the position after it."""
        d = self.data
        aug_len, p = _uleb(d, p)
        aug_end = p + aug_len
        if aug_end > end:
            raise _BadFde("augmentation data past the end of the CIE")
        for c in aug[1:]:
            if c == 0x52:  # R: FDE pointer encoding
                cie.fde_enc = d[p]
                p += 1
            elif c == 0x4C:  # L: LSDA encoding; the pointer is in each FDE's augmentation data
                p += 1
            elif c == 0x50:  # P: personality routine encoding and pointer
                enc = d[p]
                p = _skip_pointer(d, enc, p + 1)
            elif c in (0x53, 0x42, 0x47):  # S: signal frame; B: arm64 B key; G: MTE tagged frames
                pass
            else:
                break  # unknown: the rest is skipped by length ("z" says how long)
        if p > aug_end:
            raise _BadFde("augmentation data longer than declared")
        return aug_end

    # ------------------------------------------------ FDE

    def _fde(self, cie: _Cie, p: int, end: int) -> tuple[int, int, bytes] | None:
        st = self.stats
        if cie.unsupported:
            st["skipped_fdes"] += 1
            return None
        d = self.data
        try:
            begin, p = _pointer(d, p, cie.fde_enc, cie.addr_size, self.sec.addr + p, self.m)
            size, p = _pointer(d, p, cie.fde_enc & 0x0F, cie.addr_size, 0, self.m)
            if cie.has_z:
                aug_len, p = _uleb(d, p)
                p += aug_len
            if p > end:
                raise _BadFde("FDE fields past its end")
        except (IndexError, struct.error, _BadFde):
            st["skipped_fdes"] += 1
            return None
        if (cie.fde_enc & 0x0F) in (0x09, 0x0A, 0x0B, 0x0C) and size >= 1 << 63:
            size -= 1 << 64
        stop = begin + size
        if size <= 0 or begin < self.lo or stop > self.hi:
            st["skipped_fdes"] += 1  # empty, or outside the executable segment
            return None
        st["fdes"] += 1
        if self.ranges_only:
            return begin, stop, b""
        init = cie.initial
        if init is not None and end - p <= MAX_CFA_PROGRAM_BYTES:
            program = self.program
            program.signed = False
            try:
                parts = program.run(d[p:end], init, init, cie, (begin, stop, self.sec.addr + p))[1]
                if program.signed:
                    st["signed_ra_fdes"] += 1
                return begin, stop, b"".join(parts)
            except (IndexError, struct.error, _BadFde, ValueError):
                pass
        st["fallback_fdes"] += 1
        return begin, stop, ut.ROW.pack(begin - self.lo, *_FALLBACK)


def _skip_pointer(d: bytes, enc: int, p: int) -> int:
    """The position after the pointer encoded `enc` at d[p] (its value is not needed)."""
    if enc == 0xFF:
        return p
    fmt = enc & 0x0F
    if fmt == 0x00:
        return p + 8
    if fmt in (0x01, 0x09):
        return _uleb(d, p)[1]
    fixed = _FIXED.get(fmt)
    if fixed is None:
        raise _BadFde(f"pointer encoding {enc:#x}")
    return p + fixed[1]


def _pointer(d: bytes, p: int, enc: int, addr_size: int, field_addr: int, m: Module) -> tuple[int, int]:
    """(value, position after) of an encoded pointer at d[p]; field_addr: its virtual address."""
    fmt = enc & 0x0F
    if fmt == 0x00:
        v = (_u64 if addr_size == 8 else _u32)(d, p)[0]
        q = p + addr_size
    elif fmt == 0x01:
        v, q = _uleb(d, p)
    elif fmt == 0x09:
        v, q = _sleb(d, p)
    else:
        unpack, size = _FIXED[fmt]
        v = unpack(d, p)[0]
        q = p + size
    app = enc & 0x70
    if app == 0x10:
        v += field_addr
    elif app == 0x20:
        if m.text_addr is None:
            raise _BadFde("textrel pointer without .text")
        v += m.text_addr
    elif app == 0x30:
        if m.got_addr is None:
            raise _BadFde("datarel pointer without .got")
        v += m.got_addr
    return v & _U64, q


# ---------------------------------------------------------------- CFA programs


class _Program:
    """The interpreter of CFA programs for one module: it tracks the CFA rule, the frame pointer's and
    the return address's (a state: cfa_reg, cfa_off, cfa_expr, fp_rule, fp_off, ra_rule, ra_off) and
    packs the rows of an FDE's range. The frequent opcodes are run inline in run(), the others by _op."""

    def __init__(self, m: Module) -> None:
        self.m = m
        self.fp_reg, self.ra_col, self.sp_reg = _REGS[m.arch]
        self.row = _x86_row if m.arch == ut.ARCH_X86_64 else _arm_row
        self.lo = m.text_vaddr
        self.signed = False  # a program run toggled return address signing (recorded, not applied)

    # The frequent opcodes stay inline in one loop (PLR0912's branches): a call each would slow every build.
    def run(self, prog: bytes, state: tuple, init: tuple, cie: _Cie, span: _Span) -> tuple[tuple, list[bytes]]:  # noqa: PLR0912
        """(the final state, the packed rows of [loc, stop)) of `prog` run from `state` over `span` (`init`: the CIE's
        state; `last_loc`: the pc of the last row; `stack`: remember_state's); _BadFde, IndexError, struct.error."""
        (loc, stop, prog_addr), (cfa_reg, cfa_off, cfa_expr, fp_rule, fp_off, ra_rule, ra_off) = span, state
        fp_reg, ra_reg, caf, daf, row, base = self.fp_reg, self.ra_col, cie.caf, cie.daf, self.row, self.lo
        n, p, dirty, last, last_loc, parts, stack = len(prog), 0, True, _NO_ROW, -1, [], []  # type: int, int, bool, tuple[int, ...], int, list[bytes], list[tuple]
        while True:
            if p < n:
                op = prog[p]
                p += 1
                if op >= 0x80:  # DW_CFA_offset (and its operand), DW_CFA_restore: a register's rule
                    if op < 0xC0:
                        v, p = (prog[p], p + 1) if prog[p] < 0x80 else _uleb(prog, p)
                    if op & 0x3F == fp_reg:
                        fp_rule, fp_off, dirty = (_OFFSET, v * daf, True) if op < 0xC0 else (init[3], init[4], True)
                    elif op & 0x3F == ra_reg:
                        ra_rule, ra_off, dirty = (_OFFSET, v * daf, True) if op < 0xC0 else (init[5], init[6], True)
                    continue
                if op == 0x0E:  # DW_CFA_def_cfa_offset
                    cfa_off, p = (prog[p], p + 1) if prog[p] < 0x80 else _uleb(prog, p)
                    cfa_expr, dirty = _EXPR_OTHER if cfa_expr else _EXPR_NONE, True
                    continue
                if op >= 0x40:  # DW_CFA_advance_loc
                    new = loc + (op & 0x3F) * caf
                elif op == 0x02:  # DW_CFA_advance_loc1
                    new, p = loc + prog[p] * caf, p + 1
                elif op in (0x01, 0x03, 0x04):  # DW_CFA_set_loc, DW_CFA_advance_loc2, 4
                    new, p = self._advance(op, prog, p, loc, caf, cie, prog_addr)
                else:
                    if op == 0x0A:  # DW_CFA_remember_state
                        if len(stack) >= MAX_REMEMBER_DEPTH:
                            raise _BadFde("remember_state nested too deep")
                        stack.append((cfa_reg, cfa_off, cfa_expr, fp_rule, fp_off, ra_rule, ra_off))
                    elif op == 0x0B:  # DW_CFA_restore_state (IndexError without a remember_state)
                        (cfa_reg, cfa_off, cfa_expr, fp_rule, fp_off, ra_rule, ra_off), dirty = stack.pop(), True
                    elif op == 0x0C:  # DW_CFA_def_cfa
                        (cfa_reg, p), cfa_expr, dirty = _uleb(prog, p), _EXPR_NONE, True
                        cfa_off, p = _uleb(prog, p)
                    elif op == 0x0D:  # DW_CFA_def_cfa_register
                        (cfa_reg, p), cfa_expr, dirty = _uleb(prog, p), _EXPR_OTHER if cfa_expr else _EXPR_NONE, True
                    elif op:  # the less frequent opcodes (not DW_CFA_nop)
                        st = (cfa_reg, cfa_off, cfa_expr, fp_rule, fp_off, ra_rule, ra_off)
                        p, st, dirty = self._op(op, prog, p, st, init, daf, dirty)
                        cfa_reg, cfa_off, cfa_expr, fp_rule, fp_off, ra_rule, ra_off = st
                    continue
            elif loc < stop:  # the end of the program: its rules hold to the end of the FDE
                new = stop
            else:
                break
            if dirty:  # an advance to `new`: the rules so far hold from loc
                c = row(cfa_reg, cfa_off, cfa_expr, fp_rule, fp_off, ra_rule, ra_off)
                if loc == last_loc:  # a second row at one pc (DW_CFA_advance_loc 0) holds there, as elsewhere
                    parts[-1], last = _pack(loc - base, *c), c
                elif c != last:
                    parts.append(_pack(loc - base, *c))
                    last, last_loc = c, loc
            loc, dirty = new, False
            if loc >= stop:
                break
        return (cfa_reg, cfa_off, cfa_expr, fp_rule, fp_off, ra_rule, ra_off), parts

    def _advance(self, op: int, prog: bytes, p: int, loc: int, caf: int, cie: _Cie, prog_addr: int) -> tuple[int, int]:
        """(the new location, position after) of DW_CFA_set_loc (0x01) or DW_CFA_advance_loc1/2/4."""
        if op == 0x02:
            return loc + prog[p] * caf, p + 1
        if op == 0x03:
            return loc + _u16(prog, p)[0] * caf, p + 2
        if op == 0x04:
            return loc + _u32(prog, p)[0] * caf, p + 4
        new, p = _pointer(prog, p, cie.fde_enc, cie.addr_size, prog_addr + p, self.m)
        if new < loc:
            raise _BadFde("set_loc backwards")
        return new, p

    def _op(
        self, op: int, prog: bytes, p: int, st: tuple, init: tuple, daf: int, dirty: bool
    ) -> tuple[int, tuple, bool]:
        """One of the less frequent opcodes from state `st`: (position after it, the state after it,
        whether the row may have changed since the last one: `dirty`, or true if it sets a rule).
        _BadFde for an opcode the table cannot follow."""
        if op == 0x2E:  # DW_CFA_GNU_args_size
            return _uleb(prog, p)[1], st, dirty
        if op == 0x2D:  # DW_CFA_GNU_window_save / DW_CFA_AARCH64_negate_ra_state
            self.signed = True
            return p, st, dirty
        if op in (0x12, 0x13, 0x0F):
            p, cfa = self._cfa_op(op, prog, p, st[0], st[1], st[2], daf)
            return p, (*cfa, *st[3:]), True
        p, reg, rule = _register_op(op, prog, p, daf)
        if reg == self.fp_reg:  # (a frame pointer "undefined" is taken as the same value)
            fp = (init[3], init[4]) if rule is None else (_SAME if rule[0] == _UNDEFINED else rule[0], rule[1])
            return p, (*st[:3], *fp, *st[5:]), True
        if reg == self.ra_col:
            return p, (*st[:5], *((init[5], init[6]) if rule is None else rule)), True
        return p, st, True

    def _cfa_op(
        self, op: int, prog: bytes, p: int, cfa_reg: int, cfa_off: int, cfa_expr: int, daf: int
    ) -> tuple[int, tuple[int, int, int]]:
        """DW_CFA_def_cfa_sf, def_cfa_offset_sf or def_cfa_expression (run() does def_cfa and
        def_cfa_register itself: they are frequent): (position after it, the CFA rule after it)."""
        if op == 0x12:  # DW_CFA_def_cfa_sf
            cfa_reg, p = _uleb(prog, p)
            cfa_off, p = _sleb(prog, p)
            return p, (cfa_reg, cfa_off * daf, _EXPR_NONE)
        if op == 0x13:  # DW_CFA_def_cfa_offset_sf
            cfa_off, p = _sleb(prog, p)
            cfa_off *= daf
        else:  # DW_CFA_def_cfa_expression
            size, p = _uleb(prog, p)
            block = prog[p : p + size]
            p += size
            if p > len(prog):
                raise _BadFde("expression past the end of the program")
            if self.fp_reg == 6 and block[:1] == b"\x77" and block.endswith(_PLT_TAIL):
                off, q = _sleb(block, 1)
                if q == len(block) - len(_PLT_TAIL):
                    return p, (cfa_reg, off, _EXPR_PLT)
            return p, (cfa_reg, cfa_off, _EXPR_OTHER)
        return p, (cfa_reg, cfa_off, _EXPR_OTHER if cfa_expr else cfa_expr)


def _register_op(op: int, prog: bytes, p: int, daf: int) -> tuple[int, int, tuple[int, int] | None]:
    """(position after, register, its rule as the return address's: (rule, offset), or None: its
    initial rule) of an opcode that sets one register's rule other than DW_CFA_offset and
    DW_CFA_restore; _BadFde for an unknown opcode."""
    if op in (0x05, 0x11, 0x2F, 0x14, 0x15):  # offset_extended(_sf), GNU_negative_offset_extended, val_offset(_sf)
        reg, p = _uleb(prog, p)
        if op in (0x11, 0x15):
            v, p = _sleb(prog, p)
        else:
            v, p = _uleb(prog, p)
        v = -v * daf if op == 0x2F else v * daf
        return p, reg, (_OFFSET if op in (0x05, 0x11, 0x2F) else _OTHER, v)
    if op in (0x06, 0x07, 0x08, 0x09):  # restore_extended, undefined, same_value, register
        reg, p = _uleb(prog, p)
        if op == 0x09:
            _, p = _uleb(prog, p)
        return p, reg, None if op == 0x06 else ({0x07: _UNDEFINED, 0x08: _SAME, 0x09: _OTHER}[op], 0)
    if op in (0x10, 0x16):  # DW_CFA_expression, DW_CFA_val_expression
        reg, p = _uleb(prog, p)
        size, p = _uleb(prog, p)
        p += size
        if p > len(prog):
            raise _BadFde("expression past the end of the program")
        return p, reg, (_OTHER, 0)
    raise _BadFde(f"unknown CFA opcode {op:#x}")


def _fits16(v: int) -> bool:
    return -0x8000 <= v <= 0x7FFF


def _x86_row(
    cfa_reg: int, cfa_off: int, cfa_expr: int, fp_rule: int, fp_off: int, ra_rule: int, ra_off: int
) -> tuple[int, ...]:
    """Row contents for x86-64: CFA from rsp (7) or rbp (6); RA at CFA-8; rbp same or saved."""
    if ra_rule == _UNDEFINED:
        return _END
    if cfa_expr == _EXPR_PLT:
        kind = ut.CFA_PLT
    elif cfa_expr or cfa_reg not in (6, 7):
        return _FALLBACK
    else:
        kind = ut.CFA_SP if cfa_reg == 7 else ut.CFA_FP
    if ra_rule != _OFFSET or ra_off != -8 or not -0x80000000 <= cfa_off <= 0x7FFFFFFF:
        return _FALLBACK
    if fp_rule == _SAME:
        return (cfa_off, 0, -8, kind, ut.FP_SAME, ut.RA_SAVED, 0)
    if fp_rule == _OFFSET and _fits16(fp_off):
        return (cfa_off, fp_off, -8, kind, ut.FP_SAVED, ut.RA_SAVED, 0)
    return _FALLBACK


def _arm_row(
    cfa_reg: int, cfa_off: int, cfa_expr: int, fp_rule: int, fp_off: int, ra_rule: int, ra_off: int
) -> tuple[int, ...]:
    """Row contents for aarch64: CFA from sp (31) or x29 (29); RA (x30) in the link register or saved."""
    if ra_rule == _UNDEFINED:
        return _END
    if cfa_expr or cfa_reg not in (29, 31) or not -0x80000000 <= cfa_off <= 0x7FFFFFFF:
        return _FALLBACK
    kind = ut.CFA_SP if cfa_reg == 31 else ut.CFA_FP
    if ra_rule == _SAME:
        ra_kind, ra_off = ut.RA_LR, 0
    elif ra_rule == _OFFSET and _fits16(ra_off):
        ra_kind = ut.RA_SAVED
    else:
        return _FALLBACK
    if fp_rule == _SAME:
        return (cfa_off, 0, ra_off, kind, ut.FP_SAME, ra_kind, 0)
    if fp_rule == _OFFSET and _fits16(fp_off):
        return (cfa_off, fp_off, ra_off, kind, ut.FP_SAVED, ra_kind, 0)
    return _FALLBACK


# ---------------------------------------------------------------- the table


def _assemble(fdes: list[tuple[int, int, bytes]], parser: _Parser, source: str, m: Module) -> Built:
    fdes.sort(key=lambda t: t[0])
    pack = ut.ROW.pack
    size = ut.ROW.size
    fallback = pack(0, *_FALLBACK)[4:]  # a row's contents: every field after its pc
    base = m.text_vaddr
    parts: list[bytes] = []
    rows = 0
    last = b""
    prev_end = base
    overlapping = 0
    for begin, stop, body in fdes:
        if begin < prev_end:
            overlapping += 1  # two FDEs claim one pc: keep the first
            continue
        if begin > prev_end and last != fallback:
            parts.append(pack(prev_end - base, *_FALLBACK))  # a gap (or the start before the first FDE)
            rows += 1
            last = fallback
        if body[4:size] == last:
            body = body[size:]  # the same rules carry on across the boundary  # noqa: PLW2901
        if body:
            parts.append(body)
            rows += len(body) // size
            last = body[-size + 4 :]
        prev_end = stop
        if rows > ut.MAX_ROWS:
            raise CfiError("over_cap", f"more than {ut.MAX_ROWS} rows")
    if not rows:
        raise NoCfi(f"no FDE in {source} covers the executable segment")
    if last != fallback:
        parts.append(pack(prev_end - base, *_FALLBACK))
        rows += 1
    end_pc = prev_end - base
    header = ut.Header(
        arch=m.arch,
        span=max(m.text_size, end_pc + 1),
        pc_base=base,
        text_offset=m.text_offset,
        text_vaddr=m.text_vaddr,
        text_size=m.text_size,
    )
    try:
        table = ut.encode(header, b"".join(parts))
    except ut.UnwindTableError as e:
        raise CfiError("internal", f"table does not validate: {e}") from None
    st = parser.stats
    return Built(
        table=table,
        source=source,
        fdes=st["fdes"] - overlapping,
        rows=rows,
        fallback_fdes=st["fallback_fdes"],
        skipped_fdes=st["skipped_fdes"] + overlapping,
        signed_ra_fdes=st["signed_ra_fdes"],
    )


def describe(built: Built) -> dict[str, Any]:
    """The figures of a build, for logs and benchmarks."""
    return {
        "source": built.source,
        "fdes": built.fdes,
        "rows": built.rows,
        "bytes": len(built.table),
        "fallback_fdes": built.fallback_fdes,
        "skipped_fdes": built.skipped_fdes,
        "signed_ra_fdes": built.signed_ra_fdes,
    }
