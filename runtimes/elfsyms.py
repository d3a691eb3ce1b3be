"""Addresses of a few named data symbols of an ELF file (an interpreter or its library).

Owns: reading the section headers, the symbol tables (.dynsym, then .symtab)
and their string tables of one 64-bit little-endian ELF file with bounded
reads, and returning the link-time addresses of the names asked for, plus the
file's first PT_LOAD (to compute the load bias in a process).

The file is untrusted (a profiled process maps what it likes): every count,
offset and size is checked against the caps below and the file's size before
it is read, and every failure is an ElfSymbolError. (symbolizer/elf.py reads
function symbols for the symbolizer; this reads the data symbols a runtime
reader needs, and only those.)

Must not: read a whole file into memory, or follow anything outside the file.
"""

from __future__ import annotations

import os
import struct
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

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_PT_LOAD = 1
_SHT_SYMTAB, _SHT_DYNSYM, _SHT_STRTAB = 2, 11, 3


class ElfSymbolError(Exception):
    """The file is not a readable 64-bit little-endian ELF file, or breaks a cap."""


@dataclass(frozen=True)
class ElfInfo:
    is_pie: bool                       # ET_DYN: addresses are relative to the load bias
    first_load_vaddr: int              # p_vaddr of the PT_LOAD with the lowest file offset
    first_load_offset: int
    symbols: dict[str, int]            # name → st_value, only the names asked for


def _read(f: BinaryIO, size: int, offset: int, length: int, what: str) -> bytes:
    if offset < 0 or length < 0 or offset + length > size:
        raise ElfSymbolError(f"{what} lies outside the file")
    f.seek(offset)
    data = f.read(length)
    if len(data) != length:
        raise ElfSymbolError(f"short read of {what}")
    return data


def read_symbols(f: BinaryIO, names: Iterable[str]) -> ElfInfo:
    """The addresses of `names` (those present) and the load layout of the ELF file `f`."""
    wanted = {n.encode(): n for n in names}
    size = os.fstat(f.fileno()).st_size
    if size > MAX_FILE_BYTES:
        raise ElfSymbolError(f"{size} bytes, more than {MAX_FILE_BYTES}")
    ident, e_type, _machine, _v, _entry, phoff, shoff, _flags, _ehsize, phentsize, phnum, shentsize, shnum, \
        _shstrndx = _EHDR.unpack(_read(f, size, 0, _EHDR.size, "ELF header"))
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
        p_type, _pf, p_offset, p_vaddr, *_ = _PHDR.unpack_from(table, i * _PHDR.size)
        if p_type == _PT_LOAD:
            loads.append((p_offset, p_vaddr))
    if not loads:
        raise ElfSymbolError("no PT_LOAD segment")
    first_offset, first_vaddr = min(loads)
    shdrs = [_SHDR.unpack_from(_read(f, size, shoff, shnum * _SHDR.size, "section headers"), i * _SHDR.size)
             for i in range(shnum)] if shoff else []
    found: dict[str, int] = {}
    for sh_type in (_SHT_DYNSYM, _SHT_SYMTAB):
        for sh in shdrs:
            if sh[1] != sh_type or len(found) == len(wanted):
                continue
            _name, _t, _fl, _addr, offset, sh_size, link, _info, _align, entsize = sh
            if entsize != _SYM.size or link >= len(shdrs) or shdrs[link][1] != _SHT_STRTAB:
                raise ElfSymbolError("unusable symbol table")
            count = sh_size // entsize
            if count > MAX_SYMBOLS:
                raise ElfSymbolError(f"{count} symbols, more than {MAX_SYMBOLS}")
            str_offset, str_size = shdrs[link][4], shdrs[link][5]
            if str_size > MAX_STRTAB_BYTES:
                raise ElfSymbolError(f"string table of {str_size} bytes, more than {MAX_STRTAB_BYTES}")
            strtab = _read(f, size, str_offset, str_size, "string table")
            for first in range(0, count, SYMBOL_CHUNK):
                n = min(SYMBOL_CHUNK, count - first)
                chunk = _read(f, size, offset + first * entsize, n * entsize, "symbols")
                for st_name, _info, _other, shndx, value, _sz in _SYM.iter_unpack(chunk):
                    if not value or not shndx or st_name >= str_size:
                        continue
                    end = strtab.find(b"\0", st_name)
                    name = strtab[st_name:end if end >= 0 else str_size]
                    if name in wanted and wanted[name] not in found:
                        found[wanted[name]] = value
                if len(found) == len(wanted):
                    break
    return ElfInfo(e_type == 3, first_vaddr, first_offset, found)
