"""Java thread stacks of one HotSpot JVM, read from its memory while it runs.

Owns: the JVM's Java threads (ThreadsSMRSupport::_java_thread_list, each
JavaThread's OSThread for its tid) and, for each thread that has a last
Java frame recorded (its JavaFrameAnchor: in native code, in the VM or
blocked; a thread running Java code has none, and is not walked without its
registers: its stack is the one frame "[running Java code]"), its frames
from there:
- interpreted frames (the pc in the code cache's "Interpreter" blob): the
  Method and bcp from the frame's slots; the caller from the saved fp, the
  return address and the interpreter's sender sp;
- compiled frames (an nmethod: C1, C2, or a native method's wrapper): the
  PcDesc of the pc (exact for a return address, the next one after it
  otherwise) and its ScopeDesc chain, leaf first, so methods inlined into the
  nmethod are frames of their own, each with its bci; the caller from the
  nmethod's frame size. A layout or scope that fails its checks gives the
  nmethod's own method, counted in dropped["scope_fallback"];
- the call stub (Java called from native code): its JavaCallWrapper's saved
  anchor continues the walk below the native frames (a "[call stub]" frame
  marks the transition), or ends it (the thread's first Java call);
- other code blobs (runtime stubs, adapters, safepoint and deopt blobs):
  a frame named "[stub: <name>]", then sp-based unwinding by its frame size.
Methods are named Class.method (the class's name with dots), their source
file from the class's SourceFile attribute and the line from the method's
compressed line-number table at the frame's bci.

Caches (bounded): code blob per pc, decoded nmethod per blob (re-checked
by its compile id once per sample), method names and line tables by Method*.

Validation: every pointer is checked before it is followed (alignment, the
thread's stack bounds for stack slots, the code heaps for pcs); counts and
lengths are capped (the constants below). A thread or frame that fails is
dropped and counted in `dropped` by reason.

Must not: write to, stop or attach to the target; log.
"""

from __future__ import annotations

import re
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtimes.jvm import layouts, x86edge
from runtimes.jvm.layouts import Layout
from runtimes.memory import MAX_USER_ADDRESS, MemoryReadError, ProcessMemory
from runtimes.runtime import ThreadStack
from shared.safestr import process_string as safe_text
from shared.wire import RegsSample

# Java threads read per process (a busy server has a few hundred).
MAX_THREADS = 2048
# Frames read per thread (profiles cut deeper stacks here).
MAX_FRAMES = 128
# Inlining depth of one PcDesc (C2's MaxInlineLevel is 15; JDK 21's default is 15).
MAX_INLINE_DEPTH = 64
# Bytes of a symbol (class or method name) read.
MAX_SYMBOL_BYTES = 1024
# Bytes of a method's compressed line-number table (two to five per entry).
MAX_LINE_TABLE_BYTES = 16 << 10
# A method's bytecodes are at most 64 KB (the class-file limit).
MAX_CODE_SIZE = 65535
# Bytes of one nmethod's PcDescs or scopes data (C2's largest are a few tens of KB).
MAX_DEBUG_BYTES = 256 << 10
# Code heaps (HotSpot has three with a segmented code cache).
MAX_HEAPS = 8
# Segment-map bytes read per hop back to a blob's start, and hops.
SEGMAP_CHUNK = 1024
MAX_SEGMAP_HOPS = 64
# Bytes of a thread's stack read with its anchor at first (then what its last walk needed, rounded up
# to pages, at most MAX_STACK_WINDOW); further slots are read in chunks of this size.
STACK_CHUNK = 8 << 10
MAX_STACK_WINDOW = 48 << 10
# A frame size (words) past this is corrupt (HotSpot's largest are a few thousand).
MAX_FRAME_WORDS = 1 << 16
# A thread stack larger than this is corrupt (HotSpot's -Xss is at most 1 GiB).
MAX_THREAD_STACK = 1 << 32
# An nmethod's metadata (Method*, Klass*) table index past this is corrupt.
MAX_METADATA_INDEX = 1 << 16
# CodeHeap segment sizes: 2^4 to 2^16 bytes (CodeCacheSegmentSize is 64 or 128).
MIN_LOG2_SEGMENT, MAX_LOG2_SEGMENT = 4, 16
# A code blob larger than this is corrupt (the whole code cache is at most 2 GiB).
MAX_BLOB_BYTES = 1 << 30
# Bytes of a code blob's name ("nmethod", "Interpreter", "StubRoutines (1)", a runtime stub's).
MAX_BLOB_NAME = 64
# Stack read beyond the deepest slot the last walk needed, and the granule the window is rounded to.
STACK_SLACK, STACK_GRANULE = 1024, 4096
# Cache sizes (entries).
BLOB_CACHE_ENTRIES = 16384
METHOD_CACHE_ENTRIES = 16384
NMETHOD_CACHE_ENTRIES = 4096
# Running pcs of compiled code whose place in the frame's set-up (x86edge) is remembered: the hot ones.
EDGE_CACHE_ENTRIES = 16384
# Interpreted frames (Method*, bcp) remembered, then forgotten all at once.
INTERP_FRAME_ENTRIES = 65536
# Frames read, by kind; "no_scope": a running pc of compiled code with no debug information near it;
# "entry", "exit": one in its method's prologue or epilogue, walked from the decoded instructions.
FRAME_KINDS = ("interpreted", "compiled", "inlined", "native", "stub", "running", "no_scope", "entry", "exit")

