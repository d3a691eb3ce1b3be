"""Thread stacks of one Ruby process, read from its memory while it runs.

Owns: from the VM (found by detect: the symbol or a validated scan), the
main ractor's threads (the ring of their list nodes, each validated by
pointing back to the VM and the ractor), each thread's execution context and
its control frames from the current one to the end of its VM stack; each
frame of Ruby code (its iseq an imemo_iseq) turned into a RubyFrame: label
(the method or block name), file (the iseq's path) and line (from the
iseq's instruction info at the frame's pc, through the succinct index table
as Ruby's iseq.c encodes it). Frames of C functions (sleep, Integer#times)
have no iseq and are skipped. Decoded iseqs are cached by address and body,
bounded.

Validation: a thread whose links do not point back, an iseq that is not an
imemo_iseq, a path or label that is not a string, a pc outside the iseq or
an index outside its table drops the thread or frame, counted in `dropped`
by reason. Reads are bounded (MAX_THREADS, MAX_FRAMES, MAX_NAME_BYTES,
MAX_INSN_ENTRIES); the ReadBudget bounds the bytes.

Other ractors' threads are not reached yet: the ring of ractors hangs off
fields this reader has no checked offsets for (the main ractor is where
every program without Ractor.new runs).

Must not: write to, stop or attach to the target; log.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from ebpfprofiler.runtimes.memory import MemoryReadError, ProcessMemory
from ebpfprofiler.runtimes.ruby import layouts
from ebpfprofiler.runtimes.ruby.layouts import Layout
from ebpfprofiler.runtimes.runtime import ThreadStack

# Threads read per process.
MAX_THREADS = 512
# Control frames read per thread (Ruby's default VM stack holds ~10K; profiles cut at 128).
MAX_FRAMES = 128
# Bytes of a label or path.
MAX_NAME_BYTES = 1024
# Instruction-info entries of one iseq (a 10,000-line method has ~40K).
MAX_INSN_ENTRIES = 1 << 16
# Instructions of one iseq: a pc past this is not inside it.
MAX_ISEQ_SIZE = 1 << 24
# Decoded iseqs cached per process.
ISEQ_CACHE_ENTRIES = 4096

_Q = struct.Struct("<Q")
_I = struct.Struct("<I")
_i = struct.Struct("<i")


@dataclass(frozen=True, slots=True)
class RubyFrame:
    function: str          # the iseq's label: method, "block in m", "<main>"
    class_name: str        # "" (not read yet)
    filename: str
    line: int


@dataclass(slots=True)
class _Iseq:
    label: str
    path: str
    encoded: int
    size: int              # instruction info entries
    lines: list[int]       # line of each entry
    succ: int              # address of the succinct index table (0: none)
    cache: dict[int, int]  # position → entry index


class RubyProcess:
    def __init__(self, version: str, layout: Layout, vm: int) -> None:
        self.version, self.layout, self.vm = version, layout, vm
        self._iseqs: OrderedDict[tuple[int, int], _Iseq | None] = OrderedDict()
        self.dropped: dict[str, int] = {}

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def threads(self, mem: ProcessMemory) -> list[tuple[int, int, int]]:
        """(thread, its execution context, its native thread) of each thread of the main ractor."""
        lay = self.layout
        vm = mem.read(self.vm, lay.vm_main_thread + 8)
        ractor, main = _Q.unpack_from(vm, lay.vm_main_ractor)[0], _Q.unpack_from(vm, lay.vm_main_thread)[0]
        out: list[tuple[int, int, int]] = []
        node, seen = main, set[int]()
        want = max(lay.th_ractor, lay.th_vm, lay.th_nt, lay.th_ec) + 8
        while node and node not in seen and len(seen) < MAX_THREADS + 1:
            seen.add(node)
            th = node - lay.th_node
            try:
                raw = mem.read(th, want) if not th & 7 else None
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                raw = None
            if raw is None:
                self._drop("bad_thread")
                break
            # The ring's head lives in the ractor, not in a thread: it fails this check and is passed.
            if _Q.unpack_from(raw, lay.th_vm)[0] == self.vm and _Q.unpack_from(raw, lay.th_ractor)[0] == ractor:
                out.append((th, _Q.unpack_from(raw, lay.th_ec)[0], _Q.unpack_from(raw, lay.th_nt)[0]))
            node = _Q.unpack_from(raw, lay.th_node)[0]
        return out

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]:
        lay = self.layout
        out = []
        for _th, ec, nt in self.threads(mem):
            try:
                tid = mem.i32(nt + lay.nt_tid) if nt else 0
                frames = self._frames(mem, ec)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                self._drop("thread_unreadable")
                continue
            if frames:
                out.append(ThreadStack(max(tid, 0), tuple(frames)))
        return out

    def _frames(self, mem: ProcessMemory, ec: int) -> list[RubyFrame]:
        lay = self.layout
        raw = mem.read(ec, lay.ec_cfp + 8)
        stack = _Q.unpack_from(raw, lay.ec_vm_stack)[0]
        size = _Q.unpack_from(raw, lay.ec_vm_stack_size)[0]
        cfp = _Q.unpack_from(raw, lay.ec_cfp)[0]
        end = stack + 8 * size
        if not stack <= cfp < end or size > 1 << 28:
            self._drop("bad_stack")
            return []
        n = min(MAX_FRAMES, (end - cfp) // lay.cfp_bytes)
        if (end - cfp) // lay.cfp_bytes > MAX_FRAMES:
            self._drop("too_deep")
        cfps = mem.read_many([(cfp + i * lay.cfp_bytes, lay.cfp_bytes) for i in range(n)])
        frames: list[RubyFrame] = []
        for c in cfps:
            if c is None:
                self._drop("bad_pointer")
                break
            iseq = _Q.unpack_from(c, lay.cfp_iseq)[0]
            if not iseq or iseq & 7:
                continue                     # a C function's frame, or the VM's dummy bottom frame
            got = self._frame(mem, iseq, _Q.unpack_from(c, lay.cfp_pc)[0])
            if got is not None:
                frames.append(got)
        return frames

    def _frame(self, mem: ProcessMemory, iseq: int, pc: int) -> RubyFrame | None:
        head = mem.read(iseq, self.layout.iseq_body + 8)
        flags = _Q.unpack_from(head, 0)[0]
        if flags & layouts.T_MASK != layouts.T_IMEMO:
            return None                      # a C function's method entry, or a dummy frame
        if (flags >> layouts.FL_USHIFT) & 0xF != layouts.IMEMO_ISEQ:
            return None
        body = _Q.unpack_from(head, self.layout.iseq_body)[0]
        key = (iseq, body)
        info = self._iseqs.get(key)
        if key in self._iseqs:
            self._iseqs.move_to_end(key)
        else:
            try:
                info = self._read_iseq(mem, body)
            except MemoryReadError as e:
                if e.reason in ("gone", "budget"):
                    raise
                self._drop("bad_pointer")
                info = None
            self._iseqs[key] = info
            if len(self._iseqs) > ISEQ_CACHE_ENTRIES:
                self._iseqs.popitem(last=False)
        if info is None:
            return None
        if not pc:
            return RubyFrame(info.label, "", info.path, 0)
        pos = (pc - info.encoded) // 8
        if not 0 <= pos < MAX_ISEQ_SIZE:
            self._drop("bad_pc")
            return None
        pos = pos - 1 if pos else 0          # the pc is past the instruction being run
        line = self._line(mem, info, pos)
        if line is None:
            return None
        return RubyFrame(info.label, "", info.path, line)

    def _read_iseq(self, mem: ProcessMemory, body: int) -> _Iseq | None:
        lay = self.layout
        if not body or body & 7:
            self._drop("bad_pointer")
            return None
        raw = mem.read(body, lay.body_succ_table + 8)
        label = self._string(mem, _Q.unpack_from(raw, lay.body_label)[0])
        path = self._path(mem, _Q.unpack_from(raw, lay.body_pathobj)[0])
        if label is None or path is None:
            return None
        size = _I.unpack_from(raw, lay.body_insns_size)[0]
        entries = _Q.unpack_from(raw, lay.body_insns_body)[0]
        if size > MAX_INSN_ENTRIES or (size and not entries):
            self._drop("bad_insn_info")
            return None
        table = mem.read(entries, size * layouts.INSN_INFO_ENTRY_BYTES) if size else b""
        lines = [_i.unpack_from(table, k * layouts.INSN_INFO_ENTRY_BYTES)[0] for k in range(size)]
        return _Iseq(label, path, _Q.unpack_from(raw, lay.body_iseq_encoded)[0], size, lines,
                     _Q.unpack_from(raw, lay.body_succ_table)[0], {})

    def _line(self, mem: ProcessMemory, info: _Iseq, pos: int) -> int | None:
        if info.size == 0:
            return 0
        if info.size == 1:
            return info.lines[0]
        index = info.cache.get(pos)
        if index is None:
            if not info.succ:
                self._drop("bad_insn_info")
                return None
            index = self._succ_lookup(mem, info.succ, pos)
            if len(info.cache) < 256:
                info.cache[pos] = index
        if not 1 <= index <= info.size:
            self._drop("impossible_line")
            return None
        line = info.lines[index - 1]
        return line if 0 <= line < 1 << 24 else 0

    def _succ_lookup(self, mem: ProcessMemory, table: int, x: int) -> int:
        """Ruby's succ_index_lookup (iseq.c): the number of instruction-info entries starting at or before x."""
        if x < layouts.SUCC_IMMEDIATE:
            word = mem.u64(table + 8 * (x // 9))
            return (word >> (7 * (x % 9))) & 0x7F
        block = (x - layouts.SUCC_IMMEDIATE) // 512
        bit = (x - layouts.SUCC_IMMEDIATE) % 512
        raw = mem.read(table + layouts.SUCC_IMM_BYTES + block * layouts.SUCC_BLOCK_BYTES, layouts.SUCC_BLOCK_BYTES)
        rank = _I.unpack_from(raw, 0)[0]
        small_ranks = _Q.unpack_from(raw, 8)[0]
        small = bit // 64
        small_rank = 0 if small == 0 else (small_ranks >> ((small - 1) * 9)) & 0x1FF
        word = _Q.unpack_from(raw, 16 + 8 * small)[0]
        popcount = bin((word << (63 - bit % 64)) & 0xFFFFFFFFFFFFFFFF).count("1")
        return rank + small_rank + popcount

    def _string(self, mem: ProcessMemory, value: int) -> str | None:
        lay = self.layout
        if not value or value & 7:
            self._drop("bad_string")
            return None
        head = mem.read(value, lay.str_ptr + 8)
        flags = _Q.unpack_from(head, 0)[0]
        length = _Q.unpack_from(head, lay.str_len)[0]
        if flags & layouts.T_MASK != layouts.T_STRING or length > 1 << 20:
            self._drop("bad_string")
            return None
        n = min(length, MAX_NAME_BYTES)
        if not n:
            return ""
        ptr = _Q.unpack_from(head, lay.str_ptr)[0] if flags & layouts.STRING_NOEMBED else value + lay.str_ptr
        return mem.read(ptr, n).decode("utf-8", "replace")

    def _path(self, mem: ProcessMemory, value: int) -> str | None:
        """pathobj: a path string, or an array [path, realpath]."""
        if not value or value & 7:
            self._drop("bad_string")
            return None
        flags = mem.u64(value)
        if flags & layouts.T_MASK == layouts.T_ARRAY:
            lay = self.layout
            if flags & layouts.ARRAY_EMBED:
                first = mem.u64(value + lay.ary_embed)
            else:
                first = mem.u64(mem.u64(value + lay.ary_heap_ptr))
            return self._string(mem, first)
        return self._string(mem, value)
