"""PHP 8.2 to 8.5, NTS builds (CLI, php-fpm, php-cgi, libphp): the plug-in.

Owns: detection (runtimes/runtime.py's contract): a process is PHP's when
it maps php*, php-fpm*, php-cgi* or libphp*.so; from that file (opened as
the process sees it, its data cached by file identity) the version
("X-Powered-By: PHP/x.y.z" in its read-only data, as PHP itself prints it),
the build (the module build id "API…,NTS" or ",TS") and the
executor_globals symbol; then a self-check of EG in memory. The answer is a
PhpProcess, a Refusal with the reason (ZTS, no executor_globals symbol as in
a stripped static build, an unsupported version, a failed self-check), or
None.

Must not: walk frames (reader.py does), or log (targets.py logs refusals).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, BinaryIO

from runtimes import elfsyms
from runtimes.php.layouts import LAYOUTS
from runtimes.php.reader import PhpProcess
from runtimes.runtime import (
    Mapping,
    ProcessContext,
    Refusal,
    first_mappings,
    mapped_file_facts,
)
from shared.runtime_registry import RuntimeSpec, spec_of

SPEC: RuntimeSpec = spec_of("php")

# Bytes of a PHP file scanned for its version and build id (php8.2 is 5.7 MB, a static PHP ~30 MB).
MAX_SCAN_BYTES = 128 << 20
# Bytes read per step of that scan.
SCAN_CHUNK = 1 << 20
# Overlap between steps, longer than the longest marker with its value.
SCAN_OVERLAP = 64

_NAME = re.compile(r"^(php(-fpm|-cgi)?[\d.]*|libphp[\d.]*\.so)$")
_VERSION = re.compile(rb"X-Powered-By: PHP/(\d+)\.(\d+)\.(\d+)")
_BUILD = re.compile(rb"API(\d{8}),(NTS|TS)\b")
SYMBOLS = ("executor_globals", "executor_globals_offset", "tsrm_get_ls_cache")


@dataclass(frozen=True)
class FileFacts:
    """What one PHP file says of itself (cached by file identity)."""

    version: tuple[int, int, int] | None
    build: str | None  # "NTS", "TS", or None if no build id was found
    elf: elfsyms.ElfInfo


def _scan(f: BinaryIO) -> tuple[tuple[int, int, int] | None, str | None]:
    version, build, at, tail = None, None, 0, b""
    f.seek(0)
    while at < MAX_SCAN_BYTES and (version is None or build is None):
        chunk = f.read(min(SCAN_CHUNK, MAX_SCAN_BYTES - at))
        if not chunk:
            break
        at += len(chunk)
        window, tail = tail + chunk, (tail + chunk)[-SCAN_OVERLAP:]
        if version is None and (m := _VERSION.search(window)):
            version = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        if build is None and (m := _BUILD.search(window)):
            build = m.group(2).decode()
    return version, build


def _facts(f: BinaryIO) -> FileFacts:
    elf = elfsyms.read_symbols(f, SYMBOLS)
    version, build = _scan(f)
    return FileFacts(version, build, elf)


class Php:
    spec = SPEC

    def detect(self, process: ProcessContext) -> PhpProcess | Refusal | None:
        mods = first_mappings(process.mappings, lambda base: bool(_NAME.match(base)))
        if not mods:
            return None
        # libphp holds the engine when it is mapped (an embedding server); else the executable.
        mod = sorted(mods.values(), key=lambda m: not m.path.rsplit("/", 1)[-1].startswith("lib"))[0]
        facts = mapped_file_facts(process, mod, "php", _facts)
        if isinstance(facts, Refusal):
            return facts
        return self._decide(process, mod, facts)

    def stop(self) -> list[str]:
        """Nothing to undo: detect asks nothing of a process, only reads it."""
        return []

    def counters(self) -> dict[str, int]:
        """No checks of its own (its refusals are counted by the reader, by kind)."""
        return {}

    def _decide(self, process: ProcessContext, mod: Mapping, facts: FileFacts) -> PhpProcess | Refusal:
        if facts.version is None:
            return Refusal(f"{mod.path}: no PHP version string in the file (not a PHP build this reader knows)")
        major, minor, micro = facts.version
        where = f"{mod.path} (PHP {major}.{minor}.{micro})"
        syms = facts.elf.symbols
        if facts.build == "TS" or "executor_globals_offset" in syms or "tsrm_get_ls_cache" in syms:
            return Refusal(
                f"{where}: a ZTS (thread-safe) build: its executor globals live in each thread's "
                f"storage; only NTS builds are read"
            )
        layout = LAYOUTS.get((major, minor))
        if layout is None:
            return Refusal(f"{where}: PHP {major}.{minor} is not supported (8.2 to 8.5 are)")
        if "executor_globals" not in syms:
            return Refusal(
                f"{where}: no executor_globals symbol (a stripped or static build): the reader "
                f"needs it to find the running request"
            )
        eg = syms["executor_globals"] + facts.elf.load_bias(mod.start, mod.offset)
        # Self-check: EG is mapped and its current frame pointer is null or aligned.
        ex = process.mem.u64(eg + layout.eg_current_execute_data)
        if ex & 7:
            return Refusal(f"{where}: self-check failed: executor_globals.current_execute_data is {ex:#x}")
        return PhpProcess(f"{major}.{minor}.{micro}", layout, eg)


def runtime(cfg: Any) -> Php | None:
    return Php() if "php" in cfg.runtime_stacks else None
