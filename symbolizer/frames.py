"""Turns raw stack addresses into frames: module, build id, module-relative address, name.

Owns: the address → frame rules of docs/architecture.md ("Data flow"): a user frame carries
its module path, GNU build id and module-relative address (address − mapping
start + file offset) and a function name where the module has symbols; kernel
frames take the names the collector resolved from /proc/kallsyms; frames in
anonymous executable memory take names from the process's /tmp/perf-<pid>.map.
The names come from the name sources of symbolizer/names.py (NameSource), asked
in the order here: for a frame in a mapped file, its separate debug file, then
the file's own symbols; for one in anonymous memory, the perf map.

Also owns the frames it resolved per process (bounded): a long-lived process's stacks come back in
every batch, and a frame resolved once costs a dict lookup the next time instead of a mapping
search, a module and debug file lookup and a symbol search (~10 us of Python). They are kept
while the process's mappings are the same, and never for frames in anonymous memory or outside
every mapping (its perf map may name them later).

Must not: keep per-process state beyond those bounded caches, read files
itself (the sources do, through the broker), or build profiles.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shared.wire import Mapping, Process
from symbolizer.elf import ElfCache, ElfSymbols
from symbolizer.files import FileClient
from symbolizer.names import DebugFileNames, KernelNames, ModuleNames, NameSource, PerfMapNames
from symbolizer.perfmap import PerfMapCache

KERNEL_MODULE = "[kernel.kallsyms]"
JIT_MODULE = "[jit]"
# Addresses outside every executable mapping the collector read.
UNKNOWN_MODULE = "[unknown]"
# Processes whose resolved frames are kept (the least recently resolved go first), and frames kept
# per process: a busy host's long-lived processes, and the few thousand places each is sampled in.
REMEMBERED_PROCESSES = 256
REMEMBERED_FRAMES = 4096


@dataclass(frozen=True, slots=True)
class Frame:
    module: str
    build_id: str
    address: int  # module-relative for user frames; absolute for kernel and JIT
    function: str  # "" when unknown


def _start(m: Mapping) -> int:
    return m.start


# Mappings with no file of their own, whose code a perf map may name (perf's is_anon_memory: "//anon",
# "/dev/zero" for shared anonymous memory, "/anon_hugepage"; and memfds, the kernel's "[anon:NAME]").
ANONYMOUS_PREFIXES = ("[anon", "//anon", "/dev/zero", "/anon_hugepage", "/memfd:", "[heap]", "[stack]")


def _is_anonymous(path: str) -> bool:
    return path == "" or path.startswith(ANONYMOUS_PREFIXES)


class FrameResolver:
    def __init__(
        self, files: FileClient, elf_cache: ElfCache | None = None, perf_maps: PerfMapCache | None = None
    ) -> None:
        elf = elf_cache or ElfCache()
        self.stats = {
            "user_frames": 0,
            "named": 0,
            "debug_named": 0,
            "no_mapping": 0,
            "jit_named": 0,
            "perf_map_skipped_gone": 0,
        }
        self._modules = ModuleNames(files, elf)
        # The name sources of a frame in a mapped file, and of one in anonymous memory (or none), in order.
        self._file_names: tuple[NameSource, ...] = (DebugFileNames(files, elf), self._modules)
        self._anonymous_names: tuple[NameSource, ...] = (
            PerfMapNames(perf_maps or PerfMapCache(files.perf_map), self.stats),
        )
        self._user_names = self._file_names + self._anonymous_names
        # (pid, start ticks) → (the mappings its frames were resolved with, {(address, leaf): (frame,
        # the stats counters resolving it added one to)}).
        self._remembered: OrderedDict[
            tuple[int, int], tuple[tuple[Mapping, ...], dict[tuple[int, bool], tuple[Frame, tuple[str, ...]]]]
        ]
        self._remembered = OrderedDict()

    def kernel(self, stack: Sequence[int], symbols: dict[int, str]) -> list[Frame]:
        names = (KernelNames(symbols),)
        return [Frame(KERNEL_MODULE, "", a, self._counted(self._name(names, None, None, a, None))) for a in stack]

    def user(self, proc: Process, stack: Sequence[int]) -> list[Frame]:
        """Frames of a user stack (leaf first) of `proc`."""
        known = self._known_frames(proc)
        out: list[Frame] = []
        fresh = True
        for depth, addr in enumerate(stack):
            self.stats["user_frames"] += 1
            got = known.get((addr, depth == 0))
            if got is None:
                if fresh:
                    for source in self._user_names:
                        source.new_stack(proc)
                    fresh = False
                got = self._resolve(proc, addr, depth)
                if got[0].module not in (JIT_MODULE, UNKNOWN_MODULE) and len(known) < REMEMBERED_FRAMES:
                    known[(addr, depth == 0)] = got
            frame, counters = got
            for counter in counters:
                self.stats[counter] += 1
            out.append(frame)
        return out

    def _known_frames(self, proc: Process) -> dict[tuple[int, bool], tuple[Frame, tuple[str, ...]]]:
        """The frames resolved before for `proc`, with its mappings as they are now (else none)."""
        key = (proc.pid, proc.start_ticks)
        entry = self._remembered.get(key)
        # the same tuple for every stack of a batch; an equal one from a later batch
        if entry is not None and (entry[0] is proc.mappings or entry[0] == proc.mappings):
            self._remembered.move_to_end(key)
            return entry[1]
        self._remembered[key] = entry = (proc.mappings, {})
        self._remembered.move_to_end(key)
        if len(self._remembered) > REMEMBERED_PROCESSES:
            self._remembered.popitem(last=False)
        return entry[1]

    def _resolve(self, proc: Process, addr: int, depth: int) -> tuple[Frame, tuple[str, ...]]:
        """The frame at `addr` (depth 0: the leaf), and the stats counters it adds one to."""
        maps = proc.mappings
        # A return address points after its call; look up the call itself.
        lookup = addr if depth == 0 else addr - 1
        i = bisect.bisect_right(maps, lookup, key=_start) - 1
        m = maps[i] if i >= 0 and lookup < maps[i].end else None
        if m is not None and not _is_anonymous(m.path):
            rel = addr - m.start + m.offset
            module = self._modules.symbols(proc, m)
            name, counters = self._name(self._file_names, proc, m, lookup, module)
            return Frame(m.path, module.build_id if module is not None else "", rel, name), counters
        jit_name, counters = self._name(self._anonymous_names, proc, m, lookup, None)
        if jit_name:
            return Frame(JIT_MODULE, "", addr, jit_name), counters
        if m is None:
            return Frame(UNKNOWN_MODULE, "", addr, ""), ("no_mapping",)
        return Frame(JIT_MODULE, "", addr, ""), ()

    def _counted(self, named: tuple[str, tuple[str, ...]]) -> str:
        name, counters = named
        for counter in counters:
            self.stats[counter] += 1
        return name

    @staticmethod
    def _name(
        sources: tuple[NameSource, ...],
        proc: Process | None,
        m: Mapping | None,
        address: int,
        module: ElfSymbols | None,
    ) -> tuple[str, tuple[str, ...]]:
        """The first name one of `sources` gives for the frame ("" if none), and the stats counters of
        the source that gave it."""
        for source in sources:
            name = source.name(proc, m, address, module)
            if name:
                return name, source.counters
        return "", ()
