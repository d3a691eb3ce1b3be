"""What the JVM reader's parts share: the frames they make, the failure they raise, what they count.

Owns: JvmFrame (one frame of a Java stack) and the fixed frames ("[call
stub]", "[running Java code]"); BadFrame, the exception a part raises when
a thread or frame fails its checks (its first argument is the reason
counted); Counts, the frames read by kind and what was dropped by reason,
one per process, shared by its parts; HotSpot's compressed streams
(UNSIGNED5 values and the line-number table coded in them).

Must not: read process memory, or log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Frames read, by kind; "no_scope": a running pc of compiled code with no debug information near it;
# "entry", "exit": one in its method's prologue or epilogue, walked from the decoded instructions.
FRAME_KINDS = ("interpreted", "compiled", "inlined", "native", "stub", "running", "no_scope", "entry", "exit")


@dataclass(frozen=True, slots=True)
class JvmFrame:
    function: str  # "pkg.Class.method", or "[stub: name]"
    filename: str  # the class's source file ("Foo.java"); "" for stubs
    line: int
    kind: str  # interpreted, compiled, inlined, native, stub, running


# The frame between Java code and the native code that called it (its entry frame, the call stub).
CALL_STUB = JvmFrame("[call stub]", "", 0, "stub")
# The one frame of a thread running Java code: it records no last Java frame while it runs.
RUNNING_JAVA = JvmFrame("[running Java code]", "", 0, "running")


class BadFrame(Exception):
    """A frame or thread failed validation; args[0] is the reason counted."""


class Counts:
    """One process's counters: frames read by kind, and threads or frames dropped by reason."""

    def __init__(self) -> None:
        self.dropped: dict[str, int] = {}
        self.frames: dict[str, int] = dict.fromkeys(FRAME_KINDS, 0)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def count(self, kind: str) -> None:
        self.frames[kind] += 1


def read_uint(buf: bytes, pos: int, x: int) -> tuple[int, int]:
    """One UNSIGNED5 value at pos (x: excluded low bytes, 0 before JDK 20, 1 after); (value, next pos)."""
    low = 256 - 64 - x
    b = buf[pos] - x
    if b < 0:
        raise BadFrame("stream_byte")
    if b < low:
        return b, pos + 1
    total, shift = b, 6
    for i in range(1, 5):
        c = buf[pos + i] - x
        if c < 0:
            raise BadFrame("stream_byte")
        total += c << shift
        if c < low or i == 4:
            return total & 0xFFFFFFFF, pos + i + 1
        shift += 6
    raise AssertionError("unreachable")


def read_signed(buf: bytes, pos: int, x: int) -> tuple[int, int]:
    v, pos = read_uint(buf, pos, x)
    return (v >> 1) ^ -(v & 1), pos


def line_table(buf: bytes, x: int) -> tuple[tuple[int, int], ...]:
    """HotSpot's compressed line-number table: a byte (bci delta << 3 | line delta), or 0xFF then two
    signed values; 0 ends it."""
    out: list[tuple[int, int]] = []
    bci = line = pos = 0
    while pos < len(buf):
        b = buf[pos]
        pos += 1
        if b == 0:
            return tuple(out)
        if b == 0xFF:
            d_bci, pos = read_signed(buf, pos, x)
            d_line, pos = read_signed(buf, pos, x)
            bci, line = bci + d_bci, line + d_line
        else:
            bci, line = bci + (b >> 3), line + (b & 7)
        out.append((bci, line))
    raise BadFrame("line_table_unterminated")


def describe(frames: list[Any]) -> str:
    return " ← ".join(f"{f.function}:{f.line}" for f in frames)
