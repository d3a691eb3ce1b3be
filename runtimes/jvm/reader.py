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
lengths are capped (each part's named constants). A thread or frame that
fails is dropped and counted in `dropped` by reason.

The parts, one responsibility each: threads.py (discovery: the Java
threads, their stack bounds and anchors), codecache.py (the symbol table:
code blobs and nmethods' debug information), walker.py (frame walking),
naming.py (Class.method, file and line); frames.py (what they share: the
frames, the failure they raise, the counters). JvmProcess, here, samples a
process with them.

Must not: write to, stop or attach to the target; log.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from runtimes.jvm.codecache import CodeCache
from runtimes.jvm.frames import CALL_STUB, FRAME_KINDS, RUNNING_JAVA, BadFrame, Counts, JvmFrame, describe
from runtimes.jvm.layouts import Layout
from runtimes.jvm.naming import FrameNamer
from runtimes.jvm.threads import JavaThreads, read_anchor
from runtimes.jvm.walker import MAX_FRAMES, STACK_CHUNK, FrameWalker, StackWindow
from runtimes.memory import MemoryReadError, ProcessMemory
from runtimes.runtime import ThreadStack
from shared.wire import RegsSample

__all__ = [
    "CALL_STUB",
    "FRAME_KINDS",
    "MAX_FRAMES",
    "RUNNING_JAVA",
    "BadFrame",
    "JvmFrame",
    "JvmProcess",
    "describe",
]

# Bytes of a thread's stack read with its anchor: STACK_CHUNK at first, then what its last walk needed,
# rounded up to pages, at most this.
MAX_STACK_WINDOW = 48 << 10
# Stack read beyond the deepest slot the last walk needed, and the granule the window is rounded to.
STACK_SLACK, STACK_GRANULE = 1024, 4096

_Q = struct.Struct("<Q")
_I = struct.Struct("<i")


class JvmProcess:
    def __init__(self, version: str, layout: Layout) -> None:
        self.version, self.lay = version, layout
        self.counts = Counts()
        self.dropped: dict[str, int] = self.counts.dropped
        self.frames: dict[str, int] = self.counts.frames  # frames read, by kind
        self.threads = JavaThreads(layout, self.counts)
        self.code = CodeCache(layout, self.counts)
        self.walker = FrameWalker(layout, self.code, FrameNamer(layout, self.code, self.counts), self.counts)
        self._depths: dict[int, int] = {}  # JavaThread → bytes of its stack read with its anchor

    def self_check(self, mem: ProcessMemory) -> None:
        """The thread list and the code heaps are where the tables say (raises BadFrame or MemoryReadError)."""
        self.threads.self_check(mem)
        self.code.heaps(mem)

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]:
        self.code.new_sample()
        lo, records = self.threads.records(mem)
        out: list[ThreadStack] = []
        depths: dict[int, int] = {}
        for t, raw_t, tid in records:
            if raw_t is None:
                self.counts.drop("thread_unreadable")
                continue
            got = self._thread(mem, t, raw_t, lo, depths)
            if got:
                out.append(ThreadStack(tid, got))
        self._depths = depths
        return out

    def _thread(
        self, mem: ProcessMemory, t: int, raw_t: bytes, lo: int, depths: dict[int, int]
    ) -> tuple[JvmFrame, ...] | None:
        """The frames of the JavaThread t (its fields read from offset lo on), or None; the bytes of its
        stack its walk needed go into `depths`."""
        lay = self.lay
        if not _Q.unpack_from(raw_t, lay.jt_anchor - lo + lay.anchor_sp)[0]:
            # No recorded frame: running Java code (shown as such: walking it needs its registers), or a
            # thread with no Java frames (compiler threads, one not started yet).
            state = _I.unpack_from(raw_t, lay.jt_thread_state - lo)[0]
            if state in (lay.state_in_java, lay.state_in_java_trans):
                self.counts.count("running")
                return (RUNNING_JAVA,)
            self.counts.drop("no_java_frame")
            return None
        base, size = self.threads.bounds(raw_t, lo)
        if not size:
            self.counts.drop("stack_bounds")
            return None
        # The anchor and the stack below the thread's base in one system call: read apart, a thread
        # that parks again at the same depth meanwhile mixes one call's callers into another's.
        depth = min(size, self._depths.get(t, STACK_CHUNK))
        anchor, window = mem.read_many([(t + lay.jt_anchor, 24), (base - depth, depth)])
        if anchor is None or window is None:
            self.counts.drop("stack_unreadable")
            return None
        sp, pc, fp = (_Q.unpack_from(anchor, o)[0] for o in (lay.anchor_sp, lay.anchor_pc, lay.anchor_fp))
        if not sp:
            self.counts.count("running")
            return (RUNNING_JAVA,)  # it went back into Java meanwhile
        stack = StackWindow(mem, base - size, base)
        stack.add(base - depth, window)
        frames = self.walker.walk_or_drop(mem, stack, sp, fp, pc)
        if frames is None:
            return None
        need = -(-(base - stack.lowest + STACK_SLACK) // STACK_GRANULE) * STACK_GRANULE
        depths[t] = min(max(STACK_CHUNK, need), MAX_STACK_WINDOW)
        return tuple(frames)

    def sample_regs(self, mem: ProcessMemory, samples: Sequence[RegsSample]) -> list[ThreadStack]:
        """On-CPU samples walked from their registers: a thread running JIT or interpreted code from its
        pc, sp and fp (the slots the stack copy holds from it, the rest from memory now: a caller that
        returned since the sample is read as the frame now there); a thread in the VM or native code
        from its last Java frame, as sample() walks it. A thread that is not a Java thread, or with no
        Java frame, is left out (dropped["regs_no_thread"], ["no_java_frame"])."""
        self.code.new_sample()
        out: list[ThreadStack] = []
        for r in samples:
            frames = self._regs(mem, r)
            if frames:
                out.append(ThreadStack(r.tid, tuple(frames)))
        return out

    def _regs(self, mem: ProcessMemory, r: RegsSample) -> list[JvmFrame] | None:
        """The frames of one on-CPU sample, or None (counted in dropped)."""
        t = self.threads.of_tid(mem, r.tid)
        if t is None:
            self.counts.drop("regs_no_thread")  # a VM thread (GC, compiler), or one gone since
            return None
        ptr, base, size = t
        if not size or not base - size <= r.sp < base:
            self.counts.drop("stack_bounds")
            self.threads.forget(r.tid)  # a new thread with the old one's id: read again next time
            return None
        stack = StackWindow(mem, base - size, base)
        if r.stack:
            stack.add(r.sp, r.stack[: max(0, min(len(r.stack), base - r.sp)) & ~7])
        sp, fp, pc, running = r.sp, r.fp, r.ip, True
        if self.code.blob(mem, pc) is None:  # in the VM or native code: from its last Java frame
            running = False
            try:
                sp, pc, fp = read_anchor(mem, self.lay, ptr + self.lay.jt_anchor)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget", "denied"):
                    raise
                self.counts.drop("thread_unreadable")
                return None
            if not sp:
                self.counts.drop("no_java_frame")
                return None
        return self.walker.walk_or_drop(mem, stack, sp, fp, pc, running)
