"""Addresses of a few named data symbols of an ELF file (an interpreter or its library).

Owns: reading the section headers, the symbol tables (.dynsym, then .symtab)
and their string tables of one 64-bit little-endian ELF file with bounded
reads, and returning the link-time addresses of the names asked for (and of
every name with a prefix asked for: node's v8dbg_* set), plus the file's
PT_LOAD segments (the first computes the load bias in a process; all of
them place an initialised data symbol's bytes in the file: read_values).

The file is untrusted (a profiled process maps what it likes): every count,
offset and size is checked against the caps below and the file's size before
it is read (the first table of each type only, MAX_SYMBOL_BYTES in all, within
READ_SECONDS), and every failure is an ElfSymbolError naming the cap that
fired (its `kind`, which the reader counts). (symbolizer/elf.py reads
function symbols for the symbolizer; this reads the data symbols a runtime
reader needs, and only those.)

Must not: read a whole file into memory, or follow anything outside the file.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

# The kernel execs at most a page of program headers; real files have ~15.
MAX_PROGRAM_HEADERS = 128
# Linked binaries have ~40 sections.
MAX_SECTION_HEADERS = 4096
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

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_PT_LOAD = 1
_SHT_SYMTAB, _SHT_DYNSYM, _SHT_STRTAB = 2, 11, 3


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
    size = os.fstat(f.fileno()).st_size
    out: dict[str, int] = {}
    for name in names:
        at = info.symbols.get(name)
        off = None if at is None else info.file_offset(at, width)
        if off is None:
            continue
        out[name] = int.from_bytes(_read(f, size, off, width, name), "little")
    return out


def _read(f: BinaryIO, size: int, offset: int, length: int, what: str) -> bytes:
    if offset < 0 or length < 0 or offset + length > size:
        raise ElfSymbolError(f"{what} lies outside the file")
    f.seek(offset)
    data = f.read(length)
    if len(data) != length:
        raise ElfSymbolError(f"short read of {what}")
    return data


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


def read_symbols(f: BinaryIO, names: Iterable[str], prefix: str = "", dynsym_only: bool = False) -> ElfInfo:  # noqa: PLR0912
    """The addresses of `names` (those present), and of every symbol starting with `prefix` when one
    is given, and the load layout of the ELF file `f`. With dynsym_only, .symtab is never read (node
    exports its v8dbg_ symbols in .dynsym; its .symtab's string table is past MAX_STRTAB_BYTES)."""
    wanted = {n.encode(): n for n in names}
    pre = prefix.encode()
    longest = max([len(w) for w in wanted] + ([MAX_PREFIX_NAME_BYTES] if pre else []), default=0)
    prefixed = 0
    deadline = time.monotonic() + READ_SECONDS
    size = os.fstat(f.fileno()).st_size
    if size > MAX_FILE_BYTES:
        raise ElfSymbolError(f"{size} bytes, more than {MAX_FILE_BYTES}", "file_over_cap")
    (
        ident,
        e_type,
        _machine,
        _v,
        _entry,
        phoff,
        shoff,
        _flags,
        _ehsize,
        phentsize,
        phnum,
        shentsize,
        shnum,
        _shstrndx,
    ) = _EHDR.unpack(_read(f, size, 0, _EHDR.size, "ELF header"))
    if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
        raise ElfSymbolError("not a 64-bit little-endian ELF file")
    if e_type not in (2, 3):
        raise ElfSymbolError(f"ELF type {e_type} is not an executable or shared object")
    if phnum > MAX_PROGRAM_HEADERS or (phnum and phentsize != _PHDR.size):
        raise ElfSymbolError("unusable program headers")
    if shnum > MAX_SECTION_HEADERS or (shnum and shentsize != _SHDR.size):
        raise ElfSymbolError("unusable section headers")
    loads = []
    table = _read(f, size, phoff, phnum * _PHDR.size, "program headers")
    for i in range(phnum):
        p_type, _pf, p_offset, p_vaddr, _paddr, p_filesz, *_ = _PHDR.unpack_from(table, i * _PHDR.size)
        if p_type == _PT_LOAD:
            loads.append((p_offset, p_vaddr, p_filesz))
    if not loads:
        raise ElfSymbolError("no PT_LOAD segment")
    first_offset, first_vaddr, _ = min(loads)
    # The section header table is read once (reading it per header made 4096 headers a read of 1 GiB).
    raw_shdrs = _read(f, size, shoff, shnum * _SHDR.size, "section headers") if shoff else b""
    shdrs = [_SHDR.unpack_from(raw_shdrs, i * _SHDR.size) for i in range(shnum)] if shoff else []
    found: dict[str, int] = {}
    spent = 0  # bytes of symbol and string tables read
    for sh_type in (_SHT_DYNSYM,) if dynsym_only else (_SHT_DYNSYM, _SHT_SYMTAB):
        # An ELF file has at most one section of each type (the gABI): a crafted one's others are not read.
        for sh in [sh for sh in shdrs if sh[1] == sh_type][:1]:
            if len(found) == len(wanted) and not pre:
                continue
            _name, _t, _fl, _addr, offset, sh_size, link, _info, _align, entsize = sh
            if entsize != _SYM.size or link >= len(shdrs) or shdrs[link][1] != _SHT_STRTAB:
                raise ElfSymbolError("unusable symbol table")
            count = sh_size // entsize
            if count > MAX_SYMBOLS:
                raise ElfSymbolError(f"{count} symbols, more than {MAX_SYMBOLS}", "symbols_over_cap")
            str_offset, str_size = shdrs[link][4], shdrs[link][5]
            if str_size > MAX_STRTAB_BYTES:
                raise ElfSymbolError(
                    f"string table of {str_size} bytes, more than {MAX_STRTAB_BYTES}", "strtab_over_cap"
                )
            spent += str_size + count * entsize
            if spent > MAX_SYMBOL_BYTES:
                raise ElfSymbolError(
                    f"symbol and string tables of more than {MAX_SYMBOL_BYTES} bytes", "bytes_over_cap"
                )
            strtab = _read(f, size, str_offset, str_size, "string table")
            # With a prefix, only symbols whose name starts where a wanted name or the prefix occurs in
            # the string table are looked at (found by bytes.find, not per symbol: node's 90K .dynsym
            # entries took over 2 s on a loaded host otherwise).
            starts = _starts(strtab, [*wanted, pre]) if pre else None
            for first in range(0, count, SYMBOL_CHUNK):
                if time.monotonic() > deadline:
                    raise ElfSymbolError(f"reading symbols took more than {READ_SECONDS:g} s", "time")
                n = min(SYMBOL_CHUNK, count - first)
                chunk = _read(f, size, offset + first * entsize, n * entsize, "symbols")
                for st_name, _info, _other, shndx, value, _sz in _SYM.iter_unpack(chunk):
                    if not value or not shndx or st_name >= str_size:
                        continue
                    if starts is not None and st_name not in starts:
                        continue
                    # No name we want is longer than `longest`: the NUL is looked for that far only
                    # (a string table without NULs made each symbol a scan of 16 MiB).
                    end = strtab.find(b"\0", st_name, st_name + longest + 1)
                    if end < 0:
                        continue
                    name = strtab[st_name:end]
                    if name in wanted and wanted[name] not in found:
                        found[wanted[name]] = value
                    elif pre and name.startswith(pre):
                        text = name.decode("ascii", "replace")
                        if text not in found:
                            prefixed += 1
                            if prefixed > MAX_PREFIX_SYMBOLS:
                                raise ElfSymbolError(
                                    f"more than {MAX_PREFIX_SYMBOLS} {prefix}* symbols", "prefix_over_cap"
                                )
                            found[text] = value
                if len(found) == len(wanted) and not pre:
                    break
    return ElfInfo(e_type == 3, first_vaddr, first_offset, found, tuple(sorted(loads)))
