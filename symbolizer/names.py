"""Where a frame's function name comes from: the NameSource protocol and the sources that implement it.

A name source names the frames of one kind of memory. symbolizer/frames.py's FrameResolver asks
its sources in order and takes the first name one gives: for a frame in a mapped file, the
file's separate debug file (DebugFileNames: a module with a build id but no .symtab, such as
Debian's libc, whose static functions are in no .dynsym), then the file's own symbols
(ModuleNames); for a frame in anonymous executable memory, the process's perf map
(PerfMapNames); for a kernel frame, the names the collector resolved from /proc/kallsyms
(KernelNames).

Module files and perf maps come as descriptors from the collector's file broker (files.py):
exactly the file mapped at that range, even if deleted or in another mount namespace. A debug
file is found by build id (the process's root first, then the host's), read by the same
read_elf under the same caps and budget, used only if its build id and PT_LOAD addresses are
the module's (else it is counted, logged once and ignored), and asked at the module's virtual
address of the frame: its own PT_LOADs carry no file bytes. Symbols are cached per file and per
debug file identity (ElfCache), perf maps per process (PerfMapCache).

Owns: the protocol, the four sources, and opening a module file for its symbols (its build id is
the frame's too). Must not: decide the order the sources are asked in, or put frames together
(frames.py does both), or keep per-process state beyond those bounded caches.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import BinaryIO, Protocol

from shared.wire import MAX_BUILD_ID_HEX, Mapping, Process
from symbolizer.elf import ElfCache, ElfSymbols
from symbolizer.files import FileClient, ProcessGone
from symbolizer.perfmap import PerfMap, PerfMapCache

__all__ = ["MAX_MODULE_BYTES", "DebugFileNames", "KernelNames", "ModuleNames", "NameSource", "PerfMapNames"]

# Module files (and their debug files) larger than this are not opened for symbols (the
# backend can still symbolize them by build id): bounds what one frame can cost.
MAX_MODULE_BYTES = 2 << 30
# Processes × build ids whose debug file (or its absence) is remembered: a few per process on a busy host.
DEBUG_FILES_REMEMBERED = 65536


class NameSource(Protocol):
    """One source of function names. Sources inherit the default below by subclassing this class."""

    # The FrameResolver.stats counters that a frame this source named adds one to.
    counters: tuple[str, ...]

    def name(
        self, proc: Process | None, mapping: Mapping | None, address: int, module: ElfSymbols | None
    ) -> str | None:
        """The function at `address` (absolute; of a return address, its call) in `mapping` (None:
        in none the collector read) of `proc` (None: the kernel's), where `module` is the symbols of
        the mapped file (None: no file, or one that cannot be read); None (or "") if this source has
        no name for it."""
        ...

    def new_stack(self, proc: Process | None) -> None:
        """A stack of `proc` is next: drop what was kept for the last one (a source that looks
        something up once per stack)."""
        return None


class ModuleNames(NameSource):
    """The symbols (.symtab, else .dynsym) of the file a frame's mapping maps."""

    counters = ("named",)

    def __init__(self, files: FileClient, elf: ElfCache) -> None:
        self._files = files
        self._elf = elf

    def symbols(self, proc: Process, m: Mapping) -> ElfSymbols | None:
        """The symbols of the file mapped at `m` in `proc`, cached by the file's identity; None if it
        has no file ([vdso], [vsyscall]) or cannot be read."""
        if m.path.startswith("["):  # [vdso], [vsyscall]: no file to read
            return None
        key = (m.dev, m.inode, m.path) if m.inode else (proc.pid, proc.start_ticks, m.path)
        return self._elf.get(key, lambda: capped(self._files.module(proc, m), m.path))

    def name(
        self, proc: Process | None, mapping: Mapping | None, address: int, module: ElfSymbols | None
    ) -> str | None:
        if module is None or mapping is None:
            return None
        return module.function_at(address - mapping.start + mapping.offset)


class DebugFileNames(NameSource):
    """The symbols of a module's separate debug file, for a module with a build id but no .symtab."""

    counters = ("debug_named", "named")

    def __init__(self, files: FileClient, elf: ElfCache) -> None:
        self._files = files
        self._elf = elf
        # (pid, start ticks, build id) → the identity key of the debug file the broker gave for it (None: none).
        self._debug_files: OrderedDict[tuple[int, int, str], tuple | None] = OrderedDict()

    def name(
        self, proc: Process | None, mapping: Mapping | None, address: int, module: ElfSymbols | None
    ) -> str | None:
        if proc is None or mapping is None or module is None:
            return None
        if not module.build_id or module.has_symtab or len(module.build_id) > MAX_BUILD_ID_HEX:
            return None
        debug = self._symbols(proc, module)
        # The module's layout: the debug file's PT_LOADs have no file bytes.
        vaddr = module.address_of(address - mapping.start + mapping.offset)
        if debug is None or vaddr is None:
            return None
        return debug.function_at_address(vaddr)

    def _symbols(self, proc: Process, module: ElfSymbols) -> ElfSymbols | None:
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
            f = capped(self._files.debug(proc, build_id), f"debug file of {build_id}")
        except ProcessGone:
            return None
        except OSError:
            self._remember(memo, None)
            return None
        with f:
            key = _debug_key(build_id, f)
            self._remember(memo, key)
            return self._elf.get(key, lambda: os.fdopen(os.dup(f.fileno()), "rb"), check=check)

    def _same_debug_file(self, proc: Process, build_id: str, key: tuple) -> BinaryIO:
        f = capped(self._files.debug(proc, build_id), f"debug file of {build_id}")
        if _debug_key(build_id, f) != key:
            f.close()
            self._debug_files.pop((proc.pid, proc.start_ticks, build_id), None)
            raise ProcessGone(f"the debug file of {build_id} changed")
        return f

    def _remember(self, memo: tuple[int, int, str], key: tuple | None) -> None:
        self._debug_files[memo] = key
        self._debug_files.move_to_end(memo)
        while len(self._debug_files) > DEBUG_FILES_REMEMBERED:
            self._debug_files.popitem(last=False)


class PerfMapNames(NameSource):
    """A process's /tmp/perf-<pid>.map (JIT compilers write one): names in anonymous executable memory.

    Looked up once per stack, at its first frame that needs it."""

    counters = ("jit_named",)

    def __init__(self, perf_maps: PerfMapCache, stats: dict[str, int]) -> None:
        self._perf_maps = perf_maps
        self._stats = stats  # FrameResolver.stats: perf_map_skipped_gone is counted here
        self._checked = False
        self._map: PerfMap | None = None

    def new_stack(self, proc: Process | None) -> None:
        self._checked = False
        self._map = None

    def name(
        self, proc: Process | None, mapping: Mapping | None, address: int, module: ElfSymbols | None
    ) -> str | None:
        if proc is None:
            return None
        if not self._checked:
            # A process with no mappings exited before the collector read it: its perf map, if it
            # wrote one, is out of reach with its /proc/PID/root, and asking the broker for it is
            # what a host starting hundreds of short processes a second spent most on.
            if proc.mappings:
                self._map = self._perf_maps.get(proc.pid, proc.start_ticks, proc.nspid, proc.uid)
            else:
                self._stats["perf_map_skipped_gone"] += 1
            self._checked = True
        return self._map.lookup(address) if self._map is not None else None


class KernelNames(NameSource):
    """The kernel symbols the collector resolved from /proc/kallsyms for one batch (address → name)."""

    counters = ()

    def __init__(self, symbols: dict[int, str]) -> None:
        self._symbols = symbols

    def name(
        self, proc: Process | None, mapping: Mapping | None, address: int, module: ElfSymbols | None
    ) -> str | None:
        return self._symbols.get(address)


def capped(f: BinaryIO, what: str) -> BinaryIO:
    """`f`, or OSError (and `f` closed) if it is larger than MAX_MODULE_BYTES."""
    size = os.fstat(f.fileno()).st_size
    if size > MAX_MODULE_BYTES:
        f.close()
        raise OSError(f"{what}: {size} bytes is over the cap of {MAX_MODULE_BYTES}")
    return f


def _debug_key(build_id: str, f: BinaryIO) -> tuple:
    """What the symbols of a debug file are cached under: its build id and the identity of the file."""
    st = os.fstat(f.fileno())
    return ("debug", build_id, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
