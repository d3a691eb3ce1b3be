"""Which CPython a process runs, whether we read it, and with which layout: decided here, once.

Owns: finding the interpreter among a process's mappings (libpython3.X, else
the python3.X executable), opening that file through /proc/<pid>/root (so a
container's own files are read; resolved with openat2 RESOLVE_IN_ROOT, so no
symlink leaves that root, and opened only once fstat says it is the mapped,
regular file: a FIFO named python3.13 cannot hang the reader), its symbols (_PyRuntime, Py_Version,
PyCode_Type, PyType_Type), the load bias, the version the process reports in
memory (Py_Version), and for 3.13+ the _Py_DebugOffsets cookie, version and
free-threading flag at _PyRuntime; then the Layout (layouts.py) and a
self-check: PyCode_Type must be a type object (its ob_type is &PyType_Type)
named "code". The answer is a Target to read, a Refusal with the reason, or
None for a process that is not CPython.

Must not: walk frames, or log (the caller logs each refusal once).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

from runtimes.cpython import layouts
from runtimes.elfsyms import ElfInfo, ElfSymbolError, read_symbols
from runtimes.memory import MemoryReadError, ProcessMemory
from shared.files import open_in_root, open_regular
from shared.safestr import process_string

# /proc/<pid>/maps of a Python process is a few hundred lines; a JVM's a few MB.
MAX_MAPS_BYTES = 4 << 20
# tp_name of a type is a short C string.
MAX_TYPE_NAME = 64

# libpython3.13.so.1.0, libpython3.13t.so.1.0, python3.11, python3.14d ...
_NAME = re.compile(r"^(lib)?python(\d)\.(\d+)([td]*)(\.so[.\d]*)?$")
SYMBOLS = ("_PyRuntime", "Py_Version", "PyCode_Type", "PyType_Type")


@dataclass(frozen=True)
class Target:
    pid: int
    version: str  # "3.13.5"
    layout: layouts.Layout
    runtime: int  # address of _PyRuntime in the process
    code_type: int  # address of PyCode_Type
    module: str  # the interpreter's path as the process maps it


@dataclass(frozen=True)
class Refusal:
    pid: int
    reason: str
    kind: str = ""  # a cap that fired (runtime.Refusal's kind)


@dataclass(frozen=True)
class _Module:
    path: str
    start: int
    offset: int
    inode: int
    major: int
    minor: int
    flags: str  # "t": free-threaded, "d": debug build


def _modules(pid: int, proc: str) -> list[_Module]:
    with open(f"{proc}/{pid}/maps", "rb") as f:
        # surrogateescape: the path opens as the bytes it is; it is named by shared/safestr's rule only
        # where it leaves this module (process_string below)
        text = f.read(MAX_MAPS_BYTES).decode("utf-8", "surrogateescape")
    out: dict[str, _Module] = {}
    executable: set[str] = set()
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5].replace("\\012", "\n")  # the kernel writes a newline in a maps path as \012
        m = _NAME.match(os.path.basename(path))
        if not m:
            continue
        if "x" in parts[1]:
            executable.add(path)
        start = int(parts[0].split("-")[0], 16)
        offset = int(parts[2], 16)
        known = out.get(path)
        if known is None or offset < known.offset:
            out[path] = _Module(path, start, offset, int(parts[4]), int(m.group(2)), int(m.group(3)), m.group(4))
    # Only a file the process runs code from is its interpreter (a file merely mapped under the
    # name is not); the library holds the runtime when there is one, the executable is then a stub.
    return sorted(
        (mod for path, mod in out.items() if path in executable),
        key=lambda mod: not os.path.basename(mod.path).startswith("lib"),
    )


def parse_hexversion(v: int) -> tuple[int, int, int]:
    return v >> 24 & 0xFF, v >> 16 & 0xFF, v >> 8 & 0xFF


def read_c_string(mem: ProcessMemory, address: int, cap: int) -> str:
    raw = mem.read(address, cap)
    end = raw.find(b"\0")
    if end < 0:
        raise MemoryReadError("bad_address", "string without an end")
    return raw[:end].decode("utf-8", "replace")


def _symbols_of(pid: int, mod: _Module, proc: str) -> ElfInfo | None:
    """The interpreter's symbols, from the file the process maps: through /proc/<pid>/root (a
    container's own files), else the path as this host sees it (maps shows a chroot's files with
    the host's path); only a file with the mapped inode is used."""
    for where in ("root", "host"):
        try:
            path_fd = (
                _open_path(f"{proc}/{pid}/root", mod.path)
                if where == "root"
                else os.open(mod.path, os.O_PATH | os.O_CLOEXEC)
            )
        except OSError:
            continue
        try:
            if os.fstat(path_fd).st_ino != mod.inode:
                continue
            fd = open_regular(path_fd, mod.path)  # nothing but a regular file is opened: a FIFO would hang
        except OSError:
            continue
        finally:
            os.close(path_fd)
        with os.fdopen(fd, "rb") as f:
            return read_symbols(f, SYMBOLS)
    return None


