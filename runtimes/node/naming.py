"""Names of a Node.js process's JavaScript frames, from V8's heap objects.

Owns: a V8 frame's NodeFrame: its JSFunction's SharedFunctionInfo gives the
function name (a string, or its ScopeInfo's function variable or inferred
name), the script name and the line of the function's start (its ScopeInfo's
position, found in the script's line ends or, before V8 computed them, in
its source); its kind from the frame (an interpreter or Sparkplug frame's
bytecode array and offset) or the function's code kind (Maglev, TurboFan);
a builtin from a JSFunction without a script, or the called builtin of a
builtin exit frame. Strings: sequential, cons, thin and sliced (capped);
external ones are dropped. Caches (bounded): functions by (address, map,
SharedFunctionInfo) and by SharedFunctionInfo, scripts, maps' instance
types, code kinds.

Validation: every pointer is a tagged heap object of the expected instance
type before it is followed; names and sources are capped.

Must not: walk frames (chain.py), write to the target, or log.
"""

from __future__ import annotations

import bisect
import struct
from collections import OrderedDict
from dataclasses import dataclass

from runtimes.memory import MAX_READ_BYTES, MemoryReadError, ProcessMemory
from runtimes.node.frames import Counts, NodeFrame, word
from runtimes.node.v8info import V8Info

# Slots above a builtin exit frame's return address that may hold the called builtin's JSFunction
# (new target, target, argc, receiver: their order moved between V8 11 and 14).
BUILTIN_EXIT_SLOTS = 4
# Bytes of a function or script name; longer ones are cut.
MAX_NAME_BYTES = 1024
# Bytes of a script's source read to count its lines (when V8 has not computed its line ends): a
# quarter of a tick's read budget, so that one read fits in a tick; a longer script's later lines are 0.
MAX_SOURCE_BYTES = 1 << 20
# Line ends read from a script's line_ends array at most (8 bytes each: 1 MiB, as above).
MAX_LINES = 1 << 17
# Pieces of a cons string followed at most.
MAX_CONS_DEPTH = 16
# Functions (by SharedFunctionInfo address) and scripts cached per process.
FUNCTION_CACHE_ENTRIES = 4096
SCRIPT_CACHE_ENTRIES = 256
# Slots of a ScopeInfo looked at for the function's name and position (its context locals' names and
# infos come first: a function with more than 26 captured variables is "(anonymous)").
MAX_SCOPE_SLOTS = 64

_Q = struct.Struct("<Q")
_q = struct.Struct("<q")
_i = struct.Struct("<i")
_H = struct.Struct("<H")


def _smi(word: int) -> int | None:
    return (_q.unpack(_Q.pack(word))[0] >> 32) if not word & 1 else None


@dataclass(frozen=True, slots=True)
class _Function:
    name: str
    filename: str
    line: int
    builtin: bool


