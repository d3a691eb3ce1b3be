"""What the Node.js reader's parts share: the frames they make, a word of a stack window, the counters.

Owns: NodeFrame (one frame of a JavaScript stack), `word` (an aligned word
of a stack window read from address lo, or None outside it), Counts (what
was dropped, by reason, one per process, shared by its parts).

Must not: read process memory, or log.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_Q = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class NodeFrame:
    function: str  # the function's name; "(anonymous)"; "(idle)" and such for a thread without JS
    filename: str  # the script's name ("" for builtins)
    line: int  # the line the function starts at, 1-based (0: unknown)
    kind: str  # interpreted, baseline, optimized, maglev, turbofan, builtin, vm


class Counts:
    """One process's counters: frames, samples and searches dropped, by reason."""

    def __init__(self) -> None:
        self.dropped: dict[str, int] = {}

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n


def word(window: bytes, lo: int, address: int) -> int | None:
    """The word at `address` of a window read from `lo`, or None (outside it, or unaligned)."""
    off = address - lo
    return _Q.unpack_from(window, off)[0] if 0 <= off <= len(window) - 8 and not address & 7 else None
