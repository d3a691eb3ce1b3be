"""The call chain of one PHP process, read from its memory while it runs.

Owns: the walk from executor_globals.current_execute_data along
prev_execute_data, each zend_execute_data turned into a PhpFrame: function
(Class::method, a function's name, <main> for a script's top level, <eval>
for eval'd code), class, file and line (the lineno of the frame's current
opline; an internal function such as sleep() has no file or line). Function
records (zend_function) are cached by address and the strings they point to,
bounded.

Validation: a func pointer whose type is not internal, user or eval code, a
name or file that is not a zend_string, or a line outside its function's
lines drops the frame, counted in `dropped` by reason; a frame seen before in
the chain (a loop) or an unreadable frame ends the chain; a chain torn by the
running process (it ends in an internal function) is dropped whole, counted
as "torn". Reads are bounded
per chain (MAX_FRAMES); the ReadBudget of the ProcessMemory bounds the bytes.

PHP runs one request per process and thread (NTS): a stack is the current
request's chain; php-fpm and CLI read the same. Fibers that are suspended are
not reached (their chains hang off their zend_fiber objects, not EG).

Must not: write to, stop or attach to the target; log (the caller counts).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from runtimes.memory import MemoryReadError, ProcessMemory
from runtimes.php import layouts
from runtimes.php.layouts import Layout
from runtimes.runtime import ThreadStack

# Frames read per chain: deeper chains are cut (and counted), like the kernel's 127.
MAX_FRAMES = 128
# Bytes of a function, class or file name; longer ones are cut.
MAX_NAME_BYTES = 1024
# Function records cached per process (three names each).
FUNCTION_CACHE_ENTRIES = 4096
# Lines of a PHP source file anyone wrote.
MAX_LINE = 1 << 24

_Q = struct.Struct("<Q")
_I = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class PhpFrame:
    function: str  # Class::method, function, <main>, <eval>
    class_name: str  # "" outside a class
    filename: str  # "" for internal functions
    line: int  # 0 when unknown


@dataclass(frozen=True, slots=True)
class _Function:
    kind: int
    name: str
    class_name: str
    filename: str
    line_start: int
    line_end: int


class PhpProcess:
    def __init__(self, version: str, layout: Layout, executor_globals: int) -> None:
        self.version, self.layout, self.eg = version, layout, executor_globals
        self._ex_bytes = max(layout.ex_opline, layout.ex_func, layout.ex_prev) + 8
        self._functions: OrderedDict[tuple[int, bytes], _Function | None] = OrderedDict()
        self.dropped: dict[str, int] = {}

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]:
        lay = self.layout
        ex = mem.u64(self.eg + lay.eg_current_execute_data)
        frames: list[PhpFrame] = []
        seen: set[int] = set()
        while ex:
            if ex in seen:
                self._drop("loop")
                break
            if len(seen) >= MAX_FRAMES:
                self._drop("too_deep")
                break
            seen.add(ex)
            try:
                raw = mem.read(ex, self._ex_bytes) if not ex & 7 else None
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                raw = None
            if raw is None:
                self._drop("bad_pointer")
                break
            func = _Q.unpack_from(raw, lay.ex_func)[0]
            if func:  # a frame without a function is a VM stub frame
                got = self._frame(mem, func, _Q.unpack_from(raw, lay.ex_opline)[0])
                if got is not None:
                    frames.append(got)
            ex = _Q.unpack_from(raw, lay.ex_prev)[0]
        if not frames:
            return []
        # The process runs on while its chain is read, leaf first. A call frame is reused by the
        # next call, whose setup clears its prev_execute_data before the call: a chain read across
        # that ends in an internal function (real chains end in a script's top level). (Re-reading
        # EG after the walk to drop chains whose leaf moved was tried: a leaf internal call is over
        # long before the walk ends, so it dropped a tenth of the stacks, unevenly: 3:1 read 3.4:1.)
        if frames[-1].filename == "":
            self._drop("torn")
            return []
        return [ThreadStack(0, tuple(frames))]

    def _frame(self, mem: ProcessMemory, func: int, opline: int) -> PhpFrame | None:
        try:
            fn = self._function(mem, func)
            if fn is None:
                return None
            if fn.kind == layouts.INTERNAL_FUNCTION:
                return PhpFrame(_qualified(fn), fn.class_name, "", 0)
            line = mem.u32(opline + self.layout.op_lineno) if opline else 0
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            self._drop("bad_pointer")
            return None
        if opline and not fn.line_start <= line <= fn.line_end:
            self._drop("impossible_line")
            return None
        return PhpFrame(_qualified(fn), fn.class_name, fn.filename, line)

    def _function(self, mem: ProcessMemory, func: int) -> _Function | None:
        lay = self.layout
        if func & 7:
            self._drop("bad_pointer")
            return None
        head = mem.read(func, lay.fn_bytes)
        kind = head[lay.fn_type]
        if kind not in (layouts.INTERNAL_FUNCTION, layouts.USER_FUNCTION, layouts.EVAL_CODE):
            self._drop("not_function")
            return None
        user = kind != layouts.INTERNAL_FUNCTION
        # The record's pointers and lines are its identity: a freed and reused address differs in them.
        key = (func, head[lay.fn_name : lay.fn_name + 16] + (head[lay.fn_filename : lay.fn_bytes] if user else b""))
        if key in self._functions:
            self._functions.move_to_end(key)
            return self._functions[key]
        got = self._read_function(mem, head, kind)
        self._functions[key] = got
        if len(self._functions) > FUNCTION_CACHE_ENTRIES:
            self._functions.popitem(last=False)
        return got

    def _read_function(self, mem: ProcessMemory, head: bytes, kind: int) -> _Function | None:
        lay = self.layout
        name_p, scope = _Q.unpack_from(head, lay.fn_name)[0], _Q.unpack_from(head, lay.fn_scope)[0]
        name = self._string(mem, name_p) if name_p else ("<eval>" if kind == layouts.EVAL_CODE else "<main>")
        class_name = self._string(mem, mem.u64(scope + lay.ce_name)) if scope else ""
        if name is None or class_name is None:
            return None
        if kind == layouts.INTERNAL_FUNCTION:
            return _Function(kind, name, class_name, "", 0, 0)
        filename = self._string(mem, _Q.unpack_from(head, lay.fn_filename)[0])
        start, end = _I.unpack_from(head, lay.fn_line_start)[0], _I.unpack_from(head, lay.fn_line_end)[0]
        if filename is None:
            return None
        if not 0 < start <= end <= MAX_LINE:
            self._drop("impossible_line")
            return None
        return _Function(kind, name, class_name, filename, start, end)

    def _string(self, mem: ProcessMemory, address: int) -> str | None:
        """A zend_string's text; None (counted) if `address` does not hold one."""
        if not address or address & 7:
            self._drop("bad_string")
            return None
        head = mem.read(address, layouts.STRING_VAL)
        type_info = _I.unpack_from(head, layouts.STRING_TYPE_INFO)[0]
        length = _Q.unpack_from(head, layouts.STRING_LEN)[0]
        if type_info & 0xF != layouts.IS_STRING or length > 1 << 20:
            self._drop("bad_string")
            return None
        n = min(length, MAX_NAME_BYTES)
        return mem.read(address + layouts.STRING_VAL, n).decode("utf-8", "replace") if n else ""


def _qualified(fn: _Function) -> str:
    return f"{fn.class_name}::{fn.name}" if fn.class_name else fn.name
