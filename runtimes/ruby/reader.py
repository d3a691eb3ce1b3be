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
index table as Ruby's iseq.c encodes it). Frames of C functions (sleep,
Integer#times in 3.3) have no iseq and are skipped.

The class: the frame's environment (cfp->ep; for a block, the chain of
previous environments up to the method's own, as rb_vm_frame_method_entry
walks it) holds the method entry (an imemo_ment; in the method's own
environment possibly behind an svar), whose owner is the class or module
the method was defined in; its classpath (RCLASS_EXT) names it. A
singleton class's methods are named after the class it is attached to, with
"."; a singleton of an ordinary object, an anonymous class (no classpath)
or a temporary path ("#<Class:0x...>") leave the bare label, as Ruby's own
backtraces do. Decoded iseqs are cached by address and body, class names by
method entry and owner, both bounded. In three parts: RubyProcess (the
threads and their control frames), _Iseqs (each frame's iseq: label, path,
line) and _Names (each frame's class, through its environments).

Validation: a ractor or thread whose links do not point back, an iseq that
is not an imemo_iseq, a path or label that is not a string, a pc outside the
iseq or an index outside its table drops the thread or frame, counted in
`dropped` by reason. An environment, method entry or class that cannot be
read or is not what it must be is counted too (bad_env, env_too_deep,
bad_method_entry, bad_class), and its frame keeps its bare label. Reads are
bounded (MAX_RACTORS, MAX_THREADS, MAX_FRAMES, MAX_ENV_HOPS,
MAX_NAME_BYTES, MAX_INSN_ENTRIES); the ReadBudget bounds the bytes.

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


class _Iseqs:
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

    def named(self, mem: ProcessMemory, info: _Iseq, line: int, owner: tuple[int, int] | None) -> RubyFrame:
        """The frame of `info` at `line`, named after its method entry and owner (if any)."""
        cls, sep = self._class_name(mem, owner) if owner else ("", "")
        if not cls or not info.label.endswith(info.base_label):
            return RubyFrame(info.label, "", info.path, line)
        prefix = info.label[: len(info.label) - len(info.base_label)]  # "block in ", "rescue in "
        return RubyFrame(f"{prefix}{cls}{sep}{info.base_label}", cls, info.path, line)

    def owners(self, mem: ProcessMemory, eps: list[int], stack: int = 0, top: int = 0) -> list[tuple[int, int] | None]:
        """(method entry, its owner) of each frame's environment, as rb_vm_frame_method_entry finds it:
        ep[-2] of the environment, or of the previous ones up to the method's own (a block's frame);
        None where there is none (top-level code: a cref) or it fails its checks (counted).
        Environments on the thread's VM stack (between `stack` and `top`) are read in one span;
        others (a block that outlived its frame has its environment on the heap) one by one."""
        chains = self._chains(_Envs(mem, eps, stack, top), eps)
        values = list({v for chain in chains for v, _ in chain})
        heads = dict(zip(values, mem.read_many([(v, self.layout.me_owner + 8) for v in values]))) if values else {}
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
                got = mem.read(inner, lay.me_owner + 8)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                got = None
            return self._method_entry(mem, inner, got, False)
        return None  # a cref (top-level or class body code), or another imemo

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
    """Reads the stacks of one Ruby process: its threads (here), their frames' iseqs (_Iseqs) and names
    (_Names); sample() once per tick."""

    def __init__(self, version: str, layout: Layout, vm: int) -> None:
        self.version, self.layout, self.vm = version, layout, vm
        self.dropped: dict[str, int] = {}
        self.iseqs = _Iseqs(layout, self._drop)
        self.names = _Names(layout, self._drop, self.iseqs.string)

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
        n = min(MAX_FRAMES, (end - cfp) // lay.cfp_bytes)
        if (end - cfp) // lay.cfp_bytes > MAX_FRAMES:
            self._drop("too_deep")
        cfps = mem.read_many([(cfp + i * lay.cfp_bytes, lay.cfp_bytes) for i in range(n)])
        got: list[tuple[_Iseq, int, int]] = []  # each Ruby frame's iseq, line and environment
        for c in cfps:
            if c is None:
                self._drop("bad_pointer")
                break
            iseq = _Q.unpack_from(c, lay.cfp_iseq)[0]
            if not iseq or iseq & 7:
                continue  # a C function's frame, or the VM's dummy bottom frame
            frame = self.iseqs.frame(mem, iseq, _Q.unpack_from(c, lay.cfp_pc)[0])
            if frame is not None:
                got.append((frame[0], frame[1], _Q.unpack_from(c, lay.cfp_ep)[0]))
        owners = self.names.owners(mem, [ep for _, _, ep in got], stack, cfp)
        return [self.names.named(mem, info, line, owner) for (info, line, _), owner in zip(got, owners)]
