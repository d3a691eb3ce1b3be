"""Addresses of a few named data symbols of an ELF file (an interpreter or its library).

Owns: reading the section headers, the symbol tables (.dynsym, then .symtab)
and their string tables of one 64-bit little-endian ELF file with bounded
reads, and returning the link-time addresses of the names asked for (and of
every name with a prefix asked for: node's v8dbg_* set), plus the file's
PT_LOAD segments (the first computes the load bias in a process; all of
them place an initialised data symbol's bytes in the file: read_values).

The file is untrusted (a profiled process maps what it likes): it is read
through shared/elf.py, the one bounded ELF reader (header, program and section
header tables, symbol entries), and every count, offset and size is checked
against the caps below and the file's size before it is read (the first table
of each type only, MAX_SYMBOL_BYTES in all, within READ_SECONDS); every
failure is an ElfSymbolError naming the cap that fired (its `kind`, which the
reader counts). (symbolizer/elf.py reads function symbols for the symbolizer;
this reads the data symbols a runtime reader needs, and only those.)

Must not: read a whole file into memory, or follow anything outside the file.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import BinaryIO

from shared import elf as shared_elf
from shared.elf import SYM, ElfError, Reader, SectionHeader

# The header caps are shared/elf.py's: MAX_PROGRAM_HEADERS, MAX_SECTION_HEADERS.
# libpython has ~20K symbols in .dynsym, ~30K in .symtab; past this a file is not an interpreter.
MAX_SYMBOLS = 1_000_000
# Symbol entries read per chunk (24 bytes each).
SYMBOL_CHUNK = 4096
# A string table is read whole: libpython's .dynstr is ~300 KB, .strtab ~1 MB.
MAX_STRTAB_BYTES = 16 << 20
# Larger files are not interpreters (libpython is ~8 MB).
MAX_FILE_BYTES = 1 << 30
# Symbols kept for a prefix (node's v8dbg_ set is ~550); past this a file is not a runtime we know.
MAX_PREFIX_SYMBOLS = 4096
# Longest symbol name matched by prefix (v8dbg_ names are under 120 bytes).
MAX_PREFIX_NAME_BYTES = 256
# Wall-clock budget of one file: libpython's ~50K symbols take ~50 ms; a crafted file is cut off here.
READ_SECONDS = 2.0
# Bytes of symbol tables and their string tables read from one file in all (libpython's are ~2 MB, node's
# .dynsym and .dynstr ~6 MB); past it the file is refused.
MAX_SYMBOL_BYTES = 64 << 20


class ElfSymbolError(Exception):
    """The file is not a readable 64-bit little-endian ELF file, or breaks a cap; `kind` names which
    ("malformed", or the cap: "file_over_cap", "symbols_over_cap", "strtab_over_cap", "bytes_over_cap",
    "prefix_over_cap", "time"), for the reader's counters."""

    def __init__(self, message: str, kind: str = "malformed") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ElfInfo:
    is_pie: bool  # ET_DYN: addresses are relative to the load bias
    first_load_vaddr: int  # p_vaddr of the PT_LOAD with the lowest file offset
    first_load_offset: int
    symbols: dict[str, int]  # name → st_value, only the names asked for
    loads: tuple[tuple[int, int, int], ...] = ()  # (p_offset, p_vaddr, p_filesz) of each PT_LOAD

    def load_bias(self, map_start: int, map_offset: int) -> int:
        """What to add to a link-time address of this file mapped at `map_start` from file offset
        `map_offset` (a line of /proc/PID/maps) to get its address in the process (0 unless PIE)."""
        if not self.is_pie:
            return 0
        return map_start - (map_offset + self.first_load_vaddr - self.first_load_offset)

    def file_offset(self, vaddr: int, length: int) -> int | None:
        """Where the `length` bytes at link-time address `vaddr` lie in the file (None: not in it)."""
        for offset, start, filesz in self.loads:
            if start <= vaddr and vaddr + length <= start + filesz:
                return offset + vaddr - start
        return None


def read_values(f: BinaryIO, info: ElfInfo, names: Iterable[str], width: int = 4) -> dict[str, int]:
    """The little-endian unsigned integers of `width` bytes the data symbols `names` hold in the file
    (initialised data: a v8dbg_ constant, V8's Version::major_); names absent or outside the file's
    loaded bytes are left out."""
    out: dict[str, int] = {}
    with _as_symbol_errors():
        r = Reader(f, MAX_FILE_BYTES)
        for name in names:
            at = info.symbols.get(name)
            off = None if at is None else info.file_offset(at, width)
            if off is None:
                continue
            out[name] = int.from_bytes(r.read(off, width, name), "little")
    return out


@contextmanager
def _as_symbol_errors() -> Iterator[None]:
    """shared/elf.py's ElfError as an ElfSymbolError: the file over its cap keeps its kind, the rest is
    "malformed"."""
    try:
        yield
    except ElfError as e:
        raise ElfSymbolError(str(e), "file_over_cap" if e.kind == "file_over_cap" else "malformed") from None


def _starts(strtab: bytes, needles: list[bytes]) -> set[int]:
    """Every offset of the string table at which one of `needles` occurs (a name may start there)."""
    out: set[int] = set()
    for needle in needles:
        i = strtab.find(needle)
        while i >= 0:
            if len(out) >= MAX_PREFIX_SYMBOLS * 4:
                raise ElfSymbolError(
                    f"more than {MAX_PREFIX_SYMBOLS * 4} names starting like the ones asked for", "prefix_over_cap"
                )
            out.add(i)
            i = strtab.find(needle, i + 1)
    return out


