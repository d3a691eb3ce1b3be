"""HotSpot's own description of itself, read from a JVM's memory.

Owns: reading the four tables libjvm exports for serviceability agents
(gHotSpotVMStructs, gHotSpotVMTypes, gHotSpotVMIntConstants,
gHotSpotVMLongConstants) from a running JVM: each table's entry stride and
field offsets are themselves exported variables (gHotSpotVMStructEntry*Offset,
...ArrayStride), read from the process like the tables, never assumed. The
result, VMStructs, is plain data (dicts of names to numbers) that can be
recorded and replayed in unit tests.

The process is untrusted: entry counts, strides and name lengths are capped
(the named constants below), names are bytes until decoded as ASCII (a name
that is not printable ASCII is skipped, counted in `skipped`).

Must not: know which fields the reader needs (layouts.py checks that), or
follow any pointer beyond the tables and their name strings.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from runtimes.memory import MemoryReadError, ProcessMemory

# HotSpot 25 has ~2,300 struct entries, ~1,100 types, ~1,500 int and ~100 long constants.
MAX_ENTRIES = 16384
# VMStructEntry is 48 bytes, VMTypeEntry 48, the constant entries 16: larger strides are corrupt.
MAX_STRIDE = 256
# The longest name or type string in HotSpot 25 is ~90 characters ("GrowableArray<...>").
MAX_NAME_BYTES = 128
# A name read shorter than this when the longer read fails (its string ends near the end of a mapping).
SHORT_NAME_BYTES = 24
# Entries read per chunk (one process_vm_readv per chunk).
ENTRIES_PER_CHUNK = 512

_Q = struct.Struct("<Q")
_I = struct.Struct("<i")
_q = struct.Struct("<q")

# The exported variables that describe each table, in the order read.
STRUCT_VARS = (
    "gHotSpotVMStructs",
    "gHotSpotVMStructEntryTypeNameOffset",
    "gHotSpotVMStructEntryFieldNameOffset",
    "gHotSpotVMStructEntryTypeStringOffset",
    "gHotSpotVMStructEntryIsStaticOffset",
    "gHotSpotVMStructEntryOffsetOffset",
    "gHotSpotVMStructEntryAddressOffset",
    "gHotSpotVMStructEntryArrayStride",
)
TYPE_VARS = (
    "gHotSpotVMTypes",
    "gHotSpotVMTypeEntryTypeNameOffset",
    "gHotSpotVMTypeEntrySuperclassNameOffset",
    "gHotSpotVMTypeEntryIsOopTypeOffset",
    "gHotSpotVMTypeEntryIsIntegerTypeOffset",
    "gHotSpotVMTypeEntryIsUnsignedOffset",
    "gHotSpotVMTypeEntrySizeOffset",
    "gHotSpotVMTypeEntryArrayStride",
)
INT_VARS = (
    "gHotSpotVMIntConstants",
    "gHotSpotVMIntConstantEntryNameOffset",
    "gHotSpotVMIntConstantEntryValueOffset",
    "gHotSpotVMIntConstantEntryArrayStride",
)
LONG_VARS = (
    "gHotSpotVMLongConstants",
    "gHotSpotVMLongConstantEntryNameOffset",
    "gHotSpotVMLongConstantEntryValueOffset",
    "gHotSpotVMLongConstantEntryArrayStride",
)
SYMBOLS: tuple[str, ...] = STRUCT_VARS + TYPE_VARS + INT_VARS + LONG_VARS


class VMStructsError(Exception):
    """The tables are missing or malformed."""


@dataclass
class VMStructs:
    """What the tables say. fields: (type, field) → offset in the type; statics: (type, field) → the
    static's address in the process; sizes: type → sizeof; ints / longs: constant → value."""

    fields: dict[tuple[str, str], int] = field(default_factory=dict)
    statics: dict[tuple[str, str], int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    ints: dict[str, int] = field(default_factory=dict)
    longs: dict[str, int] = field(default_factory=dict)
    skipped: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "fields": [[t, f, v] for (t, f), v in sorted(self.fields.items())],
            "statics": [[t, f, v] for (t, f), v in sorted(self.statics.items())],
            "sizes": self.sizes,
            "ints": self.ints,
            "longs": self.longs,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VMStructs:
        return cls(
            {(t, f): v for t, f, v in data["fields"]},
            {(t, f): v for t, f, v in data["statics"]},
            dict(data["sizes"]),
            dict(data["ints"]),
            dict(data["longs"]),
        )


def _names(mem: ProcessMemory, pointers: set[int]) -> dict[int, str]:
    """Each pointer's NUL-terminated printable-ASCII string (pointers whose string is not are left out)."""
    order = sorted(p for p in pointers if p)
    out: dict[int, str] = {}
    for size in (MAX_NAME_BYTES, SHORT_NAME_BYTES):
        got = mem.read_many([(p, size) for p in order])
        retry = []
        for p, raw in zip(order, got):
            if raw is None:
                retry.append(p)
                continue
            end = raw.find(b"\0")
            if end < 0:
                continue
            text = raw[:end]
            if text and all(0x20 < c < 0x7F or c == 0x20 for c in text):
                out[p] = text.decode("ascii")
        order = retry
    return out


def _entries(mem: ProcessMemory, first: int, stride: int, name_offset: int, what: str) -> list[bytes]:
    """The raw entries of a table up to the one whose name pointer is NULL (its end marker)."""
    if not first:
        raise VMStructsError(f"{what}: the table pointer is NULL")
    if not 0 < stride <= MAX_STRIDE or not 0 <= name_offset <= stride - 8:
        raise VMStructsError(f"{what}: entry stride {stride} / name at {name_offset} are not plausible")
    out: list[bytes] = []
    while len(out) < MAX_ENTRIES:
        n = min(ENTRIES_PER_CHUNK, MAX_ENTRIES - len(out))
        try:
            raw = mem.read(first + len(out) * stride, n * stride)
        except MemoryReadError as e:
            if e.reason in ("gone", "budget", "denied"):
                raise
            if n == 1:
                raise VMStructsError(f"{what}: entry {len(out)} is not readable") from None
            # The table ends within this chunk, before the chunk's end: read entry by entry.
            raw = b""
            for k in range(n):
                try:
                    raw += mem.read(first + (len(out) + k) * stride, stride)
                except MemoryReadError as e2:
                    if e2.reason in ("gone", "budget", "denied"):
                        raise
                    break
            n = len(raw) // stride
            if not n:
                raise VMStructsError(f"{what}: entry {len(out)} is not readable") from None
        for k in range(n):
            entry = raw[k * stride : (k + 1) * stride]
            if _Q.unpack_from(entry, name_offset)[0] == 0:
                return out
            out.append(entry)
    raise VMStructsError(f"{what}: no end marker within {MAX_ENTRIES} entries")


# The constant tables: (table, name offset, value offset, stride) variables and the value's format.
CONST_TABLES = (
    (
        "gHotSpotVMIntConstants",
        "gHotSpotVMIntConstantEntryNameOffset",
        "gHotSpotVMIntConstantEntryValueOffset",
        "gHotSpotVMIntConstantEntryArrayStride",
        _I,
    ),
    (
        "gHotSpotVMLongConstants",
        "gHotSpotVMLongConstantEntryNameOffset",
        "gHotSpotVMLongConstantEntryValueOffset",
        "gHotSpotVMLongConstantEntryArrayStride",
        _q,
    ),
)


@dataclass
class _Table:
    """A table's raw entries and where their fields are: name pointers (`names`, the first of which is
    the entry's end-marker field), and the values (`values`: offset and format)."""

    entries: list[bytes]
    names: tuple[int, ...]
    values: tuple[tuple[int, struct.Struct], ...]


def read(mem: ProcessMemory, addresses: dict[str, int]) -> VMStructs:
    """The tables of the JVM whose exported variables are at `addresses` (already biased)."""
    missing = [s for s in SYMBOLS if s not in addresses]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise VMStructsError(f"libjvm does not export {', '.join(missing[:3])}{more} (HotSpot's serviceability tables)")
    v = {s: mem.u64(addresses[s]) for s in SYMBOLS}
    # Structs: typeName, fieldName, typeString, isStatic (int32), offset (uint64), address (void*).
    stride = v["gHotSpotVMStructEntryArrayStride"]
    tn = _offset(v, "gHotSpotVMStructEntryTypeNameOffset", stride)
    entries = _entries(mem, v["gHotSpotVMStructs"], stride, tn, "gHotSpotVMStructs")
    fn = _offset(v, "gHotSpotVMStructEntryFieldNameOffset", stride)
    st = _offset(v, "gHotSpotVMStructEntryIsStaticOffset", stride, 4)
    oo = _offset(v, "gHotSpotVMStructEntryOffsetOffset", stride)
    ao = _offset(v, "gHotSpotVMStructEntryAddressOffset", stride)
    structs = _Table(entries, (tn, fn), ((st, _I), (oo, _Q), (ao, _Q)))
    # Types: typeName, superclassName, isOopType, isIntegerType, isUnsigned (int32 each), size (uint64).
    tstride = v["gHotSpotVMTypeEntryArrayStride"]
    ttn = _offset(v, "gHotSpotVMTypeEntryTypeNameOffset", tstride)
    entries = _entries(mem, v["gHotSpotVMTypes"], tstride, ttn, "gHotSpotVMTypes")
    types = _Table(entries, (ttn,), ((_offset(v, "gHotSpotVMTypeEntrySizeOffset", tstride), _Q),))
    consts = []
    for table, name_var, value_var, stride_var, fmt in CONST_TABLES:
        cs = v[stride_var]
        no = _offset(v, name_var, cs)
        vo = _offset(v, value_var, cs, fmt.size)
        consts.append(_Table(_entries(mem, v[table], cs, no, table), (no,), ((vo, fmt),)))
    pointers = {_Q.unpack_from(e, o)[0] for t in (structs, types, *consts) for o in t.names for e in t.entries}
    return _decoded(structs, types, consts, _names(mem, pointers))


def _offset(v: dict[str, int], name: str, entry_size: int, width: int = 8) -> int:
    """The exported offset `name` of a field `width` bytes wide, checked to lie within its entry."""
    o = v[name]
    if o > entry_size - width:
        raise VMStructsError(f"{name} is {o}, outside its {entry_size}-byte entry")
    return o


def _decoded(structs: _Table, types: _Table, consts: list[_Table], names: dict[int, str]) -> VMStructs:
    """VMStructs from the tables' entries and their names (an entry whose name is not known is skipped)."""
    out = VMStructs()
    (tn, fn), ((st, _), (oo, _), (ao, _)) = structs.names, structs.values
    for e in structs.entries:
        t, f = names.get(_Q.unpack_from(e, tn)[0]), names.get(_Q.unpack_from(e, fn)[0])
        if t is None or f is None:
            out.skipped += 1
            continue
        if _I.unpack_from(e, st)[0]:
            out.statics[(t, f)] = _Q.unpack_from(e, ao)[0]
        else:
            out.fields[(t, f)] = _Q.unpack_from(e, oo)[0]
    for table, target in ((types, out.sizes), *zip(consts, (out.ints, out.longs))):
        ((no,), ((vo, fmt),)) = table.names, table.values
        for e in table.entries:
            name = names.get(_Q.unpack_from(e, no)[0])
            if name is None:
                out.skipped += 1
                continue
            target[name] = fmt.unpack_from(e, vo)[0]
    return out
