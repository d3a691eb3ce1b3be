"""Ruby 3.3 and 3.4 (4.0's layout as data): the plug-in.

Owns: detection (runtimes/runtime.py's contract): a process is Ruby's when
it maps libruby-X.Y.so (Debian's, and any --enable-shared build); the version
from the file's name, checked against ruby_version in memory; then the VM:
- ruby_current_vm_ptr when the file exports it (or its .symtab has it);
- else (Debian's libruby 3.3 and 3.4 hide it and strip .symtab) a scan of
  libruby's writable data and the .bss after it for a pointer to a structure
  whose main thread points back to it and to its main ractor, and whose
  execution context's frame lies inside its VM stack; exactly one such
  pointer must be found. Its place in the file is kept per file (by file
  identity), so the next process of the same libruby is checked, not
  scanned;
- else a Refusal with the reason.
Then the VM's global symbol table (ruby_global_symbols: the names of C
functions' methods), the same way: the symbol if the file has one; else a
scan of the same data for an rb_symbols_t (last_id past the operators' IDs,
two heap pointers) whose lookup names the one-character operators' serials
as Init_op_tbl registers them ("+", "~"); exactly one must pass, and its
place is kept per file too. None found is no refusal: the reader leaves C
functions' frames out, counted.
Ruby 3.2 and older (Debian bookworm's 3.1) are refused with the reason.

Must not: walk frames (reader.py does), or log.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from runtimes import elfsyms
from runtimes.memory import MemoryReadError, ProcessMemory
from runtimes.ruby.layouts import LAYOUTS, Layout
from runtimes.ruby.reader import MAX_SYMBOL_SERIAL, Iseqs, RubyProcess, Symbols
from runtimes.runtime import (
    Mapping,
    ProcessContext,
    Refusal,
    first_mappings,
    mapped_file_facts,
)
from shared.runtime_registry import RuntimeSpec, spec_of

SPEC: RuntimeSpec = spec_of("ruby")

# Bytes of libruby's writable data and .bss scanned for the VM (3.3's are ~85 KB).
MAX_SCAN_BYTES = 4 << 20
# Candidate pointers checked per scan (each a read of 48 bytes, batched).
MAX_CANDIDATES = 65536
# ruby_version is "3.3.8".
MAX_VERSION_CHARS = 16

_NAME = re.compile(r"^libruby(-(\d+)\.(\d+))?\.so(\.(\d+)\.(\d+)[.\d]*)?$")
SYMBOLS = ("ruby_current_vm_ptr", "ruby_version", "ruby_global_symbols")
# Serials of one-character operators, registered under their own character (symbol.c's Init_op_tbl): a
# symbol table must name them so.
KNOWN_SERIALS = {ord("+"): "+", ord("~"): "~"}
_Q = struct.Struct("<Q")


@dataclass
class FileFacts:
    elf: elfsyms.ElfInfo
    vm_place: int | None = None  # link-time address of the VM pointer a scan found (no symbol for it)
    symbols_place: int | None = None  # link-time address of ruby_global_symbols a scan found


def _version(base: str) -> tuple[int, int] | None:
    m = _NAME.match(base)
    if not m:
        return None
    if m.group(2):
        return int(m.group(2)), int(m.group(3))
    if m.group(5):
        return int(m.group(5)), int(m.group(6))
    return None


class Ruby:
    spec = SPEC

    def detect(self, process: ProcessContext) -> RubyProcess | Refusal | None:
        mods = first_mappings(process.mappings, lambda base: bool(_NAME.match(base)))
        if not mods:
            return None
        mod = next(iter(mods.values()))
        ver = _version(mod.path.rsplit("/", 1)[-1])
        if ver is None:
            return Refusal(f"{mod.path}: no version in the library's name")
        where = f"{mod.path} (Ruby {ver[0]}.{ver[1]})"
        layout = LAYOUTS.get(ver)
        if layout is None:
            return Refusal(
                f"{where}: Ruby {ver[0]}.{ver[1]} is not supported (3.3 and 3.4 are; 4.0's layout is data only)"
            )
        facts = mapped_file_facts(process, mod, "ruby", lambda f: FileFacts(elfsyms.read_symbols(f, SYMBOLS)), where)
        if isinstance(facts, Refusal):
            return facts
        elf = facts.elf
        bias = elf.load_bias(mod.start, mod.offset)
        mem = process.mem
        if "ruby_version" in elf.symbols:
            raw = mem.read(elf.symbols["ruby_version"] + bias, MAX_VERSION_CHARS)
            text = raw.split(b"\0", 1)[0].decode("ascii", "replace")
            if not text.startswith(f"{ver[0]}.{ver[1]}."):
                return Refusal(f"{where}: self-check failed: ruby_version in memory is {text!r}")
            version = text
        else:
            version = f"{ver[0]}.{ver[1]}"
        if "ruby_current_vm_ptr" in elf.symbols:
            vm = mem.u64(elf.symbols["ruby_current_vm_ptr"] + bias)
            if not _valid_vm(mem, layout, vm):
                return Refusal(
                    f"{where}: self-check failed: ruby_current_vm_ptr does not point at a VM whose "
                    f"main thread points back"
                )
            return RubyProcess(version, layout, vm, _symbols(process, mod, layout, facts, bias))
        if facts.vm_place is not None:
            vm = mem.u64(facts.vm_place + bias)
            if _valid_vm(mem, layout, vm):
                return RubyProcess(version, layout, vm, _symbols(process, mod, layout, facts, bias))
        found = _scan(process, mod, layout)
        if len(found) != 1:
            return Refusal(
                f"{where}: no ruby_current_vm_ptr symbol (hidden, .symtab stripped), and a scan of "
                f"its writable data found {len(found)} VM candidates, not one"
            )
        at, vm = found[0]
        facts.vm_place = at - bias
        return RubyProcess(version, layout, vm, _symbols(process, mod, layout, facts, bias))

    def stop(self) -> list[str]:
        """Nothing to undo: detect asks nothing of a process, only reads it."""
        return []

    def counters(self) -> dict[str, int]:
        """No checks of its own (its refusals are counted by the reader, by kind)."""
        return {}


def _valid_vm(mem: ProcessMemory, lay: Layout, vm: int) -> bool:
    """vm points at an rb_vm_t: its main thread's vm and ractor point back, and the thread's
    execution context has its current frame inside its VM stack."""
    if not vm or vm & 7:
        return False
    try:
        raw = mem.read(vm, lay.vm_main_thread + 8)
        ractor, th = _Q.unpack_from(raw, lay.vm_main_ractor)[0], _Q.unpack_from(raw, lay.vm_main_thread)[0]
        if not ractor or not th or th & 7 or ractor & 7:
            return False
        t = mem.read(th, max(lay.th_vm, lay.th_ractor, lay.th_ec) + 8)
        if _Q.unpack_from(t, lay.th_vm)[0] != vm or _Q.unpack_from(t, lay.th_ractor)[0] != ractor:
            return False
        ec = _Q.unpack_from(t, lay.th_ec)[0]
        e = mem.read(ec, lay.ec_cfp + 8)
    except MemoryReadError as err:
        if err.reason in ("gone", "budget"):
            raise
        return False
    stack, size, cfp = (_Q.unpack_from(e, o)[0] for o in (lay.ec_vm_stack, lay.ec_vm_stack_size, lay.ec_cfp))
    return 0 < size < 1 << 28 and stack <= cfp < stack + 8 * size


def _valid_symbols(mem: ProcessMemory, lay: Layout, at: int) -> bool:
    """`at` holds an rb_symbols_t: the operators' serials name them (KNOWN_SERIALS), each step of the
    lookup checked as the reader checks it."""
    table = Symbols(lay, at, lambda _reason: None, Iseqs(lay, lambda _reason: None).string)
    try:
        return all(table.name(mem, serial) == text for serial, text in KNOWN_SERIALS.items())
    except MemoryReadError as err:
        if err.reason in ("gone", "budget"):
            raise
        return False


def _symbols(process: ProcessContext, mod: Mapping, lay: Layout, facts: FileFacts, bias: int) -> int:
    """The address of the VM's global symbol table (the names of C functions' methods): the symbol
    ruby_global_symbols if the file has it; else the place a scan found in this file before, checked;
    else a scan of libruby's writable data for the one table that passes the check. 0 when none is (or
    several are) found: C functions' frames are then left out, counted by the reader."""
    mem = process.mem
    for place in (facts.elf.symbols.get("ruby_global_symbols"), facts.symbols_place):
        if place is not None and _valid_symbols(mem, lay, place + bias):
            return place + bias
    found = _scan_symbols(process, mod, lay)
    if len(found) != 1:
        return 0
    facts.symbols_place = found[0] - bias
    return found[0]