def read_symbols(f: BinaryIO, names: Iterable[str], prefix: str = "", dynsym_only: bool = False) -> ElfInfo:
    """The addresses of `names` (those present), and of every symbol starting with `prefix` when one
    is given, and the load layout of the ELF file `f`. With dynsym_only, .symtab is never read (node
    exports its v8dbg_ symbols in .dynsym; its .symtab's string table is past MAX_STRTAB_BYTES)."""
    search = _Search(names, prefix, time.monotonic() + READ_SECONDS)
    with _as_symbol_errors():
        r = Reader(f, MAX_FILE_BYTES)
        h = shared_elf.read_header(r)
        if h.e_type not in (shared_elf.ET_EXEC, shared_elf.ET_DYN):
            raise ElfSymbolError(f"ELF type {h.e_type} is not an executable or shared object")
        phdrs = shared_elf.program_headers(r, h)
        loads = [(p.p_offset, p.p_vaddr, p.p_filesz) for p in phdrs if p.p_type == shared_elf.PT_LOAD]
        if not loads:
            raise ElfSymbolError("no PT_LOAD segment")
        shdrs = shared_elf.section_headers(r, h)  # read once (read per header, 4096 of them made 1 GiB)
        for sh_type in (shared_elf.SHT_DYNSYM,) if dynsym_only else (shared_elf.SHT_DYNSYM, shared_elf.SHT_SYMTAB):
            # An ELF file has at most one section of each type (the gABI): a crafted one's others are not read.
            for sh in [sh for sh in shdrs if sh.sh_type == sh_type][:1]:
                if not search.done():
                    search.table(r, shdrs, sh)
    first_offset, first_vaddr, _ = min(loads)
    return ElfInfo(h.e_type == shared_elf.ET_DYN, first_vaddr, first_offset, search.found, tuple(sorted(loads)))


@dataclass
class _Search:
    """The names asked for (and the prefix), what was found of them, and the caps spent so far."""

    names: Iterable[str]
    prefix: str
    deadline: float
    found: dict[str, int] = field(default_factory=dict)
    prefixed: int = 0  # symbols found by the prefix
    spent: int = 0  # bytes of symbol and string tables read

    def __post_init__(self) -> None:
        self.wanted = {n.encode(): n for n in self.names}
        self.pre = self.prefix.encode()
        # No name we want is longer than this: the NUL is looked for that far only (a string table
        # without NULs made each symbol a scan of 16 MiB).
        self.longest = max([len(w) for w in self.wanted] + ([MAX_PREFIX_NAME_BYTES] if self.pre else []), default=0)

    def done(self) -> bool:
        return len(self.found) == len(self.wanted) and not self.pre

    def table(self, r: Reader, shdrs: list[SectionHeader], sh: SectionHeader) -> None:
        """Look for the names in the symbol table `sh`, after checking its caps."""
        strings = shared_elf.linked_strings(shdrs, sh)
        count = sh.sh_size // SYM.size
        if count > MAX_SYMBOLS:
            raise ElfSymbolError(f"{count} symbols, more than {MAX_SYMBOLS}", "symbols_over_cap")
        if strings.sh_size > MAX_STRTAB_BYTES:
            raise ElfSymbolError(
                f"string table of {strings.sh_size} bytes, more than {MAX_STRTAB_BYTES}", "strtab_over_cap"
            )
        self.spent += strings.sh_size + count * SYM.size
        if self.spent > MAX_SYMBOL_BYTES:
            raise ElfSymbolError(f"symbol and string tables of more than {MAX_SYMBOL_BYTES} bytes", "bytes_over_cap")
        strtab = r.read(strings.sh_offset, strings.sh_size, "string table")
        # With a prefix, only symbols whose name starts where a wanted name or the prefix occurs in the
        # string table are looked at (found by bytes.find, not per symbol: node's 90K .dynsym entries took
        # over 2 s on a loaded host otherwise).
        starts = _starts(strtab, [*self.wanted, self.pre]) if self.pre else None
        self._check_time()
        for chunk in shared_elf.symbol_chunks(r, sh, SYMBOL_CHUNK):
            self._chunk(strtab, chunk, starts)
            if self.done():
                break
            self._check_time()  # before the next chunk is read

    def _check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ElfSymbolError(f"reading symbols took more than {READ_SECONDS:g} s", "time")

    def _chunk(self, strtab: bytes, chunk: bytes, starts: set[int] | None) -> None:
        for st_name, _info, _other, shndx, value, _sz in SYM.iter_unpack(chunk):
            if not value or not shndx or st_name >= len(strtab):
                continue
            if starts is not None and st_name not in starts:
                continue
            end = strtab.find(b"\0", st_name, st_name + self.longest + 1)
            if end < 0:
                continue
            name = strtab[st_name:end]
            if name in self.wanted and self.wanted[name] not in self.found:
                self.found[self.wanted[name]] = value
            elif self.pre and name.startswith(self.pre):
                self._prefixed(name.decode("ascii", "replace"), value)

    def _prefixed(self, text: str, value: int) -> None:
        if text not in self.found:
            self.prefixed += 1
            if self.prefixed > MAX_PREFIX_SYMBOLS:
                raise ElfSymbolError(f"more than {MAX_PREFIX_SYMBOLS} {self.prefix}* symbols", "prefix_over_cap")
            self.found[text] = value
