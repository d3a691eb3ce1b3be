"""Turns raw stack addresses into frames: module, build id, module-relative address, name.

Owns: the address → frame rules of docs/architecture.md ("Data flow"): a user frame carries
its module path, GNU build id and module-relative address (address − mapping
start + file offset) and a function name where the module has symbols; kernel
frames take the names the collector resolved from /proc/kallsyms; frames in
anonymous executable memory take names from the process's /tmp/perf-<pid>.map.

Module files and perf maps come as descriptors from the collector's file
broker (files.py): exactly the file mapped at that range, even if deleted or
in another mount namespace. A module with a build id but no .symtab (Debian's
libc: its static functions, such as __libc_start_call_main, are in no
.dynsym) is named from its separate debug file, which the broker finds by
build id (the process's root first, then the host's). That file is read by
the same read_elf under the same caps and budget, used only if its build id
and PT_LOAD addresses are the module's (else it is counted, logged once and
ignored), and asked at the module's virtual address of the frame: its own
PT_LOADs carry no file bytes. Symbols are cached per file and per debug build
id (ElfCache), perf maps per process (PerfMapCache).

Must not: keep per-process state beyond those bounded caches, or build profiles.
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import BinaryIO, Sequence

from ebpfprofiler.shared.wire import MAX_BUILD_ID_HEX, Mapping, Process
from ebpfprofiler.symbolizer.elf import ElfCache, ElfSymbols
from ebpfprofiler.symbolizer.files import FileClient, ProcessGone
from ebpfprofiler.symbolizer.perfmap import PerfMapCache

KERNEL_MODULE = "[kernel.kallsyms]"
JIT_MODULE = "[jit]"
# Addresses outside every executable mapping the collector read.
UNKNOWN_MODULE = "[unknown]"

# Module files (and their debug files) larger than this are not opened for symbols (the
# backend can still symbolize them by build id): bounds what one frame can cost.
MAX_MODULE_BYTES = 2 << 30
# Processes × build ids whose debug file (or its absence) is remembered: a few per process on a busy host.
DEBUG_FILES_REMEMBERED = 65536


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
        self._files = files
        self._elf = elf_cache or ElfCache()
        self._perf_maps = perf_maps or PerfMapCache(files.perf_map)
        self.stats = {"user_frames": 0, "named": 0, "debug_named": 0, "no_mapping": 0, "jit_named": 0,
                      "perf_map_skipped_gone": 0}
        # (pid, start ticks, build id) → the identity key of the debug file the broker gave for it (None: none).
        self._debug_files: OrderedDict[tuple[int, int, str], tuple | None] = OrderedDict()

    def kernel(self, stack: Sequence[int], symbols: dict[int, str]) -> list[Frame]:
        return [Frame(KERNEL_MODULE, "", a, symbols.get(a, "")) for a in stack]

    def user(self, proc: Process, stack: Sequence[int]) -> list[Frame]:
        """Frames of a user stack (leaf first) of `proc`."""
        maps = proc.mappings
        starts = [m.start for m in maps]
        perf_map = None
        perf_map_checked = False
        out: list[Frame] = []
        for depth, addr in enumerate(stack):
            self.stats["user_frames"] += 1
            # A return address points after its call; look up the call itself.
            lookup = addr if depth == 0 else addr - 1
            i = bisect.bisect_right(starts, lookup) - 1
            m = maps[i] if i >= 0 and lookup < maps[i].end else None
            if m is not None and not _is_anonymous(m.path):
                rel = addr - m.start + m.offset
                name, build_id = self._module_symbol(proc, m, lookup - m.start + m.offset)
                if name:
                    self.stats["named"] += 1
                out.append(Frame(m.path, build_id, rel, name))
                continue
            if not perf_map_checked:
                # A process with no mappings exited before the collector read it: its perf map, if it
                # wrote one, is out of reach with its /proc/PID/root, and asking the broker for it is
                # what a host starting hundreds of short processes a second spent most on.
                if maps:
                    perf_map = self._perf_maps.get(proc.pid, proc.start_ticks, proc.nspid, proc.uid)
                else:
                    self.stats["perf_map_skipped_gone"] += 1
                perf_map_checked = True
            jit_name = perf_map.lookup(lookup) if perf_map is not None else None
            if jit_name:
                self.stats["jit_named"] += 1
                out.append(Frame(JIT_MODULE, "", addr, jit_name))
            else:
                if m is None:
                    self.stats["no_mapping"] += 1
                out.append(Frame(JIT_MODULE if m else UNKNOWN_MODULE, "", addr, ""))
        return out

    def _module_symbol(self, proc: Process, m: Mapping, file_offset: int) -> tuple[str, str]:
        if m.path.startswith("["):   # [vdso], [vsyscall]: no file to read
            return "", ""
        key = (m.dev, m.inode, m.path) if m.inode else (proc.pid, proc.start_ticks, m.path)
        syms = self._elf.get(key, lambda: _capped(self._files.module(proc, m), m.path))
        if syms is None:
            return "", ""
        name = None
        if syms.build_id and not syms.has_symtab and len(syms.build_id) <= MAX_BUILD_ID_HEX:
            debug = self._debug_symbols(proc, syms)
            address = syms.address_of(file_offset)   # the module's layout: the debug file's has no file bytes
            if debug is not None and address is not None:
                name = debug.function_at_address(address)
                if name:
                    self.stats["debug_named"] += 1
        return name or syms.function_at(file_offset) or "", syms.build_id

    def _debug_symbols(self, proc: Process, module: ElfSymbols) -> ElfSymbols | None:
        """The symbols of `module`'s separate debug file as `proc`'s root (else the host's) has it;
        None if there is none to use.

        The broker is asked once per process and build id, and the symbols are cached by the identity
        of the file it hands over, never by the build id alone: a container's root may hold a debug
        file claiming the host libc's build id, and its names must not reach other processes."""
        build_id = module.build_id
        memo = (proc.pid, proc.start_ticks, build_id)
        def check(debug: ElfSymbols) -> str:
            if debug.build_id != build_id:
                return f"debug file for build id {build_id} has build id {debug.build_id or '(none)'}"
            if not module.loads_like(debug):
                return f"debug file for build id {build_id} loads at other addresses than its module"
            return ""

        if memo in self._debug_files:
            self._debug_files.move_to_end(memo)
            key = self._debug_files[memo]
            if key is None:
                return None
            # A hit unless the symbols were evicted: then the file is opened again, and used only if it is
            # still the same file (else, ProcessGone: nothing is remembered under this key).
            hit = key
            return self._elf.get(hit, lambda: self._same_debug_file(proc, build_id, hit), check=check)

        try:
            f = _capped(self._files.debug(proc, build_id), f"debug file of {build_id}")
        except ProcessGone:
            return None
        except OSError:
            self._remember_debug(memo, None)
            return None
        with f:
            key = _debug_key(build_id, f)
            self._remember_debug(memo, key)
            return self._elf.get(key, lambda: os.fdopen(os.dup(f.fileno()), "rb"), check=check)

    def _same_debug_file(self, proc: Process, build_id: str, key: tuple) -> BinaryIO:
        f = _capped(self._files.debug(proc, build_id), f"debug file of {build_id}")
        if _debug_key(build_id, f) != key:
            f.close()
            self._debug_files.pop((proc.pid, proc.start_ticks, build_id), None)
            raise ProcessGone(f"the debug file of {build_id} changed")
        return f

    def _remember_debug(self, memo: tuple[int, int, str], key: tuple | None) -> None:
        self._debug_files[memo] = key
        self._debug_files.move_to_end(memo)
        while len(self._debug_files) > DEBUG_FILES_REMEMBERED:
            self._debug_files.popitem(last=False)


def _debug_key(build_id: str, f: BinaryIO) -> tuple:
    """What the symbols of a debug file are cached under: its build id and the identity of the file."""
    st = os.fstat(f.fileno())
    return ("debug", build_id, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _capped(f: BinaryIO, what: str) -> BinaryIO:
    """`f`, or OSError (and `f` closed) if it is larger than MAX_MODULE_BYTES."""
    size = os.fstat(f.fileno()).st_size
    if size > MAX_MODULE_BYTES:
        f.close()
        raise OSError(f"{what}: {size} bytes is over the cap of {MAX_MODULE_BYTES}")
    return f