def _scan_symbols(process: ProcessContext, mod: Mapping, lay: Layout) -> list[int]:
    """The address of each rb_symbols_t in libruby's writable data (it is initialised: {tNEXT_ID-1}):
    last_id a serial past the operators' with its padding zero, then two pointers into the heap (the
    string table, the ids), and the table passes the check (_valid_symbols)."""
    heap = _heap(process)
    mem, candidates = process.mem, 0
    found: list[int] = []
    ids = lay.sym_ids - lay.sym_last_id
    tail_at, tail = 0, b""  # the last words of the previous chunk: a table may straddle two
    for chunk_at, chunk in _chunks(process, mod):
        at, data = (tail_at, tail + chunk) if tail and tail_at + len(tail) == chunk_at else (chunk_at, chunk)
        tail_at, tail = chunk_at + len(chunk) - ids, chunk[-ids:]
        words = [w for (w,) in _Q.iter_unpack(data)]
        for k in range(len(words) - ids // 8):
            head, table, ary = words[k], words[k + 1], words[k + ids // 8]
            if not lay.last_op_id < head <= MAX_SYMBOL_SERIAL or not table or not ary or (table | ary) & 7:
                continue
            if not any(lo <= ary < hi for lo, hi in heap) or not any(lo <= table < hi for lo, hi in heap):
                continue
            candidates += 1
            if candidates > MAX_CANDIDATES:
                return found
            if _valid_symbols(mem, lay, at + 8 * k):
                found.append(at + 8 * k)
    return found


def _heap(process: ProcessContext) -> list[tuple[int, int]]:
    """Writable anonymous memory and the brk heap: where Ruby's objects and malloc's blocks are."""
    return [
        (m.start, m.end) for m in process.mappings if m.perms.startswith("rw") and (not m.path or m.path == "[heap]")
    ]


def _chunks(process: ProcessContext, mod: Mapping) -> Iterator[tuple[int, bytes]]:
    """(address, bytes) of libruby's writable data and the .bss right after it, in reads of 64 KB, at most
    MAX_SCAN_BYTES; a chunk that cannot be read is passed over."""
    maps = process.mappings
    regions: list[Mapping] = []
    for i, m in enumerate(maps):
        if m.path == mod.path and m.perms.startswith("rw"):
            regions.append(m)
            if (
                i + 1 < len(maps)
                and not maps[i + 1].path
                and maps[i + 1].start == m.end
                and maps[i + 1].perms.startswith("rw")
            ):
                regions.append(maps[i + 1])
    scanned = 0
    for r in regions:
        for at in range(r.start, r.end, 1 << 16):
            n = min(1 << 16, r.end - at)
            if scanned + n > MAX_SCAN_BYTES:
                return
            scanned += n
            try:
                yield at, process.mem.read(at, n)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                continue


def _scan(process: ProcessContext, mod: Mapping, lay: Layout) -> list[tuple[int, int]]:
    """(address, value) of each pointer in libruby's writable data (and the .bss right after it) to a valid VM."""
    heap = _heap(process)
    mem, candidates = process.mem, 0
    found: list[tuple[int, int]] = []
    for at, data in _chunks(process, mod):
        for k, (value,) in enumerate(_Q.iter_unpack(data)):
            if not value or value & 7 or not any(lo <= value < hi for lo, hi in heap):
                continue
            candidates += 1
            if candidates > MAX_CANDIDATES:
                return found
            if _valid_vm(mem, lay, value):
                found.append((at + 8 * k, value))
    return found


def runtime(cfg: Any) -> Ruby | None:
    return Ruby() if "ruby" in cfg.runtime_stacks else None
