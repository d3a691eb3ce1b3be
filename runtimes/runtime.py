"""The runtime-reader plug-in contract, and what every plug-in shares.

A runtime is one folder, runtimes/<name>/, and one line in
shared/runtime_registry.py (its RuntimeSpec: name, opt-ins, profile type,
frame fields). The folder's __init__.py exports `runtime(cfg)`, which
returns an object that satisfies `Runtime` below, or None when the config
does not ask for this runtime (its opt-in is not in runtime_stacks; CPython
3.13+ follows python_stacks). The contract, in three levels (as in the
opentelemetry-ebpf-profiler's interpreter loaders):

1. Runtime (one per runtime, for the life of the reader)
   - `spec`: its line in the registry.
   - `detect(process)`: is this process mine, and which version?  Returns
       * a StackReader for it,
       * a Refusal(reason): it is mine but not read (unsupported version,
         ZTS build, stripped binary, failed self-check ...); the reason is
         logged once per process by targets.py, then the process is left
         alone until its pid names another process,
       * a Served(message): it is mine, and detect did all there is to do for it
         (the .NET plug-in asked it for a perf map: its frames are named in the
         cpu profiles, no stacks are read here); logged once like a refusal,
       * a Pending(message, poll): it is mine, and detect asked it something it
         answers later (the .NET plug-in's EnablePerfMap); targets.py calls
         poll() at every tick, which must never block, until it gives the
         Served or Refusal (None: not yet; retries and their time limits are
         the plug-in's),
       * or None: not mine (looked at its mappings' names only, cheaply).
     It may raise MemoryReadError or OSError when the process vanished
     meanwhile; anything else it raises is logged once and the process is
     left alone (targets.give_up).
   - `stop()`: called once when the reader stops (and harmless if called
     again: a second call finds nothing to undo), to undo what detect asked
     of processes (the .NET plug-in's perf maps); returns lines for the
     reader's log ([] when there was nothing to undo).
   - `counters()`: its own checks on what processes gave it that fired,
     {name: count since start}, each name starting with its spec.name and "_"
     ("dotnet_stalled"); the reader writes them with its own to
     RUN_DIR/runtime.counters.json, which `ebpfprofiler status` shows ({}:
     none of its own).
   tests/unit/test_runtime_contract.py holds every registered runtime to
   this level, with real processes.
   - Per-file data (symbols and offsets read from a binary; what the
     loader of the OTel profiler computes once per ELF file) goes in
     `process.files`, a FileCache keyed by the file's identity (device,
     inode, size, mtime), so a hundred php-fpm workers read libphp once.
2. StackReader (one per process: per-process state only: addresses after
   the load bias, caches of what that process's memory holds)
   - `sample(mem)`: every thread's stack (leaf first), read from process
     memory with `mem` (process_vm_readv through ProcessMemory, charged to
     the tick's ReadBudget). MemoryReadError "gone" or "budget" propagates;
     a thread or frame that fails validation is dropped and counted in
     `dropped` by reason, never raised.
   - `version`: what detect found ("8.2.29"), for the log.
   - `sample_regs(mem, samples)` (only a runtime whose RuntimeSpec has a
     cpu_profile_type: the JVM, Node.js): the collector's on-CPU samples of the
     process (RegsSample: the thread's user registers and the top of its
     stack when the sample was taken; tid is the runtime's own thread id),
     one ThreadStack each, frames walked from those registers (the stack
     copy first, the process's memory above it). Same errors as sample().
   - In-BPF walks (issue 42; CPython today): a runtime whose frames the
     collector also walks in BPF at every sample gives, per version, a layout
     table (its layouts as data), a BPF walker (the collector's: bpf/python.h,
     collector/pywalk.py), and here, on its StackReader, the two halves the
     reader serves (WalkedReader): `walk_data(start_ticks)`, what the walker
     needs of this process (a wire message: CPython's PythonProcess, its
     _PyRuntime address and its version's layout), which
     runtimes/bpf_walks.py pushes to the collector when the process is first
     read and at each full announcement; and `name(mem, code, offset)`, the
     user-space finisher: a frame as the walk recorded it (the code object's
     address, the instruction's offset in bytes, None: not started) named
     with function, file and line (a Frame below), or None (counted in
     `dropped`). The next runtime adds its layouts, its walker, these two
     methods and its request type to runtimes/bpf_walks.py.
3. Frames: any frozen dataclass with `function` (the qualified name as the
   profile shows it: "Class::method", "Class#method"), `filename` and
   `line` (0: unknown); fields beyond those are the runtime's own (its
   RuntimeSpec.frame_fields name them).

Shared by every runtime, so no plug-in does its own: the announced-process
table with the pid/start-time check before every read and the refusal log
(targets.py), the per-tick caps and cpu_budget over all runtimes together
(main.py), the bounded reads (memory.py), ELF data symbols (elfsyms.py),
mapping lists and safe file opening (here), and the pprof per profile type
(profile.py).

Rules for every plug-in: never stop, attach to or write to a target (the .NET
plug-in's EnablePerfMap and DisablePerfMap go over the runtime's own
diagnostics socket, as its tools send them, and are undone at stop); validate
every pointer read from it before following it; cap every count and length
read from it with a named constant.

Owns: the Protocols above, Detected, Refusal, Served, Pending, ThreadStack, Mapping (/proc/PID/maps,
parsed once per detection for all runtimes), open_mapped (a mapped file
opened through /proc/PID/root without following the target's links out of
its root), mapped_file_facts (a plug-in's per-file data of a mapped file, or
the refusal every runtime gives when it cannot be reached or read), FileCache.
(elfsyms.ElfInfo.load_bias turns link-time addresses into the process's.)

Must not: know any one runtime.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol, TypeVar, runtime_checkable

from runtimes.elfsyms import ElfSymbolError
from runtimes.memory import ProcessMemory
from shared.files import PATH_ONLY as _PATH_ONLY
from shared.files import open_regular, open_under
from shared.runtime_registry import RuntimeSpec
from shared.safestr import process_string
from shared.wire import Message, RegsSample

# /proc/<pid>/maps of a PHP or Python process is a few hundred lines; a JVM's a few MB.
MAX_MAPS_BYTES = 4 << 20
# Mappings kept per process (vm.max_map_count is 65530 by default).
MAX_MAPPINGS = 65536
# Per-file entries cached (symbols of one interpreter file each, a few KB).
FILE_CACHE_ENTRIES = 256
# The reader's timer: stacks per second per process (wall-clock sampling, every thread each time); a plug-in
# that shares a profile with the collector's register samples (Node) needs its period.
SAMPLE_HZ = 19


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    kind: str = ""  # a cap or time limit that fired ("elf_time", "dotnet_stalled"): counted by it


@dataclass(frozen=True, slots=True)
class Served:
    message: str


@dataclass(frozen=True, slots=True)
class Pending:
    message: str  # what was asked, for the log
    poll: Callable[[], Served | Refusal | None]  # never blocks; None: no outcome yet


@dataclass(frozen=True, slots=True)
class ThreadStack:
    native_tid: int  # the thread id the runtime recorded (its pid namespace's); 0: unknown
    frames: tuple[Any, ...]  # leaf first; each has function, filename, line


@dataclass(frozen=True, slots=True)
class Mapping:
    start: int
    end: int
    perms: str  # "r-xp"
    offset: int
    inode: int
    path: str  # as this host sees it ("" for anonymous memory): its bytes, surrogateescape-decoded


@runtime_checkable
class StackReader(Protocol):
    version: str
    dropped: dict[str, int]

    def sample(self, mem: ProcessMemory) -> list[ThreadStack]: ...


@runtime_checkable
class RegsStackReader(StackReader, Protocol):
    """A StackReader that also walks the collector's on-CPU samples from their registers."""

    def sample_regs(self, mem: ProcessMemory, samples: Sequence[RegsSample]) -> list[ThreadStack]: ...


