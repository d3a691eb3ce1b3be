"""Names of the JVM's frames: Class.method, the source file, and the line at a bci.

Owns: a Method* read (its ConstMethod, ConstantPool and holder Klass: the
class's name with dots, a hidden class's "+0x<address>" suffix cut, the
method's name, the class's SourceFile attribute, the method's compressed
line-number table); an interpreted frame's JvmFrame from its Method* and
bcp; a compiled frame's JvmFrames from its nmethod's scope chain at a pc,
leaf first (inlined methods are frames of their own), or the nmethod's own
method when its scopes fail their checks (dropped["scope_fallback"]).
Caches (bounded): methods by Method*, interpreted frames by (Method*, bcp).

Must not: walk frames (walker.py), find code blobs (codecache.py), write
to the target, or log.
"""

from __future__ import annotations

import re
import struct
from collections import OrderedDict
from dataclasses import dataclass

from runtimes.jvm.codecache import Blob, CodeCache
from runtimes.jvm.frames import BadFrame, Counts, JvmFrame, line_table
from runtimes.jvm.layouts import Layout
from runtimes.memory import MemoryReadError, ProcessMemory
from shared.safestr import process_string as safe_text

# Bytes of a symbol (class or method name) read.
MAX_SYMBOL_BYTES = 1024
# Bytes of a method's compressed line-number table (two to five per entry).
MAX_LINE_TABLE_BYTES = 16 << 10
# A method's bytecodes are at most 64 KB (the class-file limit).
MAX_CODE_SIZE = 65535
# Bytes of a line table read first, and at least when a read fails at a page's end; at most per read.
LINE_TABLE_FIRST_READ, LINE_TABLE_MIN_READ, LINE_TABLE_MAX_READ = 256, 16, 8192
# Methods cached (entries).
METHOD_CACHE_ENTRIES = 16384
# Interpreted frames (Method*, bcp) remembered, then forgotten all at once.
INTERP_FRAME_ENTRIES = 65536

# A hidden class's name ends in "+0x<address>" (lambdas' "Foo$$Lambda+0x0000000800000a08"): one name per
# lambda site, not one per process.
_HIDDEN_SUFFIX = re.compile(r"\+0x[0-9a-f]+$")
_Q = struct.Struct("<Q")
_H = struct.Struct("<H")


@dataclass(frozen=True, slots=True)
class Method:
    function: str
    filename: str
    native: bool
    code_base: int  # the address of bytecode 0 (ConstMethod's end)
    lines: tuple[tuple[int, int], ...]  # (start bci, line), in bci order

    def line_at(self, bci: int) -> int:
        line = 0
        for start, ln in self.lines:
            if start > bci:
                break
            line = ln
        return line


