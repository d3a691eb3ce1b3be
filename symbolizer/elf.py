"""Build ids and function symbols of the ELF files mapped by profiled processes.

Owns: turning one ELF file object into an ElfSymbols (GNU build id, PT_LOAD
layout, function symbols of .symtab and .dynsym) that maps a file offset -- the
profiler's module-relative address -- to a function name; and ElfCache, a
bounded LRU of those per file identity, in which failures are cached, logged
once and counted.

Input is untrusted: a profiled process can map any file it likes. Every read is
bounded by a cap below, parsing runs under time_budget(ELF_PARSE_SECONDS), and
every failure becomes ElfError. The parser is `struct` over bounded reads, not
pyelftools, whose generic paths read C strings up to the end of the file and
build a Python object per symbol. Only 64-bit little-endian ELF is read (x86-64
and arm64); anything else is an ElfError.

Must not: open files by path, follow anything outside the file object it is
given (debuglink, build-id directories, DWARF links), or read a whole file into
memory.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import time
from array import array
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Hashable

from ebpfprofiler.shared.log import LogOnce
from ebpfprofiler.symbolizer.limits import BudgetExceeded, time_budget

log = logging.getLogger(__name__)

# Larger files are not binaries anyone maps to run (node is 99 MB); also bounds every offset read.
MAX_FILE_BYTES = 2 << 30
# Function symbols kept per file, the first ones found (node keeps 78k); bounds worker memory.
MAX_SYMBOLS = 250_000
# Longer names (deep C++ templates) are cut to this; node's longest is 483 bytes.
MAX_SYMBOL_NAME_BYTES = 1024
# Name bytes kept per file (node: 6.4 MB); stops many long names from ballooning a worker.
MAX_SYMBOL_NAME_TOTAL_BYTES = 32 << 20
# A PT_NOTE segment holds a few notes of < 100 bytes (a build id note is 36); larger ones are not read.
MAX_NOTE_BYTES = 4096
# SHA-1 build ids are 20 bytes; a longer "id" is not one and would bloat every frame sent upstream.
MAX_BUILD_ID_BYTES = 64
# The kernel will not exec a file with more than a page (73) of program headers; real files have ~15.
MAX_PROGRAM_HEADERS = 128
# Linked binaries have ~40 sections; bounds the single read of the section header table (256 KiB).
MAX_SECTION_HEADERS = 4096
# Wall-clock budget for parsing one file; node, the largest binary on a typical host, takes ~0.5 s.
ELF_PARSE_SECONDS = 5.0
# Parsed files kept by ElfCache (a libc-sized entry is ~0.3 MB).
ELF_CACHE_ENTRIES = 256
# A file that could not be opened (process exited, fd raced) may be tried again after this.
UNREADABLE_RETRY_S = 60.0

_SYM_CHUNK = 4096        # symbol entries per read
_STRTAB_WINDOW = 64 << 10  # string table bytes per read; must be >= MAX_SYMBOL_NAME_BYTES

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")    # type flags offset vaddr paddr filesz memsz align
_SHDR = struct.Struct("<IIQQQQIIQQ")  # name type flags addr offset size link info addralign entsize
_SYM = struct.Struct("<IBBHQQ")       # name info other shndx value size
_NOTE = struct.Struct("<III")         # namesz descsz type
_ELFCLASS64, _ELFDATA2LSB = 2, 1
_ET_EXEC, _ET_DYN = 2, 3
_PT_LOAD, _PT_NOTE = 1, 4
_SHT_SYMTAB, _SHT_STRTAB, _SHT_DYNSYM = 2, 3, 11
_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_NT_GNU_BUILD_ID = 3
_BIND_RANK = {1: 0, 2: 1}  # among aliases of one address: STB_GLOBAL, then STB_WEAK, then the rest
_U64_MAX = (1 << 64) - 1


class ElfError(Exception):
    """A file that is not usable: malformed, unsupported, oversized or too slow to parse."""


@dataclass(frozen=True)
class ElfSymbols:
    """What the symbolizer needs of one ELF file. Equality and hash use build id and layout."""

    build_id: str  # lowercase hex of NT_GNU_BUILD_ID, "" if none
    _loads: tuple[tuple[int, int, int], ...] = field(repr=False)  # (p_offset, p_filesz, p_vaddr) by offset
    _starts: array = field(repr=False, compare=False)  # sorted function start addresses ("Q")
    _ends: array = field(repr=False, compare=False)    # exclusive end of each ("Q")
    _names: tuple[str, ...] = field(repr=False, compare=False)

    def function_at(self, file_offset: int) -> str | None:
        """The function containing `file_offset` (a module-relative address), else None."""
        for offset, filesz, vaddr in self._loads:
            if offset <= file_offset < offset + filesz:
                address = file_offset - offset + vaddr
                break
        else:
            return None
        i = bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._ends[i]:
            return self._names[i]
        return None


def read_elf(f: BinaryIO) -> ElfSymbols:
    """Read build id and function symbols from `f`, a seekable binary file.

    Raises ElfError, and nothing else, for any file that cannot be read. The
    time budget applies in the main thread only (see limits.time_budget).
    """
    try:
        with time_budget(ELF_PARSE_SECONDS):
            return _parse(f)
    except ElfError:
        raise
    except BudgetExceeded as e:
        raise ElfError(str(e)) from None
    except Exception as e:  # anything a hostile file can provoke: struct, Memory, Recursion, OS errors
        raise ElfError(f"{type(e).__name__}: {e}"[:200]) from None


class ElfCache:
    """Bounded LRU of read_elf results by the caller's key (file identity or build id).

    A file that fails to parse is cached as None, so it is parsed, logged and
    counted once. A file the opener cannot open counts as "unreadable" and is
    tried again after UNREADABLE_RETRY_S. get() closes the file the opener returns.
    """

    def __init__(self, max_entries: int = ELF_CACHE_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[ElfSymbols | None, float]] = OrderedDict()  # value, expiry
        self._log_once = LogOnce(log)
        self.stats: dict[str, int] = dict.fromkeys(("parsed", "skipped", "unreadable", "hits", "evicted"), 0)

    def get(self, key: Hashable, opener: Callable[[], BinaryIO],
            now: float | None = None) -> ElfSymbols | None:
        """Symbols of the file `key` names; `opener` is called only on a miss. None: unusable."""
        now = time.monotonic() if now is None else now
        entry = self._entries.get(key)
        if entry is not None and now < entry[1]:
            self._entries.move_to_end(key)
            self.stats["hits"] += 1
            return entry[0]
        try:
            f = opener()
        except OSError as e:
            self.stats["unreadable"] += 1
            log.debug("cannot open ELF file %r: %s", key, e)
            return self._put(key, None, now + UNREADABLE_RETRY_S)
        with f:
            try:
                symbols = read_elf(f)
            except ElfError as e:
                self.stats["skipped"] += 1
                self._log_once(key, logging.WARNING, "skipping ELF file %r: %s", key, e)
                return self._put(key, None, math.inf)
        self.stats["parsed"] += 1
        return self._put(key, symbols, math.inf)

    def _put(self, key: Hashable, value: ElfSymbols | None, expiry: float) -> ElfSymbols | None:
        self._entries[key] = (value, expiry)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
            self.stats["evicted"] += 1
        return value


class _Reader:
    """Checked reads of exact byte ranges inside the file."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.size = f.seek(0, os.SEEK_END)
        if self.size > MAX_FILE_BYTES:
            raise ElfError(f"file of {self.size} bytes is larger than {MAX_FILE_BYTES}")

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