@runtime_checkable
class WalkedReader(StackReader, Protocol):
    """A StackReader whose process the collector also walks in BPF (the docstring above: level 2)."""

    def walk_data(self, start_ticks: int) -> Message: ...

    def name(self, mem: ProcessMemory, code: int, offset: int | None) -> Any | None: ...


@dataclass
class ProcessContext:
    """What detect() is given about one process."""

    pid: int
    proc: str
    mem: ProcessMemory
    files: FileCache
    start_ticks: int = 0  # its start time (/proc/PID/stat field 22), as announced
    _maps: list[Mapping] | None = field(default=None, repr=False)

    @property
    def mappings(self) -> list[Mapping]:
        if self._maps is None:
            self._maps = read_maps(self.pid, self.proc)
        return self._maps


# What detect() may return (None: not this runtime's process).
Detected = StackReader | Refusal | Served | Pending | None
# The same, for isinstance (StackReader is a runtime-checkable Protocol).
DETECTED_TYPES: tuple[type, ...] = (StackReader, Refusal, Served, Pending, type(None))


class Runtime(Protocol):
    """One runtime's plug-in, for the life of the reader (the docstring above: level 1)."""

    spec: RuntimeSpec

    def detect(self, process: ProcessContext) -> Detected: ...

    def stop(self) -> list[str]: ...

    def counters(self) -> dict[str, int]: ...