class FrameNamer:
    def __init__(self, layout: Layout, code: CodeCache, counts: Counts) -> None:
        self.lay, self.code, self.counts = layout, code, counts
        self._methods: OrderedDict[int, Method | None] = OrderedDict()
        self._interp_frames: dict[tuple[int, int], JvmFrame] = {}  # (Method*, bcp) → its frame

    # ------------------------------------------------------------ frames
    def interpreted(self, mem: ProcessMemory, method: int, bcp: int) -> JvmFrame:
        key = (method, bcp)
        frame = self._interp_frames.get(key)
        if frame is not None:
            self.counts.count("interpreted")
            return frame
        if len(self._interp_frames) >= INTERP_FRAME_ENTRIES:
            self._interp_frames.clear()
        frame = self._interp_frames[key] = self._read_interpreted(mem, method, bcp)
        return frame

    def _read_interpreted(self, mem: ProcessMemory, method: int, bcp: int) -> JvmFrame:
        m = self.method(mem, method)
        if m is None:
            raise BadFrame("interpreted_method")
        bci = bcp - m.code_base if bcp else -1
        self.counts.count("interpreted")
        return JvmFrame(
            m.function,
            m.filename,
            m.line_at(bci) if 0 <= bci <= MAX_CODE_SIZE else 0,
            "native" if m.native else "interpreted",
        )

    def compiled(self, mem: ProcessMemory, blob: Blob, pc: int, running: bool = False) -> list[JvmFrame]:
        """The frames of an nmethod at pc: a return address (a caller's frame), or, `running`, where a
        thread ran when it was sampled: then the PcDesc after pc, or the one before it when there is none
        after it or that one is at no bytecode (the method's entry or exit: a loop with no safepoint or
        call in it has no PcDesc of its own)."""
        nm = self.code.nmethod(mem, blob)
        chain: list[tuple[int, int]] | None = None
        near: tuple[int, ...] = (1,)  # the scopes of the PcDescs around a running pc (0: none)
        if nm.pcs:
            i = nm.pc_desc(pc - blob.code_begin)
            chain = self.code.chain(mem, nm, i)
            before = (len(nm.pcs) if i is None else i) - 1
            if running and before >= 0 and (chain is None or chain[0][1] < 0):
                near = (nm.pcs[before][1], nm.pcs[i][1] if i is not None else 0)
                chain = self.code.chain(mem, nm, before) or chain
        if chain is None:
            m = self.method(mem, nm.method)
            if m is None:
                raise BadFrame("compiled_method")
            if running and not any(near):
                # No scope near a running pc (a loop with no call or safepoint in it): the nmethod's
                # own method, line unknown, as the JIT left no debug information there.
                self.counts.count("no_scope")
            elif nm.pcs:
                self.counts.drop("scope_fallback")
            self.counts.count("native" if m.native else "compiled")
            return [JvmFrame(m.function, m.filename, 0, "native" if m.native else "compiled")]
        out = []
        for depth, (method, bci) in enumerate(chain):
            m = self.method(mem, method)
            if m is None:
                raise BadFrame("scope_method")
            kind = "compiled" if depth == len(chain) - 1 else "inlined"
            self.counts.count(kind)
            out.append(JvmFrame(m.function, m.filename, m.line_at(bci) if bci >= 0 else 0, kind))
        return out

    # ------------------------------------------------------------ methods
    def method(self, mem: ProcessMemory, method: int) -> Method | None:
        if method in self._methods:
            self._methods.move_to_end(method)
            return self._methods[method]
        try:
            m = self._read_method(mem, method)
        except (BadFrame, IndexError, struct.error):
            m = None
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            m = None
        self._methods[method] = m
        if len(self._methods) > METHOD_CACHE_ENTRIES:
            self._methods.popitem(last=False)
        return m

    def _read_method(self, mem: ProcessMemory, method: int) -> Method:
        lay = self.lay
        if not method or method & 7:
            raise BadFrame("method_pointer")
        cm = mem.u64(method + lay.m_const_method)
        if not cm or cm & 7:
            raise BadFrame("const_method")
        raw = mem.read(cm, lay.cm_size)
        cp = _Q.unpack_from(raw, lay.cm_constants)[0]
        code_size = _H.unpack_from(raw, lay.cm_code_size)[0]
        name_index = _H.unpack_from(raw, lay.cm_name_index)[0]
        flags = (
            struct.unpack_from("<I", raw, lay.cm_flags)[0]
            if lay.cm_flags + 4 <= lay.cm_size
            else _H.unpack_from(raw, lay.cm_flags)[0]
        )
        if not cp or cp & 7:
            raise BadFrame("constant_pool")
        craw = mem.read(cp, lay.cp_size)
        holder = _Q.unpack_from(craw, lay.cp_pool_holder)[0]
        if not holder or holder & 7:
            raise BadFrame("pool_holder")
        if lay.cp_source_file_index >= 0:
            file_index = _H.unpack_from(craw, lay.cp_source_file_index)[0]
        else:
            file_index = _H.unpack(mem.read(holder + lay.ik_source_file_index, 2))[0]
        klass = _HIDDEN_SUFFIX.sub("", self._symbol(mem, mem.u64(holder + lay.klass_name)).replace("/", "."))
        name = self._symbol(mem, self._cp_symbol(mem, cp, name_index))
        filename = self._symbol(mem, self._cp_symbol(mem, cp, file_index)) if file_index else ""
        lines: tuple[tuple[int, int], ...] = ()
        if flags & lay.has_linenumber_table:
            lines = self._lines(mem, cm + lay.cm_size + code_size)
        # Native methods: ACC_NATIVE is in Method::_access_flags, not read; a native method has no bytecodes.
        return Method(f"{klass}.{name}", filename, code_size == 0, cm + lay.cm_size, lines)

    def _lines(self, mem: ProcessMemory, at: int) -> tuple[tuple[int, int], ...]:
        """The line-number table at `at` (after the bytecodes), read in growing chunks until it ends."""
        buf = b""
        chunk = LINE_TABLE_FIRST_READ
        while len(buf) < MAX_LINE_TABLE_BYTES:
            try:
                buf += mem.read(at + len(buf), chunk)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget", "denied") or chunk == LINE_TABLE_MIN_READ:
                    raise
                chunk = LINE_TABLE_MIN_READ
                continue
            try:
                return line_table(buf, self.lay.stream_x)
            except (BadFrame, IndexError):
                chunk = min(chunk * 2, LINE_TABLE_MAX_READ)
        return ()

    def _cp_symbol(self, mem: ProcessMemory, cp: int, index: int) -> int:
        return mem.u64(cp + self.lay.cp_size + 8 * index)

    def _symbol(self, mem: ProcessMemory, sym: int) -> str:
        lay = self.lay
        if not sym or sym & 7:
            raise BadFrame("symbol")
        n = _H.unpack(mem.read(sym + lay.sym_length, 2))[0]
        if not n:
            return ""
        return safe_text(mem.read(sym + lay.sym_body, min(n, MAX_SYMBOL_BYTES)))
