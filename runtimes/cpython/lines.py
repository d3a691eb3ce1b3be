"""Line numbers from a CPython 3.11+ code object's location table (co_linetable).

Owns: decoding the table as CPython's Objects/locations.md describes it and
Objects/codeobject.c walks it: a sequence of entries, each starting with a
byte 1CCCCLLL (code C, length L+1 code units), followed by varint/svarint
fields depending on the code; the line of an entry is the previous line plus
its delta (codes 0-9: 0; 10-12: code-10; 13 and 14: a signed varint), and code
15 means "no location" (line -1). addr2line() finds the entry covering a
byte offset into the bytecode.

The table comes from another process's memory: decoding is bounded by the
table's length and by MAX_ENTRIES, and any malformed input gives None.

Must not: read memory.
"""

from __future__ import annotations

# A function of 1M code units is beyond anything real; bounds the walk.
MAX_ENTRIES = 1 << 20
# Lines beyond this are not lines of a source file anyone wrote.
MAX_LINE = 1 << 24


def _varint(table: bytes, i: int) -> tuple[int, int]:
    b = table[i]
    i += 1
    value, shift = b & 63, 0
    while b & 64:
        b = table[i]
        i += 1
        shift += 6
        if shift > 60:
            raise IndexError("varint too long")
        value |= (b & 63) << shift
    return value, i


def _svarint(table: bytes, i: int) -> tuple[int, int]:
    u, i = _varint(table, i)
    return (-(u >> 1) if u & 1 else u >> 1), i


def addr2line(table: bytes, firstlineno: int, byte_offset: int) -> int | None:
    """The line of the instruction at `byte_offset` (bytes into co_code_adaptive);
    -1 if the table says it has no location; None if the table does not cover it or is malformed."""
    line, addr, i, n = firstlineno, 0, 0, len(table)
    try:
        for _ in range(MAX_ENTRIES):
            if i >= n:
                return None
            first = table[i]
            if not first & 0x80:
                return None  # every entry starts with its high bit set
            code, length = (first >> 3) & 15, (first & 7) + 1
            i += 1
            delta = 0
            if code == 15:
                pass
            elif code == 14:
                delta, i = _svarint(table, i)
                for _k in range(3):  # end line delta, column + 1, end column + 1
                    _, i = _varint(table, i)
            elif code == 13:
                delta, i = _svarint(table, i)
            elif code >= 10:
                delta = code - 10
                i += 2
            else:
                i += 1
            line += delta
            end = addr + 2 * length
            if addr <= byte_offset < end:
                if code == 15:
                    return -1
                return line if 0 < line <= MAX_LINE else None
            addr = end
    except IndexError:
        return None
    return None
