"""Thread stacks of one Ruby process, read from its memory while it runs.

Owns: from the VM (found by detect: the symbol or a validated scan), the
threads of every ractor: the main ractor first, then each other ractor on
the VM's ring of ractors (vm->ractor.set), and per ractor the ring of its
threads' list nodes, each thread validated by pointing back to the VM and to
that ractor; each thread's execution context and its control frames from
the current one to the end of its VM stack; each frame of Ruby code (its
iseq an imemo_iseq) turned into a RubyFrame: the method with its class as
Ruby's own profiling API names it (rb_profile_frame_full_label:
"Worker#hot", "Worker.cls_method" for a method of a singleton class,
"block in Worker#hot", "Spin#cpu_b" for a module's method; the bare label,
"<main>", for code outside any method), file (the iseq's path) and line
(from the iseq's instruction info at the frame's pc, through the succinct
index table as Ruby's iseq.c encodes it). As rb_profile_frames does, the
thread's bottom frame (the VM's dummy; in the main thread an empty "<main>"
that showed as a second <main> at line 0) and frames of Ruby code whose pc
is 0 (not yet run) are left out. A frame without an iseq whose
environment's flags (ep[0]) say VM_FRAME_MAGIC_CFUNC is a C function's
("Kernel#sleep", "Thread#join", "Array#each", "Process.clock_gettime"): its
method entry is ep[-2], its class the entry's owner (as for Ruby code), its
name the definition's original_id (else the called_id), an ID, turned into
its string through the VM's global symbol table (ruby_global_symbols,
located by detect) as rb_id2str does; it has no file or line ("", 0). Other
frames without Ruby code (the VM's dummy frames, a C block's) are skipped.

The class: the frame's environment (cfp->ep; for a block, the chain of
previous environments up to the method's own, as rb_vm_frame_method_entry
walks it) holds the method entry (an imemo_ment; in the method's own
environment possibly behind an svar), whose owner is the class or module
the method was defined in; its classpath (RCLASS_EXT) names it. A
singleton class's methods are named after the class it is attached to, with
"."; a singleton of an ordinary object, an anonymous class (no classpath)
or a temporary path ("#<Class:0x...>") leave the bare label, as Ruby's own
backtraces do. Decoded iseqs are cached by address and body, class names by
method entry and owner, method names by ID, all bounded. In four parts:
RubyProcess (the threads and their control frames), Iseqs (each frame's
iseq: label, path, line), _Names (each frame's class, through its
environments) and Symbols (a C function's name from its ID).

Validation: a ractor or thread whose links do not point back, an iseq that
is not an imemo_iseq, a path or label that is not a string, a pc outside the
iseq or an index outside its table drops the thread or frame, counted in
`dropped` by reason. An environment, method entry or class that cannot be
read or is not what it must be is counted too (bad_env, env_too_deep,
bad_method_entry, bad_class), and its frame keeps its bare label. A C
function's frame whose method entry is missing or whose definition is not a
C function's (bad_cfunc), whose ID the symbol table does not hold as it must
(bad_symbol: the serial within last_id, each array a T_ARRAY read within its
length, the name a T_STRING), or of a process whose table was not found
(no_symbol_table) is left out, counted: a name is never guessed. Reads are
bounded (MAX_RACTORS, MAX_THREADS, MAX_FRAMES, MAX_ENV_HOPS,
MAX_NAME_BYTES, MAX_INSN_ENTRIES, MAX_SYMBOL_SERIAL); the ReadBudget bounds
the bytes.

Must not: write to, stop or attach to the target; log.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from runtimes.memory import MemoryReadError, ProcessMemory
from runtimes.ruby import layouts
from runtimes.ruby.layouts import Layout
from runtimes.runtime import ThreadStack

# Ractors read per process (each is an OS-thread-backed actor; thousands are not a program, a loop is).
MAX_RACTORS = 256
# Threads read per process, over all its ractors.
MAX_THREADS = 512
# Previous environments followed from a block's frame to its method's (one per nesting level of blocks).
MAX_ENV_HOPS = 32
# Bytes of a thread's VM stack read at once for its frames' environments (a 64-frame-deep stack's
# environments span a few KB; a larger span is read environment by environment).
MAX_ENV_SPAN = 32 << 10
# Class names cached per process (a method entry and owner each).
CLASS_CACHE_ENTRIES = 4096
# Control frames read per thread (Ruby's default VM stack holds ~10K; profiles cut at 128).
MAX_FRAMES = 128
# Bytes of a label or path.
MAX_NAME_BYTES = 1024
# Instruction-info entries of one iseq (a 10,000-line method has ~40K).
MAX_INSN_ENTRIES = 1 << 16
# Instructions of one iseq: a pc past this is not inside it.
MAX_ISEQ_SIZE = 1 << 24
# Decoded iseqs cached per process.
ISEQ_CACHE_ENTRIES = 4096
# Method names (ID → string) cached per process: an ID of a method's name never changes its name.
ID_CACHE_ENTRIES = 4096
# Serials a symbol table may hold (a program with millions of symbols is not a program, a leak is).
MAX_SYMBOL_SERIAL = 1 << 26

_Q = struct.Struct("<Q")
_I = struct.Struct("<I")
_i = struct.Struct("<i")


@dataclass(frozen=True, slots=True)
class RubyFrame:
    function: str  # "Worker#hot", "Worker.cls_method", "block in Worker#hot", "<main>"
    class_name: str  # "Worker" (of both), "" when no class is named
    filename: str
    line: int


@dataclass(slots=True)
class _Iseq:
    label: str
    base_label: str
    path: str
    encoded: int
    size: int  # instruction info entries
    lines: list[int]  # line of each entry
    succ: int  # address of the succinct index table (0: none)
    cache: dict[int, int]  # position → entry index


class Iseqs:
    """Iseqs decoded (cached by address and body, bounded) and the strings they hold: each Ruby frame's
    label, path and line."""

    def __init__(self, layout: Layout, drop: Callable[[str], None]) -> None:
        self.layout = layout
        self._drop = drop
        self._cache: OrderedDict[tuple[int, int], _Iseq | None] = OrderedDict()

    def frame(self, mem: ProcessMemory, iseq: int, pc: int) -> tuple[_Iseq, int] | None:
        head = mem.read(iseq, self.layout.iseq_body + 8)
        flags = _Q.unpack_from(head, 0)[0]
        if flags & layouts.T_MASK != layouts.T_IMEMO:
            return None  # a C function's method entry, or a dummy frame
        if (flags >> layouts.FL_USHIFT) & 0xF != layouts.IMEMO_ISEQ:
            return None
        body = _Q.unpack_from(head, self.layout.iseq_body)[0]
        key = (iseq, body)
        info = self._cache.get(key)
        if key in self._cache:
            self._cache.move_to_end(key)
        else:
            try:
                info = self._read_iseq(mem, body)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                self._drop("bad_pointer")
                info = None
            self._cache[key] = info
            if len(self._cache) > ISEQ_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        if info is None:
            return None
        if not pc:
            return info, 0
        pos = (pc - info.encoded) // 8
        if not 0 <= pos < MAX_ISEQ_SIZE:
            self._drop("bad_pc")
            return None
        pos = pos - 1 if pos else 0  # the pc is past the instruction being run
        line = self._line(mem, info, pos)
        if line is None:
            return None
        return info, line

    def _read_iseq(self, mem: ProcessMemory, body: int) -> _Iseq | None:
        lay = self.layout
        if not body or body & 7:
            self._drop("bad_pointer")
            return None
        raw = mem.read(body, lay.body_succ_table + 8)
        label = self.string(mem, _Q.unpack_from(raw, lay.body_label)[0])
        base = self.string(mem, _Q.unpack_from(raw, lay.body_base_label)[0])
        path = self._path(mem, _Q.unpack_from(raw, lay.body_pathobj)[0])
        if label is None or base is None or path is None:
            return None
        size = _I.unpack_from(raw, lay.body_insns_size)[0]
        entries = _Q.unpack_from(raw, lay.body_insns_body)[0]
        if size > MAX_INSN_ENTRIES or (size and not entries):
            self._drop("bad_insn_info")
            return None
        table = mem.read(entries, size * layouts.INSN_INFO_ENTRY_BYTES) if size else b""
        lines = [_i.unpack_from(table, k * layouts.INSN_INFO_ENTRY_BYTES)[0] for k in range(size)]
        return _Iseq(
            label,
            base,
            path,
            _Q.unpack_from(raw, lay.body_iseq_encoded)[0],
            size,
            lines,
            _Q.unpack_from(raw, lay.body_succ_table)[0],
            {},
        )

    def _line(self, mem: ProcessMemory, info: _Iseq, pos: int) -> int | None:
        if info.size == 0:
            return 0
        if info.size == 1:
            return info.lines[0]
        index = info.cache.get(pos)
        if index is None:
            if not info.succ:
                self._drop("bad_insn_info")
                return None
            index = self.succ_lookup(mem, info.succ, pos)
            if len(info.cache) < 256:
                info.cache[pos] = index
        if not 1 <= index <= info.size:
            self._drop("impossible_line")
            return None
        line = info.lines[index - 1]
        return line if 0 <= line < 1 << 24 else 0

    def succ_lookup(self, mem: ProcessMemory, table: int, x: int) -> int:
        """Ruby's succ_index_lookup (iseq.c): the number of instruction-info entries starting at or before x."""
        if x < layouts.SUCC_IMMEDIATE:
            word = mem.u64(table + 8 * (x // 9))
            return (word >> (7 * (x % 9))) & 0x7F
        block = (x - layouts.SUCC_IMMEDIATE) // 512
        bit = (x - layouts.SUCC_IMMEDIATE) % 512
        raw = mem.read(table + layouts.SUCC_IMM_BYTES + block * layouts.SUCC_BLOCK_BYTES, layouts.SUCC_BLOCK_BYTES)
        rank = _I.unpack_from(raw, 0)[0]
        small_ranks = _Q.unpack_from(raw, 8)[0]
        small = bit // 64
        small_rank = 0 if small == 0 else (small_ranks >> ((small - 1) * 9)) & 0x1FF
        word = _Q.unpack_from(raw, 16 + 8 * small)[0]
        popcount = bin((word << (63 - bit % 64)) & 0xFFFFFFFFFFFFFFFF).count("1")
        return rank + small_rank + popcount

    def string(self, mem: ProcessMemory, value: int) -> str | None:
        lay = self.layout
        if not value or value & 7:
            self._drop("bad_string")
            return None
        head = mem.read(value, lay.str_ptr + 8)
        flags = _Q.unpack_from(head, 0)[0]
        length = _Q.unpack_from(head, lay.str_len)[0]
        if flags & layouts.T_MASK != layouts.T_STRING or length > 1 << 20:
            self._drop("bad_string")
            return None
        n = min(length, MAX_NAME_BYTES)
        if not n:
            return ""
        ptr = _Q.unpack_from(head, lay.str_ptr)[0] if flags & layouts.STRING_NOEMBED else value + lay.str_ptr
        return mem.read(ptr, n).decode("utf-8", "replace")

    def _path(self, mem: ProcessMemory, value: int) -> str | None:
        """pathobj: a path string, or an array [path, realpath]."""
        if not value or value & 7:
            self._drop("bad_string")
            return None
        flags = mem.u64(value)
        if flags & layouts.T_MASK == layouts.T_ARRAY:
            lay = self.layout
            if flags & layouts.ARRAY_EMBED:
                first = mem.u64(value + lay.ary_embed)
            else:
                first = mem.u64(mem.u64(value + lay.ary_heap_ptr))
            return self.string(mem, first)
        return self.string(mem, value)


class Symbols:
    """A method's name from its ID through the VM's global symbol table (ruby_global_symbols, found by
    detect), as rb_id2str does: the ID's serial, the array of ID_ENTRY_UNIT serials holding it in the
    table's ids, the name (an fstring) in that array. Every step is checked (the serial within the
    table's last_id, each array a T_ARRAY read within its length, the name a T_STRING); names are cached
    by ID, bounded."""

    def __init__(
        self,
        layout: Layout,
        table: int,
        drop: Callable[[str], None],
        string: Callable[[ProcessMemory, int], str | None],
    ) -> None:
        self.layout = layout
        self.table = table  # the address of ruby_global_symbols in the process; 0: not found
        self._drop = drop
        self._string = string
        self._names: OrderedDict[int, str] = OrderedDict()

    def serial(self, ident: int) -> int:
        """rb_id_to_serial (symbol.h)."""
        return ident >> layouts.ID_SCOPE_SHIFT if ident > self.layout.last_op_id else ident

    def name(self, mem: ProcessMemory, ident: int) -> str | None:
        """The name of ID `ident`; None (counted) when the table does not hold it as it must."""
        got = self._names.get(ident)
        if got is not None:
            self._names.move_to_end(ident)
            return got
        try:
            got = self._lookup(mem, self.serial(ident))
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            got = None
        if got is None:
            self._drop("bad_symbol")
            return None
        self._names[ident] = got
        if len(self._names) > ID_CACHE_ENTRIES:
            self._names.popitem(last=False)
        return got

    def _lookup(self, mem: ProcessMemory, serial: int) -> str | None:
        """get_id_serial_entry (symbol.c) for the name: None when any step is not what it must be."""
        lay = self.layout
        if not self.table:
            return None
        raw = mem.read(self.table + lay.sym_last_id, lay.sym_ids + 8 - lay.sym_last_id)
        last = _I.unpack_from(raw, 0)[0]
        if not 0 < serial <= last or last > MAX_SYMBOL_SERIAL:
            return None
        unit = self.entry(mem, _Q.unpack_from(raw, lay.sym_ids - lay.sym_last_id)[0], serial // layouts.ID_ENTRY_UNIT)
        if unit is None:
            return None
        pos = (serial % layouts.ID_ENTRY_UNIT) * layouts.ID_ENTRY_SIZE + layouts.ID_ENTRY_STR
        value = self.entry(mem, unit, pos)
        if value is None or not value or value & 7:
            return None
        return self._string(mem, value)

    def entry(self, mem: ProcessMemory, ary: int, index: int) -> int | None:
        """Element `index` of the T_ARRAY `ary`; None when it is no array or the index is past its length."""
        lay = self.layout
        if not ary or ary & 7:
            return None
        raw = mem.read(ary, lay.ary_heap_ptr + 8)
        flags = _Q.unpack_from(raw, 0)[0]
        if flags & layouts.T_MASK != layouts.T_ARRAY:
            return None
        if flags & layouts.ARRAY_EMBED:
            length = (flags & layouts.ARRAY_EMBED_LEN_MASK) >> layouts.ARRAY_EMBED_LEN_SHIFT
            first = ary + lay.ary_embed
        else:
            length, first = _Q.unpack_from(raw, lay.ary_heap_len)[0], _Q.unpack_from(raw, lay.ary_heap_ptr)[0]
        if not 0 <= index < length or length > MAX_SYMBOL_SERIAL:
            return None
        return mem.u64(first + 8 * index)


class _Envs:
    """The three words before and at each environment pointer (ep[-2], ep[-1], ep[0]) of one thread's
    frames: those on its VM stack (between `stack` and `top`) from one read of their span (up to
    MAX_ENV_SPAN), the others (a block's environment that outlived its frame is on the heap) fetched in
    batches."""

    def __init__(self, mem: ProcessMemory, eps: list[int], stack: int, top: int) -> None:
        self._mem = mem
        self._span_at, self._span = 0, b""
        on_stack = [ep for ep in eps if stack + 16 <= ep < top and not ep & 7]
        if on_stack:
            self._span_at = min(on_stack) + layouts.EP_ME_CREF
            size = max(on_stack) + 8 - self._span_at
            if size <= MAX_ENV_SPAN:
                self._span = mem.read(self._span_at, size)
        self._off: dict[int, bytes | None] = {}  # environments off the VM stack: ep → its three words

    def fetch(self, eps: list[int]) -> None:
        """The environments of `eps` not in the span and not read yet, in one read."""
        span, span_at = self._span, self._span_at
        fetch = list(
            {
                ep
                for ep in eps
                if ep not in self._off
                and not (span and span_at <= ep + layouts.EP_ME_CREF and ep + 8 <= span_at + len(span))
            }
        )
        if fetch:
            got = self._mem.read_many([(ep + layouts.EP_ME_CREF, 24) if ep and not ep & 7 else (0, 0) for ep in fetch])
            self._off.update(zip(fetch, got))

    def slots(self, ep: int) -> tuple[int, int, int] | None:
        """ep[-2], ep[-1], ep[0]; None if they could not be read."""
        at = ep + layouts.EP_ME_CREF - self._span_at
        if self._span and 0 <= at <= len(self._span) - 24:
            raw = self._span
        else:
            got = self._off.get(ep)
            if got is None:
                return None
            raw, at = got, 0
        return _Q.unpack_from(raw, at)[0], _Q.unpack_from(raw, at + 8)[0], _Q.unpack_from(raw, at + 16)[0]


class _Names:
    """Each Ruby frame named with its class: the method entry its environments hold, the entry's owner, and
    that class's path (cached by method entry and owner, bounded)."""

    def __init__(
        self, layout: Layout, drop: Callable[[str], None], string: Callable[[ProcessMemory, int], str | None]
    ) -> None:
        self.layout = layout
        self._drop = drop
        self._string = string
        self._classes: OrderedDict[tuple[int, int], tuple[str, str]] = OrderedDict()
        self._heads: dict[int, bytes | None] = {}  # the method entries read by the last owners(): their first bytes

    def named(self, mem: ProcessMemory, info: _Iseq, line: int, owner: tuple[int, int] | None) -> RubyFrame:
        """The frame of `info` at `line`, named after its method entry and owner (if any)."""
        cls, sep = self._class_name(mem, owner) if owner else ("", "")
        if not cls or not info.label.endswith(info.base_label):
            return RubyFrame(info.label, "", info.path, line)
        prefix = info.label[: len(info.label) - len(info.base_label)]  # "block in ", "rescue in "
        return RubyFrame(f"{prefix}{cls}{sep}{info.base_label}", cls, info.path, line)

    def owners(
        self, mem: ProcessMemory, eps: list[int], stack: int = 0, top: int = 0, envs: _Envs | None = None
    ) -> list[tuple[int, int] | None]:
        """(method entry, its owner) of each frame's environment, as rb_vm_frame_method_entry finds it:
        ep[-2] of the environment, or of the previous ones up to the method's own (a block's frame);
        None where there is none (top-level code: a cref) or it fails its checks (counted).
        Environments on the thread's VM stack (between `stack` and `top`) are read in one span (or
        those of `envs`, already read); others (a block that outlived its frame has its environment on
        the heap) one by one."""
        chains = self._chains(envs if envs is not None else _Envs(mem, eps, stack, top), eps)
        values = list({v for chain in chains for v, _ in chain})
        heads = dict(zip(values, mem.read_many([(v, self._entry_bytes()) for v in values]))) if values else {}
        self._heads = heads
        out: list[tuple[int, int] | None] = []
        for chain in chains:
            found = None
            for value, local in chain:
                found = self._method_entry(mem, value, heads[value], local)
                if found is not None:
                    break
            out.append(found)
        return out

    def _chains(self, envs: _Envs, eps: list[int]) -> list[list[tuple[int, bool]]]:
        """Each frame's candidates, in the order Ruby checks them: ep[-2] of each environment up to the
        local one (and whether that one is the local one). All frames step together, so the environments
        off the stack of a step are one read."""
        chains: list[list[tuple[int, bool]]] = [[] for _ in eps]
        walking = list(enumerate(eps))
        for _hop in range(MAX_ENV_HOPS):
            if not walking:
                break
            envs.fetch([ep for _, ep in walking])
            still: list[tuple[int, int]] = []
            for i, ep in walking:
                slots = envs.slots(ep)
                if slots is None:
                    self._drop("bad_env")
                    continue
                me_cref, specval, flags = slots
                local = bool(flags & layouts.ENV_FLAG_LOCAL)
                if me_cref and not me_cref & 7:
                    chains[i].append((me_cref, local))
                if not local:
                    still.append((i, specval & ~3))
            walking = still
        if walking:
            self._drop("env_too_deep")
        return chains

    def _method_entry(
        self, mem: ProcessMemory, value: int, head: bytes | None, svar_allowed: bool
    ) -> tuple[int, int] | None:
        """check_method_entry (vm_insnhelper.c): (value, its owner) when `value` (whose first bytes are
        `head`) is an imemo_ment; an svar's cref_or_me in a method's own environment; else None."""
        lay = self.layout
        if not value or value & 7:
            return None  # Qfalse: no method entry here
        if head is None:
            self._drop("bad_method_entry")
            return None
        flags = _Q.unpack_from(head, 0)[0]
        if flags & layouts.T_MASK != layouts.T_IMEMO:
            self._drop("bad_method_entry")
            return None
        kind = (flags >> layouts.FL_USHIFT) & layouts.IMEMO_MASK
        if kind == layouts.IMEMO_MENT:
            return value, _Q.unpack_from(head, lay.me_owner)[0]
        if kind == layouts.IMEMO_SVAR and svar_allowed:
            inner = _Q.unpack_from(head, layouts.SVAR_CREF_OR_ME)[0]
            if not inner or inner & 7:
                return None
            try:
                got = mem.read(inner, self._entry_bytes())
                self._heads[inner] = got
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                got = None
            return self._method_entry(mem, inner, got, False)
        return None  # a cref (top-level or class body code), or another imemo

    def _entry_bytes(self) -> int:
        """The first bytes of a method entry read: up to its owner, its definition and called_id in them."""
        lay = self.layout
        return max(lay.me_owner, lay.me_def, lay.me_called_id) + 8

    def definition(self, entry: int) -> tuple[int, int] | None:
        """(definition, called_id) of a method entry the last owners() found, from the bytes it read."""
        head = self._heads.get(entry)
        if head is None:
            return None
        lay = self.layout
        return _Q.unpack_from(head, lay.me_def)[0], _Q.unpack_from(head, lay.me_called_id)[0]

    def c_function(self, mem: ProcessMemory, entry: tuple[int, int], method: str) -> RubyFrame:
        """A C function's frame: `method` (its name) with the class of its method entry, as
        rb_profile_frame_full_label names it ("Kernel#sleep", "Process.clock_gettime"); a C function
        has no file or line."""
        cls, sep = self._class_name(mem, entry)
        return RubyFrame(f"{cls}{sep}{method}" if cls else method, cls, "", 0)

    def _class_name(self, mem: ProcessMemory, entry: tuple[int, int]) -> tuple[str, str]:
        """("Worker", "#") for a method of Worker, ("Worker", ".") for one of Worker's singleton class,
        ("", "") when no class is named; cached by method entry and owner."""
        got = self._classes.get(entry)
        if got is not None:
            self._classes.move_to_end(entry)
            return got
        try:
            got = self._read_class_name(mem, entry[1])
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            self._drop("bad_class")
            return "", ""  # not cached: a torn read may read right next time
        self._classes[entry] = got
        if len(self._classes) > CLASS_CACHE_ENTRIES:
            self._classes.popitem(last=False)
        return got

    def _read_class_name(self, mem: ProcessMemory, owner: int) -> tuple[str, str]:
        lay = self.layout
        got = self._class(mem, owner)
        if got is None:
            raise MemoryReadError("bad_address", f"owner {owner:#x} is not a class or module")
        flags, attached, path = got
        sep = "#"
        if flags & lay.fl_singleton:
            got = self._class(mem, attached)
            if got is None:
                return "", ""  # a singleton of an ordinary object: Ruby names no class
            path, sep = got[2], "."
        if not path or path & 7:
            return "", ""  # an anonymous class (nil classpath)
        name = self._string(mem, path)
        if name is None:
            raise MemoryReadError("bad_address", f"classpath {path:#x} is not a string")
        if not name or name.startswith("#<"):
            return "", ""  # a temporary path: Ruby names no class either
        return name, sep

    def _class(self, mem: ProcessMemory, klass: int) -> tuple[int, int, int] | None:
        """(flags, attached object, classpath) of a class or module; None for any other object."""
        lay = self.layout
        if not klass or klass & 7:
            return None
        raw = mem.read(klass, max(lay.class_attached, lay.class_path) + 8)
        flags = _Q.unpack_from(raw, 0)[0]
        if flags & layouts.T_MASK not in (layouts.T_CLASS, layouts.T_MODULE):
            return None
        return flags, _Q.unpack_from(raw, lay.class_attached)[0], _Q.unpack_from(raw, lay.class_path)[0]


class RubyProcess:
    """Reads the stacks of one Ruby process: its threads (here), their frames' iseqs (Iseqs) and names
    (_Names); sample() once per tick."""

    def __init__(self, version: str, layout: Layout, vm: int, symbols: int = 0) -> None:
        """`symbols`: the address of the VM's global symbol table (0: not found; C functions' frames
        are then left out, counted)."""
        self.version, self.layout, self.vm = version, layout, vm
        self.dropped: dict[str, int] = {}
        self.iseqs = Iseqs(layout, self._drop)
        self.names = _Names(layout, self._drop, self.iseqs.string)
        self.symbols = Symbols(layout, symbols, self._drop, self.iseqs.string)

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def threads(self, mem: ProcessMemory) -> list[tuple[int, int, int]]:
        """(thread, its execution context, its native thread) of each thread of every ractor: the main
        ractor's first, then those of each other ractor on the VM's ring of ractors."""
        lay = self.layout
        vm = mem.read(self.vm, lay.vm_main_thread + 8)
        main = _Q.unpack_from(vm, lay.vm_main_ractor)[0]
        out = self._ractor_threads(mem, main, MAX_THREADS)
        head = self.vm + lay.vm_ractor_set
        node, seen = _Q.unpack_from(vm, lay.vm_ractor_set)[0], {head}
        while node not in seen:
            if not node or node & 7 or len(seen) > MAX_RACTORS:
                self._drop("bad_ractor" if len(seen) <= MAX_RACTORS else "too_many_ractors")
                break
            seen.add(node)
            ractor = node - lay.ractor_node
            if ractor != main:
                out += self._ractor_threads(mem, ractor, MAX_THREADS - len(out))
            next_node = mem.u64_or_none(node)
            if next_node is None:
                self._drop("bad_ractor")
                break
            node = next_node
        return out

    def _ractor_threads(self, mem: ProcessMemory, ractor: int, room: int) -> list[tuple[int, int, int]]:
        """Up to `room` threads on `ractor`'s ring of threads, each checked to point back to the VM and to it."""
        lay = self.layout
        out: list[tuple[int, int, int]] = []
        if not ractor or ractor & 7:
            self._drop("bad_ractor")
            return out
        head = ractor + lay.ractor_threads
        want = max(lay.th_node, lay.th_ractor, lay.th_vm, lay.th_nt, lay.th_ec) + 8
        first = mem.u64_or_none(head)
        if first is None:
            self._drop("bad_ractor")
            return out
        node, seen = first, {head}
        while node not in seen:
            if len(out) >= room:
                self._drop("too_many_threads")
                break
            seen.add(node)
            th = node - lay.th_node
            try:
                raw = mem.read(th, want) if node and not th & 7 else None
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                raw = None
            if (
                raw is None
                or _Q.unpack_from(raw, lay.th_vm)[0] != self.vm
                or _Q.unpack_from(raw, lay.th_ractor)[0] != ractor
            ):
                self._drop("bad_thread")
                break
            out.append((th, _Q.unpack_from(raw, lay.th_ec)[0], _Q.unpack_from(raw, lay.th_nt)[0]))
            node = _Q.unpack_from(raw, lay.th_node)[0]
        return out

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]:
        lay = self.layout
        out = []
        for _th, ec, nt in self.threads(mem):
            try:
                tid = mem.i32(nt + lay.nt_tid) if nt else 0
                frames = self._frames(mem, ec)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                self._drop("thread_unreadable")
                continue
            if frames:
                out.append(ThreadStack(max(tid, 0), tuple(frames)))
        return out

    def _frames(self, mem: ProcessMemory, ec: int) -> list[RubyFrame]:
        lay = self.layout
        raw = mem.read(ec, lay.ec_cfp + 8)
        stack = _Q.unpack_from(raw, lay.ec_vm_stack)[0]
        size = _Q.unpack_from(raw, lay.ec_vm_stack_size)[0]
        cfp = _Q.unpack_from(raw, lay.ec_cfp)[0]
        end = stack + 8 * size
        if not stack <= cfp < end or size > 1 << 28:
            self._drop("bad_stack")
            return []
        # The bottom frame is the VM's dummy (rb_ec_initialize_vm_stack's; in the main thread Init_VM gave it
        # an empty "<main>" iseq, whose path rb_vm_set_progname set to the script's): thread_profile_frames
        # stops before it, and so does the reader.
        total = (end - cfp) // lay.cfp_bytes - 1
        n = min(MAX_FRAMES, total)
        if total > MAX_FRAMES:
            self._drop("too_deep")
        cfps = mem.read_many([(cfp + i * lay.cfp_bytes, lay.cfp_bytes) for i in range(n)])
        got: list[tuple[_Iseq | None, int, int]] = []  # each frame's iseq (None: not Ruby code), line, environment
        for c in cfps:
            if c is None:
                self._drop("bad_pointer")
                break
            iseq, ep, pc = (_Q.unpack_from(c, o)[0] for o in (lay.cfp_iseq, lay.cfp_ep, lay.cfp_pc))
            if iseq and not pc:
                continue  # code that has not run: the VM's top frame (rb_profile_frames skips it too), a C block's
            frame = self.iseqs.frame(mem, iseq, pc) if iseq and not iseq & 7 else None
            if frame is not None:
                got.append((frame[0], frame[1], ep))
            elif ep and not ep & 7:
                got.append((None, 0, ep))  # a C function's frame if its flags say so (else a dummy, an ifunc's)
        envs = _Envs(mem, [ep for _, _, ep in got], stack, cfp)
        got = self._c_functions_only(envs, got)
        eps = [ep for _, _, ep in got]
        owners = self.names.owners(mem, eps, envs=envs)
        methods = self._c_names(mem, [owner for (info, _, _), owner in zip(got, owners) if info is None])
        out: list[RubyFrame] = []
        for (info, line, _), owner in zip(got, owners):
            if info is not None:
                out.append(self.names.named(mem, info, line, owner))
                continue
            method = methods.pop(0)
            if method is not None and owner is not None:
                out.append(self.names.c_function(mem, owner, method))
        return out

    def _c_functions_only(
        self, envs: _Envs, got: list[tuple[_Iseq | None, int, int]]
    ) -> list[tuple[_Iseq | None, int, int]]:
        """`got` without the frames that are neither Ruby code nor a C function's (VM_FRAME_MAGIC_CFUNC in
        their environment's flags): the VM's dummy frames, a C block's (ifunc)."""
        others = [ep for info, _, ep in got if info is None]
        if not others:
            return got
        envs.fetch(others)
        kept: list[tuple[_Iseq | None, int, int]] = []
        for item in got:
            if item[0] is None:
                slots = envs.slots(item[2])
                if slots is None:
                    self._drop("bad_env")
                    continue
                if slots[2] & layouts.FRAME_MAGIC_MASK != layouts.FRAME_MAGIC_CFUNC:
                    continue
            kept.append(item)
        return kept

    def _c_names(self, mem: ProcessMemory, entries: list[tuple[int, int] | None]) -> list[str | None]:
        """The method name of each C function's method entry: its definition's original_id (or, if
        none, the ID it was called by) through the symbol table; None, counted, where the entry is
        missing, its definition is not a C function's, or the name is not in the table."""
        if not entries:
            return []
        lay = self.layout
        heads = [self.names.definition(e[0]) if e else None for e in entries]  # read by owners()
        bodies = mem.read_many(
            [(h[0], lay.def_original_id + 8) if h and h[0] and not h[0] & 7 else (0, 0) for h in heads]
        )
        out: list[str | None] = []
        for head, body in zip(heads, bodies):
            if head is None or body is None:
                self._drop("bad_cfunc")
                out.append(None)
                continue
            if _I.unpack_from(body, 0)[0] & layouts.METHOD_TYPE_MASK != layouts.METHOD_TYPE_CFUNC:
                self._drop("bad_cfunc")
                out.append(None)
                continue
            if not self.symbols.table:
                self._drop("no_symbol_table")
                out.append(None)
                continue
            ident = _Q.unpack_from(body, lay.def_original_id)[0] or head[1]
            out.append(self.symbols.name(mem, ident))
        return out