# A hidden class's name ends in "+0x<address>" (lambdas' "Foo$$Lambda+0x0000000800000a08"): one name per
# lambda site, not one per process.
_HIDDEN_SUFFIX = re.compile(r"\+0x[0-9a-f]+$")
_Q = struct.Struct("<Q")
_I = struct.Struct("<i")
_H = struct.Struct("<H")
_h = struct.Struct("<h")
_QQQ = struct.Struct("<QQQ")


@dataclass(frozen=True, slots=True)
class JvmFrame:
    function: str  # "pkg.Class.method", or "[stub: name]"
    filename: str  # the class's source file ("Foo.java"); "" for stubs
    line: int
    kind: str  # interpreted, compiled, inlined, native, stub, running


# The frame between Java code and the native code that called it (its entry frame, the call stub).
CALL_STUB = JvmFrame("[call stub]", "", 0, "stub")
# The one frame of a thread running Java code: it records no last Java frame while it runs.
RUNNING_JAVA = JvmFrame("[running Java code]", "", 0, "running")


@dataclass(frozen=True, slots=True)
class _Method:
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


@dataclass(slots=True)
class _Blob:
    start: int
    end: int
    name: str
    frame_words: int
    frame_complete: int  # bytes from code_begin where the frame is whole; -1 unknown
    nmethod: bool
    code_begin: int
    compile_id: int
    interpreter: bool
    call_stub: bool


@dataclass(slots=True)
class _Nmethod:
    method: int
    compile_id: int
    pcs: list[tuple[int, int]]  # (pc offset, scope decode offset), sorted by pc offset
    scopes: bytes
    metadata: int
    chains: dict[int, list[tuple[int, int]] | None]


class _Bad(Exception):
    """A frame or thread failed validation; args[0] is the reason counted."""


def read_uint(buf: bytes, pos: int, x: int) -> tuple[int, int]:
    """One UNSIGNED5 value at pos (x: excluded low bytes, 0 before JDK 20, 1 after); (value, next pos)."""
    low = 256 - 64 - x
    b = buf[pos] - x
    if b < 0:
        raise _Bad("stream_byte")
    if b < low:
        return b, pos + 1
    total, shift = b, 6
    for i in range(1, 5):
        c = buf[pos + i] - x
        if c < 0:
            raise _Bad("stream_byte")
        total += c << shift
        if c < low or i == 4:
            return total & 0xFFFFFFFF, pos + i + 1
        shift += 6
    raise AssertionError("unreachable")


def read_signed(buf: bytes, pos: int, x: int) -> tuple[int, int]:
    v, pos = read_uint(buf, pos, x)
    return (v >> 1) ^ -(v & 1), pos


def line_table(buf: bytes, x: int) -> tuple[tuple[int, int], ...]:
    """HotSpot's compressed line-number table: a byte (bci delta << 3 | line delta), or 0xFF then two
    signed values; 0 ends it."""
    out: list[tuple[int, int]] = []
    bci = line = pos = 0
    while pos < len(buf):
        b = buf[pos]
        pos += 1
        if b == 0:
            return tuple(out)
        if b == 0xFF:
            d_bci, pos = read_signed(buf, pos, x)
            d_line, pos = read_signed(buf, pos, x)
            bci, line = bci + d_bci, line + d_line
        else:
            bci, line = bci + (b >> 3), line + (b & 7)
        out.append((bci, line))
    raise _Bad("line_table_unterminated")


class _Stack:
    """A thread's stack, read in chunks: first the window read with its anchor, then more as needed."""

    def __init__(self, mem: ProcessMemory, lo: int, hi: int) -> None:
        self.mem, self.lo, self.hi = mem, lo, hi
        self.start, self.data = hi, b""  # the chunk looked in first
        self.chunks: list[tuple[int, bytes]] = []
        self.lowest = hi  # the lowest slot read

    def add(self, start: int, data: bytes) -> None:
        self.chunks.append((start, data))
        self.start, self.data = start, data

    def word(self, address: int) -> int:
        start = self.start
        if start <= address <= start + len(self.data) - 8 and not address & 7:
            self.lowest = min(self.lowest, address)
            return _Q.unpack_from(self.data, address - start)[0]
        return self.words(address, 1)[0]

    def words(self, address: int, n: int) -> tuple[int, ...]:
        """n words from address up."""
        end = address + 8 * n
        if address & 7 or not self.lo <= address or end > self.hi:
            raise _Bad("stack_slot")
        self.lowest = min(self.lowest, address)
        for start, data in self.chunks:
            if start <= address and end <= start + len(data):
                self.start, self.data = start, data
                return struct.unpack_from(f"<{n}Q", data, address - start)
        start = address & ~0xFFF
        size = min(max(STACK_CHUNK, end - start), self.hi - start)
        try:
            data = self.mem.read(start, size)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            raise _Bad("stack_unreadable") from None
        self.add(start, data)
        return struct.unpack_from(f"<{n}Q", data, address - start)


