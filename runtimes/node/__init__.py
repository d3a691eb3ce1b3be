"""Node.js (V8 11.3 to 14.6, x86-64, builds without pointer compression): the plug-in.

Owns: detection (runtimes/runtime.py's contract): a process is Node's when it
maps node, nodeNN or libnode.so.N (Debian's packages keep V8 in libnode; the
official builds in the node binary); from that file (opened as the process
sees it, its data cached by file identity) the v8dbg_* symbols and their
values (frame slots, object fields, type numbers, tags) and V8's version
(v8::internal::Version's major_, minor_, build_, patch_), all from .dynsym
only (an official build's .symtab strings are past elfsyms' cap). The answer
is a NodeProcess, a Refusal with the reason (no v8dbg_ symbols, a
pointer-compressed build, a V8 older or newer than the layouts in
layouts.py, a v8dbg_ set without a field the reader needs or with values no
V8 has), or None.

Must not: walk frames (reader.py does), or log (targets.py logs refusals).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, BinaryIO

from runtimes import elfsyms
from runtimes.node.layouts import LAYOUTS, SUPPORTED
from runtimes.node.reader import NodeProcess, V8Info, scan_ranges
from runtimes.runtime import ProcessContext, Refusal, first_mappings, mapped_file_facts
from shared.runtime_registry import RuntimeSpec, spec_of

SPEC: RuntimeSpec = spec_of("node")

_NAME = re.compile(r"^(node\d*|libnode\.so(\.\d+)*)$")
_VERSION = {part: f"_ZN2v88internal7Version{len(part)}{part}E" for part in ("major_", "minor_", "build_", "patch_")}
PREFIX = "v8dbg_"


@dataclass(frozen=True)
class FileFacts:
    elf: elfsyms.ElfInfo
    values: dict[str, int]  # v8dbg_ name (without the prefix) → its value (signed)
    version: tuple[int, int, int, int] | None


def _facts(f: BinaryIO) -> FileFacts:
    elf = elfsyms.read_symbols(f, _VERSION.values(), prefix=PREFIX, dynsym_only=True)
    raw = elfsyms.read_values(f, elf, [n for n in elf.symbols if n.startswith(PREFIX)])
    values = {n[len(PREFIX) :]: v - (1 << 32) if v >= 1 << 31 else v for n, v in raw.items()}
    ver = elfsyms.read_values(f, elf, _VERSION.values())
    version = (
        (ver[_VERSION["major_"]], ver[_VERSION["minor_"]], ver[_VERSION["build_"]], ver[_VERSION["patch_"]])
        if len(ver) == 4
        else None
    )
    return FileFacts(elf, values, version)


class Node:
    spec = SPEC

    def detect(self, process: ProcessContext) -> NodeProcess | Refusal | None:
        mods = first_mappings(process.mappings, lambda base: bool(_NAME.match(base)))
        if not mods:
            return None
        # libnode holds V8 when it is mapped (Debian's node); else the executable.
        mod = sorted(mods.values(), key=lambda m: not m.path.rsplit("/", 1)[-1].startswith("lib"))[0]
        facts = mapped_file_facts(process, mod, "node", _facts)
        if isinstance(facts, Refusal):
            return facts
        v = facts.values
        if not v:
            return Refusal(
                f"{mod.path}: no v8dbg_ symbols in its .dynsym (a build without V8's postmortem "
                f"metadata): the reader needs them for V8's frame and object layouts"
            )
        if facts.version is None:
            return Refusal(f"{mod.path}: no v8::internal::Version symbols: the V8 version is unknown")
        major, minor, build, patch = facts.version
        where = f"{mod.path} (V8 {major}.{minor}.{build}.{patch})"
        if v.get("TaggedSize") != 8 or v.get("SmiShiftSize") != 31:
            return Refusal(
                f"{where}: a pointer-compressed build (v8dbg_TaggedSize {v.get('TaggedSize')}, "
                f"SmiShiftSize {v.get('SmiShiftSize')}): only full 64-bit tagged pointers are read"
            )
        layout = LAYOUTS.get((major, minor))
        if layout is None:
            older = (major, minor) < min(LAYOUTS)
            return Refusal(
                f"{where}: V8 {major}.{minor} is {'older than' if older else 'not one of'} the "
                f"layouts this reader knows ({SUPPORTED})"
            )
        try:
            info = V8Info.from_values(v)
        except KeyError as e:
            return Refusal(f"{where}: no v8dbg_{e.args[0]} symbol: the reader needs it")
        if (bad := info.check()) is not None:
            return Refusal(f"{where}: implausible v8dbg_ values ({bad})")
        stack = next((m for m in process.mappings if m.path == "[stack]"), None)
        if stack is None:
            return Refusal(f"{where}: no [stack] mapping: the main thread's stack is not found")
        return NodeProcess(
            f"{major}.{minor}.{build}.{patch}",
            layout,
            info,
            scan_ranges(process.mappings),
            (stack.start, stack.end),
            process.pid,
            process.proc,
            mod.path,
        )

    def stop(self) -> list[str]:
        """Nothing to undo: detect asks nothing of a process, only reads it."""
        return []

    def counters(self) -> dict[str, int]:
        """No checks of its own (its refusals are counted by the reader, by kind)."""
        return {}


def runtime(cfg: Any) -> Node | None:
    return Node() if "node" in cfg.runtime_stacks else None