class _StringTable:
    """Names from one string table, read through a window; cheapest when asked in offset order."""

    def __init__(self, r: _Reader, offset: int, size: int) -> None:
        r.check(offset, size, "string table")
        self._r, self._offset, self._size = r, offset, size
        self._at, self._window = 0, b""

    def name(self, at: int) -> bytes:
        if at >= self._size:
            raise ElfError("symbol name: outside its string table")
        end = min(at + MAX_SYMBOL_NAME_BYTES, self._size)
        if at < self._at or end > self._at + len(self._window):
            self._at = at
            self._window = self._r.read(self._offset + at, min(_STRTAB_WINDOW, self._size - at), "string table")
        return self._window[at - self._at:end - self._at].split(b"\0", 1)[0]


def _parse(f: BinaryIO) -> ElfSymbols:
    r = _Reader(f)
    head = r.read(0, min(r.size, _EHDR.size), "ELF header")
    if not head.startswith(b"\x7fELF"):
        raise ElfError("not an ELF file")
    if len(head) < _EHDR.size:
        raise ElfError("truncated ELF header")
    if head[4] != _ELFCLASS64 or head[5] != _ELFDATA2LSB:
        raise ElfError("not a 64-bit little-endian ELF file")
    (_, e_type, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = _EHDR.unpack(head)
    if e_type not in (_ET_EXEC, _ET_DYN):
        raise ElfError(f"ELF type {e_type} is not an executable or shared object")
    if phnum > MAX_PROGRAM_HEADERS:
        raise ElfError(f"{phnum} program headers, more than {MAX_PROGRAM_HEADERS}")
    if shnum > MAX_SECTION_HEADERS:
        raise ElfError(f"{shnum} section headers, more than {MAX_SECTION_HEADERS}")
    if (phnum and phentsize != _PHDR.size) or (shnum and shentsize != _SHDR.size):
        raise ElfError("unexpected program or section header size")

    phdrs = list(_PHDR.iter_unpack(r.read(phoff, phnum * _PHDR.size, "program headers"))) if phnum else []
    loads = tuple(sorted((p[2], p[5], p[3]) for p in phdrs if p[0] == _PT_LOAD and p[5]))
    build_id = ""
    for p_type, _, p_offset, _, _, p_filesz, _, p_align in phdrs:
        if p_type == _PT_NOTE and 0 < p_filesz <= MAX_NOTE_BYTES:
            build_id = _build_id(r.read(p_offset, p_filesz, "note segment"), 8 if p_align == 8 else 4)
            if build_id:
                break

    # e_shnum 0 with extended numbering (>= 65280 sections) reads as no sections: no symbols.
    shdrs = list(_SHDR.iter_unpack(r.read(shoff, shnum * _SHDR.size, "section headers"))) if shnum else []
    symbols: list[tuple[int, int, int, bytes]] = []  # (value, preference, size, name)
    name_room = MAX_SYMBOL_NAME_TOTAL_BYTES
    for table_rank, sh_type in enumerate((_SHT_SYMTAB, _SHT_DYNSYM)):  # .symtab names preferred
        known = {s[0] for s in symbols}  # .dynsym repeats the global symbols of .symtab
        for sh in shdrs:
            if sh[1] == sh_type:
                name_room -= _read_symbol_table(r, shdrs, sh, table_rank * 3, known, symbols, name_room)
    return _build(build_id, loads, phdrs, symbols)


def _build_id(notes: bytes, align: int) -> str:
    pos = 0
    while pos + _NOTE.size <= len(notes):
        namesz, descsz, n_type = _NOTE.unpack_from(notes, pos)
        desc = _align_up(pos + _NOTE.size + namesz, align)
        end = desc + descsz
        if end > len(notes):
            break
        name = notes[pos + _NOTE.size:pos + _NOTE.size + namesz]
        if n_type == _NT_GNU_BUILD_ID and name == b"GNU\0" and 0 < descsz <= MAX_BUILD_ID_BYTES:
            return notes[desc:end].hex()
        pos = _align_up(end, align)
    return ""


def _align_up(n: int, align: int) -> int:
    return (n + align - 1) & -align


def _read_symbol_table(r: _Reader, shdrs: list[tuple[int, ...]], sh: tuple[int, ...], rank: int,
                       known: set[int], out: list[tuple[int, int, int, bytes]], name_room: int) -> int:
    """Append the function symbols of one table to `out`, except at `known` addresses;
    return the name bytes used."""
    offset, size, link, entsize = sh[4], sh[5], sh[6], sh[9]
    if entsize != _SYM.size:
        raise ElfError("unexpected symbol entry size")
    if link >= len(shdrs) or shdrs[link][1] != _SHT_STRTAB:
        raise ElfError("symbol table without a string table")
    r.check(offset, size, "symbol table")
    strings = _StringTable(r, shdrs[link][4], shdrs[link][5])

    found: list[tuple[int, int, int, int]] = []  # (name offset, value, size, preference)
    count, room = size // _SYM.size, MAX_SYMBOLS - len(out)
    for first in range(0, count, _SYM_CHUNK):
        if len(found) >= room:
            break
        chunk = r.read(offset + first * _SYM.size, min(_SYM_CHUNK, count - first) * _SYM.size, "symbols")
        for st_name, info, _, shndx, value, st_size in _SYM.iter_unpack(chunk):
            if info & 0xF in (_STT_FUNC, _STT_GNU_IFUNC) and value and shndx and st_name and value not in known:
                found.append((st_name, value, st_size, rank + _BIND_RANK.get(info >> 4, 2)))
    del found[room:]

    found.sort()  # string table order: the window reads it front to back
    used = 0
    for st_name, value, st_size, preference in found:
        name = strings.name(st_name)
        used += len(name)
        if used > name_room:
            break
        if name:
            out.append((value, preference, st_size, name))
    return used


def _build(build_id: str, loads: tuple[tuple[int, int, int], ...], phdrs: list[tuple[int, ...]],
           symbols: list[tuple[int, int, int, bytes]]) -> ElfSymbols:
    symbols.sort()
    starts, ends, names = array("Q"), array("Q"), []
    for value, _, size, name in symbols:
        if starts and starts[-1] == value:
            continue  # an alias with a less preferred name
        starts.append(value)
        ends.append(min(value + size, _U64_MAX) if size else 0)
        names.append(name.decode("utf-8", "replace"))
    # A size-0 symbol covers up to the next one; the last, up to the end of its segment.
    for i, end in enumerate(ends):
        if end == 0:
            if i + 1 < len(starts):
                ends[i] = starts[i + 1]
            else:
                ends[i] = next((min(p[3] + p[6], _U64_MAX) for p in phdrs
                                if p[0] == _PT_LOAD and p[3] <= starts[i] < p[3] + p[6]), starts[i])
    return ElfSymbols(build_id, loads, starts, ends, tuple(names))