class JvmProcess:
    def __init__(self, version: str, layout: Layout) -> None:
        self.version, self.lay = version, layout
        self.dropped: dict[str, int] = {}
        self.frames: dict[str, int] = dict.fromkeys(FRAME_KINDS, 0)  # frames read, by kind
        self._interp_frames: dict[tuple[int, int], JvmFrame] = {}  # (Method*, bcp) → its frame
        self._heaps: list[tuple[int, int, int, int]] | None = None  # (low, high, segmap, log2 segment)
        self._blobs: OrderedDict[int, _Blob | None] = OrderedDict()
        self._methods: OrderedDict[int, _Method | None] = OrderedDict()
        self._nmethods: OrderedDict[int, _Nmethod] = OrderedDict()
        # (blob start, compile id, pc) → where a running frame at pc stands (None: whole), x86edge
        self._edges: OrderedDict[tuple[int, int, int], tuple[x86edge.Edge, str] | None] = OrderedDict()
        self._depths: dict[int, int] = {}  # JavaThread → bytes of its stack read with its anchor
        self._checked: set[int] = set()  # code blobs (by start) checked again this sample
        # OS thread id → (JavaThread*, stack base, stack size), read again when a sample names another
        self._regs_threads: dict[int, tuple[int, int, int]] = {}

    def self_check(self, mem: ProcessMemory) -> None:
        """The thread list and the code heaps are where the tables say (raises _Bad or MemoryReadError)."""
        at = self.lay.java_thread_list if self.lay.java_thread_list >= 0 else self.lay.threads_head
        tl = mem.u64(at)
        if tl & 7:
            raise _Bad(f"the thread list pointer is {tl:#x}")
        self._heap_list(mem)

    # ------------------------------------------------------------ threads
    def _threads(self, mem: ProcessMemory) -> list[int]:
        lay = self.lay
        if lay.java_thread_list < 0:  # JDK 11: the list linked by JavaThread::_next
            out: list[int] = []
            t = mem.u64(lay.threads_head)
            while t and not t & 7 and len(out) < MAX_THREADS:
                out.append(t)
                t = mem.u64(t + lay.jt_next)
            return out
        tl = mem.u64(lay.java_thread_list)
        if not tl or tl & 7:
            self._drop("thread_list")
            return []
        raw = mem.read(tl, max(lay.tl_length + 4, lay.tl_threads + 8))
        n = struct.unpack_from("<I", raw, lay.tl_length)[0]
        arr = _Q.unpack_from(raw, lay.tl_threads)[0]
        if n > MAX_THREADS:
            self._drop("threads_capped")
            n = MAX_THREADS
        if not n:
            return []
        return [p for (p,) in struct.iter_unpack("<Q", mem.read(arr, 8 * n))]

    def _thread_records(self, mem: ProcessMemory) -> tuple[int, list[tuple[int, bytes | None, int]]]:
        """(lo, [(JavaThread*, its fields from offset lo on or None, its OS thread id or 0)]) of every Java
        thread: the list, the threads' fields and their OS thread ids in three reads."""
        lay = self.lay
        try:
            ptrs = self._threads(mem)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            self._drop("thread_list_unreadable")
            return 0, []
        lo = min(lay.jt_anchor, lay.jt_osthread, lay.jt_stack_base, lay.jt_stack_size, lay.jt_thread_state)
        if not ptrs:
            return lo, []
        hi = max(
            lay.jt_anchor + 24,
            lay.jt_osthread + 8,
            lay.jt_stack_base + 8,
            lay.jt_stack_size + 8,
            lay.jt_thread_state + 4,
        )
        got = mem.read_many([(p + lo, hi - lo) if p and not p & 7 else (0, 0) for p in ptrs])
        osreads = []
        for raw_t in got:
            if raw_t is None:
                osreads.append((0, 0))
                continue
            os_t = _Q.unpack_from(raw_t, lay.jt_osthread - lo)[0]
            osreads.append((os_t + lay.os_thread_id, 4) if os_t and not os_t & 7 else (0, 0))
        tids = mem.read_many(osreads)
        return lo, [
            (t, raw_t, struct.unpack("<i", raw_tid)[0] if raw_tid else 0) for t, raw_t, raw_tid in zip(ptrs, got, tids)
        ]

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]:
        lay = self.lay
        self._checked = set()
        lo, records = self._thread_records(mem)
        out: list[ThreadStack] = []
        depths: dict[int, int] = {}
        for t, raw_t, tid in records:
            if raw_t is None:
                self._drop("thread_unreadable")
                continue
            a = lay.jt_anchor - lo
            if not _Q.unpack_from(raw_t, a + lay.anchor_sp)[0]:
                # No recorded frame: running Java code (shown as such: walking it needs its registers), or a
                # thread with no Java frames (compiler threads, one not started yet).
                state = _I.unpack_from(raw_t, lay.jt_thread_state - lo)[0]
                if state in (lay.state_in_java, lay.state_in_java_trans):
                    out.append(ThreadStack(tid, (RUNNING_JAVA,)))
                    self._count("running")
                else:
                    self._drop("no_java_frame")
                continue
            base, size = self._bounds(raw_t, lo)
            if not size:
                self._drop("stack_bounds")
                continue
            # The anchor and the stack below the thread's base in one system call: read apart, a thread
            # that parks again at the same depth meanwhile mixes one call's callers into another's.
            depth = min(size, self._depths.get(t, STACK_CHUNK))
            anchor, window = mem.read_many([(t + lay.jt_anchor, 24), (base - depth, depth)])
            if anchor is None or window is None:
                self._drop("stack_unreadable")
                continue
            sp, pc, fp = (_Q.unpack_from(anchor, o)[0] for o in (lay.anchor_sp, lay.anchor_pc, lay.anchor_fp))
            if not sp:
                out.append(ThreadStack(tid, (RUNNING_JAVA,)))  # it went back into Java meanwhile
                self._count("running")
                continue
            stack = _Stack(mem, base - size, base)
            stack.add(base - depth, window)
            frames = self._walk_or_drop(mem, stack, sp, fp, pc)
            if frames is None:
                continue
            need = -(-(base - stack.lowest + STACK_SLACK) // STACK_GRANULE) * STACK_GRANULE
            depths[t] = min(max(STACK_CHUNK, need), MAX_STACK_WINDOW)
            if frames:
                out.append(ThreadStack(tid, tuple(frames)))
        self._depths = depths
        return out

    def _bounds(self, raw_t: bytes, lo: int) -> tuple[int, int]:
        """(stack base, stack size) of a JavaThread's fields read from offset lo; (0, 0) if implausible."""
        base = _Q.unpack_from(raw_t, self.lay.jt_stack_base - lo)[0]
        size = _Q.unpack_from(raw_t, self.lay.jt_stack_size - lo)[0]
        if not 0 < size < MAX_THREAD_STACK or not size < base <= MAX_USER_ADDRESS or base & 7:
            return 0, 0
        return base, size

    def _walk_or_drop(
        self, mem: ProcessMemory, stack: _Stack, sp: int, fp: int, pc: int, running: bool = False
    ) -> list[JvmFrame] | None:
        """walk(), with a stack that fails its checks counted in `dropped` (None) rather than raised."""
        try:
            return self.walk(mem, stack, sp, fp, pc, running)
        except _Bad as e:
            self._drop(e.args[0])
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            self._drop(f"read_{e.reason}")  # a pointer into memory the JVM freed or never had
        except (struct.error, IndexError, ValueError, OverflowError):
            self._drop("malformed")
        return None

    def sample_regs(self, mem: ProcessMemory, samples: Sequence[RegsSample]) -> list[ThreadStack]:
        """On-CPU samples walked from their registers: a thread running JIT or interpreted code from its
        pc, sp and fp (the slots the stack copy holds from it, the rest from memory now: a caller that
        returned since the sample is read as the frame now there); a thread in the VM or native code
        from its last Java frame, as sample() walks it. A thread that is not a Java thread, or with no
        Java frame, is left out (dropped["regs_no_thread"], ["no_java_frame"])."""
        lay = self.lay
        self._checked = set()
        out: list[ThreadStack] = []
        for r in samples:
            t = self._regs_threads.get(r.tid)
            if t is None:
                lo, records = self._thread_records(mem)
                self._regs_threads = {
                    tid: (p, *self._bounds(raw, lo)) for p, raw, tid in records if raw is not None and tid
                }
                t = self._regs_threads.get(r.tid)
                if t is None:
                    self._drop("regs_no_thread")  # a VM thread (GC, compiler), or one gone since
                    continue
            ptr, base, size = t
            if not size or not base - size <= r.sp < base:
                self._drop("stack_bounds")
                del self._regs_threads[r.tid]  # a new thread with the old one's id: read again next time
                continue
            stack = _Stack(mem, base - size, base)
            if r.stack:
                stack.add(r.sp, r.stack[: max(0, min(len(r.stack), base - r.sp)) & ~7])
            sp, fp, pc, running = r.sp, r.fp, r.ip, True
            if self._blob(mem, pc) is None:  # in the VM or native code: from its last Java frame
                running = False
                try:
                    sp, pc, fp = self._anchor(mem, ptr + lay.jt_anchor)
                except MemoryReadError as e:
                    if e.reason in ("gone", "budget", "denied"):
                        raise
                    self._drop("thread_unreadable")
                    continue
                if not sp:
                    self._drop("no_java_frame")
                    continue
            frames = self._walk_or_drop(mem, stack, sp, fp, pc, running)
            if frames:
                out.append(ThreadStack(r.tid, tuple(frames)))
        return out

    def walk(  # noqa: PLR0912
        self, mem: ProcessMemory, stack: _Stack, sp: int, fp: int, pc: int, running: bool = False
    ) -> list[JvmFrame]:
        """Frames leaf first from a last Java frame (sp, fp, pc; pc 0: the word below sp), or, `running`,
        from the registers of a thread sampled while it ran (its pc is not a return address)."""
        lay = self.lay
        stack_lo, stack_hi = stack.lo, stack.hi
        if not pc:
            pc = stack.word(sp - 8)
        frames: list[JvmFrame] = []
        while len(frames) < MAX_FRAMES:
            below = sp
            blob = self._blob(mem, pc)
            if blob is None:
                break  # native code: the end of this Java stack
            if blob.interpreter:
                if not stack_lo < fp < stack_hi:
                    raise _Bad("interpreter_fp")
                # The slots from the bcp's up to the return address, in one unpack.
                slots = stack.words(fp + 8 * layouts.INTERP_BCP_SLOT, 2 - layouts.INTERP_BCP_SLOT)
                top = -layouts.INTERP_BCP_SLOT  # index of the slot at fp
                frames.append(self._interpreted(mem, slots[top + layouts.INTERP_METHOD_SLOT], slots[0]))
                pc, fp, sp = slots[top + 1], slots[top], slots[top + lay.sender_sp_slot]
            elif blob.call_stub:
                wrapper = stack.word(fp + 8 * lay.call_wrapper_slot)
                if not wrapper or wrapper & 7:
                    raise _Bad("call_wrapper")
                sp, pc, fp = self._anchor(mem, wrapper + lay.wrapper_anchor)
                if not sp:
                    break  # the thread's first Java call: nothing below but native code
                # Java called from native code (JNI, the VM's own calls such as reflection's before JDK 18):
                # the Java frames that called that native code continue at the wrapper's saved anchor.
                frames.append(CALL_STUB)
                self._count("stub")
                if not pc:
                    pc = stack.word(sp - 8)
            else:
                top = running and not frames  # pc is where it ran, not a return address
                if blob.nmethod:
                    frames.extend(self._compiled(mem, blob, pc, top))
                else:
                    frames.append(JvmFrame(f"[stub: {blob.name}]", "", 0, "stub"))
                    self._count("stub")
                if blob.frame_words <= 0:
                    break  # no frame size: not walkable from here
                edge = self._edge(mem, blob, pc) if top and blob.nmethod else None
                if edge is None:
                    sender_sp = sp + 8 * blob.frame_words
                    pc, fp, sp = stack.word(sender_sp - 8), stack.word(sender_sp - 16), sender_sp
                else:  # entering or returning: less than the whole frame on the stack
                    ret = sp + edge.ret_at
                    fp = fp if edge.caller_rbp_at is None else stack.word(sp + edge.caller_rbp_at)
                    pc, sp = stack.word(ret), ret + 8
            if not below < sp <= stack_hi:
                raise _Bad("sender_sp")  # every caller's frame lies above its callee's
        else:
            self._drop("frames_capped")
        return frames[:MAX_FRAMES]

    def _edge(self, mem: ProcessMemory, blob: _Blob, pc: int) -> x86edge.Edge | None:
        """Where a compiled frame sampled running at pc stands if that is in its method's prologue or
        epilogue (x86edge); None when its frame is whole there, or its code there is not known."""
        key = (blob.start, blob.compile_id, pc)
        if key in self._edges:
            got = self._edges[key]
            self._edges.move_to_end(key)
        else:
            try:
                code = mem.read(pc, min(x86edge.EDGE_CODE_BYTES, blob.end - pc))
            except MemoryReadError as e:
                if e.reason in ("gone", "budget", "denied"):
                    raise
                return None
            off = pc - blob.code_begin
            if 0 <= off < blob.frame_complete:
                edge = x86edge.in_prologue(code, blob.frame_complete - off, 8 * blob.frame_words)
                got = (edge, "entry") if edge else None
            else:
                edge = x86edge.in_epilogue(code)
                got = (edge, "exit") if edge else None
            self._edges[key] = got
            if len(self._edges) > EDGE_CACHE_ENTRIES:
                self._edges.popitem(last=False)
        if got is None:
            return None
        self._count(got[1])
        return got[0]

    def _anchor(self, mem: ProcessMemory, at: int) -> tuple[int, int, int]:
        raw = mem.read(at, 24)
        lay = self.lay
        return (
            _Q.unpack_from(raw, lay.anchor_sp)[0],
            _Q.unpack_from(raw, lay.anchor_pc)[0],
            _Q.unpack_from(raw, lay.anchor_fp)[0],
        )

    # ------------------------------------------------------------ frames
    def _interpreted(self, mem: ProcessMemory, method: int, bcp: int) -> JvmFrame:
        key = (method, bcp)
        frame = self._interp_frames.get(key)
        if frame is not None:
            self.frames["interpreted"] += 1
            return frame
        if len(self._interp_frames) >= INTERP_FRAME_ENTRIES:
            self._interp_frames.clear()
        frame = self._interp_frames[key] = self._read_interpreted(mem, method, bcp)
        return frame

    def _read_interpreted(self, mem: ProcessMemory, method: int, bcp: int) -> JvmFrame:
        m = self._method(mem, method)
        if m is None:
            raise _Bad("interpreted_method")
        bci = bcp - m.code_base if bcp else -1
        self._count("interpreted")
        return JvmFrame(
            m.function,
            m.filename,
            m.line_at(bci) if 0 <= bci <= MAX_CODE_SIZE else 0,
            "native" if m.native else "interpreted",
        )

    def _compiled(self, mem: ProcessMemory, blob: _Blob, pc: int, running: bool = False) -> list[JvmFrame]:
        """The frames of an nmethod at pc: a return address (a caller's frame), or, `running`, where a
        thread ran when it was sampled: then the PcDesc after pc, or the one before it when there is none
        after it or that one is at no bytecode (the method's entry or exit: a loop with no safepoint or
        call in it has no PcDesc of its own)."""
        nm = self._nmethod(mem, blob)
        chain: list[tuple[int, int]] | None = None
        near: tuple[int, ...] = (1,)  # the scopes of the PcDescs around a running pc (0: none)
        if nm.pcs:
            i = self._pc_desc(nm, pc - blob.code_begin)
            chain = self._chain(mem, nm, i)
            before = (len(nm.pcs) if i is None else i) - 1
            if running and before >= 0 and (chain is None or chain[0][1] < 0):
                near = (nm.pcs[before][1], nm.pcs[i][1] if i is not None else 0)
                chain = self._chain(mem, nm, before) or chain
        if chain is None:
            m = self._method(mem, nm.method)
            if m is None:
                raise _Bad("compiled_method")
            if running and not any(near):
                # No scope near a running pc (a loop with no call or safepoint in it): the nmethod's
                # own method, line unknown, as the JIT left no debug information there.
                self._count("no_scope")
            elif nm.pcs:
                self._drop("scope_fallback")
            self._count("native" if m.native else "compiled")
            return [JvmFrame(m.function, m.filename, 0, "native" if m.native else "compiled")]
        out = []
        for depth, (method, bci) in enumerate(chain):
            m = self._method(mem, method)
            if m is None:
                raise _Bad("scope_method")
            kind = "compiled" if depth == len(chain) - 1 else "inlined"
            self._count(kind)
            out.append(JvmFrame(m.function, m.filename, m.line_at(bci) if bci >= 0 else 0, kind))
        return out

    def _chain(self, mem: ProcessMemory, nm: _Nmethod, i: int | None) -> list[tuple[int, int]] | None:
        """The scope chain of the nmethod's i-th PcDesc (decoded once), or None."""
        if i is None:
            return None
        scope = nm.pcs[i][1]
        if scope not in nm.chains:
            try:
                nm.chains[scope] = self._scopes(mem, nm, scope)
            except (_Bad, IndexError):
                nm.chains[scope] = None
        return nm.chains[scope]

    @staticmethod
    def _pc_desc(nm: _Nmethod, off: int) -> int | None:
        """The index of the PcDesc at pc offset `off` (a return address), else of the first one after it."""
        lo, hi = 0, len(nm.pcs)
        while lo < hi:
            mid = (lo + hi) // 2
            if nm.pcs[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(nm.pcs):
            return None
        return lo

    def _scopes(self, mem: ProcessMemory, nm: _Nmethod, decode: int) -> list[tuple[int, int]] | None:
        """(Method*, bci) of the scope at `decode` and its senders, innermost first."""
        lay, x = self.lay, self.lay.stream_x
        chain: list[tuple[int, int]] = []
        indices: list[tuple[int, int]] = []
        while decode and len(indices) < MAX_INLINE_DEPTH:
            if not 0 < decode < len(nm.scopes):
                raise _Bad("scope_offset")
            sender, pos = read_uint(nm.scopes, decode, x)
            index, pos = read_uint(nm.scopes, pos, x)
            bci, pos = read_uint(nm.scopes, pos, x)
            indices.append((index, bci + lay.invocation_entry_bci))
            if sender >= decode:
                raise _Bad("scope_order")  # senders are written before the scopes that name them
            decode = sender
        if not indices:
            return None
        if not nm.metadata:
            raise _Bad("scope_metadata")
        want = sorted({i for i, _ in indices})
        if want[0] < 1 or want[-1] > MAX_METADATA_INDEX:
            raise _Bad("scope_index")
        got = mem.read_many([(nm.metadata + 8 * (i - 1), 8) for i in want])
        methods = {}
        for i, raw in zip(want, got):
            if raw is None:
                raise _Bad("scope_metadata")
            methods[i] = _Q.unpack(raw)[0]
        for i, bci in indices:
            chain.append((methods[i], bci))
        return chain

    # ------------------------------------------------------------ methods
    def _method(self, mem: ProcessMemory, method: int) -> _Method | None:
        if method in self._methods:
            self._methods.move_to_end(method)
            return self._methods[method]
        try:
            m = self._read_method(mem, method)
        except (_Bad, IndexError, struct.error):
            m = None
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            m = None
        self._methods[method] = m
        if len(self._methods) > METHOD_CACHE_ENTRIES:
            self._methods.popitem(last=False)
        return m

    def _read_method(self, mem: ProcessMemory, method: int) -> _Method:
        lay = self.lay
        if not method or method & 7:
            raise _Bad("method_pointer")
        cm = mem.u64(method + lay.m_const_method)
        if not cm or cm & 7:
            raise _Bad("const_method")
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
            raise _Bad("constant_pool")
        craw = mem.read(cp, lay.cp_size)
        holder = _Q.unpack_from(craw, lay.cp_pool_holder)[0]
        if not holder or holder & 7:
            raise _Bad("pool_holder")
        if lay.cp_source_file_index >= 0:
            file_index = _H.unpack_from(craw, lay.cp_source_file_index)[0]
        else:
            file_index = _H.unpack(mem.read(holder + lay.ik_source_file_index, 2))[0]
        klass = _HIDDEN_SUFFIX.sub("", self._symbol(mem, mem.u64(holder + lay.klass_name)).replace("/", "."))
        name = self._symbol(mem, self._cp_symbol(mem, cp, name_index))
        filename = self._symbol(mem, self._cp_symbol(mem, cp, file_index)) if file_index else ""
        lines: tuple[tuple[int, int], ...] = ()
        if flags & lay.has_linenumber_table:
            at = cm + lay.cm_size + code_size
            buf = b""
            chunk = 256
            while len(buf) < MAX_LINE_TABLE_BYTES:
                try:
                    buf += mem.read(at + len(buf), chunk)
                except MemoryReadError as e:
                    if e.reason in ("gone", "budget", "denied") or chunk == 16:
                        raise
                    chunk = 16
                    continue
                try:
                    lines = line_table(buf, lay.stream_x)
                    break
                except (_Bad, IndexError):
                    chunk = min(chunk * 2, 8192)
        # Native methods: ACC_NATIVE is in Method::_access_flags, not read; a native method has no bytecodes.
        return _Method(f"{klass}.{name}", filename, code_size == 0, cm + lay.cm_size, lines)

    def _cp_symbol(self, mem: ProcessMemory, cp: int, index: int) -> int:
        return mem.u64(cp + self.lay.cp_size + 8 * index)

    def _symbol(self, mem: ProcessMemory, sym: int) -> str:
        lay = self.lay
        if not sym or sym & 7:
            raise _Bad("symbol")
        n = _H.unpack(mem.read(sym + lay.sym_length, 2))[0]
        if not n:
            return ""
        return safe_text(mem.read(sym + lay.sym_body, min(n, MAX_SYMBOL_BYTES)))

    # ------------------------------------------------------------ code cache
    def _heap_list(self, mem: ProcessMemory) -> list[tuple[int, int, int, int]]:
        lay = self.lay
        if self._heaps is not None:
            return self._heaps
        ga = mem.u64(lay.code_heaps)
        n = _I.unpack(mem.read(ga + lay.ga_len, 4))[0]
        data = mem.u64(ga + lay.ga_data)
        if not 0 < n <= MAX_HEAPS:
            raise _Bad("code_heaps")
        heaps = []
        for (h,) in struct.iter_unpack("<Q", mem.read(data, 8 * n)):
            low = mem.u64(h + lay.heap_memory + lay.vs_low_boundary)
            high = mem.u64(h + lay.heap_memory + lay.vs_high)
            segmap = mem.u64(h + lay.heap_segmap + lay.vs_low)
            log2 = _I.unpack(mem.read(h + lay.heap_log2_segment, 4))[0]
            if not low < high or not MIN_LOG2_SEGMENT <= log2 <= MAX_LOG2_SEGMENT:
                raise _Bad("code_heap")
            heaps.append((low, high, segmap, log2))
        self._heaps = heaps
        return heaps

    def _blob(self, mem: ProcessMemory, pc: int) -> _Blob | None:
        """The code blob holding pc, or None (not in the code cache). A cached blob is checked again
        once per sample (its header re-read): the code cache frees and reuses nmethods' space."""
        if pc in self._blobs:
            self._blobs.move_to_end(pc)
            blob = self._blobs[pc]
            if blob is None or blob.start in self._checked:
                return blob
            try:
                again = self._header(mem, blob.start, pc)
            except _Bad:
                again = None
            if again is not None and (again.end, again.code_begin, again.compile_id, again.name) == (
                blob.end,
                blob.code_begin,
                blob.compile_id,
                blob.name,
            ):
                self._checked.add(blob.start)
                return blob
            # Freed or replaced since: forget what was read of that space, and look again.
            self._blobs = OrderedDict(
                (k, b) for k, b in self._blobs.items() if b is None or not (b.start < blob.end and blob.start < b.end)
            )
            self._nmethods.pop(blob.start, None)
        blob = None
        for low, high, segmap, log2 in self._heap_list(mem):
            if low <= pc < high:
                blob = self._find_blob(mem, pc, low, segmap, log2)
                break
        if blob is not None:
            self._checked.add(blob.start)
            old = self._nmethods.get(blob.start)
            if old is not None and old.compile_id != blob.compile_id:
                del self._nmethods[blob.start]
        self._blobs[pc] = blob
        if len(self._blobs) > BLOB_CACHE_ENTRIES:
            self._blobs.popitem(last=False)
        return blob

    def _find_blob(self, mem: ProcessMemory, pc: int, low: int, segmap: int, log2: int) -> _Blob | None:
        lay = self.lay
        seg = (pc - low) >> log2
        for _ in range(MAX_SEGMAP_HOPS):
            first = max(0, seg - SEGMAP_CHUNK + 1)
            raw = mem.read(segmap + first, seg - first + 1)
            if raw[-1] == 0xFF:
                return None  # a free segment
            while seg >= first and raw[seg - first] > 0:
                seg -= raw[seg - first]
            if seg < 0:
                raise _Bad("segmap")
            if seg >= first:
                break
        else:
            raise _Bad("segmap_hops")
        block = low + (seg << log2)
        if mem.read(block + lay.hb_used, 1)[0] == 0:
            return None
        return self._header(mem, block + lay.heap_block_size, pc)

    def _header(self, mem: ProcessMemory, start: int, pc: int) -> _Blob:
        lay = self.lay
        need = (
            max(
                lay.cb_name,
                lay.cb_size,
                lay.cb_frame_size,
                lay.cb_frame_complete,
                lay.cb_code_begin,
                lay.cb_code_offset,
                lay.cb_kind,
                lay.nm_compile_id,
            )
            + 8
        )
        raw = mem.read(start, need)
        size = _I.unpack_from(raw, lay.cb_size)[0]
        if not 0 < size < MAX_BLOB_BYTES or not start <= pc < start + size:
            raise _Bad("blob_size")
        name_ptr = _Q.unpack_from(raw, lay.cb_name)[0]
        name = safe_text(mem.read(name_ptr, MAX_BLOB_NAME).split(b"\0", 1)[0]) if name_ptr else ""
        nmethod = raw[lay.cb_kind] == lay.kind_nmethod if lay.cb_kind >= 0 else name in ("nmethod", "native nmethod")
        code_begin = (
            _Q.unpack_from(raw, lay.cb_code_begin)[0]
            if lay.cb_code_begin >= 0
            else start + _I.unpack_from(raw, lay.cb_code_offset)[0]
        )
        frame_words = _I.unpack_from(raw, lay.cb_frame_size)[0]
        if not 0 <= frame_words <= MAX_FRAME_WORDS:
            raise _Bad("frame_size")
        # An int to JDK 22, an int16_t since: its low 16 bits either way (offsets are small; -1 is -1).
        frame_complete = _h.unpack_from(raw, lay.cb_frame_complete)[0] if lay.cb_frame_complete >= 0 else -1
        compile_id = _I.unpack_from(raw, lay.nm_compile_id)[0] if nmethod else 0
        call_stub = False
        if not nmethod and name.startswith("StubRoutines"):
            call_stub = pc == mem.u64(lay.call_stub_return)
        return _Blob(
            start,
            start + size,
            name,
            frame_words,
            frame_complete,
            nmethod,
            code_begin,
            compile_id,
            name == "Interpreter",
            call_stub,
        )

    def _nmethod(self, mem: ProcessMemory, blob: _Blob) -> _Nmethod:
        lay = self.lay
        nm = self._nmethods.get(blob.start)
        if nm is not None and nm.compile_id == blob.compile_id:
            self._nmethods.move_to_end(blob.start)
            return nm
        start = blob.start
        method = mem.u64(start + lay.nm_method)
        pcs: list[tuple[int, int]] = []
        scopes = b""
        metadata = 0
        try:
            if lay.nm_immutable_data >= 0:
                imm = mem.u64(start + lay.nm_immutable_data)
                pcs_lo = imm + _I.unpack(mem.read(start + lay.nm_scopes_pcs_offset, 4))[0]
                scopes_lo = imm + _I.unpack(mem.read(start + lay.nm_scopes_data_offset, 4))[0]
                pcs_hi = scopes_lo
                mutable = mem.u64(start + lay.cb_mutable_data)
                metadata = mutable + _I.unpack(mem.read(start + lay.cb_relocation_size, 4))[0]
            else:
                pcs_lo = start + _I.unpack(mem.read(start + lay.nm_scopes_pcs_offset, 4))[0]
                pcs_hi = start + _I.unpack(mem.read(start + lay.nm_pcs_end_offset, 4))[0]
                scopes_lo = mem.u64(start + lay.nm_scopes_data_begin)
                metadata = start + _I.unpack(mem.read(start + lay.nm_metadata_offset, 4))[0]
            if lay.nm_immutable_data >= 0:
                imm_end = imm + _I.unpack(mem.read(start + lay.nm_immutable_size, 4))[0]
                scopes_hi, ordered = imm_end, pcs_lo <= pcs_hi <= scopes_lo < imm_end
            else:
                scopes_hi, ordered = pcs_lo, scopes_lo < pcs_lo <= pcs_hi
            if ordered and 0 < pcs_hi - pcs_lo <= MAX_DEBUG_BYTES and (pcs_hi - pcs_lo) % lay.pc_desc_size == 0:
                raw = _read_big(mem, pcs_lo, pcs_hi - pcs_lo)
                for k in range(0, len(raw), lay.pc_desc_size):
                    pcs.append(
                        (_I.unpack_from(raw, k + lay.pc_offset)[0], _I.unpack_from(raw, k + lay.pc_scope_decode)[0])
                    )
                pcs.sort()
                scopes = _read_big(mem, scopes_lo, min(scopes_hi - scopes_lo, MAX_DEBUG_BYTES))
            elif pcs_hi != pcs_lo:
                self._drop("pc_descs")
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            self._drop("nmethod_unreadable")
            pcs = []
        nm = _Nmethod(method, blob.compile_id, pcs, scopes, metadata, {})
        self._nmethods[start] = nm
        if len(self._nmethods) > NMETHOD_CACHE_ENTRIES:
            self._nmethods.popitem(last=False)
        return nm

    # ------------------------------------------------------------ counters
    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _count(self, kind: str) -> None:
        self.frames[kind] += 1


def _read_big(mem: ProcessMemory, at: int, size: int) -> bytes:
    """size bytes from at, in reads of at most the memory module's cap."""
    parts = []
    step = 32 << 10
    for off in range(0, size, step):
        parts.append(mem.read(at + off, min(step, size - off)))
    return b"".join(parts)


def describe(frames: list[Any]) -> str:
    return " ← ".join(f"{f.function}:{f.line}" for f in frames)
