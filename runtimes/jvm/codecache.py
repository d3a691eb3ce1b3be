"""The JVM's code cache as a symbol table: which code blob holds a pc, and an nmethod's debug information.

Owns: the code heaps (CodeCache::_heaps: each one's bounds, segment map and
segment size); the code blob holding a pc (found through its heap's segment
map, its header read: name, size, frame size, where its frame is complete,
whether it is an nmethod, the interpreter or the call stub's return); an
nmethod's PcDescs and scopes data, and the scope chain ((Method*, bci),
innermost first) of the PcDesc at a pc offset. Caches (bounded): the blob
per pc, re-checked once per sample (its header read again: the code cache
frees and reuses nmethods' space), and the decoded nmethod per blob, by
its compile id.

Must not: name methods (naming.py), walk frames (walker.py), write to the
target, or log.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from runtimes.jvm.frames import BadFrame, Counts, read_uint
from runtimes.jvm.layouts import Layout
from runtimes.memory import MemoryReadError, ProcessMemory
from shared.safestr import process_string as safe_text

# Inlining depth of one PcDesc (C2's MaxInlineLevel is 15; JDK 21's default is 15).
MAX_INLINE_DEPTH = 64
# Bytes of one nmethod's PcDescs or scopes data (C2's largest are a few tens of KB).
MAX_DEBUG_BYTES = 256 << 10
# Code heaps (HotSpot has three with a segmented code cache).
MAX_HEAPS = 8
# Segment-map bytes read per hop back to a blob's start, and hops.
SEGMAP_CHUNK = 1024
MAX_SEGMAP_HOPS = 64
# A frame size (words) past this is corrupt (HotSpot's largest are a few thousand).
MAX_FRAME_WORDS = 1 << 16
# An nmethod's metadata (Method*, Klass*) table index past this is corrupt.
MAX_METADATA_INDEX = 1 << 16
# CodeHeap segment sizes: 2^4 to 2^16 bytes (CodeCacheSegmentSize is 64 or 128).
MIN_LOG2_SEGMENT, MAX_LOG2_SEGMENT = 4, 16
# A code blob larger than this is corrupt (the whole code cache is at most 2 GiB).
MAX_BLOB_BYTES = 1 << 30
# Bytes of a code blob's name ("nmethod", "Interpreter", "StubRoutines (1)", a runtime stub's).
MAX_BLOB_NAME = 64
# Bytes read at once of an nmethod's debug information (the memory module's cap per read).
BIG_READ_STEP = 32 << 10
# Cache sizes (entries).
BLOB_CACHE_ENTRIES = 16384
NMETHOD_CACHE_ENTRIES = 4096

_Q = struct.Struct("<Q")
_I = struct.Struct("<i")
_h = struct.Struct("<h")


@dataclass(slots=True)
class Blob:
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
class Nmethod:
    method: int
    compile_id: int
    pcs: list[tuple[int, int]]  # (pc offset, scope decode offset), sorted by pc offset
    scopes: bytes
    metadata: int
    chains: dict[int, list[tuple[int, int]] | None]

    def pc_desc(self, off: int) -> int | None:
        """The index of the PcDesc at pc offset `off` (a return address), else of the first one after it."""
        lo, hi = 0, len(self.pcs)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.pcs[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(self.pcs):
            return None
        return lo


class CodeCache:
    def __init__(self, layout: Layout, counts: Counts) -> None:
        self.lay, self.counts = layout, counts
        self._heaps: list[tuple[int, int, int, int]] | None = None  # (low, high, segmap, log2 segment)
        self._blobs: OrderedDict[int, Blob | None] = OrderedDict()
        self._nmethods: OrderedDict[int, Nmethod] = OrderedDict()
        self._checked: set[int] = set()  # code blobs (by start) checked again this sample

    def new_sample(self) -> None:
        """A new sample: each cached blob is checked again the first time it is looked up."""
        self._checked = set()

    def heaps(self, mem: ProcessMemory) -> list[tuple[int, int, int, int]]:
        lay = self.lay
        if self._heaps is not None:
            return self._heaps
        ga = mem.u64(lay.code_heaps)
        n = _I.unpack(mem.read(ga + lay.ga_len, 4))[0]
        data = mem.u64(ga + lay.ga_data)
        if not 0 < n <= MAX_HEAPS:
            raise BadFrame("code_heaps")
        heaps = []
        for (h,) in struct.iter_unpack("<Q", mem.read(data, 8 * n)):
            low = mem.u64(h + lay.heap_memory + lay.vs_low_boundary)
            high = mem.u64(h + lay.heap_memory + lay.vs_high)
            segmap = mem.u64(h + lay.heap_segmap + lay.vs_low)
            log2 = _I.unpack(mem.read(h + lay.heap_log2_segment, 4))[0]
            if not low < high or not MIN_LOG2_SEGMENT <= log2 <= MAX_LOG2_SEGMENT:
                raise BadFrame("code_heap")
            heaps.append((low, high, segmap, log2))
        self._heaps = heaps
        return heaps

    def blob(self, mem: ProcessMemory, pc: int) -> Blob | None:
        """The code blob holding pc, or None (not in the code cache). A cached blob is checked again
        once per sample (its header re-read): the code cache frees and reuses nmethods' space."""
        if pc in self._blobs:
            self._blobs.move_to_end(pc)
            blob = self._blobs[pc]
            if blob is None or blob.start in self._checked or self._still(mem, blob, pc):
                return blob
        blob = None
        for low, high, segmap, log2 in self.heaps(mem):
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

    def _still(self, mem: ProcessMemory, blob: Blob, pc: int) -> bool:
        """Whether a cached blob's header reads the same again; if not, what was read of its space is
        forgotten."""
        try:
            again = self._header(mem, blob.start, pc)
        except BadFrame:
            again = None
        if again is not None and (again.end, again.code_begin, again.compile_id, again.name) == (
            blob.end,
            blob.code_begin,
            blob.compile_id,
            blob.name,
        ):
            self._checked.add(blob.start)
            return True
        # Freed or replaced since: forget what was read of that space, and look again.
        self._blobs = OrderedDict(
            (k, b) for k, b in self._blobs.items() if b is None or not (b.start < blob.end and blob.start < b.end)
        )
        self._nmethods.pop(blob.start, None)
        return False

    def _find_blob(self, mem: ProcessMemory, pc: int, low: int, segmap: int, log2: int) -> Blob | None:
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
                raise BadFrame("segmap")
            if seg >= first:
                break
        else:
            raise BadFrame("segmap_hops")
        block = low + (seg << log2)
        if mem.read(block + lay.hb_used, 1)[0] == 0:
            return None
        return self._header(mem, block + lay.heap_block_size, pc)

    def _header(self, mem: ProcessMemory, start: int, pc: int) -> Blob:
        lay = self.lay
        need = 8 + max(
            lay.cb_name,
            lay.cb_size,
            lay.cb_frame_size,
            lay.cb_frame_complete,
            lay.cb_code_begin,
            lay.cb_code_offset,
            lay.cb_kind,
            lay.nm_compile_id,
        )
        raw = mem.read(start, need)
        size = _I.unpack_from(raw, lay.cb_size)[0]
        if not 0 < size < MAX_BLOB_BYTES or not start <= pc < start + size:
            raise BadFrame("blob_size")
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
            raise BadFrame("frame_size")
        # An int to JDK 22, an int16_t since: its low 16 bits either way (offsets are small; -1 is -1).
        frame_complete = _h.unpack_from(raw, lay.cb_frame_complete)[0] if lay.cb_frame_complete >= 0 else -1
        compile_id = _I.unpack_from(raw, lay.nm_compile_id)[0] if nmethod else 0
        call_stub = False
        if not nmethod and name.startswith("StubRoutines"):
            call_stub = pc == mem.u64(lay.call_stub_return)
        return Blob(
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

    # ------------------------------------------------------------ nmethods
    def nmethod(self, mem: ProcessMemory, blob: Blob) -> Nmethod:
        nm = self._nmethods.get(blob.start)
        if nm is not None and nm.compile_id == blob.compile_id:
            self._nmethods.move_to_end(blob.start)
            return nm
        start = blob.start
        method = mem.u64(start + self.lay.nm_method)
        pcs: list[tuple[int, int]] = []
        scopes = b""
        metadata = 0
        try:
            pcs, scopes, metadata = self._debug_info(mem, start)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            self.counts.drop("nmethod_unreadable")
            pcs = []
        nm = Nmethod(method, blob.compile_id, pcs, scopes, metadata, {})
        self._nmethods[start] = nm
        if len(self._nmethods) > NMETHOD_CACHE_ENTRIES:
            self._nmethods.popitem(last=False)
        return nm

    def _debug_info(self, mem: ProcessMemory, start: int) -> tuple[list[tuple[int, int]], bytes, int]:
        """(PcDescs, scopes data, metadata table) of the nmethod at start: JDK 25 keeps the first two in
        its immutable data, the metadata after the relocations in its mutable data; older ones inline."""
        lay = self.lay
        pcs: list[tuple[int, int]] = []
        scopes = b""
        if lay.nm_immutable_data >= 0:
            imm = mem.u64(start + lay.nm_immutable_data)
            pcs_lo = imm + _I.unpack(mem.read(start + lay.nm_scopes_pcs_offset, 4))[0]
            scopes_lo = imm + _I.unpack(mem.read(start + lay.nm_scopes_data_offset, 4))[0]
            pcs_hi = scopes_lo
            mutable = mem.u64(start + lay.cb_mutable_data)
            metadata = mutable + _I.unpack(mem.read(start + lay.cb_relocation_size, 4))[0]
            imm_end = imm + _I.unpack(mem.read(start + lay.nm_immutable_size, 4))[0]
            scopes_hi, ordered = imm_end, pcs_lo <= pcs_hi <= scopes_lo < imm_end
        else:
            pcs_lo = start + _I.unpack(mem.read(start + lay.nm_scopes_pcs_offset, 4))[0]
            pcs_hi = start + _I.unpack(mem.read(start + lay.nm_pcs_end_offset, 4))[0]
            scopes_lo = mem.u64(start + lay.nm_scopes_data_begin)
            metadata = start + _I.unpack(mem.read(start + lay.nm_metadata_offset, 4))[0]
            scopes_hi, ordered = pcs_lo, scopes_lo < pcs_lo <= pcs_hi
        if ordered and 0 < pcs_hi - pcs_lo <= MAX_DEBUG_BYTES and (pcs_hi - pcs_lo) % lay.pc_desc_size == 0:
            raw = _read_big(mem, pcs_lo, pcs_hi - pcs_lo)
            for k in range(0, len(raw), lay.pc_desc_size):
                pcs.append((_I.unpack_from(raw, k + lay.pc_offset)[0], _I.unpack_from(raw, k + lay.pc_scope_decode)[0]))
            pcs.sort()
            scopes = _read_big(mem, scopes_lo, min(scopes_hi - scopes_lo, MAX_DEBUG_BYTES))
        elif pcs_hi != pcs_lo:
            self.counts.drop("pc_descs")
        return pcs, scopes, metadata

    def chain(self, mem: ProcessMemory, nm: Nmethod, i: int | None) -> list[tuple[int, int]] | None:
        """The scope chain of the nmethod's i-th PcDesc (decoded once), or None."""
        if i is None:
            return None
        scope = nm.pcs[i][1]
        if scope not in nm.chains:
            try:
                nm.chains[scope] = self._scopes(mem, nm, scope)
            except (BadFrame, IndexError):
                nm.chains[scope] = None
        return nm.chains[scope]

    def _scopes(self, mem: ProcessMemory, nm: Nmethod, decode: int) -> list[tuple[int, int]] | None:
        """(Method*, bci) of the scope at `decode` and its senders, innermost first."""
        lay, x = self.lay, self.lay.stream_x
        indices: list[tuple[int, int]] = []
        while decode and len(indices) < MAX_INLINE_DEPTH:
            if not 0 < decode < len(nm.scopes):
                raise BadFrame("scope_offset")
            sender, pos = read_uint(nm.scopes, decode, x)
            index, pos = read_uint(nm.scopes, pos, x)
            bci, pos = read_uint(nm.scopes, pos, x)
            indices.append((index, bci + lay.invocation_entry_bci))
            if sender >= decode:
                raise BadFrame("scope_order")  # senders are written before the scopes that name them
            decode = sender
        if not indices:
            return None
        if not nm.metadata:
            raise BadFrame("scope_metadata")
        want = sorted({i for i, _ in indices})
        if want[0] < 1 or want[-1] > MAX_METADATA_INDEX:
            raise BadFrame("scope_index")
        got = mem.read_many([(nm.metadata + 8 * (i - 1), 8) for i in want])
        methods = {}
        for i, raw in zip(want, got):
            if raw is None:
                raise BadFrame("scope_metadata")
            methods[i] = _Q.unpack(raw)[0]
        return [(methods[i], bci) for i, bci in indices]


def _read_big(mem: ProcessMemory, at: int, size: int) -> bytes:
    """size bytes from at, in reads of at most the memory module's cap."""
    parts = []
    for off in range(0, size, BIG_READ_STEP):
        parts.append(mem.read(at + off, min(BIG_READ_STEP, size - off)))
    return b"".join(parts)
