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

Input is untrusted: a profiled process can map any file it likes. The file is
read through shared/elf.py, the one bounded ELF reader (ELF header, program
and section header tables, the build id note, string tables, symbol entries),
each structure checked against its cap and the file's size before one exact
read; MAX_FILE_BYTES bounds every offset. What is this module's:
- which symbols name functions (STT_FUNC and STT_GNU_IFUNC, defined, with a
  value and a name), decoded in bulk from each chunk of entries (struct
  iter_unpack, the preference of each st_info byte worked out once);
- caps on what is kept: MAX_SYMBOLS entries, names cut to
  MAX_SYMBOL_NAME_BYTES (read in string table order through a window),
  MAX_SYMBOL_NAME_TOTAL_BYTES of names in all, made strings by the
  process-string rule (shared/safestr.process_string: escaped, no control
  characters).
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
import time
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import BinaryIO

from shared import elf as shared_elf
from shared.elf import (
    MAX_BUILD_ID_BYTES,
    MAX_NOTE_BYTES,
    MAX_PROGRAM_HEADERS,
    MAX_SECTION_HEADERS,
    SYM,
    ElfError,
    Reader,
    SectionHeader,
    StringTable,
)
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
# The header and note caps are shared/elf.py's (MAX_PROGRAM_HEADERS, MAX_SECTION_HEADERS,
# MAX_NOTE_BYTES, MAX_BUILD_ID_BYTES), re-exported here with ElfError for this module's users.
__all__ = [
    "ELF_CACHE_ENTRIES",
    "ELF_PARSE_SECONDS",
    "MAX_BUILD_ID_BYTES",
    "MAX_FILE_BYTES",
    "MAX_NOTE_BYTES",
    "MAX_PROGRAM_HEADERS",
    "MAX_SECTION_HEADERS",
    "MAX_SYMBOLS",
    "MAX_SYMBOL_NAME_BYTES",
    "MAX_SYMBOL_NAME_TOTAL_BYTES",
    "UNREADABLE_RETRY_S",
    "ElfCache",
    "ElfError",
    "ElfSymbols",
    "read_elf",
]
# Wall-clock budget for parsing one file; node, the largest binary on a typical host, takes ~0.5 s.
ELF_PARSE_SECONDS = 5.0
# Parsed files kept by ElfCache (a libc-sized entry is ~0.3 MB).
ELF_CACHE_ENTRIES = 256
# A file that could not be opened (process exited, fd raced) may be tried again after this.
UNREADABLE_RETRY_S = 60.0

# Functions whose compiler-split parts are recovered from a file without a .symtab, named NAME.cold as
# GCC's .symtab names them: symbolizer/pystacks.py puts Python frames in place of this function's frames,
# and Debian's PGO builds of CPython 3.13-3.15 run the eval loop in a part split away from the exported
# symbol (python3.14: 1,184 bytes exported, an 84 KB part elsewhere, entered by jumps alone).
SPLIT_FUNCTIONS = (b"_PyEval_EvalFrameDefault",)
# Bytes of such a function scanned for its jumps into a split part (CPython's exported parts: 0.8-55 KB).
MAX_SPLIT_SCAN_BYTES = 256 << 10
_EM_X86_64 = 62
_SYM_CHUNK = 4096  # symbol entries per read
_STRTAB_WINDOW = 64 << 10  # string table bytes per read; must be >= MAX_SYMBOL_NAME_BYTES

_FUNCTION_TYPES = frozenset((shared_elf.STT_FUNC, shared_elf.STT_GNU_IFUNC))
# Among aliases of one address: global, weak, then the rest.
_BIND_RANK = {shared_elf.STB_GLOBAL: 0, shared_elf.STB_WEAK: 1}
_U64_MAX = (1 << 64) - 1


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
    except Exception as e:  # anything a hostile file can provoke: struct, Memory, Recursion, OS errors
        over = shared_elf.caused_by(e, BudgetExceeded)
        raise ElfError(str(over) if over else f"{type(e).__name__}: {e}"[:200]) from None


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


