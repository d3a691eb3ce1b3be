"""Which code a pc of a Node.js process is in: JIT code, the file holding V8, or other native code.

Owns: the process's executable mappings, sorted by start (read again at
most every CODE_MAPS_AGAIN_S, for a pc in none of those known: V8 commits
JIT code pages as it needs them), and the kind of a pc's mapping: "jit"
(anonymous memory), "v8" (the node binary or libnode holding V8),
"native" (any other file).

Must not: read process memory, or log.
"""

from __future__ import annotations

import bisect
import time

from runtimes.node.frames import Counts
from runtimes.runtime import read_maps

# The process's executable mappings are read again at most this often, for a pc in none of those known
# (V8 commits JIT code pages as it needs them).
CODE_MAPS_AGAIN_S = 1.0


class CodeMap:
    def __init__(self, pid: int, proc: str, module: str, counts: Counts) -> None:
        self.pid, self.proc, self.counts = pid, proc, counts
        self.module = module  # the mapped file holding V8 (node or libnode.so.N), as maps names it
        self.regions: list[tuple[int, int, str]] = []  # (start, end, kind) of the executable mappings
        self.starts: list[int] = []
        self._after = 0.0

    def set(self, regions: list[tuple[int, int, str]]) -> None:
        """The executable mappings as (start, end, kind), sorted by start."""
        self.regions = regions
        self.starts = [r[0] for r in regions]

    def in_v8_code(self, pc: int) -> bool:
        """Whether pc is in JIT code (anonymous executable memory) or in the file holding V8 (its builtins,
        or its C++: sample_regs tells them apart by the frames); counted in dropped when not."""
        kind = self.kind(pc)
        if kind is None and self.pid and time.monotonic() >= self._after:
            self._after = time.monotonic() + CODE_MAPS_AGAIN_S
            try:
                maps = read_maps(self.pid, self.proc)
            except OSError:
                maps = []
            self.set(
                sorted(
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
            )
            kind = self.kind(pc)
        if kind in ("jit", "v8"):
            return True
        self.counts.drop("regs_not_js")
        return False

    def kind(self, pc: int) -> str | None:
        i = bisect.bisect_right(self.starts, pc) - 1
        if i >= 0 and pc < self.regions[i][1]:
            return self.regions[i][2]
        return None
