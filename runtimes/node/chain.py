"""Frame pointer chains of a Node.js main thread's stack, found in a window of it read at once.

Owns: the chain up from an exact leaf (an exit frame's c_entry_fp) to the
entry frame; without a leaf (running JavaScript, no registers), the chain
down from the entry frame (each frame's callee: the highest slot below it
that holds its frame pointer and looks like a V8 frame) and its live part
(exit frames found so are cut off: no call into C++ is running); and the
chain up from an on-CPU sample's rbp to its outermost entry frame.

Must not: name frames (naming.py), read process memory, or log.
"""

from __future__ import annotations

import struct

from runtimes.node.frames import Counts, word
from runtimes.node.v8info import V8Info

# Frames read per chain: deeper chains are cut (and counted), like the kernel's 127.
MAX_FRAMES = 128
# A frame type marker is a small integer shifted by one (StackFrame::TypeToMarker); V8 has ~30 types.
MAX_FRAME_TYPE = 64

_Q = struct.Struct("<Q")


class FrameChains:
    def __init__(self, v8: V8Info, counts: Counts) -> None:
        self.v8, self.counts = v8, counts

    def up(self, window: bytes, lo: int, fp: int, top: int) -> list[int]:
        """Frame pointers from the exact leaf `fp` to the entry frame at `top`, leaf first."""
        out: list[int] = []
        while fp and fp <= top:
            if len(out) >= MAX_FRAMES:
                self.counts.drop("too_deep")
                break
            out.append(fp)
            nxt = word(window, lo, fp)
            if nxt is None or nxt <= fp:
                break
            fp = nxt
        return out

    def down(self, window: bytes, lo: int, top: int) -> list[int]:
        """Without the leaf: from the entry frame at `top` down, each frame's callee: the highest slot
        below it that holds its frame pointer and looks like a V8 frame. Leaf first."""
        out = [top]
        fp = top
        while len(out) < MAX_FRAMES:
            needle = _Q.pack(fp)
            end = fp - lo
            callee = None
            while end > 0:
                i = window.rfind(needle, 0, end)
                if i < 0:
                    break
                if not (lo + i) & 7 and self.plausible(window, lo, lo + i):
                    callee = lo + i
                    break
                end = i + 7  # an unaligned or implausible hit: look for one starting below it
            if callee is None:
                break
            out.append(callee)
            fp = callee
        else:
            self.counts.drop("too_deep")
        out.reverse()
        return out

    def live_part(self, window: bytes, lo: int, fps: list[int]) -> list[int]:
        """A scanned chain (leaf first) without its exit frames and what is below them: with no
        c_entry_fp, no call into C++ is running, so an exit frame found below is one a finished call
        left (Date.now's under a later Array.prototype.slice), or one whose JavaScript callees below
        the C++ frames the scan cannot reach."""
        exits = (self.v8.ft_exit, self.v8.ft_builtin_exit)
        for i in range(len(fps) - 1, -1, -1):
            marker = word(window, lo, fps[i] + self.v8.off_context)
            if marker is not None and not marker & 1 and marker >> 1 in exits:
                self.counts.drop("stale_exit_frame")
                return fps[i + 1 :]
        return fps

    def plausible(self, window: bytes, lo: int, fp: int) -> bool:
        """A V8 frame: a frame type marker, or a tagged context and a tagged function below fp."""
        marker = word(window, lo, fp + self.v8.off_context)
        fn = word(window, lo, fp + self.v8.off_function)
        if marker is None or fn is None:
            return False
        if not marker & 1:
            return marker >> 1 < MAX_FRAME_TYPE
        return fn & 3 == 1

    # ------------------------------------------------------------ frames

    def from_regs(self, window: bytes, lo: int, fp: int, entry: int | None) -> list[int] | None:
        """Frame pointers from a sample's rbp up to its outermost entry frame (the one at `entry`, the
        js_entry_sp now, or the last one the chain passes), leaf first. None: not running JavaScript (a
        first frame that is no V8 frame, or an exit frame before the first entry frame: a call into C++).
        Where the chain breaks before any entry frame: once the isolate is known (`entry` not None), []
        (from a JavaScript leaf the first entry frame is reached over V8 frames only, which all keep
        rbp: the stack above the sample's copy was read after the thread had moved on, and what the
        chain found there is another moment's); before (None), as far as it goes."""
        v8 = self.v8
        if not self.plausible(window, lo, fp):
            return None
        out: list[int] = []
        last_entry = -1
        while True:
            if len(out) >= MAX_FRAMES:
                self.counts.drop("too_deep")
                break
            out.append(fp)
            marker = word(window, lo, fp + v8.off_context)
            if marker is not None and not marker & 1:
                if marker >> 1 in v8.ft_entry:
                    last_entry = len(out) - 1
                elif marker >> 1 in (v8.ft_exit, v8.ft_builtin_exit) and last_entry < 0:
                    return None
            if entry and fp == entry:
                break
            nxt = word(window, lo, fp)
            if nxt is None or nxt <= fp:
                break
            fp = nxt
        if last_entry < 0:
            if len(out) >= MAX_FRAMES:  # deeper than is walked: the leaf end is kept (too_deep)
                return out
            if entry is not None:
                self.counts.drop("regs_stack_changed")
                return []
            self.counts.drop("regs_chain_cut")
            return out
        return out[: last_entry + 1]
