"""Bounded reading of a hostile ELF file: the one ELF reader of the tree.

Owns: Reader (exact, bounds-checked reads of a file object whose size is under
a cap the caller gives), and on top of it the structures every ELF user here
needs, each read once and checked before use: the ELF header (64-bit
little-endian only: x86-64 and arm64), the program and section header tables
(each count under its cap and each entry size checked before the one read of
a table), section names, the GNU build id of a PT_NOTE segment (the segment
read whole under MAX_NOTE_BYTES, notes walked at its 4- or 8-byte alignment,
a note running past the end ends the walk), a string table read through a
window with names cut to a length, a symbol table's string table, its entries
in chunks, and caused_by (the budget exception behind another one: a parser
may wrap whatever interrupts it). symbolizer/elf.py (function symbols, build
ids), symbolizer/cfi.py (the CFI sections and executable segment) and
runtimes/elfsyms.py (a runtime's data symbols) read ELF files through it and
keep only their own caps and policies.

Input is untrusted (a profiled process maps what it likes): every failure is
an ElfError whose `kind` ("not_elf", "unsupported", "over_cap",
"file_over_cap", "malformed") the callers turn into their own errors and
counters.

Must not: open files by path, follow anything outside the file object it is
given (debuglink, build-id directories), read a whole file into memory, or
know what a caller does with what it reads.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple, TypeVar

# The kernel will not exec a file with more than a page (73) of program headers; real files have ~15.
MAX_PROGRAM_HEADERS = 128
# Linked binaries have ~40 sections; bounds the single read of the section header table (256 KiB).
MAX_SECTION_HEADERS = 4096
# A PT_NOTE segment holds a few notes of < 100 bytes (a build id note is 36); larger ones are not read.
MAX_NOTE_BYTES = 4096
# SHA-1 build ids are 20 bytes; a longer "id" is not one and would bloat every frame sent upstream.
MAX_BUILD_ID_BYTES = 64

# e_type, p_type, p_flags, sh_type, st_info, st_shndx and n_type values (the gABI; include/uapi/linux/elf.h).
ET_EXEC, ET_DYN = 2, 3
EM_X86_64, EM_AARCH64 = 62, 183
PT_LOAD, PT_NOTE = 1, 4
PF_X = 1
SHT_SYMTAB, SHT_STRTAB, SHT_NOBITS, SHT_DYNSYM = 2, 3, 8, 11
SHF_COMPRESSED = 0x800
STT_FUNC, STT_GNU_IFUNC = 2, 10
STB_GLOBAL, STB_WEAK = 1, 2
SHN_UNDEF = 0
NT_GNU_BUILD_ID = 3

# The 64-bit little-endian layouts: Elf64_Ehdr, Elf64_Phdr, Elf64_Shdr, Elf64_Sym, Elf64_Nhdr.
EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
PHDR = struct.Struct("<IIQQQQQQ")
SHDR = struct.Struct("<IIQQQQIIQQ")
SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
NHDR = struct.Struct("<III")  # n_namesz, n_descsz, n_type


class ElfError(Exception):
    """The file cannot be read as asked. `kind`: not_elf (no ELF magic), unsupported (not 64-bit
    little-endian), over_cap (a count past its cap), file_over_cap (the file past the caller's
    cap), malformed (anything else: a table outside the file, a wrong entry size, a short read)."""

    def __init__(self, message: str, kind: str = "malformed") -> None:
        super().__init__(message)
        self.kind = kind


class Header(NamedTuple):
    e_ident: bytes
    e_type: int
    e_machine: int
    e_version: int
    e_entry: int
    e_phoff: int
    e_shoff: int
    e_flags: int
    e_ehsize: int
    e_phentsize: int
    e_phnum: int
    e_shentsize: int
    e_shnum: int
    e_shstrndx: int


class ProgramHeader(NamedTuple):
    p_type: int
    p_flags: int
    p_offset: int
    p_vaddr: int
    p_paddr: int
    p_filesz: int
    p_memsz: int
    p_align: int


class SectionHeader(NamedTuple):
    sh_name: int
    sh_type: int
    sh_flags: int
    sh_addr: int
    sh_offset: int
    sh_size: int
    sh_link: int
    sh_info: int
    sh_addralign: int
    sh_entsize: int


class Reader:
    """Checked reads of exact byte ranges inside the file `f` (seekable), refused whole past `max_bytes`."""

    def __init__(self, f: BinaryIO, max_bytes: int) -> None:
        self._f = f
        self.size = f.seek(0, os.SEEK_END)
        if self.size > max_bytes:
            raise ElfError(f"file of {self.size} bytes is larger than {max_bytes}", "file_over_cap")

    def check(self, offset: int, size: int, what: str) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ElfError(f"{what}: outside the file")

    def read(self, offset: int, size: int, what: str) -> bytes:
        self.check(offset, size, what)
        self._f.seek(offset)
        data = self._f.read(size)
        if len(data) != size:
            raise ElfError(f"{what}: short read")
        return data


def read_header(r: Reader) -> Header:
    """The ELF header of a 64-bit little-endian file; ElfError (not_elf, unsupported, malformed) if not."""
    if r.read(0, min(r.size, 4), "ELF header") != b"\x7fELF":
        raise ElfError("not an ELF file", "not_elf")
    ident = r.read(0, min(r.size, 16), "ELF header")
    if len(ident) < 16 or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        raise ElfError("ELF header: no valid class or byte order")
    if ident[4] != 2 or ident[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file", "unsupported")
    return Header(*EHDR.unpack(r.read(0, EHDR.size, "ELF header")))


_T = TypeVar("_T", ProgramHeader, SectionHeader)


def _table(
    r: Reader, make: type[_T], layout: struct.Struct, offset: int, count: int, entsize: int, what: str
) -> list[_T]:
    """`count` entries of `layout` at `offset`, after checking the entry size and bounds (one read)."""
    if not count:
        return []
    if entsize != layout.size:
        raise ElfError(f"{what}: entries of {entsize} bytes, expected {layout.size}")
    return [make(*t) for t in layout.iter_unpack(r.read(offset, count * layout.size, what))]


def program_headers(r: Reader, h: Header) -> list[ProgramHeader]:
    """The program header table; ElfError over_cap past MAX_PROGRAM_HEADERS (e_phnum 0xffff, PN_XNUM, is)."""
    if h.e_phnum > MAX_PROGRAM_HEADERS:
        raise ElfError(f"{h.e_phnum} program headers, more than {MAX_PROGRAM_HEADERS}", "over_cap")
    return _table(r, ProgramHeader, PHDR, h.e_phoff, h.e_phnum, h.e_phentsize, "program headers")


def section_headers(r: Reader, h: Header) -> list[SectionHeader]:
    """The section header table (none if e_shoff is 0); ElfError over_cap past MAX_SECTION_HEADERS.
    e_shnum 0 (extended numbering, >= 65280 sections) reads as no sections: the real count would come
    from section 0."""
    shnum = h.e_shnum if h.e_shoff else 0
    if shnum > MAX_SECTION_HEADERS:
        raise ElfError(f"{shnum} section headers, more than {MAX_SECTION_HEADERS}", "over_cap")
    return _table(r, SectionHeader, SHDR, h.e_shoff, shnum, h.e_shentsize, "section headers")


def section_names(r: Reader, h: Header, shdrs: list[SectionHeader], max_bytes: int) -> list[bytes]:
    """Each section's name (b"" when it has none or no name table); ElfError over_cap when the name
    table is larger than `max_bytes`."""
    if not shdrs or not 0 < h.e_shstrndx < len(shdrs):
        return [b""] * len(shdrs)
    names_sh = shdrs[h.e_shstrndx]
    if names_sh.sh_size > max_bytes:
        raise ElfError(f"section name table of {names_sh.sh_size} bytes", "over_cap")
    names = r.read(names_sh.sh_offset, names_sh.sh_size, "section names")
    return [names[sh.sh_name : names.find(b"\0", sh.sh_name)] if sh.sh_name < len(names) else b"" for sh in shdrs]


def build_id(r: Reader, phdrs: list[ProgramHeader]) -> str:
    """The GNU build id (lowercase hex) of the first PT_NOTE segment that has one; "" if none."""
    for p in phdrs:
        if p.p_type == PT_NOTE and 0 < p.p_filesz <= MAX_NOTE_BYTES:
            found = note_build_id(r.read(p.p_offset, p.p_filesz, "note segment"), 8 if p.p_align == 8 else 4)
            if found:
                return found
    return ""


def note_build_id(notes: bytes, align: int) -> str:
    """The NT_GNU_BUILD_ID of a note segment read whole; "" if none or a note runs past its end."""
    pos = 0
    while pos + NHDR.size <= len(notes):
        namesz, descsz, n_type = NHDR.unpack_from(notes, pos)
        name = notes[pos + NHDR.size : pos + NHDR.size + namesz]
        desc = align_up(pos + NHDR.size + namesz, align)
        end = desc + descsz
        if end > len(notes):
            break
        if n_type == NT_GNU_BUILD_ID and name == b"GNU\0" and 0 < descsz <= MAX_BUILD_ID_BYTES:
            return notes[desc:end].hex()
        pos = align_up(end, align)
    return ""


def align_up(n: int, align: int) -> int:
    return (n + align - 1) & -align


def linked_strings(shdrs: list[SectionHeader], sh: SectionHeader) -> SectionHeader:
    """The string table of the symbol table `sh` (its sh_link); ElfError if it has none, or if its
    entries are not Elf64_Sym."""
    if sh.sh_entsize != SYM.size:
        raise ElfError("unexpected symbol entry size")
    if sh.sh_link >= len(shdrs) or shdrs[sh.sh_link].sh_type != SHT_STRTAB:
        raise ElfError("symbol table without a string table")
    return shdrs[sh.sh_link]


def symbol_chunks(r: Reader, sh: SectionHeader, chunk: int) -> Iterator[bytes]:
    """The entries of the symbol table `sh` (checked by linked_strings), `chunk` entries a read, for
    SYM.iter_unpack; the caller may stop (or check its time) between chunks."""
    count = sh.sh_size // SYM.size
    for first in range(0, count, chunk):
        yield r.read(sh.sh_offset + first * SYM.size, min(chunk, count - first) * SYM.size, "symbols")


class StringTable:
    """Names from one string table, read through a window of `window` bytes and cut to `max_name`
    bytes; cheapest when asked in offset order."""

    def __init__(self, r: Reader, offset: int, size: int, max_name: int, window: int) -> None:
        if window < max_name:
            raise ValueError(f"a window of {window} bytes cannot hold a name of {max_name}")
        r.check(offset, size, "string table")
        self._r, self._offset, self._size = r, offset, size
        self._max_name, self._window_bytes = max_name, window
        self._at, self._window = 0, b""

    def name(self, at: int) -> bytes:
        if at >= self._size:
            raise ElfError("symbol name: outside its string table")
        end = min(at + self._max_name, self._size)
        if at < self._at or end > self._at + len(self._window):
            self._at = at
            self._window = self._r.read(self._offset + at, min(self._window_bytes, self._size - at), "string table")
        return self._window[at - self._at : end - self._at].split(b"\0", 1)[0]


_E = TypeVar("_E", bound=BaseException)


def caused_by(e: BaseException, kind: type[_E]) -> _E | None:
    """The exception of type `kind` (a time budget's) behind `e`, following __cause__ and
    __context__ (a parser may re-raise whatever interrupted it as its own error); None if none."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, kind):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None
