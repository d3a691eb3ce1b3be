"""Python stacks walked in BPF at the sample (bpf/python.h): which processes are walked, and their stacks.

Owns: the -D flags bpf/python.h is compiled with (its caps, and task_struct.thread.fsbase from the
kernel's BTF); py_procs entries: one per CPython process whose layout (runtimes/cpython/layouts.py) and
_PyRuntime address it is given, each offset checked against what the walk can use before it is written
(a layout that fails is refused with its reason, never written), at most PY_PROCS, removed on request;
taking a family's retired buffer's stacks (py_stacks_<family>_<buf>) at its drain as PythonStacks (shared/wire.py); py_counters as deltas.

Must not: read process memory, decide which version a process runs or where its runtime is (the
runtime reader does, as the runtime user), name frames (code pointers are named in user space), or
attach anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import platform
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol

from collector.bpfmaps import take_all
from collector.btfprog import BtfProgramError, member_offsets
from shared.wire import PyFrameRef, PythonStack

log = logging.getLogger(__name__)

# CPython processes walked at once (40 bytes each); past it a process keeps native frames only.
PY_PROCS = 1024
# Distinct Python stacks per drain buffer (1 KiB each, two buffers: 8 MiB of kernel memory); past it a
# sample keeps its native frames only, counted as stack_full.
PY_STACK_ENTRIES = 4096
# Frames kept per stack (bpf/python.h PY_MAX_FRAMES): a deeper one keeps its root-most frames.
PY_MAX_FRAMES = 64
# Frames walked at most (bpf/python.h PY_WALK_FRAMES): the cost of a walk is bounded by it.
PY_WALK_FRAMES = 512
# Bytes of a frame the walk reads (bpf/python.h PY_FRAME_BYTES): every frame offset lies below it.
PY_FRAME_BYTES = 128
# An offset a version does not have (bpf/python.h PY_NO_OFFSET); every other offset must be below it.
PY_NO_OFFSET = 0xFFFF
# bpf/python.h: an instruction offset that is not in the code; flags of a frame and of a stack.
PY_NO_INSTR = 0xFFFFFFFF
PY_FRAME_ENTRY = 1
PY_FRAME_SHIM = 2
PY_STACK_TRUNCATED = 1
PY_STACK_CUT = 2
# Names of the py_counters slots of bpf/python.h, in order.
COUNTERS = (
    "walks",
    "frames",
    "no_thread",
    "bad_read",
    "bad_code",
    "loop",
    "truncated",
    "stack_full",
    "bad_proc",
)


class Layout(Protocol):
    """The offsets the walk uses of a CPython version's layout (runtimes/cpython/layouts.py Layout)."""

    @property
    def runtime_interpreters_head(self) -> int: ...
    @property
    def interp_threads_head(self) -> int: ...
    @property
    def tstate_next(self) -> int: ...
    @property
    def tstate_thread_id(self) -> int: ...
    @property
    def tstate_current_frame(self) -> int: ...
    @property
    def cframe_current_frame(self) -> int | None: ...
    @property
    def frame_previous(self) -> int: ...
    @property
    def frame_executable(self) -> int: ...
    @property
    def frame_instr_ptr(self) -> int: ...
    @property
    def frame_owner(self) -> int: ...
    @property
    def frame_is_entry(self) -> int | None: ...
    @property
    def code_adaptive(self) -> int: ...
    @property
    def skip_owners(self) -> frozenset[int]: ...
    @property
    def tag_mask(self) -> int: ...


class PyProc(ctypes.Structure):
    """struct py_proc of bpf/python.h."""

    _fields_ = [
        ("runtime", ctypes.c_uint64),
        ("interpreters_head", ctypes.c_uint16),
        ("threads_head", ctypes.c_uint16),
        ("tstate_next", ctypes.c_uint16),
        ("tstate_thread_id", ctypes.c_uint16),
        ("tstate_current_frame", ctypes.c_uint16),
        ("cframe_current_frame", ctypes.c_uint16),
        ("frame_previous", ctypes.c_uint16),
        ("frame_executable", ctypes.c_uint16),
        ("frame_instr_ptr", ctypes.c_uint16),
        ("frame_owner", ctypes.c_uint16),
        ("frame_is_entry", ctypes.c_uint16),
        ("code_adaptive", ctypes.c_uint16),
        ("frame_bytes", ctypes.c_uint16),
        ("skip_owners", ctypes.c_uint8),
        ("tag_mask", ctypes.c_uint8),
        ("entry_mask", ctypes.c_uint8),
        ("pad8", ctypes.c_uint8),
        ("pad16", ctypes.c_uint16),
    ]


class LayoutRefused(ValueError):
    """A layout the walk cannot use; the message says which offset and why."""


def bpf_defines(offcpu: bool = False) -> dict[str, int]:
    """The -D flags of bpf/python.h: its caps, and task_struct.thread.fsbase (the thread pointer the
    walk finds a thread's state by) from the running kernel's BTF; with `offcpu`, PY_WALK_OFFCPU too
    (bpf/offcpu.c walks at an off-CPU block's end: a kernel may take the walk on-CPU only)."""
    if platform.machine() != "x86_64":
        raise BtfProgramError(f"the walk finds a thread's state by its x86-64 fs base; this is {platform.machine()}")
    fsbase = member_offsets("task_struct", [("thread", "fsbase")])[0]
    if fsbase is None:
        raise BtfProgramError("Python frames in BPF need task_struct.thread.fsbase, which the kernel's BTF lacks")
    defines = {
        "PY_WALK": 1,
        "PY_PROCS": PY_PROCS,
        "PY_STACK_ENTRIES": PY_STACK_ENTRIES,
        "PY_TASK_FSBASE_OFFSET": fsbase,
    }
    return {**defines, "PY_WALK_OFFCPU": 1} if offcpu else defines


