"""Build ids and function symbols of the ELF files mapped by profiled processes.

Owns: turning one ELF file object into an ElfSymbols (GNU build id, PT_LOAD
layout, function symbols of .symtab and .dynsym, and whether a .symtab gave
any) that maps a file offset -- the profiler's module-relative address -- to a
function name; and ElfCache, a bounded LRU of those per file identity or build
id, in which failures (and files the caller's check rejects) are cached,
logged once and counted.

A separate debug file (objcopy --only-keep-debug: a .symtab, SHT_NOBITS code,
PT_LOADs whose p_filesz is 0) is read the same way; its symbols have the
module's virtual addresses, so the caller maps a module file offset to an
address with the module's ElfSymbols (address_of) and names it with the
debug file's (function_at_address).

Input is untrusted: a profiled process can map any file it likes. pyelftools
(ELFFile and its ELFStructs) parses the structures: the ELF header, program
and section headers, note headers, and the layout and decoding of symbol
entries. Its convenience paths are not safe on hostile files, so we never call
them: get_section/iter_sections read each section name as a C string up to the
end of the file, iter_segments builds a DynamicSegment that walks every
section, num_sections/num_segments follow extended numbering to sizes the file
claims, iter_notes reads a note at whatever size it claims, and iter_symbols
reads names the same way as section names and parses one construct object per
symbol (~30 us each: for node's 185k symbols, longer than the whole budget).
What we do ourselves, each bounded by a cap below:
- the byte reads: ELFFile's constructor reads only e_ident and the fixed-size
  header; every header field is checked (type, counts under the caps, entry
  sizes equal to pyelftools' struct sizes, tables inside the file) before any
  table is read, and then each table, note segment, symbol chunk and string
  table window is one exact, bounds-checked read parsed with elffile.structs;
- the note walk over a PT_NOTE segment read whole (under MAX_NOTE_BYTES),
  honouring its 4- or 8-byte alignment, with Elf_Nhdr decoding each header;
- symbol entries in bulk, by a struct.Struct laid out from pyelftools' Elf_Sym
  fields, with pyelftools decoding each distinct st_info/st_shndx value once;
- symbol names, through a bounded window on the string table, cut to
  MAX_SYMBOL_NAME_BYTES, and made strings by the process-string rule
  (shared/safestr.process_string: escaped, no control characters).
Parsing runs under time_budget(ELF_PARSE_SECONDS) and every failure becomes
ElfError. Only 64-bit little-endian ELF is read (x86-64 and arm64); anything
else is an ElfError.

Must not: open files by path, follow anything outside the file object it is
given (debuglink, build-id directories, DWARF links), or read a whole file into
memory. Finding a module's debug file is frames.py's, through the collector's
file broker; here it is one more file object.
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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, BinaryIO

from elftools.construct.core import Construct, FormatField, Struct
from elftools.elf.elffile import ELFFile

from shared.log import LogOnce
from shared.safestr import process_string
from symbolizer.files import ProcessGone
from symbolizer.limits import BudgetExceeded, time_budget

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

_SYM_CHUNK = 4096  # symbol entries per read
_STRTAB_WINDOW = 64 << 10  # string table bytes per read; must be >= MAX_SYMBOL_NAME_BYTES

# Names as pyelftools decodes them. It names type 10, STT_GNU_IFUNC, by its range: STT_LOOS.
_FUNCTION_TYPES = frozenset(("STT_FUNC", "STT_LOOS"))
_BIND_RANK = {"STB_GLOBAL": 0, "STB_WEAK": 1}  # among aliases of one address: global, weak, then the rest
_U64_MAX = (1 << 64) - 1


class ElfError(Exception):
    """A file that is not usable: malformed, unsupported, oversized or too slow to parse."""


@dataclass(frozen=True)
class ElfSymbols:
    """What the symbolizer needs of one ELF file. Equality and hash use build id and layout."""

    build_id: str  # lowercase hex of NT_GNU_BUILD_ID, "" if none
    has_symtab: bool = field(compare=False)  # a .symtab gave function names; else .dynsym's (exported) only
    _loads: tuple[tuple[int, int, int], ...] = field(repr=False)  # (p_offset, p_filesz, p_vaddr) by offset
    _segments: tuple[tuple[int, int], ...] = field(repr=False, compare=False)  # (p_vaddr, p_memsz), sorted
    _starts: array = field(repr=False, compare=False)  # sorted function start addresses ("Q")
    _ends: array = field(repr=False, compare=False)  # exclusive end of each ("Q")
    _names: tuple[str, ...] = field(repr=False, compare=False)

    def function_at(self, file_offset: int) -> str | None:
        """The function containing `file_offset` (a module-relative address), else None."""
        address = self.address_of(file_offset)
        return None if address is None else self.function_at_address(address)

    def address_of(self, file_offset: int) -> int | None:
        """The virtual address `file_offset` is loaded at (by this file's PT_LOADs), else None."""
        for offset, filesz, vaddr in self._loads:
            if offset <= file_offset < offset + filesz:
                return file_offset - offset + vaddr
        return None

    def loads_like(self, other: ElfSymbols) -> bool:
        """Whether `other` has the same PT_LOAD address ranges (p_vaddr, p_memsz): true of a
        module and its separate debug file, whose p_offset and p_filesz differ."""
        return self._segments == other._segments

    def function_at_address(self, address: int) -> str | None:
        """The function containing virtual address `address`, else None."""
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
    except Exception as e:  # anything a hostile file can provoke: construct, struct, Memory, Recursion, OS errors
        over = _budget_exceeded(e)
        raise ElfError(str(over) if over else f"{type(e).__name__}: {e}"[:200]) from None


def _budget_exceeded(e: BaseException) -> BudgetExceeded | None:
    """The BudgetExceeded behind `e`: construct re-raises whatever interrupts a field parse as a FieldError."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, BudgetExceeded):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


class ElfCache:
    """Bounded LRU of read_elf results by the caller's key (file identity or build id).

    A file that fails to parse is cached as None, so it is parsed, logged and
    counted once. A file the opener cannot open counts as "unreadable" and is
    tried again after UNREADABLE_RETRY_S; one it could not open because the process it
    asked through had exited (ProcessGone) is not remembered at all: the file is keyed by
    its identity, and the next process that maps it opens it. get() closes the file the
    opener returns.
    """

    def __init__(self, max_entries: int = ELF_CACHE_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[ElfSymbols | None, float]] = OrderedDict()  # value, expiry
        self._log_once = LogOnce(log)
        self.stats: dict[str, int] = dict.fromkeys(
            ("parsed", "skipped", "unreadable", "rejected", "hits", "evicted"), 0
        )

    def get(
        self,
        key: Hashable,
        opener: Callable[[], BinaryIO],
        now: float | None = None,
        check: Callable[[ElfSymbols], str] | None = None,
    ) -> ElfSymbols | None:
        """Symbols of the file `key` names; `opener` is called only on a miss. None: unusable.

        `check`, if given, sees a freshly parsed file and returns why it must not be
        used ("" if it may): such a file is cached as None, counted as "rejected"
        and logged once."""
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
            if isinstance(e, ProcessGone):  # the next process that maps the file opens it
                return None
            return self._put(key, None, now + UNREADABLE_RETRY_S)
        with f:
            try:
                symbols = read_elf(f)
            except ElfError as e:
                self.stats["skipped"] += 1
                self._log_once(key, logging.WARNING, "skipping ELF file %r: %s", key, e)
                return self._put(key, None, math.inf)
        self.stats["parsed"] += 1
        reason = check(symbols) if check is not None else ""
        if reason:
            self.stats["rejected"] += 1
            self._log_once(key, logging.WARNING, "ignoring ELF file %r: %s", key, reason)
            return self._put(key, None, math.inf)
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
        return self._window[at - self._at : end - self._at].split(b"\0", 1)[0]


class _Decoded(dict):
    """Raw bytes -> then(what a pyelftools construct parses them to), worked out once per distinct value."""

    def __init__(self, con: Construct, then: Callable[[Any], Any]) -> None:
        super().__init__()
        self._con, self._then = con, then

    def __missing__(self, raw: bytes) -> Any:
        value = self[raw] = self._then(self._con.parse(raw))
        return value


class _SymbolLayout:
    """pyelftools' Elf_Sym as a struct.Struct, for decoding symbol tables in bulk.

    The format is laid out from Elf_Sym's own fields (order, widths, byte
    order). Fields construct decodes beyond a number (st_info's bit fields, the
    st_shndx enum) are unpacked as raw bytes; decoded(name, then) maps those
    to then(construct's result), parsing each distinct value once.
    """

    def __init__(self, con: Struct, little_endian: bool) -> None:
        byte_order = "<" if little_endian else ">"
        formats: list[str] = []
        self.index: dict[str, int] = {}
        self._subcons: dict[str, Construct] = {}
        for i, sub in enumerate(con.subcons):
            if sub.name is None:  # every field of Elf_Sym is named
                raise ElfError("symbol entry field without a name")
            if isinstance(sub, FormatField):
                if sub.packer.format[0] != byte_order:
                    raise ElfError("symbol entry fields of mixed byte order")
                formats.append(sub.packer.format[1:])
            else:
                formats.append(f"{sub.sizeof()}s")
                self._subcons[sub.name] = sub
            self.index[sub.name] = i
        self.struct = struct.Struct(byte_order + "".join(formats))
        if self.struct.size != con.sizeof():
            raise ElfError("symbol entry layout does not match its size")

    def decoded(self, name: str, then: Callable[[Any], Any]) -> _Decoded:
        return _Decoded(self._subcons[name], then)


def _table(r: _Reader, con: Construct, offset: int, count: int, entsize: int, cap: int, what: str) -> list[Any]:
    """Parse `count` entries of `con` at `offset`, after checking count, entry size and bounds."""
    if count > cap:
        raise ElfError(f"{count} {what}, more than {cap}")
    if not count:
        return []
    size = con.sizeof()
    if entsize != size:
        raise ElfError(f"{what}: entries of {entsize} bytes, expected {size}")
    data = r.read(offset, count * size, what)
    return [con.parse(data[i : i + size]) for i in range(0, len(data), size)]


def _parse(f: BinaryIO) -> ElfSymbols:
    r = _Reader(f)
    if r.read(0, min(r.size, 4), "ELF header") != b"\x7fELF":
        raise ElfError("not an ELF file")
    elffile = ELFFile(f)  # reads e_ident and the fixed-size header only; nothing below follows it unchecked
    if elffile.elfclass != 64 or not elffile.little_endian:
        raise ElfError("not a 64-bit little-endian ELF file")
    h, structs = elffile.header, elffile.structs
    if h.e_type not in ("ET_EXEC", "ET_DYN"):
        raise ElfError(f"ELF type {h.e_type} is not an executable or shared object")
    # e_phnum 0xffff (PN_XNUM) is over the cap; e_shnum 0 (extended numbering, >= 65280 sections)
    # reads as no sections, so no symbols: pyelftools would read either count from section 0.
    if h.e_phnum > MAX_PROGRAM_HEADERS:
        raise ElfError(f"{h.e_phnum} program headers, more than {MAX_PROGRAM_HEADERS}")
    shnum = h.e_shnum if h.e_shoff else 0
    if shnum > MAX_SECTION_HEADERS:
        raise ElfError(f"{shnum} section headers, more than {MAX_SECTION_HEADERS}")
    phdrs = _table(r, structs.Elf_Phdr, h.e_phoff, h.e_phnum, h.e_phentsize, MAX_PROGRAM_HEADERS, "program headers")
    shdrs = _table(r, structs.Elf_Shdr, h.e_shoff, shnum, h.e_shentsize, MAX_SECTION_HEADERS, "section headers")

    segments = [p for p in phdrs if p.p_type == "PT_LOAD"]
    loads = tuple(sorted((p.p_offset, p.p_filesz, p.p_vaddr) for p in segments if p.p_filesz))
    build_id = ""
    for p in phdrs:
        if p.p_type == "PT_NOTE" and 0 < p.p_filesz <= MAX_NOTE_BYTES:
            notes = r.read(p.p_offset, p.p_filesz, "note segment")
            build_id = _build_id(structs.Elf_Nhdr, notes, 8 if p.p_align == 8 else 4)
            if build_id:
                break

    symbols: list[tuple[int, int, int, bytes]] = []  # (value, preference, size, name)
    has_symtab = False
    tables = [sh for sh in shdrs if sh.sh_type in ("SHT_SYMTAB", "SHT_DYNSYM")]
    if tables:
        layout = _SymbolLayout(structs.Elf_Sym, elffile.little_endian)
        name_room = MAX_SYMBOL_NAME_TOTAL_BYTES
        for table_rank, sh_type in enumerate(("SHT_SYMTAB", "SHT_DYNSYM")):  # .symtab names preferred
            known = {s[0] for s in symbols}  # .dynsym repeats the global symbols of .symtab
            for sh in tables:
                if sh.sh_type == sh_type:
                    name_room -= _read_symbol_table(r, layout, shdrs, sh, table_rank * 3, known, symbols, name_room)
            if sh_type == "SHT_SYMTAB":
                has_symtab = bool(symbols)
    return _build(build_id, has_symtab, loads, [(p.p_vaddr, p.p_memsz) for p in segments], symbols)


def _build_id(nhdr: Construct, notes: bytes, align: int) -> str:
    """The NT_GNU_BUILD_ID of a note segment read whole; "" if none or a note runs past its end."""
    header = nhdr.sizeof()
    pos = 0
    while pos + header <= len(notes):
        note = nhdr.parse(notes[pos : pos + header])
        name = notes[pos + header : pos + header + note.n_namesz]
        desc = _align_up(pos + header + note.n_namesz, align)
        end = desc + note.n_descsz
        if end > len(notes):
            break
        if note.n_type == "NT_GNU_BUILD_ID" and name == b"GNU\0" and 0 < note.n_descsz <= MAX_BUILD_ID_BYTES:
            return notes[desc:end].hex()
        pos = _align_up(end, align)
    return ""


def _align_up(n: int, align: int) -> int:
    return (n + align - 1) & -align


def _read_symbol_table(
    r: _Reader,
    layout: _SymbolLayout,
    shdrs: list[Any],
    sh: Any,
    rank: int,
    known: set[int],
    out: list[tuple[int, int, int, bytes]],
    name_room: int,
) -> int:
    """Append the function symbols of one table to `out`, except at `known` addresses;
    return the name bytes used."""
    entsize = layout.struct.size
    if sh.sh_entsize != entsize:
        raise ElfError("unexpected symbol entry size")
    if sh.sh_link >= len(shdrs) or shdrs[sh.sh_link].sh_type != "SHT_STRTAB":
        raise ElfError("symbol table without a string table")
    r.check(sh.sh_offset, sh.sh_size, "symbol table")
    strings = _StringTable(r, shdrs[sh.sh_link].sh_offset, shdrs[sh.sh_link].sh_size)

    fields = itemgetter(*(layout.index[k] for k in ("st_name", "st_info", "st_shndx", "st_value", "st_size")))
    # st_info -> preference among aliases if a function symbol, else None; st_shndx -> defined here
    preferences = layout.decoded(
        "st_info", lambda info: rank + _BIND_RANK.get(info.bind, 2) if info.type in _FUNCTION_TYPES else None
    )
    defined = layout.decoded("st_shndx", lambda shndx: shndx != "SHN_UNDEF")
    found: list[tuple[int, int, int, int]] = []  # (name offset, value, size, preference)
    count, room = sh.sh_size // entsize, MAX_SYMBOLS - len(out)
    for first in range(0, count, _SYM_CHUNK):
        if len(found) >= room:
            break
        chunk = r.read(sh.sh_offset + first * entsize, min(_SYM_CHUNK, count - first) * entsize, "symbols")
        for st_name, info, shndx, value, st_size in map(fields, layout.struct.iter_unpack(chunk)):
            preference = preferences[info]
            if preference is not None and value and st_name and value not in known and defined[shndx]:
                found.append((st_name, value, st_size, preference))
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


def _build(
    build_id: str,
    has_symtab: bool,
    loads: tuple[tuple[int, int, int], ...],
    segments: list[tuple[int, int]],
    symbols: list[tuple[int, int, int, bytes]],
) -> ElfSymbols:
    """`segments`: (p_vaddr, p_memsz) of each PT_LOAD."""
    symbols.sort()
    starts, ends, names = array("Q"), array("Q"), []
    for value, _, size, name in symbols:
        if starts and starts[-1] == value:
            continue  # an alias with a less preferred name
        starts.append(value)
        ends.append(min(value + size, _U64_MAX) if size else 0)
        names.append(process_string(name))
    # A size-0 symbol covers up to the next one; the last, up to the end of its segment.
    for i, end in enumerate(ends):
        if end == 0:
            if i + 1 < len(starts):
                ends[i] = starts[i + 1]
            else:
                ends[i] = next(
                    (min(vaddr + memsz, _U64_MAX) for vaddr, memsz in segments if vaddr <= starts[i] < vaddr + memsz),
                    starts[i],
                )
    return ElfSymbols(build_id, has_symtab, loads, tuple(sorted(segments)), starts, ends, tuple(names))
