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

Must not: write to, stop or attach to the target; log (the caller counts).
"""

from __future__ import annotations

import bisect
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from runtimes.memory import MAX_READ_BYTES, MemoryReadError, ProcessMemory
from runtimes.node.layouts import VM_STATES, Layout
from runtimes.runtime import SAMPLE_HZ, Mapping, ThreadStack, read_maps
from shared.wire import RegsSample

# Frames read per chain: deeper chains are cut (and counted), like the kernel's 127.
MAX_FRAMES = 128
# Bytes of the stack below js_entry_sp that are read per sample at most (one read: a process_vm_readv's cap).
STACK_WINDOW = MAX_READ_BYTES - 4096
# Bytes read first: a script's JavaScript stack is a few KiB; the whole window only when it runs past them.
STACK_FIRST_READ = 8 << 10
# A scanned leaf closer than 1/LEAF_MARGIN_DIVISOR of the window to its low end may go on below it: read more.
LEAF_MARGIN_DIVISOR = 8
# Bytes of a frame read around its fp: the fixed slots below it, the saved fp and return address above.
FRAME_HEAD_BYTES = 64
# Slots above a builtin exit frame's return address that may hold the called builtin's JSFunction
# (new target, target, argc, receiver: their order moved between V8 11 and 14).
BUILTIN_EXIT_SLOTS = 4
# Bytes of a function or script name; longer ones are cut.
MAX_NAME_BYTES = 1024
# Bytes of a script's source read to count its lines (when V8 has not computed its line ends): a
# quarter of a tick's read budget, so that one read fits in a tick; a longer script's later lines are 0.
MAX_SOURCE_BYTES = 1 << 20
# Line ends read from a script's line_ends array at most (8 bytes each: 1 MiB, as above).
MAX_LINES = 1 << 17
# Pieces of a cons string followed at most.
MAX_CONS_DEPTH = 16
# Functions (by SharedFunctionInfo address) and scripts cached per process.
FUNCTION_CACHE_ENTRIES = 4096
SCRIPT_CACHE_ENTRIES = 256
# Anonymous memory searched for the Isolate: per mapping, in all, and per tick (charged to the tick's budget).
MAX_SCAN_MAPPING = 64 << 20
MAX_SCAN_TOTAL = 512 << 20
SCAN_BYTES_PER_TICK = 2 << 20
# A process announced as it starts has no Isolate yet: its memory is searched again (new mappings,
# a grown [heap]) this long after a search found none, at most MAX_SEARCHES times (a minute).
SEARCH_AGAIN_S = 2.0
MAX_SEARCHES = 30
# Slots of a ScopeInfo looked at for the function's name and position (its context locals' names and
# infos come first: a function with more than 26 captured variables is "(anonymous)").
MAX_SCOPE_SLOTS = 64
# What v8dbg_ values can be: frame slots within a few words of fp, object fields within an object's
# first KiB, ScopeInfo indices within its header (V8 11 to 14: 1 to 5).
MAX_FRAME_SLOT = 256
MAX_FIELD_OFFSET = 1024
MAX_SCOPE_INDEX = 16
# A frame type marker is a small integer shifted by one (StackFrame::TypeToMarker); V8 has ~30 types.
MAX_FRAME_TYPE = 64
# The timer's period (runtimes/runtime.py SAMPLE_HZ): a register sample taken less than this after the timer's
# last scanned stack of a thread running JavaScript is that stack's time, already counted.
TIMER_PERIOD_NS = 1_000_000_000 // SAMPLE_HZ
# A main-thread sample's sp is at most this far below the top of the [stack] seen at detection (the
# mapping grows down with the stack, up to the default 8 MiB limit).
MAX_MAIN_STACK = 8 << 20
# The process's executable mappings are read again at most this often, for a pc in none of those known
# (V8 commits JIT code pages as it needs them).
CODE_MAPS_AGAIN_S = 1.0

_Q = struct.Struct("<Q")
_q = struct.Struct("<q")
_i = struct.Struct("<i")
_H = struct.Struct("<H")


@dataclass(frozen=True, slots=True)
class NodeFrame:
    function: str  # the function's name; "(anonymous)"; "(idle)" and such for a thread without JS
    filename: str  # the script's name ("" for builtins)
    line: int  # the line the function starts at, 1-based (0: unknown)
    kind: str  # interpreted, baseline, optimized, maglev, turbofan, builtin, vm


def _field(values: dict[str, int], cls: str, name: str) -> int:
    key = f"class_{cls}__{name}__"
    for k, v in values.items():
        if k.startswith(key):
            return v
    raise KeyError(key + "*")


def _type(values: dict[str, int], cls: str) -> int:
    key = f"type_{cls}__"
    for k, v in values.items():
        if k.startswith(key):
            return v
    raise KeyError(key + "*")


@dataclass(frozen=True)
class V8Info:
    """What the v8dbg_ symbols say, as the reader uses it."""

    off_function: int
    off_context: int
    off_bytecode_array: int
    off_bytecode_offset: int
    ft_entry: frozenset[int]
    ft_exit: int
    ft_builtin_exit: int
    map_instance_type: int
    js_function_types: tuple[int, int]
    t_sfi: int
    t_script: int
    t_scope_info: int
    t_bytecode_array: int
    t_fixed_array: int | None
    first_nonstring: int
    str_encoding_mask: int
    str_one_byte: int
    str_repr_mask: int
    str_cons: int
    str_sliced: int
    str_thin: int
    str_length: int
    seq_chars: int
    cons_first: int
    cons_second: int
    sliced_parent: int
    sliced_offset: int
    thin_actual: int
    fn_shared: int
    fn_code: int | None
    sfi_name: int
    sfi_script: int
    script_name: int
    script_source: int
    script_line_ends: int
    fixed_length: int
    fixed_data: int
    scope_first_vars: int
    scope_ncontextlocals: int
    code_flags: int | None
    code_kind_mask: int
    code_kind_baseline: int

    def check(self) -> str | None:
        """What is implausible about these values (a crafted file's), or None."""
        for name in ("off_function", "off_context", "off_bytecode_array", "off_bytecode_offset"):
            if not -MAX_FRAME_SLOT <= getattr(self, name) <= MAX_FRAME_SLOT or getattr(self, name) % 8:
                return f"frame slot {name} {getattr(self, name)}"
        for name in (
            "map_instance_type",
            "str_length",
            "seq_chars",
            "cons_first",
            "cons_second",
            "sliced_parent",
            "sliced_offset",
            "thin_actual",
            "fn_shared",
            "sfi_name",
            "sfi_script",
            "script_name",
            "script_source",
            "script_line_ends",
            "fixed_length",
            "fixed_data",
            "fn_code",
            "code_flags",
        ):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_FIELD_OFFSET:
                return f"field offset {name} {value}"
        if not 0 < self.scope_ncontextlocals < self.scope_first_vars <= MAX_SCOPE_INDEX:
            return f"ScopeInfo indices {self.scope_ncontextlocals}, {self.scope_first_vars}"
        return None

    @classmethod
    def from_values(cls, v: dict[str, int]) -> V8Info:
        def opt(c: str, n: str) -> int | None:
            try:
                return _field(v, c, n)
            except KeyError:
                return None

        jsf = _type(v, "JSFunction")
        sfi_script = opt("SharedFunctionInfo", "script_or_debug_info")
        if sfi_script is None:
            sfi_script = _field(v, "SharedFunctionInfo", "script")
        return cls(
            off_function=v["off_fp_function"],
            off_context=v["off_fp_context"],
            off_bytecode_array=v["off_fp_bytecode_array"],
            off_bytecode_offset=v["off_fp_bytecode_offset"],
            ft_entry=frozenset((v["frametype_EntryFrame"], v["frametype_ConstructEntryFrame"])),
            ft_exit=v["frametype_ExitFrame"],
            ft_builtin_exit=v["frametype_BuiltinExitFrame"],
            map_instance_type=_field(v, "Map", "instance_type"),
            js_function_types=(v.get("FirstJSFunctionType", jsf), v.get("LastJSFunctionType", jsf)),
            t_sfi=_type(v, "SharedFunctionInfo"),
            t_script=_type(v, "Script"),
            t_scope_info=_type(v, "ScopeInfo"),
            t_bytecode_array=_type(v, "BytecodeArray"),
            t_fixed_array=v.get("type_FixedArray__FIXED_ARRAY_TYPE"),
            first_nonstring=v["FirstNonstringType"],
            str_encoding_mask=v["StringEncodingMask"],
            str_one_byte=v["OneByteStringTag"],
            str_repr_mask=v["StringRepresentationMask"],
            str_cons=v["ConsStringTag"],
            str_sliced=v["SlicedStringTag"],
            str_thin=v["ThinStringTag"],
            str_length=_field(v, "String", "length"),
            seq_chars=_field(v, "SeqOneByteString", "chars"),
            cons_first=_field(v, "ConsString", "first"),
            cons_second=_field(v, "ConsString", "second"),
            sliced_parent=_field(v, "SlicedString", "parent"),
            sliced_offset=_field(v, "SlicedString", "offset"),
            thin_actual=_field(v, "ThinString", "actual"),
            fn_shared=_field(v, "JSFunction", "shared"),
            fn_code=opt("JSFunction", "code"),
            sfi_name=_field(v, "SharedFunctionInfo", "name_or_scope_info"),
            sfi_script=sfi_script,
            script_name=_field(v, "Script", "name"),
            script_source=_field(v, "Script", "source"),
            script_line_ends=_field(v, "Script", "line_ends"),
            fixed_length=_field(v, "FixedArrayBase", "length"),
            fixed_data=_field(v, "FixedArray", "data"),
            scope_first_vars=v["scopeinfo_idx_first_vars"],
            scope_ncontextlocals=v["scopeinfo_idx_ncontextlocals"],
            code_flags=opt("Code", "flags"),
            code_kind_mask=v["CodeKindFieldMask"],
            code_kind_baseline=v["CodeKindBaseline"],
        )


def scan_ranges(maps: list[Mapping]) -> list[tuple[int, int]]:
    """The anonymous read-write memory the Isolate may be in (malloc'd: [heap] or an anonymous mapping)."""
    out, total = [], 0
    for m in maps:
        if not m.perms.startswith("rw") or m.path not in ("", "[heap]") or m.end - m.start > MAX_SCAN_MAPPING:
            continue
        if total + (m.end - m.start) > MAX_SCAN_TOTAL:
            break
        out.append((m.start, m.end))
        total += m.end - m.start
    return out


def _smi(word: int) -> int | None:
    return (_q.unpack(_Q.pack(word))[0] >> 32) if not word & 1 else None


@dataclass(frozen=True, slots=True)
class _Function:
    name: str
    filename: str
    line: int
    builtin: bool


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
        self.module = module  # the mapped file holding V8 (node or libnode.so.N), as maps names it
        # On-CPU samples with registers: whether any came (then the timer leaves running JavaScript to
        # them), the monotonic time of the timer's last scanned stack, the executable mappings by start.
        self.regs_seen = False
        self._scanned_ns = 0
        self._code: list[tuple[int, int, str]] = []
        self._code_starts: list[int] = []
        self._code_after = 0.0
        self.isolate: int | None = None
        self._searches, self._search_after = 1, 0.0
        self._scan = list(ranges)
        self._scan_at = self._scan[0][0] if self._scan else 0
        self._functions: OrderedDict[tuple[int, int], _Function | None] = OrderedDict()
        self._by_function: OrderedDict[tuple[int, bytes, bytes], _Function | None] = OrderedDict()
        self._code_kinds: dict[int, str] = {}
        self._scripts: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        self._types: dict[int, int] = {}
        self.dropped: dict[str, int] = {}

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    # ------------------------------------------------------------ the isolate

    def _find_isolate(self, mem: ProcessMemory) -> None:
        lay, spent = self.layout, 0
        if not self._scan and self.pid and self._searches < MAX_SEARCHES and time.monotonic() >= self._search_after:
            self._searches += 1
            self._scan = scan_ranges(read_maps(self.pid, self.proc))
            self._scan_at = self._scan[0][0] if self._scan else 0
        searching = bool(self._scan)
        while self._scan and spent < SCAN_BYTES_PER_TICK:
            lo, hi = self._scan[0]
            at = max(self._scan_at, lo)
            n = min(MAX_READ_BYTES, hi - at)
            if n <= 0:
                self._scan.pop(0)
                self._scan_at = self._scan[0][0] if self._scan else 0
                continue
            spent += n
            try:
                data = mem.read(at, n)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                data = b""
            self._scan_at = at + n
            for cand in self._self_pointers(data, at, lay.stack_guard_isolate):
                try:
                    if mem.u64(cand + lay.thread_local_top + lay.tlt_isolate) == cand:
                        self.isolate = cand
                        return
                except MemoryReadError as e:
                    if e.reason in ("gone", "budget"):
                        raise
        if not self._scan:
            if searching:  # this search is over: the next one in SEARCH_AGAIN_S
                self._search_after = time.monotonic() + SEARCH_AGAIN_S
            self._drop("no_isolate")

    @staticmethod
    def _self_pointers(data: bytes, base: int, back: int) -> list[int]:
        """Addresses a (8-aligned) in data at which the word at a + back is a itself."""
        out = []
        for hi_bits in range((base - back) >> 16, ((base + len(data)) >> 16) + 1):  # 2 or 3 values
            pattern = (hi_bits << 16).to_bytes(8, "little")[2:]
            i = data.find(pattern)
            while i >= 0:
                slot = i - 2
                if slot >= 0 and (base + slot) % 8 == 0 and slot + 8 <= len(data):
                    word = _Q.unpack_from(data, slot)[0]
                    if word == base + slot - back and word:
                        out.append(word)
                i = data.find(pattern, i + 1)
        return out

    # ------------------------------------------------------------ sampling

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]:
        if self.isolate is None:
            self._find_isolate(mem)
            if self.isolate is None:
                return []
        lay = self.layout
        tlt = mem.read(self.isolate + lay.thread_local_top, lay.tlt_bytes)
        c_entry_fp = _Q.unpack_from(tlt, lay.tlt_c_entry_fp)[0]
        js_entry_sp = _Q.unpack_from(tlt, lay.tlt_js_entry_sp)[0]
        state = _H.unpack_from(tlt, lay.tlt_vm_state)[0]
        if _Q.unpack_from(tlt, lay.tlt_isolate)[0] != self.isolate:
            self._drop("isolate_moved")
            self.isolate = None
            return []
        if not js_entry_sp:
            name = VM_STATES[state] if state < len(VM_STATES) else "OTHER"
            label = "(idle)" if name in ("EXTERNAL", "IDLE", "IDLE_EXTERNAL", "OTHER") else f"({name.lower()})"
            return [ThreadStack(0, (NodeFrame(label, "", 0, "vm"),))]
        if not self.stack_lo <= js_entry_sp < self.stack_hi:
            self._drop("not_main_stack")
            return []
        hi = min(self.stack_hi, js_entry_sp + FRAME_HEAD_BYTES)
        leaf = c_entry_fp or mem.u64(self.isolate + lay.fast_c_call_caller_fp)
        if not leaf:  # running JavaScript
            if self.regs_seen:  # the on-CPU samples' registers show it (sample_regs)
                self._drop("running_js_left_to_regs")
                return []
            self._scanned_ns = time.monotonic_ns()
        for size in (STACK_FIRST_READ, STACK_WINDOW):
            lo = max(self.stack_lo, js_entry_sp - size, min(leaf - FRAME_HEAD_BYTES, js_entry_sp) if leaf else 0)
            window = mem.read(lo, hi - lo)
            fps = self._chain_up(window, lo, leaf, js_entry_sp) if leaf else self._chain_down(window, lo, js_entry_sp)
            if leaf or lo == self.stack_lo or fps[0] - lo > size // LEAF_MARGIN_DIVISOR:
                break  # the leaf is in the window, not at its low end
        if not leaf:
            fps = self._live_part(window, lo, fps)
        frames: list[NodeFrame] = []
        for fp in fps:
            got = self._frame(mem, window, lo, fp)
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
            self._drop("regs_not_main_thread", len(samples) - len(main))
        if self._scanned_ns:
            fresh = [r for r in main if r.time_ns >= self._scanned_ns + TIMER_PERIOD_NS]
            if len(fresh) < len(main):
                self._drop("regs_before_handover", len(main) - len(fresh))
            main = fresh
        main = [r for r in main if self._in_v8_code(r.ip)]
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
            self._drop("regs_stack_unreadable")
            return []
        out: list[ThreadStack] = []
        for r in main:
            if r.sp >= hi:  # far above the others' (a read apart is not worth it)
                self._drop("regs_stack_unreadable")
                continue
            copy = r.stack[: hi - r.sp]
            window = copy + now[r.sp + len(copy) - lo :]
            fps = self._chain_from_regs(window, r.sp, r.fp, entry)
            if fps is None:
                self._drop("regs_in_cxx")
                continue
            if not fps:  # the stack changed under it (counted there)
                continue
            frames = [got for got in (self._frame(mem, window, r.sp, fp) for fp in fps) if got is not None]
            if frames:
                out.append(ThreadStack(r.tid, tuple(frames)))
            else:
                self._drop("regs_no_frames")
        return out

    def _chain_from_regs(self, window: bytes, lo: int, fp: int, entry: int | None) -> list[int] | None:
        """Frame pointers from a sample's rbp up to its outermost entry frame (the one at `entry`, the
        js_entry_sp now, or the last one the chain passes), leaf first. None: not running JavaScript (a
        first frame that is no V8 frame, or an exit frame before the first entry frame: a call into C++).
        Where the chain breaks before any entry frame: once the isolate is known (`entry` not None), []
        (from a JavaScript leaf the first entry frame is reached over V8 frames only, which all keep
        rbp: the stack above the sample's copy was read after the thread had moved on, and what the
        chain found there is another moment's); before (None), as far as it goes."""
        v8 = self.v8
        if not self._plausible(window, lo, fp):
            return None
        out: list[int] = []
        last_entry = -1
        while True:
            if len(out) >= MAX_FRAMES:
                self._drop("too_deep")
                break
            out.append(fp)
            marker = self._word(window, lo, fp + v8.off_context)
            if marker is not None and not marker & 1:
                if marker >> 1 in v8.ft_entry:
                    last_entry = len(out) - 1
                elif marker >> 1 in (v8.ft_exit, v8.ft_builtin_exit) and last_entry < 0:
                    return None
            if entry and fp == entry:
                break
            nxt = self._word(window, lo, fp)
            if nxt is None or nxt <= fp:
                break
            fp = nxt
        if last_entry < 0:
            if len(out) >= MAX_FRAMES:  # deeper than is walked: the leaf end is kept (too_deep)
                return out
            if entry is not None:
                self._drop("regs_stack_changed")
                return []
            self._drop("regs_chain_cut")
            return out
        return out[: last_entry + 1]

    def _in_v8_code(self, pc: int) -> bool:
        """Whether pc is in JIT code (anonymous executable memory) or in the file holding V8 (its builtins,
        or its C++: sample_regs tells them apart by the frames); counted in dropped when not."""
        kind = self._code_kind(pc)
        if kind is None and self.pid and time.monotonic() >= self._code_after:
            self._code_after = time.monotonic() + CODE_MAPS_AGAIN_S
            try:
                maps = read_maps(self.pid, self.proc)
            except OSError:
                maps = []
            self._code = sorted(
                (
                    m.start,
                    m.end,
                    "v8"
                    if m.path == self.module
                    else "jit"
                    if m.path == "" or m.path.startswith("[anon:")
                    else "native",
                )
                for m in maps
                if m.perms[2:3] == "x"
            )
            self._code_starts = [c[0] for c in self._code]
            kind = self._code_kind(pc)
        if kind in ("jit", "v8"):
            return True
        self._drop("regs_not_js")
        return False

    def _code_kind(self, pc: int) -> str | None:
        i = bisect.bisect_right(self._code_starts, pc) - 1
        if i >= 0 and pc < self._code[i][1]:
            return self._code[i][2]
        return None

    # ------------------------------------------------------------ the frame pointer chain

    def _word(self, window: bytes, lo: int, address: int) -> int | None:
        off = address - lo
        return _Q.unpack_from(window, off)[0] if 0 <= off <= len(window) - 8 and not address & 7 else None

    def _chain_up(self, window: bytes, lo: int, fp: int, top: int) -> list[int]:
        """Frame pointers from the exact leaf `fp` to the entry frame at `top`, leaf first."""
        out: list[int] = []
        while fp and fp <= top:
            if len(out) >= MAX_FRAMES:
                self._drop("too_deep")
                break
            out.append(fp)
            nxt = self._word(window, lo, fp)
            if nxt is None or nxt <= fp:
                break
            fp = nxt
        return out

    def _chain_down(self, window: bytes, lo: int, top: int) -> list[int]:
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
                if not (lo + i) & 7 and self._plausible(window, lo, lo + i):
                    callee = lo + i
                    break
                end = i + 7  # an unaligned or implausible hit: look for one starting below it
            if callee is None:
                break
            out.append(callee)
            fp = callee
        else:
            self._drop("too_deep")
        out.reverse()
        return out

    def _live_part(self, window: bytes, lo: int, fps: list[int]) -> list[int]:
        """A scanned chain (leaf first) without its exit frames and what is below them: with no
        c_entry_fp, no call into C++ is running, so an exit frame found below is one a finished call
        left (Date.now's under a later Array.prototype.slice), or one whose JavaScript callees below
        the C++ frames the scan cannot reach."""
        exits = (self.v8.ft_exit, self.v8.ft_builtin_exit)
        for i in range(len(fps) - 1, -1, -1):
            marker = self._word(window, lo, fps[i] + self.v8.off_context)
            if marker is not None and not marker & 1 and marker >> 1 in exits:
                self._drop("stale_exit_frame")
                return fps[i + 1 :]
        return fps

    def _plausible(self, window: bytes, lo: int, fp: int) -> bool:
        """A V8 frame: a frame type marker, or a tagged context and a tagged function below fp."""
        marker = self._word(window, lo, fp + self.v8.off_context)
        fn = self._word(window, lo, fp + self.v8.off_function)
        if marker is None or fn is None:
            return False
        if not marker & 1:
            return marker >> 1 < MAX_FRAME_TYPE
        return fn & 3 == 1

    # ------------------------------------------------------------ frames

    def _frame(self, mem: ProcessMemory, window: bytes, lo: int, fp: int) -> NodeFrame | None:
        v8 = self.v8
        marker = self._word(window, lo, fp + v8.off_context)
        if marker is None:
            return None
        try:
            if not marker & 1:  # a typed frame: entry, exit, stub, internal, construct ...
                ftype = marker >> 1
                if ftype == v8.ft_builtin_exit:
                    for slot in range(fp + 16, fp + 16 + 8 * BUILTIN_EXIT_SLOTS, 8):
                        fn = self._word(window, lo, slot)
                        got = self._function(mem, fn) if fn is not None else None
                        if got is not None:
                            return NodeFrame(got.name, "", 0, "builtin")
                return None
            fn = self._word(window, lo, fp + v8.off_function)
            got = self._function(mem, fn) if fn is not None else None
            if got is None or fn is None:
                self._drop("not_function")
                return None
            if got.builtin:
                return NodeFrame(got.name, "", 0, "builtin")
            return NodeFrame(got.name, got.filename, got.line, self._kind(mem, window, lo, fp, fn))
        except MemoryReadError as e:
            if e.reason in ("gone", "budget"):
                raise
            self._drop("bad_pointer")
            return None

    def _kind(self, mem: ProcessMemory, window: bytes, lo: int, fp: int, fn: int) -> str:
        v8 = self.v8
        bc = self._word(window, lo, fp + v8.off_bytecode_array)
        if bc is not None and bc & 3 == 1 and self._instance_type(mem, bc) == v8.t_bytecode_array:
            off = self._word(window, lo, fp + v8.off_bytecode_offset)
            return "interpreted" if off is not None and not off & 1 else "baseline"
        if v8.fn_code is not None and v8.code_flags is not None:
            code = mem.u64(fn - 1 + v8.fn_code)
            got = self._code_kinds.get(code)
            if got is None and code & 3 == 1:
                kind = mem.u32(code - 1 + v8.code_flags) & v8.code_kind_mask
                got = {v8.code_kind_baseline + 1: "maglev", v8.code_kind_baseline + 2: "turbofan"}.get(
                    kind, "optimized"
                )
                if len(self._code_kinds) < FUNCTION_CACHE_ENTRIES:
                    self._code_kinds[code] = got
            return got or "optimized"
        return "optimized"

    def _instance_type(self, mem: ProcessMemory, tagged: int) -> int:
        if tagged & 3 != 1:
            return -1
        return self._map_type(mem, mem.u64(tagged - 1))

    def _map_type(self, mem: ProcessMemory, m: int) -> int:
        if m & 3 != 1:
            return -1
        got = self._types.get(m)
        if got is None:
            got = _H.unpack(mem.read(m - 1 + self.v8.map_instance_type, 2))[0]
            if len(self._types) < FUNCTION_CACHE_ENTRIES:
                self._types[m] = got
        return got

    def _function(self, mem: ProcessMemory, fn: int) -> _Function | None:
        """The JSFunction's name, script and line: one read of the function's map and shared pointer
        when this function (address, map, SharedFunctionInfo) was seen before (the GC moves objects:
        a moved one is a new key)."""
        v8 = self.v8
        if fn & 3 != 1:
            return None
        head = mem.read(fn - 1, v8.fn_shared + 8)
        fkey = (fn, head[:8], head[v8.fn_shared :])
        if fkey in self._by_function:
            self._by_function.move_to_end(fkey)
            return self._by_function[fkey]
        lo, hi = v8.js_function_types
        if not lo <= self._map_type(mem, _Q.unpack_from(head)[0]) <= hi:
            return None
        sfi = _Q.unpack_from(head, v8.fn_shared)[0]
        if self._instance_type(mem, sfi) != v8.t_sfi:
            self._drop("not_shared_function_info")
            return None
        head = mem.read(sfi - 1, max(v8.sfi_name, v8.sfi_script) + 8)
        name_or_scope = _Q.unpack_from(head, v8.sfi_name)[0]
        script = _Q.unpack_from(head, v8.sfi_script)[0]
        key = (sfi, name_or_scope ^ (script << 1))
        if key in self._functions:
            self._functions.move_to_end(key)
            got = self._functions[key]
        else:
            got = self._read_function(mem, name_or_scope, script)
            self._functions[key] = got
            if len(self._functions) > FUNCTION_CACHE_ENTRIES:
                self._functions.popitem(last=False)
        self._by_function[fkey] = got
        if len(self._by_function) > FUNCTION_CACHE_ENTRIES:
            self._by_function.popitem(last=False)
        return got

    def _read_function(self, mem: ProcessMemory, name_or_scope: int, script: int) -> _Function | None:
        v8 = self.v8
        name, start = "", -1
        t = self._instance_type(mem, name_or_scope)
        if 0 <= t < v8.first_nonstring:
            name = self._string(mem, name_or_scope) or ""
        elif t == v8.t_scope_info:
            name, start = self._scope_info(mem, name_or_scope)
        name = name or "(anonymous)"
        if self._instance_type(mem, script) != v8.t_script:
            return _Function(name, "", 0, True)
        filename, line_ends = self._script(mem, script)
        line = 0
        if start >= 0 and line_ends:
            line = bisect.bisect_left(line_ends, start) + 1
        return _Function(name, filename, line, False)

    def _scope_info(self, mem: ProcessMemory, scope: int) -> tuple[str, int]:
        """The function's name and start position from its ScopeInfo, whose layout no v8dbg_ symbol
        gives. Its slots after the map: flags, parameter count, context local count (v8dbg_'s indices),
        (V8 13+: the start and end positions,) the context locals' names and infos, then the function
        variable's name (a string, "" for an anonymous function expression) and its slot, the inferred
        name (undefined or a string: "Module._load"), and (V8 11, 12) the start and end positions
        (small integers). Anything else: no name."""
        v8 = self.v8
        locals_ = _smi(mem.u64(scope - 1 + 8 + 8 * v8.scope_ncontextlocals))
        if locals_ is None or not 0 <= locals_ <= (MAX_SCOPE_SLOTS - v8.scope_first_vars - 8) // 2:
            return "", -1
        n = v8.scope_first_vars + 2 * locals_ + 8  # the slots this reads, no further: no overrun
        slots = struct.unpack_from(f"<{n}Q", mem.read(scope - 1 + 8, 8 * n))
        i = v8.scope_first_vars + 2 * locals_
        names = []
        for w in slots[i : i + 3]:
            if w & 3 == 1 and 0 <= self._instance_type(mem, w) < v8.first_nonstring:
                names.append(self._string(mem, w) or "")
        start = -1
        if v8.scope_first_vars >= 5:  # V8 13+: the positions are fixed slots just before the locals
            a, b = _smi(slots[v8.scope_first_vars - 2]), _smi(slots[v8.scope_first_vars - 1])
            return next((n for n in names if n), ""), a if a is not None and b is not None and 0 <= a < b else -1
        for j in range(i + 1, n - 1):
            a, b = _smi(slots[j]), _smi(slots[j + 1])
            if a is not None and b is not None and 0 <= a < b:
                start = a
                break
        return next((n for n in names if n), ""), start

    def _script(self, mem: ProcessMemory, script: int) -> tuple[str, list[int]]:
        got = self._scripts.get(script)
        if got is not None:
            self._scripts.move_to_end(script)
            return got
        v8 = self.v8
        head = mem.read(script - 1, max(v8.script_name, v8.script_source, v8.script_line_ends) + 8)
        name = self._string(mem, _Q.unpack_from(head, v8.script_name)[0]) or ""
        ends = self._line_ends(mem, _Q.unpack_from(head, v8.script_line_ends)[0])
        if ends is None:
            source = self._string(mem, _Q.unpack_from(head, v8.script_source)[0], MAX_SOURCE_BYTES)
            ends = [i for i, c in enumerate(source) if c == "\n"] if source is not None else []
        self._scripts[script] = (name, ends)
        if len(self._scripts) > SCRIPT_CACHE_ENTRIES:
            self._scripts.popitem(last=False)
        return name, ends

    def _line_ends(self, mem: ProcessMemory, arr: int) -> list[int] | None:
        v8 = self.v8
        if v8.t_fixed_array is None or self._instance_type(mem, arr) != v8.t_fixed_array:
            return None  # undefined until V8 computes them (a stack trace, a profiler)
        length = _smi(mem.u64(arr - 1 + v8.fixed_length))
        if length is None or not 0 < length <= MAX_LINES:
            return None
        out: list[int] = []
        at = arr - 1 + v8.fixed_data
        while len(out) < length:
            k = min(length - len(out), MAX_READ_BYTES // 8)
            data = mem.read(at + 8 * len(out), 8 * k)
            for (w,) in struct.iter_unpack("<Q", data):
                s = _smi(w)
                if s is None:
                    return None
                out.append(s)
        return out

    def _string(self, mem: ProcessMemory, tagged: int, cap: int = MAX_NAME_BYTES, depth: int = 0) -> str | None:
        v8 = self.v8
        t = self._instance_type(mem, tagged)
        if not 0 <= t < v8.first_nonstring or depth > MAX_CONS_DEPTH:
            self._drop("bad_string")
            return None
        obj = tagged - 1
        length = _i.unpack(mem.read(obj + v8.str_length, 4))[0]
        if length < 0:
            return None
        repr_ = t & v8.str_repr_mask
        one = (t & v8.str_encoding_mask) == v8.str_one_byte
        if repr_ == 0:  # sequential
            n = min(length, cap) * (1 if one else 2)
            if not n:
                return ""
            raw = b"".join(
                mem.read(obj + v8.seq_chars + at, min(MAX_READ_BYTES, n - at)) for at in range(0, n, MAX_READ_BYTES)
            )
            return raw.decode("latin-1" if one else "utf-16-le", "replace")
        if repr_ == v8.str_cons:
            a = self._string(mem, mem.u64(obj + v8.cons_first), cap, depth + 1)
            if a is None:
                return None
            b = self._string(mem, mem.u64(obj + v8.cons_second), cap - len(a), depth + 1) if len(a) < cap else ""
            return None if b is None else a + b
        if repr_ == v8.str_thin:
            return self._string(mem, mem.u64(obj + v8.thin_actual), cap, depth + 1)
        if repr_ == v8.str_sliced:
            off = _smi(mem.u64(obj + v8.sliced_offset)) or 0
            parent = self._string(mem, mem.u64(obj + v8.sliced_parent), off + min(length, cap), depth + 1)
            return None if parent is None else parent[off : off + min(length, cap)]
        self._drop("external_string")  # external: its bytes are in C++ memory
        return None
