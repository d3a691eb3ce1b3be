"""The JavaScript stack of one Node.js process's main thread, read from its memory while it runs.

Owns: finding the Isolate (once, a few MiB a tick: the one address in the
process's anonymous memory that its StackGuard and its ThreadLocalTop both
point back at; searched again in the process's new mappings while none is
found, as a process announced as it execs has none yet), then per sample: the ThreadLocalTop's js_entry_sp (0: no
JavaScript on the stack: the thread is in the event loop, a "(idle)" frame,
or in V8 without JavaScript, named by the VM state), its c_entry_fp (the
exit frame of a call from JavaScript into C++: the exact leaf) or the
isolate's fast-C-call caller frame pointer, and the frame pointer chain from
there to the entry frame. Each V8 frame becomes a NodeFrame named from its
JSFunction's SharedFunctionInfo: function name, script name, the line of
the function's start (from its ScopeInfo's position and the script's line
ends or, before V8 computed them, its source), and its kind: interpreted
(Ignition), baseline (Sparkplug), optimized (Maglev or TurboFan: the
function's current code kind where V8 says it), builtin (a JSFunction
without a script: Array.prototype.map, Atomics.wait in a builtin exit frame).

Running JavaScript (no exit frame) has no frame pointer that the reader can
read: the leaf is where the thread's registers are. The collector's on-CPU
samples carry them (sample_regs: the thread's pc, sp, rbp and the top of its
stack when the sample was taken): a main-thread sample whose pc is in V8's
code (JIT code, or the builtins in the node binary or libnode, its first
frame a V8 frame and no exit frame before the entry frame) is walked up the
frame pointer chain from its rbp, the sample's stack copy first and the
process's memory above it; any other sample (C++, libc, the kernel: a call
into C++, a fast C call, the event loop, GC) is left to the timer, which
reads those exactly. Once a process's samples arrive, the timer leaves a
thread running JavaScript to them (none of its samples is counted twice: a
register sample taken before the timer's last scan is dropped); until then,
or for a process the collector does not mark, the chain is found by
scanning the stack below js_entry_sp for frames that link to the entry
frame: from the entry frame down, the callee frame closest below each frame;
exit frames found so are cut off (no call into C++ is running). A
JavaScript callee below the real leaf that a finished call left behind is
taken for a live one (its caller is right, it is not): it is why scanned
stacks are "from memory".

Validation: every pointer is a tagged heap object of the expected instance
type before it is followed; names and sources are capped; a frame that fails
drops itself (counted in `dropped` by reason), a chain that loops or is too
deep ends.

The parts, one responsibility each: isolate.py (discovery: the Isolate),
codemap.py (which code a pc is in), chain.py (frame walking: the frame
pointer chains), naming.py (a frame's function, script, line and kind from
V8's heap objects), v8info.py (what the v8dbg_ symbols say), frames.py
(what they share). NodeProcess, here, samples a process with them.

Must not: write to, stop or attach to the target; log (the caller counts).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence

from runtimes.memory import MAX_READ_BYTES, MemoryReadError, ProcessMemory
from runtimes.node.chain import MAX_FRAMES, FrameChains
from runtimes.node.codemap import CodeMap
from runtimes.node.frames import Counts, NodeFrame
from runtimes.node.isolate import IsolateFinder, scan_ranges
from runtimes.node.layouts import VM_STATES, Layout
from runtimes.node.naming import FrameNamer
from runtimes.node.v8info import V8Info
from runtimes.runtime import SAMPLE_HZ, ThreadStack
from shared.wire import RegsSample

__all__ = ["MAX_FRAMES", "NodeFrame", "NodeProcess", "V8Info", "scan_ranges"]

# Bytes of the stack below js_entry_sp that are read per sample at most (one read: a process_vm_readv's cap).
STACK_WINDOW = MAX_READ_BYTES - 4096
# Bytes read first: a script's JavaScript stack is a few KiB; the whole window only when it runs past them.
STACK_FIRST_READ = 8 << 10
# A scanned leaf closer than 1/LEAF_MARGIN_DIVISOR of the window to its low end may go on below it: read more.
LEAF_MARGIN_DIVISOR = 8
# Bytes of a frame read around its fp: the fixed slots below it, the saved fp and return address above.
FRAME_HEAD_BYTES = 64
# The timer's period (runtimes/runtime.py SAMPLE_HZ): a register sample taken less than this after the timer's
# last scanned stack of a thread running JavaScript is that stack's time, already counted.
TIMER_PERIOD_NS = 1_000_000_000 // SAMPLE_HZ
# A main-thread sample's sp is at most this far below the top of the [stack] seen at detection (the
# mapping grows down with the stack, up to the default 8 MiB limit).
MAX_MAIN_STACK = 8 << 20

_Q = struct.Struct("<Q")
_H = struct.Struct("<H")


class NodeProcess:
    def __init__(
        self,
        version: str,
        layout: Layout,
        info: V8Info,
        ranges: list[tuple[int, int]],
        stack: tuple[int, int],
        pid: int = 0,
        proc: str = "/proc",
        module: str = "",
    ) -> None:
        self.version, self.layout, self.v8 = version, layout, info
        self.stack_lo, self.stack_hi = stack
        self.pid, self.proc = pid, proc
        self.counts = Counts()
        self.dropped: dict[str, int] = self.counts.dropped
        # On-CPU samples with registers: whether any came (then the timer leaves running JavaScript to
        # them), the monotonic time of the timer's last scanned stack.
        self.regs_seen = False
        self.scanned_ns = 0
        self.isolate: int | None = None
        self.finder = IsolateFinder(layout, ranges, pid, proc, self.counts)
        self.code_map = CodeMap(pid, proc, module, self.counts)
        self.chains = FrameChains(info, self.counts)
        self.namer = FrameNamer(info, self.counts)

    # ------------------------------------------------------------ sampling

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]:
        if self.isolate is None:
            self.isolate = self.finder.find(mem)
            if self.isolate is None:
                return []
        lay = self.layout
        tlt = mem.read(self.isolate + lay.thread_local_top, lay.tlt_bytes)
        c_entry_fp = _Q.unpack_from(tlt, lay.tlt_c_entry_fp)[0]
        js_entry_sp = _Q.unpack_from(tlt, lay.tlt_js_entry_sp)[0]
        state = _H.unpack_from(tlt, lay.tlt_vm_state)[0]
        if _Q.unpack_from(tlt, lay.tlt_isolate)[0] != self.isolate:
            self.counts.drop("isolate_moved")
            self.isolate = None
            return []
        if not js_entry_sp:
            name = VM_STATES[state] if state < len(VM_STATES) else "OTHER"
            label = "(idle)" if name in ("EXTERNAL", "IDLE", "IDLE_EXTERNAL", "OTHER") else f"({name.lower()})"
            return [ThreadStack(0, (NodeFrame(label, "", 0, "vm"),))]
        if not self.stack_lo <= js_entry_sp < self.stack_hi:
            self.counts.drop("not_main_stack")
            return []
        hi = min(self.stack_hi, js_entry_sp + FRAME_HEAD_BYTES)
        leaf = c_entry_fp or mem.u64(self.isolate + lay.fast_c_call_caller_fp)
        if not leaf:  # running JavaScript
            if self.regs_seen:  # the on-CPU samples' registers show it (sample_regs)
                self.counts.drop("running_js_left_to_regs")
                return []
            self.scanned_ns = time.monotonic_ns()
        for size in (STACK_FIRST_READ, STACK_WINDOW):
            lo = max(self.stack_lo, js_entry_sp - size, min(leaf - FRAME_HEAD_BYTES, js_entry_sp) if leaf else 0)
            window = mem.read(lo, hi - lo)
            fps = self.chains.up(window, lo, leaf, js_entry_sp) if leaf else self.chains.down(window, lo, js_entry_sp)
            if leaf or lo == self.stack_lo or fps[0] - lo > size // LEAF_MARGIN_DIVISOR:
                break  # the leaf is in the window, not at its low end
        if not leaf:
            fps = self.chains.live_part(window, lo, fps)
        frames: list[NodeFrame] = []
        for fp in fps:
            got = self.namer.frame(mem, window, lo, fp)
            if got is not None:
                frames.append(got)
        if not frames:
            return []
        return [ThreadStack(0, tuple(frames))]

    # ------------------------------------------------------------ on-CPU samples with registers

    def sample_regs(self, mem: ProcessMemory, samples: Sequence[RegsSample]) -> list[ThreadStack]:
        """The collector's on-CPU samples of this process: those of the main thread running JavaScript,
        walked from their registers (one stack each); the others are the timer's (counted in dropped:
        regs_not_main_thread, regs_not_js, regs_in_cxx, regs_before_handover)."""
        self.regs_seen = True
        main = [r for r in samples if self.stack_hi - MAX_MAIN_STACK <= r.sp < self.stack_hi and not r.sp & 7]
        if len(main) < len(samples):
            self.counts.drop("regs_not_main_thread", len(samples) - len(main))
        if self.scanned_ns:
            fresh = [r for r in main if r.time_ns >= self.scanned_ns + TIMER_PERIOD_NS]
            if len(fresh) < len(main):
                self.counts.drop("regs_before_handover", len(main) - len(fresh))
            main = fresh
        main = [r for r in main if self.code_map.in_v8_code(r.ip)]
        if not main:
            return []
        # The entry frame of the outermost JavaScript now, to end the chains there (0: none, or the
        # isolate no longer says: none that a chain could be checked against; None: no isolate found yet).
        entry: int | None = None
        if self.isolate is not None:
            lay = self.layout
            tlt = mem.read(self.isolate + lay.thread_local_top, lay.tlt_bytes)
            entry = 0
            if _Q.unpack_from(tlt, lay.tlt_isolate)[0] == self.isolate:
                entry = _Q.unpack_from(tlt, lay.tlt_js_entry_sp)[0]
        # The stack above the samples' copies, as it is now: one read for all of them.
        lo = min(r.sp for r in main)
        top = max(r.sp for r in main) + STACK_FIRST_READ
        if entry and lo < entry < self.stack_hi:
            top = max(top, entry + FRAME_HEAD_BYTES)
        hi = min(self.stack_hi, top, lo + STACK_WINDOW)
        try:
            now = mem.read(lo, hi - lo)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            self.counts.drop("regs_stack_unreadable")
            return []
        out: list[ThreadStack] = []
        for r in main:
            if r.sp >= hi:  # far above the others' (a read apart is not worth it)
                self.counts.drop("regs_stack_unreadable")
                continue
            copy = r.stack[: hi - r.sp]
            window = copy + now[r.sp + len(copy) - lo :]
            fps = self.chains.from_regs(window, r.sp, r.fp, entry)
            if fps is None:
                self.counts.drop("regs_in_cxx")
                continue
            if not fps:  # the stack changed under it (counted there)
                continue
            frames = [got for got in (self.namer.frame(mem, window, r.sp, fp) for fp in fps) if got is not None]
            if frames:
                out.append(ThreadStack(r.tid, tuple(frames)))
            else:
                self.counts.drop("regs_no_frames")
        return out