def _parse(f: BinaryIO) -> ElfSymbols:
    r = Reader(f, MAX_FILE_BYTES)
    h = shared_elf.read_header(r)
    if h.e_type not in (shared_elf.ET_EXEC, shared_elf.ET_DYN):
        raise ElfError(f"ELF type {h.e_type} is not an executable or shared object")
    phdrs = shared_elf.program_headers(r, h)
    shdrs = shared_elf.section_headers(r, h)
    segments = [p for p in phdrs if p.p_type == shared_elf.PT_LOAD]
    loads = tuple(sorted((p.p_offset, p.p_filesz, p.p_vaddr) for p in segments if p.p_filesz))
    build_id = shared_elf.build_id(r, phdrs)

    symbols: list[tuple[int, int, int, bytes]] = []  # (value, preference, size, name)
    has_symtab = False
    tables = [sh for sh in shdrs if sh.sh_type in (shared_elf.SHT_SYMTAB, shared_elf.SHT_DYNSYM)]
    name_room = MAX_SYMBOL_NAME_TOTAL_BYTES
    for table_rank, sh_type in enumerate((shared_elf.SHT_SYMTAB, shared_elf.SHT_DYNSYM)):  # .symtab names preferred
        known = {s[0] for s in symbols}  # .dynsym repeats the global symbols of .symtab
        for sh in tables:
            if sh.sh_type == sh_type:
                name_room -= _read_symbol_table(r, shdrs, sh, table_rank * 3, known, symbols, name_room)
        if sh_type == shared_elf.SHT_SYMTAB:
            has_symtab = bool(symbols)
    if not has_symtab and h.e_machine == _EM_X86_64:
        symbols.extend(_split_parts(f, r, loads, symbols))
    return _build(build_id, has_symtab, loads, [(p.p_vaddr, p.p_memsz) for p in segments], symbols)


def _split_parts(
    f: BinaryIO, r: Reader, loads: tuple[tuple[int, int, int], ...], symbols: list[tuple[int, int, int, bytes]]
) -> list[tuple[int, int, int, bytes]]:
    """Symbols NAME.cold for the parts of each SPLIT_FUNCTIONS function a stripped x86-64 file holds: the
    FDEs (.eh_frame) that begin exactly where a direct jump of the function (jmp or jcc, rel32) lands and
    where no symbol begins. A split part is entered by jumps, not calls; a function it calls begins at a
    symbol. The bytes are scanned, not decoded: a false match must hit an FDE's first byte exactly."""
    wanted = [(value, size, name) for value, _, size, name in symbols if name in SPLIT_FUNCTIONS and size]
    if not wanted:
        return []
    from symbolizer import cfi  # here, not at the top: cfi takes its caps from this module

    try:
        fdes = cfi.fde_ranges(f, cfi.read_module(f))
    except cfi.CfiError:
        return []
    starts = {value for value, *_ in symbols}
    unnamed = {begin: end for begin, end in fdes if begin not in starts}
    out: list[tuple[int, int, int, bytes]] = []
    for value, size, name in wanted:
        offset = next((o + value - v for o, n, v in loads if v <= value < v + n), None)
        if offset is None:
            continue
        code = r.read(offset, min(size, MAX_SPLIT_SCAN_BYTES), "a split function")
        out.extend((t, 0, unnamed[t] - t, name + b".cold") for t in sorted(_jump_targets(code, value) & unnamed.keys()))
    return out


def _jump_targets(code: bytes, address: int) -> set[int]:
    """Where every rel32 jmp (E9) and jcc (0F 80-8F) found in `code`, loaded at `address`, would land."""
    out: set[int] = set()
    for i in range(len(code) - 4):
        if code[i] == 0xE9:
            n = 1
        elif code[i] == 0x0F and 0x80 <= code[i + 1] <= 0x8F:
            n = 2
        else:
            continue
        if i + n + 4 <= len(code):
            out.add(address + i + n + 4 + int.from_bytes(code[i + n : i + n + 4], "little", signed=True))
    return out


def _preferences(rank: int) -> list[int | None]:
    """st_info → the preference among aliases of a function symbol of a table of `rank`, else None."""
    return [rank + _BIND_RANK.get(info >> 4, 2) if info & 0xF in _FUNCTION_TYPES else None for info in range(256)]


def _read_symbol_table(
    r: Reader,
    shdrs: list[SectionHeader],
    sh: SectionHeader,
    rank: int,
    known: set[int],
    out: list[tuple[int, int, int, bytes]],
    name_room: int,
) -> int:
    """Append the function symbols of one table to `out`, except at `known` addresses;
    return the name bytes used."""
    strtab = shared_elf.linked_strings(shdrs, sh)
    r.check(sh.sh_offset, sh.sh_size, "symbol table")
    strings = StringTable(r, strtab.sh_offset, strtab.sh_size, MAX_SYMBOL_NAME_BYTES, _STRTAB_WINDOW)
    preferences = _preferences(rank)
    found: list[tuple[int, int, int, int]] = []  # (name offset, value, size, preference)
    room = MAX_SYMBOLS - len(out)
    for chunk in shared_elf.symbol_chunks(r, sh, _SYM_CHUNK):
        if len(found) >= room:
            break
        for st_name, info, _other, shndx, value, st_size in SYM.iter_unpack(chunk):
            preference = preferences[info]
            if preference is not None and value and st_name and value not in known and shndx != shared_elf.SHN_UNDEF:
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
