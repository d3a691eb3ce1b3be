"""Thread stacks of one CPython process, read from its memory while it runs.

Owns: the walk from _PyRuntime to every interpreter, every thread state and
its chain of interpreter frames (shim and entry frames skipped by their
owner; 3.14's and 3.15's tagged frame references masked), each frame turned into
(qualified name, file, line): the code object checked to be a code object,
its names read as compact unicode, its line decoded from the location table
at the frame's instruction pointer. Code objects are cached by address and
header, bounded.

Validation: a frame whose code pointer is not a code object, whose
instruction pointer lies outside its code, whose line the table does not give,
or that was already seen in this chain (a loop), is dropped and counted in
`dropped` by reason; a loop also ends the chain. A thread whose reads fail
is skipped. Reads are bounded per thread (MAX_FRAMES) and per process
(MAX_THREADS, MAX_INTERPRETERS); the ReadBudget of the ProcessMemory bounds
the bytes.

Also what the collector's walk in BPF needs of the process (walk_data) and the
naming of a frame as that walk records it (name): runtimes/runtime.py
WalkedReader.

Must not: write to, stop or attach to the target; log (the caller counts).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from runtimes.cpython.layouts import wire_layout
from runtimes.cpython.lines import addr2line
from runtimes.cpython.version import Target
from runtimes.memory import MemoryReadError, ProcessMemory
from runtimes.runtime import ThreadStack
from shared.wire import PythonProcess

# Frames read per thread: deeper stacks are cut (and counted), like the kernel's 127.
MAX_FRAMES = 128
# Thread states per interpreter; a process with more is read up to here.
MAX_THREADS = 512
# Subinterpreters per process.
MAX_INTERPRETERS = 16
# Bytes read at a frame and below it in one system call: a thread's frames are pushed upwards in its
# data stack, so its callers usually lie just under its newest (a frame is 80-300 bytes). Every byte
# counts against the tick's byte caps, which the reader halves to keep to cpu_budget: 1 KiB reads
# 4.8-frame stacks in as few calls as 4 KiB did (3.3 a stack), at 1.3 KB a stack instead of 4.4.
FRAME_WINDOW_BYTES = 1024
# Characters of a function or file name; longer ones are cut.
MAX_NAME_CHARS = 1024
# Location table bytes of one code object (a 10,000-line function has ~40 KB).
MAX_LINETABLE_BYTES = 64 << 10
# Code objects cached per process (names and table: ~1 KB each).
CODE_CACHE_ENTRIES = 4096
# Code units of one function: past this an instruction pointer is not inside its code.
MAX_CODE_UNITS = 1 << 22
# Lines remembered per code object, by instruction offset (a sampled function sits at a few
# instructions; decoding its table at every sample was half the reader's CPU).
MAX_CACHED_LINES = 256

_Q = struct.Struct("<Q")
_I = struct.Struct("<i")


@dataclass(frozen=True, slots=True)
class PyFrame:
    function: str  # co_qualname
    filename: str  # co_filename
    line: int  # 0 when the instruction has no location


@dataclass(frozen=True, slots=True)
class _Code:
    qualname: str
    filename: str
    firstlineno: int
    linetable: bytes
    lines: dict[int, int | None]  # byte offset → addr2line's answer, at most MAX_CACHED_LINES

    def line(self, byte_offset: int) -> int | None:
        if byte_offset in self.lines:
            return self.lines[byte_offset]
        got = addr2line(self.linetable, self.firstlineno, byte_offset)
        if len(self.lines) < MAX_CACHED_LINES:
            self.lines[byte_offset] = got
        return got


class CPythonProcess:
    """Reads the stacks of one Target; sample() once per tick."""

    def __init__(self, target: Target) -> None:
        self.target = target
        lay = target.layout
        self._frame_bytes = max(lay.frame_previous, lay.frame_executable, lay.frame_instr_ptr) + 8
        self._frame_bytes = max(self._frame_bytes, lay.frame_owner + 1)
        self._code_bytes = max(lay.code_filename, lay.code_qualname, lay.code_linetable, lay.code_firstlineno) + 8
        self._tstate_bytes = max(lay.tstate_next, lay.tstate_native_thread_id, lay.tstate_current_frame) + 8
        # A str's header up to its data, and at least its state and length (whatever the offsets say).
        self._unicode_head = max(lay.unicode_ascii_size, lay.unicode_state + 4, lay.unicode_length + 8)
        self._codes: OrderedDict[tuple[int, ...], _Code] = OrderedDict()
        self.dropped: dict[str, int] = {}

    @property
    def version(self) -> str:
        return self.target.version

    def walk_data(self, start_ticks: int) -> PythonProcess:
        """What the collector's walk in BPF needs of this process (runtimes/runtime.py WalkedReader)."""
        t = self.target
        return PythonProcess(t.pid, start_ticks, t.version, t.runtime, wire_layout(t.layout))

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]:
        """Every thread's stack: every thread's frame chain first, then the code objects of all their
        Python frames in one read (a process's threads run the same code). MemoryReadError 'gone' or
        'budget' propagates; other failures skip a thread."""
        lay = self.target.layout
        chains: list[tuple[int, list[bytes], list[int]]] = []
        interp = mem.u64(self.target.runtime + lay.runtime_interpreters_head)
        seen_interps: set[int] = set()
        while interp and interp not in seen_interps and len(seen_interps) < MAX_INTERPRETERS:
            seen_interps.add(interp)
            tstate = mem.u64(interp + lay.interp_threads_head)
            seen_threads: set[int] = set()
            while tstate and tstate not in seen_threads and len(seen_threads) < MAX_THREADS:
                seen_threads.add(tstate)
                try:
                    raw = mem.read(tstate, self._tstate_bytes)
                    chains.append(self._chain(mem, raw))
                    tstate = _Q.unpack_from(raw, lay.tstate_next)[0]
                except MemoryReadError as e:
                    if e.reason in ("gone", "budget"):
                        raise
                    self._drop("thread_unreadable")
                    break
            interp = mem.u64(interp + lay.interp_next)
        wanted = sorted({c for _, _, codes in chains for c in codes if c and not c & 7})
        heads = dict(zip(wanted, mem.read_many([(c, self._code_bytes) for c in wanted]))) if wanted else {}
        out = []
        for tid, raws, codes in chains:
            frames = (self._frame(mem, raw, code, heads.get(code)) for raw, code in zip(raws, codes))
            out.append(ThreadStack(tid, tuple(f for f in frames if f is not None)))
        return out

    def _chain(self, mem: ProcessMemory, tstate: bytes) -> tuple[int, list[bytes], list[int]]:
        """One thread's id, and its Python frames (raw, newest first) with their code pointers, from its
        thread state."""
        lay = self.target.layout
        tid = _Q.unpack_from(tstate, lay.tstate_native_thread_id)[0]
        frame = _Q.unpack_from(tstate, lay.tstate_current_frame)[0]
        if lay.cframe_current_frame is not None and frame:
            frame = mem.u64(frame + lay.cframe_current_frame)
        raws: list[bytes] = []
        seen: set[int] = set()
        size = self._frame_bytes
        window_start, window = 0, b""  # the last read: frames lie below their callees in a data stack
        while frame:
            if frame in seen:
                self._drop("loop")
                break
            if len(seen) >= MAX_FRAMES:
                self._drop("too_deep")
                break
            seen.add(frame)
            at = frame - window_start
            if not 0 <= at <= len(window) - size:
                try:
                    window_start, window = mem.read_window(frame, size, FRAME_WINDOW_BYTES - size)
                except MemoryReadError as e:
                    if e.reason in ("gone", "budget"):
                        raise
                    self._drop("bad_pointer")
                    break
                at = frame - window_start
            raw = window[at : at + size]
            if raw[lay.frame_owner] not in lay.skip_owners:
                raws.append(raw)
            frame = _Q.unpack_from(raw, lay.frame_previous)[0]
        return tid, raws, [_Q.unpack_from(raw, lay.frame_executable)[0] & ~lay.tag_mask for raw in raws]

    def _frame(self, mem: ProcessMemory, raw: bytes, code: int, head: bytes | None) -> PyFrame | None:
        """A frame whose code object's header `head` was read (None: it could not be)."""
        lay = self.target.layout
        instr = _Q.unpack_from(raw, lay.frame_instr_ptr)[0]
        if head is None:  # a null, misaligned or unreadable code pointer
            self._drop("bad_pointer")
            return None
        return self._named(mem, code, head, instr - (code + lay.code_adaptive) if instr else None)

    def name(self, mem: ProcessMemory, code: int, offset: int | None) -> PyFrame | None:
        """The frame of the code object at `code` at the instruction `offset` bytes from its first code unit
        (None: not started), as the walk in BPF records them (collector/pywalk.py PyFrameRef); None, counted,
        if `code` is not a code object of this process. MemoryReadError 'gone' or 'budget' propagates."""
        if not code or code & 7:
            self._drop("bad_pointer")
            return None
        try:
            head = mem.read(code, self._code_bytes)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            self._drop("bad_pointer")
            return None
        return self._named(mem, code, head, offset)

    def _named(self, mem: ProcessMemory, code: int, head: bytes, offset: int | None) -> PyFrame | None:
        try:
            info = self._code(mem, code, head)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            self._drop("bad_pointer")
            return None
        if info is None:
            return None
        units = offset // 2 if offset is not None else -1
        if units == -1:  # not started yet (3.11/3.12 point before the first instruction)
            return PyFrame(info.qualname, info.filename, info.firstlineno)
        if not 0 <= units < MAX_CODE_UNITS:
            self._drop("bad_instruction_pointer")
            return None
        line = info.line(units * 2)
        if line is None:
            self._drop("impossible_line")
            return None
        return PyFrame(info.qualname, info.filename, max(line, 0))

    def _code(self, mem: ProcessMemory, code: int, head: bytes) -> _Code | None:
        lay = self.target.layout
        if _Q.unpack_from(head, lay.ob_type)[0] != self.target.code_type:
            self._drop("not_code")
            return None
        filename = _Q.unpack_from(head, lay.code_filename)[0]
        qualname = _Q.unpack_from(head, lay.code_qualname)[0]
        linetable = _Q.unpack_from(head, lay.code_linetable)[0]
        first = _I.unpack_from(head, lay.code_firstlineno)[0]
        key = (code, filename, qualname, linetable, first)
        got = self._codes.get(key)
        if got is not None:
            self._codes.move_to_end(key)
            return got
        if not 0 < first <= 1 << 24:
            self._drop("impossible_line")
            return None
        got = _Code(self._unicode(mem, qualname), self._unicode(mem, filename), first, self._bytes(mem, linetable), {})
        self._codes[key] = got
        if len(self._codes) > CODE_CACHE_ENTRIES:
            self._codes.popitem(last=False)
        return got

    def _unicode(self, mem: ProcessMemory, address: int) -> str:
        """A compact str object's text (names and paths are compact); '?' if it is not one."""
        lay = self.target.layout
        head = mem.read(address, self._unicode_head)
        length = _Q.unpack_from(head, lay.unicode_length)[0]
        state = struct.unpack_from("<I", head, lay.unicode_state)[0]
        kind, compact, ascii_ = state >> 2 & 7, state >> 5 & 1, state >> 6 & 1
        if not compact or kind not in (1, 2, 4) or length > 1 << 20:
            self._drop("bad_string")
            return "?"
        n = min(length, MAX_NAME_CHARS)
        if n == 0:
            return ""
        start = address + (lay.unicode_ascii_size if ascii_ else lay.unicode_compact_size)
        data = mem.read(start, n * kind)
        codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
        return data.decode(codec, "replace")

    def _bytes(self, mem: ProcessMemory, address: int) -> bytes:
        lay = self.target.layout
        size = mem.u64(address + lay.bytes_size)
        if size > MAX_LINETABLE_BYTES:
            self._drop("linetable_too_large")
            return b""
        return mem.read(address + lay.bytes_data, size) if size else b""
