"""The frame walk of one Java thread's stack, leaf first, from its last Java frame or its registers.

Owns: StackWindow (a thread's stack read in chunks, each slot checked
against the thread's stack bounds); the walk from (sp, fp, pc): interpreted
frames (the Method* and bcp from the frame's slots; the caller from the
saved fp, the return address and the interpreter's sender sp), compiled
frames and other code blobs (the caller from the blob's frame size, or,
for a frame sampled running in its method's prologue or epilogue, from the
decoded instructions: x86edge.py), the call stub (the JavaCallWrapper's
saved anchor continues the walk below the native frames, or ends it).
Cache (bounded): where a running frame stands, per (blob, compile id, pc).

Must not: name frames (naming.py), find code blobs (codecache.py), write
to the target, or log.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from runtimes.jvm import layouts, x86edge
from runtimes.jvm.codecache import Blob, CodeCache
from runtimes.jvm.frames import CALL_STUB, BadFrame, Counts, JvmFrame
from runtimes.jvm.layouts import Layout
from runtimes.jvm.naming import FrameNamer
from runtimes.jvm.threads import read_anchor
from runtimes.memory import MemoryReadError, ProcessMemory

# Frames read per thread (profiles cut deeper stacks here).
MAX_FRAMES = 128
# Further slots of a thread's stack are read in chunks of this size.
STACK_CHUNK = 8 << 10
# Running pcs of compiled code whose place in the frame's set-up (x86edge) is remembered: the hot ones.
EDGE_CACHE_ENTRIES = 16384

_Q = struct.Struct("<Q")


class StackWindow:
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
            raise BadFrame("stack_slot")
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
            raise BadFrame("stack_unreadable") from None
        self.add(start, data)
        return struct.unpack_from(f"<{n}Q", data, address - start)


class FrameWalker:
    def __init__(self, layout: Layout, code: CodeCache, namer: FrameNamer, counts: Counts) -> None:
        self.lay, self.code, self.namer, self.counts = layout, code, namer, counts
        # (blob start, compile id, pc) → where a running frame at pc stands (None: whole), x86edge
        self._edges: OrderedDict[tuple[int, int, int], tuple[x86edge.Edge, str] | None] = OrderedDict()

    def walk_or_drop(
        self, mem: ProcessMemory, stack: StackWindow, sp: int, fp: int, pc: int, running: bool = False
    ) -> list[JvmFrame] | None:
        """walk(), with a stack that fails its checks counted in `dropped` (None) rather than raised."""
        try:
            return self.walk(mem, stack, sp, fp, pc, running)
        except BadFrame as e:
            self.counts.drop(e.args[0])
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            self.counts.drop(f"read_{e.reason}")  # a pointer into memory the JVM freed or never had
        except (struct.error, IndexError, ValueError, OverflowError):
            self.counts.drop("malformed")
        return None

    def walk(
        self, mem: ProcessMemory, stack: StackWindow, sp: int, fp: int, pc: int, running: bool = False
    ) -> list[JvmFrame]:
        """Frames leaf first from a last Java frame (sp, fp, pc; pc 0: the word below sp), or, `running`,
        from the registers of a thread sampled while it ran (its pc is not a return address)."""
        if not pc:
            pc = stack.word(sp - 8)
        frames: list[JvmFrame] = []
        while len(frames) < MAX_FRAMES:
            below = sp
            blob = self.code.blob(mem, pc)
            if blob is None:
                break  # native code: the end of this Java stack
            caller: tuple[int, int, int] | None
            if blob.interpreter:
                caller = self._interpreted(mem, stack, fp, frames)
            elif blob.call_stub:
                caller = self._call_stub(mem, stack, fp, frames)
            else:
                caller = self._blob(mem, stack, blob, (pc, fp, sp), running and not frames, frames)
            if caller is None:
                break
            pc, fp, sp = caller
            if not below < sp <= stack.hi:
                raise BadFrame("sender_sp")  # every caller's frame lies above its callee's
        else:
            self.counts.drop("frames_capped")
        return frames[:MAX_FRAMES]

    def _interpreted(
        self, mem: ProcessMemory, stack: StackWindow, fp: int, frames: list[JvmFrame]
    ) -> tuple[int, int, int]:
        """An interpreted frame onto `frames`; its caller's (pc, fp, sp)."""
        if not stack.lo < fp < stack.hi:
            raise BadFrame("interpreter_fp")
        # The slots from the bcp's up to the return address, in one unpack.
        slots = stack.words(fp + 8 * layouts.INTERP_BCP_SLOT, 2 - layouts.INTERP_BCP_SLOT)
        top = -layouts.INTERP_BCP_SLOT  # index of the slot at fp
        frames.append(self.namer.interpreted(mem, slots[top + layouts.INTERP_METHOD_SLOT], slots[0]))
        return slots[top + 1], slots[top], slots[top + self.lay.sender_sp_slot]

    def _call_stub(
        self, mem: ProcessMemory, stack: StackWindow, fp: int, frames: list[JvmFrame]
    ) -> tuple[int, int, int] | None:
        """The call stub's frame onto `frames`; the (pc, fp, sp) its JavaCallWrapper's anchor saved, or None
        when there is none (the thread's first Java call: nothing below but native code)."""
        lay = self.lay
        wrapper = stack.word(fp + 8 * lay.call_wrapper_slot)
        if not wrapper or wrapper & 7:
            raise BadFrame("call_wrapper")
        sp, pc, fp = read_anchor(mem, lay, wrapper + lay.wrapper_anchor)
        if not sp:
            return None
        # Java called from native code (JNI, the VM's own calls such as reflection's before JDK 18):
        # the Java frames that called that native code continue at the wrapper's saved anchor.
        frames.append(CALL_STUB)
        self.counts.count("stub")
        if not pc:
            pc = stack.word(sp - 8)
        return pc, fp, sp

    def _blob(
        self,
        mem: ProcessMemory,
        stack: StackWindow,
        blob: Blob,
        at: tuple[int, int, int],
        top: bool,
        frames: list[JvmFrame],
    ) -> tuple[int, int, int] | None:
        """The frames of a compiled method or a stub at (pc, fp, sp) onto `frames` (`top`: where it ran, not
        a return address); its caller's (pc, fp, sp), or None when it has no frame size to walk by."""
        pc, fp, sp = at
        if blob.nmethod:
            frames.extend(self.namer.compiled(mem, blob, pc, top))
        else:
            frames.append(JvmFrame(f"[stub: {blob.name}]", "", 0, "stub"))
            self.counts.count("stub")
        if blob.frame_words <= 0:
            return None  # no frame size: not walkable from here
        edge = self._edge(mem, blob, pc) if top and blob.nmethod else None
        if edge is None:
            sender_sp = sp + 8 * blob.frame_words
            return stack.word(sender_sp - 8), stack.word(sender_sp - 16), sender_sp
        # entering or returning: less than the whole frame on the stack
        ret = sp + edge.ret_at
        fp = fp if edge.caller_rbp_at is None else stack.word(sp + edge.caller_rbp_at)
        return stack.word(ret), fp, ret + 8

    def _edge(self, mem: ProcessMemory, blob: Blob, pc: int) -> x86edge.Edge | None:
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
        self.counts.count(got[1])
        return got[0]