class FrameNamer:
    def __init__(self, v8: V8Info, counts: Counts) -> None:
        self.v8, self.counts = v8, counts
        self._functions: OrderedDict[tuple[int, int], _Function | None] = OrderedDict()
        self._by_function: OrderedDict[tuple[int, bytes, bytes], _Function | None] = OrderedDict()
        self._code_kinds: dict[int, str] = {}
        self._scripts: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        self._types: dict[int, int] = {}

    def frame(self, mem: ProcessMemory, window: bytes, lo: int, fp: int) -> NodeFrame | None:
        v8 = self.v8
        marker = word(window, lo, fp + v8.off_context)
        if marker is None:
            return None
        try:
            if not marker & 1:  # a typed frame: entry, exit, stub, internal, construct ...
                ftype = marker >> 1
                if ftype == v8.ft_builtin_exit:
                    for slot in range(fp + 16, fp + 16 + 8 * BUILTIN_EXIT_SLOTS, 8):
                        fn = word(window, lo, slot)
                        got = self._function(mem, fn) if fn is not None else None
                        if got is not None:
                            return NodeFrame(got.name, "", 0, "builtin")
                return None
            fn = word(window, lo, fp + v8.off_function)
            got = self._function(mem, fn) if fn is not None else None
            if got is None or fn is None:
                self.counts.drop("not_function")
                return None
            if got.builtin:
                return NodeFrame(got.name, "", 0, "builtin")
            return NodeFrame(got.name, got.filename, got.line, self._kind(mem, window, lo, fp, fn))
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            self.counts.drop("bad_pointer")
            return None

    def _kind(self, mem: ProcessMemory, window: bytes, lo: int, fp: int, fn: int) -> str:
        v8 = self.v8
        bc = word(window, lo, fp + v8.off_bytecode_array)
        if bc is not None and bc & 3 == 1 and self._instance_type(mem, bc) == v8.t_bytecode_array:
            off = word(window, lo, fp + v8.off_bytecode_offset)
            return "interpreted" if off is not None and not off & 1 else "baseline"
        if v8.fn_code is not None and v8.code_flags is not None:
            code = mem.u64(fn - 1 + v8.fn_code)
            got = self._code_kinds.get(code)
            if got is None and code & 3 == 1:
                kind = mem.u32(code - 1 + v8.code_flags) & v8.code_kind_mask
                got = {v8.code_kind_baseline + 1: "maglev", v8.code_kind_baseline + 2: "turbofan"}.get(
                    kind, "optimized"
                )
                if len(self._code_kinds) < FUNCTION_CACHE_ENTRIES:
                    self._code_kinds[code] = got
            return got or "optimized"
        return "optimized"

    def _instance_type(self, mem: ProcessMemory, tagged: int) -> int:
        if tagged & 3 != 1:
            return -1
        return self._map_type(mem, mem.u64(tagged - 1))

    def _map_type(self, mem: ProcessMemory, m: int) -> int:
        if m & 3 != 1:
            return -1
        got = self._types.get(m)
        if got is None:
            got = _H.unpack(mem.read(m - 1 + self.v8.map_instance_type, 2))[0]
            if len(self._types) < FUNCTION_CACHE_ENTRIES:
                self._types[m] = got
        return got

    def _function(self, mem: ProcessMemory, fn: int) -> _Function | None:
        """The JSFunction's name, script and line: one read of the function's map and shared pointer
        when this function (address, map, SharedFunctionInfo) was seen before (the GC moves objects:
        a moved one is a new key)."""
        v8 = self.v8
        if fn & 3 != 1:
            return None
        head = mem.read(fn - 1, v8.fn_shared + 8)
        fkey = (fn, head[:8], head[v8.fn_shared :])
        if fkey in self._by_function:
            self._by_function.move_to_end(fkey)
            return self._by_function[fkey]
        lo, hi = v8.js_function_types
        if not lo <= self._map_type(mem, _Q.unpack_from(head)[0]) <= hi:
            return None
        sfi = _Q.unpack_from(head, v8.fn_shared)[0]
        if self._instance_type(mem, sfi) != v8.t_sfi:
            self.counts.drop("not_shared_function_info")
            return None
        head = mem.read(sfi - 1, max(v8.sfi_name, v8.sfi_script) + 8)
        name_or_scope = _Q.unpack_from(head, v8.sfi_name)[0]
        script = _Q.unpack_from(head, v8.sfi_script)[0]
        key = (sfi, name_or_scope ^ (script << 1))
        if key in self._functions:
            self._functions.move_to_end(key)
            got = self._functions[key]
        else:
            got = self._read_function(mem, name_or_scope, script)
            self._functions[key] = got
            if len(self._functions) > FUNCTION_CACHE_ENTRIES:
                self._functions.popitem(last=False)
        self._by_function[fkey] = got
        if len(self._by_function) > FUNCTION_CACHE_ENTRIES:
            self._by_function.popitem(last=False)
        return got

    def _read_function(self, mem: ProcessMemory, name_or_scope: int, script: int) -> _Function | None:
        v8 = self.v8
        name, start = "", -1
        t = self._instance_type(mem, name_or_scope)
        if 0 <= t < v8.first_nonstring:
            name = self._string(mem, name_or_scope) or ""
        elif t == v8.t_scope_info:
            name, start = self._scope_info(mem, name_or_scope)
        name = name or "(anonymous)"
        if self._instance_type(mem, script) != v8.t_script:
            return _Function(name, "", 0, True)
        filename, line_ends = self._script(mem, script)
        line = 0
        if start >= 0 and line_ends:
            line = bisect.bisect_left(line_ends, start) + 1
        return _Function(name, filename, line, False)

    def _scope_info(self, mem: ProcessMemory, scope: int) -> tuple[str, int]:
        """The function's name and start position from its ScopeInfo, whose layout no v8dbg_ symbol
        gives. Its slots after the map: flags, parameter count, context local count (v8dbg_'s indices),
        (V8 13+: the start and end positions,) the context locals' names and infos, then the function
        variable's name (a string, "" for an anonymous function expression) and its slot, the inferred
        name (undefined or a string: "Module._load"), and (V8 11, 12) the start and end positions
        (small integers). Anything else: no name."""
        v8 = self.v8
        locals_ = _smi(mem.u64(scope - 1 + 8 + 8 * v8.scope_ncontextlocals))
        if locals_ is None or not 0 <= locals_ <= (MAX_SCOPE_SLOTS - v8.scope_first_vars - 8) // 2:
            return "", -1
        n = v8.scope_first_vars + 2 * locals_ + 8  # the slots this reads, no further: no overrun
        slots = struct.unpack_from(f"<{n}Q", mem.read(scope - 1 + 8, 8 * n))
        i = v8.scope_first_vars + 2 * locals_
        names = []
        for w in slots[i : i + 3]:
            if w & 3 == 1 and 0 <= self._instance_type(mem, w) < v8.first_nonstring:
                names.append(self._string(mem, w) or "")
        start = -1
        if v8.scope_first_vars >= 5:  # V8 13+: the positions are fixed slots just before the locals
            a, b = _smi(slots[v8.scope_first_vars - 2]), _smi(slots[v8.scope_first_vars - 1])
            return next((n for n in names if n), ""), a if a is not None and b is not None and 0 <= a < b else -1
        for j in range(i + 1, n - 1):
            a, b = _smi(slots[j]), _smi(slots[j + 1])
            if a is not None and b is not None and 0 <= a < b:
                start = a
                break
        return next((n for n in names if n), ""), start

    def _script(self, mem: ProcessMemory, script: int) -> tuple[str, list[int]]:
        got = self._scripts.get(script)
        if got is not None:
            self._scripts.move_to_end(script)
            return got
        v8 = self.v8
        head = mem.read(script - 1, max(v8.script_name, v8.script_source, v8.script_line_ends) + 8)
        name = self._string(mem, _Q.unpack_from(head, v8.script_name)[0]) or ""
        ends = self._line_ends(mem, _Q.unpack_from(head, v8.script_line_ends)[0])
        if ends is None:
            source = self._string(mem, _Q.unpack_from(head, v8.script_source)[0], MAX_SOURCE_BYTES)
            ends = [i for i, c in enumerate(source) if c == "\n"] if source is not None else []
        self._scripts[script] = (name, ends)
        if len(self._scripts) > SCRIPT_CACHE_ENTRIES:
            self._scripts.popitem(last=False)
        return name, ends

    def _line_ends(self, mem: ProcessMemory, arr: int) -> list[int] | None:
        v8 = self.v8
        if v8.t_fixed_array is None or self._instance_type(mem, arr) != v8.t_fixed_array:
            return None  # undefined until V8 computes them (a stack trace, a profiler)
        length = _smi(mem.u64(arr - 1 + v8.fixed_length))
        if length is None or not 0 < length <= MAX_LINES:
            return None
        out: list[int] = []
        at = arr - 1 + v8.fixed_data
        while len(out) < length:
            k = min(length - len(out), MAX_READ_BYTES // 8)
            data = mem.read(at + 8 * len(out), 8 * k)
            for (w,) in struct.iter_unpack("<Q", data):
                s = _smi(w)
                if s is None:
                    return None
                out.append(s)
        return out

    def _string(self, mem: ProcessMemory, tagged: int, cap: int = MAX_NAME_BYTES, depth: int = 0) -> str | None:
        v8 = self.v8
        t = self._instance_type(mem, tagged)
        if not 0 <= t < v8.first_nonstring or depth > MAX_CONS_DEPTH:
            self.counts.drop("bad_string")
            return None
        obj = tagged - 1
        length = _i.unpack(mem.read(obj + v8.str_length, 4))[0]
        if length < 0:
            return None
        repr_ = t & v8.str_repr_mask
        one = (t & v8.str_encoding_mask) == v8.str_one_byte
        if repr_ == 0:  # sequential
            n = min(length, cap) * (1 if one else 2)
            if not n:
                return ""
            raw = b"".join(
                mem.read(obj + v8.seq_chars + at, min(MAX_READ_BYTES, n - at)) for at in range(0, n, MAX_READ_BYTES)
            )
            return raw.decode("latin-1" if one else "utf-16-le", "replace")
        if repr_ == v8.str_cons:
            a = self._string(mem, mem.u64(obj + v8.cons_first), cap, depth + 1)
            if a is None:
                return None
            b = self._string(mem, mem.u64(obj + v8.cons_second), cap - len(a), depth + 1) if len(a) < cap else ""
            return None if b is None else a + b
        if repr_ == v8.str_thin:
            return self._string(mem, mem.u64(obj + v8.thin_actual), cap, depth + 1)
        if repr_ == v8.str_sliced:
            off = _smi(mem.u64(obj + v8.sliced_offset)) or 0
            parent = self._string(mem, mem.u64(obj + v8.sliced_parent), off + min(length, cap), depth + 1)
            return None if parent is None else parent[off : off + min(length, cap)]
        self.counts.drop("external_string")  # external: its bytes are in C++ memory
        return None
