"""Turns raw stack addresses into frames: module, build id, module-relative address, name.

Owns: the address → frame rules of docs/architecture.md ("Data flow"): a user frame carries
its module path, GNU build id and module-relative address (address − mapping
start + file offset) and a function name where the module has symbols; kernel
frames take the names the collector resolved from /proc/kallsyms; frames in
anonymous executable memory take names from the process's /tmp/perf-<pid>.map.
The names come from the name sources of symbolizer/names.py (NameSource), asked
in the order here: for a frame in a mapped file, its separate debug file, then
the file's own symbols; for one in anonymous memory, the perf map.

Must not: keep per-process state beyond the sources' bounded caches, read files
itself (the sources do, through the broker), or build profiles.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from ebpfprofiler.shared.wire import Mapping, Process
from ebpfprofiler.symbolizer.elf import ElfCache, ElfSymbols
from ebpfprofiler.symbolizer.files import FileClient
from ebpfprofiler.symbolizer.names import DebugFileNames, KernelNames, ModuleNames, NameSource, PerfMapNames
from ebpfprofiler.symbolizer.perfmap import PerfMapCache

KERNEL_MODULE = "[kernel.kallsyms]"
JIT_MODULE = "[jit]"
# Addresses outside every executable mapping the collector read.
UNKNOWN_MODULE = "[unknown]"


@dataclass(frozen=True, slots=True)
class Frame:
    module: str
    build_id: str
    address: int          # module-relative for user frames; absolute for kernel and JIT
    function: str         # "" when unknown


def _is_anonymous(path: str) -> bool:
    return path == "" or path.startswith(("[anon", "//anon", "/memfd:", "[heap]", "[stack]"))


class FrameResolver:
    def __init__(self, files: FileClient, elf_cache: ElfCache | None = None,
                 perf_maps: PerfMapCache | None = None) -> None:
        elf = elf_cache or ElfCache()
        self.stats = {"user_frames": 0, "named": 0, "debug_named": 0, "no_mapping": 0, "jit_named": 0,
                      "perf_map_skipped_gone": 0}
        self._modules = ModuleNames(files, elf)
        # The name sources of a frame in a mapped file, and of one in anonymous memory (or none), in order.
        self._file_names: tuple[NameSource, ...] = (DebugFileNames(files, elf), self._modules)
        self._anonymous_names: tuple[NameSource, ...] = (
            PerfMapNames(perf_maps or PerfMapCache(files.perf_map), self.stats),)
        self._user_names = self._file_names + self._anonymous_names

    def kernel(self, stack: Sequence[int], symbols: dict[int, str]) -> list[Frame]:
        names = (KernelNames(symbols),)
        return [Frame(KERNEL_MODULE, "", a, self._name(names, None, None, a, None)) for a in stack]

    def user(self, proc: Process, stack: Sequence[int]) -> list[Frame]:
        """Frames of a user stack (leaf first) of `proc`."""
        maps = proc.mappings
        starts = [m.start for m in maps]
        for source in self._user_names:
            source.new_stack(proc)
        out: list[Frame] = []
        for depth, addr in enumerate(stack):
            self.stats["user_frames"] += 1
            # A return address points after its call; look up the call itself.
            lookup = addr if depth == 0 else addr - 1
            i = bisect.bisect_right(starts, lookup) - 1
            m = maps[i] if i >= 0 and lookup < maps[i].end else None
            if m is not None and not _is_anonymous(m.path):
                rel = addr - m.start + m.offset
                module = self._modules.symbols(proc, m)
                name = self._name(self._file_names, proc, m, lookup, module)
                out.append(Frame(m.path, module.build_id if module is not None else "", rel, name))
                continue
            jit_name = self._name(self._anonymous_names, proc, m, lookup, None)
            if jit_name:
                out.append(Frame(JIT_MODULE, "", addr, jit_name))
            else:
                if m is None:
                    self.stats["no_mapping"] += 1
                out.append(Frame(JIT_MODULE if m else UNKNOWN_MODULE, "", addr, ""))
        return out

    def _name(self, sources: tuple[NameSource, ...], proc: Process | None, m: Mapping | None, address: int,
              module: ElfSymbols | None) -> str:
        """The first name one of `sources` gives for the frame ("" if none), counted in stats."""
        for source in sources:
            name = source.name(proc, m, address, module)
            if name:
                for counter in source.counters:
                    self.stats[counter] += 1
                return name
        return ""