def read_maps(pid: int, proc: str = "/proc") -> list[Mapping]:
    """The process's mappings. A path is the file's own bytes (surrogateescape; the kernel's \\012 for a
    newline turned back), so it opens as the file it names; shared/safestr's process_string names it for
    a log line."""
    with open(f"{proc}/{pid}/maps", "rb") as f:
        text = f.read(MAX_MAPS_BYTES).decode("utf-8", "surrogateescape")
    out: list[Mapping] = []
    for line in text.splitlines()[:MAX_MAPPINGS]:
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        path = parts[5].replace("\\012", "\n") if len(parts) > 5 else ""
        try:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append(Mapping(lo, hi, parts[1], int(parts[2], 16), int(parts[4]), path))
        except ValueError:
            continue
    return out


def first_mappings(maps: list[Mapping], match: Callable[[str], bool]) -> dict[str, Mapping]:
    """path → its mapping with the lowest file offset, for the file-backed mappings whose basename matches."""
    out: dict[str, Mapping] = {}
    for m in maps:
        if not m.path.startswith("/") or not match(os.path.basename(m.path)):
            continue
        known = out.get(m.path)
        if known is None or m.offset < known.offset:
            out[m.path] = m
    return out


# How open_mapped opens a mapped file once its O_PATH descriptor (shared.files.open_under: openat2
# with RESOLVE_IN_ROOT, so a container's absolute symlinks resolve inside its root) is checked.
_OPEN_MAPPED = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def open_mapped(pid: int, m: Mapping, proc: str = "/proc") -> BinaryIO | str:
    """The file of mapping `m`, opened as the process sees it: inside /proc/<pid>/root with its
    links resolved in that root (a container's own files), else by the path as this host sees it
    (maps shows a chroot's files with the host's path); or, when neither is it, why not (for the
    refusal). Only a regular file with the mapped inode is opened: the path is opened O_PATH and
    fstat'd first, so a FIFO or device node planted there is never opened."""
    why = []
    for where, root in ((f"through {proc}/{pid}/root", f"{proc}/{pid}/root"), ("on this host", "")):
        try:
            # the host's own path needs no openat2 (a seccomp filter may refuse it: ENOSYS)
            path_fd = open_under(root, m.path) if root else os.open(m.path, _PATH_ONLY)
        except OSError as e:
            why.append(f"{where}: {e.strerror}")
            continue
        try:
            st = os.fstat(path_fd)
            if st.st_ino != m.inode:
                why.append(f"{where}: another file (inode {st.st_ino}, mapped {m.inode})")
                continue
            return os.fdopen(open_regular(path_fd, where, _OPEN_MAPPED), "rb")
        except OSError as e:
            why.append(f"{where}: {e.strerror}")
        finally:
            os.close(path_fd)
    return "; ".join(why)


def file_key(f: BinaryIO) -> tuple[int, int, int, int]:
    st = os.fstat(f.fileno())
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_Facts = TypeVar("_Facts")


def mapped_file_facts(
    process: ProcessContext, mod: Mapping, tag: str, compute: Callable[[BinaryIO], _Facts], where: str = ""
) -> _Facts | Refusal:
    """compute(the file `mod` maps), cached in process.files by `tag` and the file's identity, or the
    Refusal every runtime gives (its text starting with `where`, by default the mapped path) when the
    file is not reachable as the process maps it or its ELF is unreadable (an ElfSymbolError)."""
    where = where or process_string(mod.path)
    f = open_mapped(process.pid, mod, process.proc)
    if isinstance(f, str):
        return Refusal(f"{where}: the file is not reachable as the process maps it ({f})")
    with f:
        try:
            got: _Facts = process.files.get((tag, *file_key(f)), lambda: compute(f))
        except ElfSymbolError as e:
            return Refusal(f"{where}: unreadable ELF file: {e}", f"elf_{e.kind}")
    return got


class FileCache:
    """Per-file data by file identity, bounded (least recently used first out)."""

    def __init__(self, capacity: int = FILE_CACHE_ENTRIES) -> None:
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._capacity = capacity
        self.hits = self.misses = 0

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The value cached for key, else compute() (its exceptions are cached too: a file that
        failed once fails again)."""
        if key in self._data:
            self._data.move_to_end(key)
            self.hits += 1
            got = self._data[key]
        else:
            self.misses += 1
            try:
                got = compute()
            except Exception as e:  # re-raised below, and at every later get
                got = _Failed(e)
            self._data[key] = got
            if len(self._data) > self._capacity:
                self._data.popitem(last=False)
        if isinstance(got, _Failed):
            raise got.error
        return got


@dataclass(frozen=True)
class _Failed:
    error: Exception