def _open_path(root: str, path: str) -> int:
    """An O_PATH descriptor of `path` inside `root`: its symlinks (absolute ones too) and .. stay inside."""
    dirfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_in_root(dirfd, path)
    finally:
        os.close(dirfd)


def detect(pid: int, mem: ProcessMemory, *, modern: bool, legacy: bool, proc: str = "/proc") -> Target | Refusal | None:  # noqa: PLR0912
    """What to do with process `pid`; MemoryReadError/OSError only if it vanished meanwhile."""
    mods = _modules(pid, proc)
    if not mods:
        return None
    mod = mods[0]
    where = f"{process_string(mod.path)} (CPython {mod.major}.{mod.minor}{mod.flags})"
    if mod.major != 3:
        return Refusal(pid, f"{where}: only CPython 3 is read")
    if "t" in mod.flags:
        return Refusal(
            pid,
            f"{where}: a free-threaded build (no GIL): its objects and frames are laid out "
            f"differently and this reader does not support it",
        )
    if mod.minor <= 10:
        return Refusal(pid, f"{where}: CPython 3.10 and older are not supported (3.11 and newer are)")
    try:
        info = _symbols_of(pid, mod, proc)
    except ElfSymbolError as e:
        return Refusal(pid, f"{where}: unreadable ELF file: {e}", f"elf_{e.kind}")
    if info is None:
        return Refusal(
            pid,
            f"{where}: the file is not reachable as the process maps it (through /proc/{pid}/root, nor on this host)",
        )
    missing = [s for s in SYMBOLS if s not in info.symbols]
    if "Py_Version" in missing:
        return Refusal(pid, f"{where}: no Py_Version symbol: CPython 3.10 or older, or a stripped build")
    if missing:
        return Refusal(pid, f"{where}: no {', '.join(missing)} symbol")
    bias = info.load_bias(mod.start, mod.offset)
    sym = {name: value + bias for name, value in info.symbols.items()}
    hexversion = mem.u64(sym["Py_Version"])
    major, minor, micro = parse_hexversion(hexversion)
    version = f"{major}.{minor}.{micro}"
    if (major, minor) != (mod.major, mod.minor):
        return Refusal(pid, f"{where}: self-check failed: Py_Version in memory says {version}")
    if (major, minor) in layouts.LEGACY:
        if not legacy:
            return Refusal(pid, f"{where}: CPython {major}.{minor} is read only with runtime_stacks: [python_legacy]")
        layout = layouts.LEGACY[(major, minor)]
    elif (major, minor) in layouts.DEBUG:
        if not modern:
            return Refusal(pid, f"{where}: python_stacks is false")
        extras = layouts.DEBUG[(major, minor)]
        raw = mem.read(sym["_PyRuntime"], layouts.DEBUG_OFFSETS_BYTES)
        if raw[:8] != layouts.COOKIE:
            return Refusal(pid, f"{where}: self-check failed: no {layouts.COOKIE.decode()} cookie at _PyRuntime")
        values = {
            name: struct.unpack_from("<Q", raw, at)[0] for name, at in layouts.debug_field_offsets(extras).items()
        }
        if struct.unpack_from("<Q", raw, 8)[0] != hexversion:
            return Refusal(pid, f"{where}: self-check failed: the debug offsets are of another version")
        if values["free_threaded"]:
            return Refusal(pid, f"{where}: a free-threaded build (no GIL): not supported")
        layout = layouts.layout_from_debug(values, extras)
        if (
            layout.ob_type != 8
            or not 0 < layout.unicode_ascii_size <= 128
            or max(layout.unicode_state + 4, layout.unicode_length + 8) > layout.unicode_ascii_size
        ):
            return Refusal(pid, f"{where}: self-check failed: implausible debug offsets")
    else:
        return Refusal(pid, f"{where}: no layout for CPython {major}.{minor} in this version of the profiler")
    # Self-check: PyCode_Type is a type object named "code".
    code_type = sym["PyCode_Type"]
    if mem.u64(code_type + layout.ob_type) != sym["PyType_Type"]:
        return Refusal(pid, f"{where}: self-check failed: PyCode_Type is not a type object")
    name = read_c_string(mem, mem.u64(code_type + layout.type_name), MAX_TYPE_NAME)
    if name != "code":
        return Refusal(pid, f"{where}: self-check failed: PyCode_Type is named {name!r}")
    return Target(pid, version, layout, sym["_PyRuntime"], code_type, process_string(mod.path))