def proc_entry(layout: Layout, runtime: int) -> PyProc:
    """The py_proc of a process with `layout` and its _PyRuntime at `runtime`; LayoutRefused if an
    offset is one the walk cannot use (a frame field past PY_FRAME_BYTES, a value past 16 bits)."""
    if not 0 < runtime < 1 << 64:
        raise LayoutRefused(f"_PyRuntime at {runtime:#x}")
    frame_fields = {
        "frame_previous": (layout.frame_previous, 8),
        "frame_executable": (layout.frame_executable, 8),
        "frame_instr_ptr": (layout.frame_instr_ptr, 8),
        "frame_owner": (layout.frame_owner, 1),
    }
    if layout.frame_is_entry is not None:
        frame_fields["frame_is_entry"] = (layout.frame_is_entry, 1)
    for name, (offset, size) in frame_fields.items():
        if not 0 <= offset <= PY_FRAME_BYTES - size:
            raise LayoutRefused(f"{name} at {offset}: the walk reads the first {PY_FRAME_BYTES} bytes of a frame")
        if offset % size:  # the walk reads a frame's u64 fields as aligned words
            raise LayoutRefused(f"{name} at {offset}: not aligned to its {size} bytes")
    other = {
        "interpreters_head": layout.runtime_interpreters_head,
        "threads_head": layout.interp_threads_head,
        "tstate_next": layout.tstate_next,
        "tstate_thread_id": layout.tstate_thread_id,
        "tstate_current_frame": layout.tstate_current_frame,
        "code_adaptive": layout.code_adaptive,
    }
    if layout.cframe_current_frame is not None:
        other["cframe_current_frame"] = layout.cframe_current_frame
    for name, offset in other.items():
        if not 0 <= offset < PY_NO_OFFSET:
            raise LayoutRefused(f"{name} at {offset}")
    if any(not 0 <= o < 8 for o in layout.skip_owners) or not 0 <= layout.tag_mask < 8:
        raise LayoutRefused(f"frame owners {sorted(layout.skip_owners)} or tag mask {layout.tag_mask:#x}")
    values = {name: offset for name, (offset, _) in frame_fields.items()} | other
    values.setdefault("frame_is_entry", PY_NO_OFFSET)
    values.setdefault("cframe_current_frame", PY_NO_OFFSET)
    return PyProc(
        runtime=runtime,
        frame_bytes=max(offset + size for offset, size in frame_fields.values()),
        skip_owners=sum(1 << o for o in layout.skip_owners),
        tag_mask=layout.tag_mask,
        entry_mask=0xFF if layout.frame_is_entry is not None else 0,
        pad8=0,
        pad16=0,
        **values,
    )


def stack_of(raw: Any) -> PythonStack:
    """A struct py_stack as the walk left it: its ring turned so that the leaf comes first, and its shims
    (3.12+) dropped, each marking the frame above it, its callee, as the first of its eval call."""
    walked = min(raw.walked, PY_WALK_FRAMES)
    kept = min(walked, PY_MAX_FRAMES)
    frames: list[PyFrameRef] = []
    for i in range(walked - kept, walked):  # the ring holds frames walked-kept .. walked-1
        f = raw.frames[i % PY_MAX_FRAMES]
        if f.flags & PY_FRAME_SHIM:
            if frames and not frames[-1].entry:
                frames[-1] = replace(frames[-1], entry=True)
            continue
        frames.append(PyFrameRef(f.code, None if f.instr == PY_NO_INSTR else f.instr, bool(f.flags & PY_FRAME_ENTRY)))
    return PythonStack(
        tuple(frames), bool(raw.flags & PY_STACK_TRUNCATED) or walked > kept, bool(raw.flags & PY_STACK_CUT)
    )


class PyWalker:
    """The collector's hold on bpf/python.h's maps."""

    def __init__(self, bpf: Any) -> None:
        self._bpf = bpf
        self._procs = bpf["py_procs"]
        self._counters = bpf["py_counters"]
        self._last = dict.fromkeys(COUNTERS, 0)
        self.walked: set[int] = set()

    def add(self, pid: int, layout: Layout, runtime: int) -> None:
        """Walk process `pid` from its next sample on; LayoutRefused (nothing written) if its layout is one
        the walk cannot use, or PY_PROCS are walked already."""
        entry = proc_entry(layout, runtime)
        if pid not in self.walked and len(self.walked) >= PY_PROCS:
            raise LayoutRefused(f"{PY_PROCS} Python processes are walked already")
        self._procs[ctypes.c_uint32(pid)] = entry
        self.walked.add(pid)

    def remove(self, pid: int) -> None:
        with contextlib.suppress(KeyError):
            del self._procs[ctypes.c_uint32(pid)]
        self.walked.discard(pid)

    def take(self, family: str, buf: int, hashes: Iterable[int]) -> tuple[dict[int, PythonStack], int]:
        """Empty the stacks of `family`'s ("oncpu", "offcpu") retired buffer `buf`; those of `hashes` as
        PythonStacks, and how many of `hashes` it no longer held."""
        held = {k.value: v for k, v in take_all(self._bpf[f"py_stacks_{family}_{buf}"])}
        out: dict[int, PythonStack] = {}
        missing = 0
        for h in hashes:
            raw = held.get(h)
            if raw is None:
                missing += 1
            else:
                out[h] = stack_of(raw)
        return out, missing

    def counters(self) -> dict[str, int]:
        """py_counters since the last call, by name (summed over CPUs)."""
        out = {}
        for i, name in enumerate(COUNTERS):
            total = sum(self._counters[ctypes.c_int(i)])
            out[name] = total - self._last[name]
            self._last[name] = total
        return out
