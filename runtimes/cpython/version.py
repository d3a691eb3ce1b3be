"""Which CPython a process runs, whether we read it, and with which layout: decided here, once.

Owns: finding the interpreter among a process's mappings
(ProcessContext.mappings: libpython3.X, else the python3.X executable), its
symbols (_PyRuntime, Py_Version, PyCode_Type, PyType_Type) read from that
file as the process maps it and cached per file (runtime.mapped_file_facts:
opened through /proc/<pid>/root, only as the mapped regular file, in the
reader's FileCache), the load bias, the version the process reports in
memory (Py_Version), and for 3.13+ the _Py_DebugOffsets cookie, version and
free-threading flag at _PyRuntime; then the Layout (layouts.py) and a
self-check: PyCode_Type must be a type object (its ob_type is &PyType_Type)
named "code". The answer is a Target to read, a runtime.Refusal with the
reason, or None for a process that is not CPython.

Must not: walk frames, or log (the caller logs each refusal once).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

from runtimes.cpython import layouts
from runtimes.elfsyms import read_symbols
from runtimes.memory import MemoryReadError, ProcessMemory
from runtimes.runtime import Mapping, ProcessContext, Refusal, first_mappings, mapped_file_facts
from shared.safestr import process_string

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
class _Module:
    mapping: Mapping  # its mapping with the lowest file offset
    major: int
    minor: int
    flags: str  # "t": free-threaded, "d": debug build

    @property
    def path(self) -> str:
        return self.mapping.path


def _modules(maps: list[Mapping]) -> list[_Module]:
    """The interpreter files among a process's mappings, the library first."""
    executable = {m.path for m in maps if "x" in m.perms}
    out = []
    for path, m in first_mappings(maps, lambda base: bool(_NAME.match(base))).items():
        # Only a file the process runs code from is its interpreter (a file merely mapped under the
        # name is not).
        if path not in executable:
            continue
        name = _NAME.match(os.path.basename(path))
        assert name is not None
        out.append(_Module(m, int(name.group(2)), int(name.group(3)), name.group(4)))
    # The library holds the runtime when there is one, the executable is then a stub.
    return sorted(out, key=lambda mod: not os.path.basename(mod.path).startswith("lib"))


def parse_hexversion(v: int) -> tuple[int, int, int]:
    return v >> 24 & 0xFF, v >> 16 & 0xFF, v >> 8 & 0xFF


def read_c_string(mem: ProcessMemory, address: int, cap: int) -> str:
    raw = mem.read(address, cap)
    end = raw.find(b"\0")
    if end < 0:
        raise MemoryReadError("bad_address", "string without an end")
    return raw[:end].decode("utf-8", "replace")


def detect(process: ProcessContext, *, modern: bool, legacy: bool) -> Target | Refusal | None:
    """What to do with the process; MemoryReadError/OSError only if it vanished meanwhile."""
    mods = _modules(process.mappings)
    if not mods:
        return None
    mod = mods[0]
    where = f"{process_string(mod.path)} (CPython {mod.major}.{mod.minor}{mod.flags})"
    refused = _by_name(mod, where)
    if refused is not None:
        return refused
    info = mapped_file_facts(process, mod.mapping, "cpython", lambda f: read_symbols(f, SYMBOLS), where)
    if isinstance(info, Refusal):
        return info
    missing = [s for s in SYMBOLS if s not in info.symbols]
    if "Py_Version" in missing:
        return Refusal(f"{where}: no Py_Version symbol: CPython 3.10 or older, or a stripped build")
    if missing:
        return Refusal(f"{where}: no {', '.join(missing)} symbol")
    bias = info.load_bias(mod.mapping.start, mod.mapping.offset)
    sym = {name: value + bias for name, value in info.symbols.items()}
    mem = process.mem
    hexversion = mem.u64(sym["Py_Version"])
    major, minor, micro = parse_hexversion(hexversion)
    version = f"{major}.{minor}.{micro}"
    if (major, minor) != (mod.major, mod.minor):
        return Refusal(f"{where}: self-check failed: Py_Version in memory says {version}")
    layout = _layout(mem, sym["_PyRuntime"], hexversion, where, modern=modern, legacy=legacy)
    if isinstance(layout, Refusal):
        return layout
    refused = _check_code_type(mem, layout, sym, where)
    if refused is not None:
        return refused
    return Target(process.pid, version, layout, sym["_PyRuntime"], sym["PyCode_Type"], process_string(mod.path))


def _by_name(mod: _Module, where: str) -> Refusal | None:
    """What the interpreter's file name alone refuses."""
    if mod.major != 3:
        return Refusal(f"{where}: only CPython 3 is read")
    if "t" in mod.flags:
        return Refusal(
            f"{where}: a free-threaded build (no GIL): its objects and frames are laid out "
            f"differently and this reader does not support it"
        )
    if mod.minor <= 10:
        return Refusal(f"{where}: CPython 3.10 and older are not supported (3.11 and newer are)")
    return None


def _layout(
    mem: ProcessMemory, runtime: int, hexversion: int, where: str, *, modern: bool, legacy: bool
) -> layouts.Layout | Refusal:
    """The layout of this version: the table's for 3.11 and 3.12 (with python_legacy), else the one its
    _Py_DebugOffsets at _PyRuntime (`runtime`) give, checked."""
    major, minor, _ = parse_hexversion(hexversion)
    if (major, minor) in layouts.LEGACY:
        if not legacy:
            return Refusal(f"{where}: CPython {major}.{minor} is read only with runtime_stacks: [python_legacy]")
        return layouts.LEGACY[(major, minor)]
    if (major, minor) not in layouts.DEBUG:
        return Refusal(f"{where}: no layout for CPython {major}.{minor} in this version of the profiler")
    if not modern:
        return Refusal(f"{where}: python_stacks is false")
    extras = layouts.DEBUG[(major, minor)]
    raw = mem.read(runtime, layouts.DEBUG_OFFSETS_BYTES)
    if raw[:8] != layouts.COOKIE:
        return Refusal(f"{where}: self-check failed: no {layouts.COOKIE.decode()} cookie at _PyRuntime")
    values = {name: struct.unpack_from("<Q", raw, at)[0] for name, at in layouts.debug_field_offsets(extras).items()}
    if struct.unpack_from("<Q", raw, 8)[0] != hexversion:
        return Refusal(f"{where}: self-check failed: the debug offsets are of another version")
    if values["free_threaded"]:
        return Refusal(f"{where}: a free-threaded build (no GIL): not supported")
    layout = layouts.layout_from_debug(values, extras)
    if (
        layout.ob_type != 8
        or not 0 < layout.unicode_ascii_size <= 128
        or max(layout.unicode_state + 4, layout.unicode_length + 8) > layout.unicode_ascii_size
    ):
        return Refusal(f"{where}: self-check failed: implausible debug offsets")
    return layout


def _check_code_type(mem: ProcessMemory, layout: layouts.Layout, sym: dict[str, int], where: str) -> Refusal | None:
    """Self-check: PyCode_Type is a type object named "code"."""
    code_type = sym["PyCode_Type"]
    if mem.u64(code_type + layout.ob_type) != sym["PyType_Type"]:
        return Refusal(f"{where}: self-check failed: PyCode_Type is not a type object")
    name = read_c_string(mem, mem.u64(code_type + layout.type_name), MAX_TYPE_NAME)
    if name != "code":
        return Refusal(f"{where}: self-check failed: PyCode_Type is named {name!r}")
    return None
