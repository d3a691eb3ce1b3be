"""Mixed stacks: a sample's Python frames (walked in BPF, bpf/python.h) spliced into its native user frames.

Owns: the splice rules of docs/runtime-stacks.md ("How a mixed stack reads"): the Python frames of a
sample (leaf first) are grouped into calls of CPython's `_PyEval_EvalFrameDefault` (a group ends at,
and includes, a frame marked `entry`; the frames after the last entry are one more group), and each
group replaces, in place, the native eval frame of its call, so the C and libc frames between two
Python calls stay where they are. When the counts differ the groups are matched from the root end of
a `truncated` Python stack (its leaf end was cut) and from the leaf end otherwise; the mismatch is
returned by kind for the worker to count. Also owns PythonFrame, the unnamed Python frame a window
keeps until its profile is built (names come later, from the runtime reader: symbolizer/pynames.py),
the one pseudo-module every Python frame is shown under, and the placeholder of a frame left unnamed.

Must not: name frames (it cannot read the process), send or receive anything, or build profiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.wire import PyFrameRef, PythonStack
from symbolizer.frames import Frame

# The native function each Python call runs in (CPython 3.11 to 3.15); a `.cold` part is the same call.
EVAL_FUNCTION = "_PyEval_EvalFrameDefault"
# The pseudo-module (pprof mapping) every Python frame is shown under.
PYTHON_MODULE = "[python]"
# Shown once at the leaf end of the Python frames of a stack whose leaf end the walk cut.
TRUNCATED_FRAME = Frame(PYTHON_MODULE, "", 0, "[truncated]")

# The kinds of mismatch between Python calls and native eval frames (counters python_splice_<kind>).
MORE_CALLS = "more_calls"  # more Python calls than native eval frames: the extra calls placed beside
FEWER_CALLS = "fewer_calls"  # native eval frames left without Python frames (kept as they are)
NO_EVAL_FRAME = "no_eval_frame"  # no native eval frame at all: every Python frame at the root end
SPLICE_MISMATCHES = (MORE_CALLS, FEWER_CALLS, NO_EVAL_FRAME)


@dataclass(frozen=True, slots=True)
class PythonFrame:
    """A Python frame of one process, as the walk saw it; named when its window's profile is built."""

    pid: int
    start_ticks: int
    code: int  # the code object's address in the process
    instr: int  # bytes from the code's first code unit to its instruction; -1: not started

    @property
    def key(self) -> tuple[int, int]:
        """What the runtime reader is asked to name (wire PythonNameRequest.frames)."""
        return self.code, self.instr


AnyFrame = Frame | PythonFrame


def placeholder(frame: PythonFrame) -> str:
    """The name of a frame the runtime reader did not name: its code object's address and offset."""
    return f"[python {frame.code:#x}]" if frame.instr < 0 else f"[python {frame.code:#x}+{frame.instr}]"


def is_eval_frame(frame: Frame) -> bool:
    return frame.function == EVAL_FUNCTION or frame.function.startswith(EVAL_FUNCTION + ".")


def frame_keys(stack: PythonStack) -> list[tuple[int, int]]:
    """The (code, instr) pairs of a stack's frames, as a name request carries them."""
    return [(f.code, -1 if f.instr is None else f.instr) for f in stack.frames]


def calls(stack: PythonStack, pid: int, start_ticks: int) -> list[list[AnyFrame]]:
    """The stack's frames grouped into eval calls, leaf first; the leaf-most call begins with
    TRUNCATED_FRAME when the walk cut the leaf end."""
    groups: list[list[AnyFrame]] = []
    current: list[AnyFrame] = []
    for f in stack.frames:
        current.append(_frame(f, pid, start_ticks))
        if f.entry:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    if stack.truncated:
        if not groups:
            groups.append([])
        groups[0].insert(0, TRUNCATED_FRAME)
    return groups


def _frame(f: PyFrameRef, pid: int, start_ticks: int) -> PythonFrame:
    return PythonFrame(pid, start_ticks, f.code, -1 if f.instr is None else f.instr)


def splice(user: Sequence[Frame], stack: PythonStack, pid: int, start_ticks: int) -> tuple[tuple[AnyFrame, ...], str]:
    """`user` (native user frames, leaf first) with `stack`'s Python calls in place of its eval frames,
    and the kind of mismatch ("" when every call met its own eval frame).

    Counts equal: the i-th call (leaf first) replaces the i-th eval frame. Otherwise as many as both
    have are paired from the root end when the Python stack is truncated (its root was kept), from
    the leaf end when not. Calls left over on the root side go at the root end of the user frames (the
    native stack lost its root, or no eval frame was named); calls left over on the leaf side join the
    leaf-most paired call, leaf-ward of it. Eval frames left over stay as they are.
    """
    if not stack.frames and not stack.truncated:
        return tuple(user), ""
    groups = calls(stack, pid, start_ticks)
    evals = [i for i, f in enumerate(user) if is_eval_frame(f)]
    n = min(len(groups), len(evals))
    if stack.truncated:  # paired from the root end
        paired = dict(zip(evals[len(evals) - n :], groups[len(groups) - n :], strict=True))
        leaf_extra, root_extra = groups[: len(groups) - n], []
    else:
        paired = dict(zip(evals[:n], groups[:n], strict=True))
        leaf_extra, root_extra = [], groups[n:]
    if paired and leaf_extra:
        leafmost = min(paired)
        paired[leafmost] = [f for g in leaf_extra for f in g] + paired[leafmost]
    elif leaf_extra:  # no eval frame to pair with: all at the root end, in order
        root_extra = leaf_extra
    out: list[AnyFrame] = []
    for i, f in enumerate(user):
        out.extend(paired.get(i, (f,)))
    for g in root_extra:
        out.extend(g)
    if not evals:
        kind = NO_EVAL_FRAME
    elif len(groups) > len(evals):
        kind = MORE_CALLS
    elif len(groups) < len(evals):
        kind = FEWER_CALLS
    else:
        kind = ""
    return tuple(out), kind
