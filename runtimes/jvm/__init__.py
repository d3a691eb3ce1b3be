"""HotSpot JVMs, JDK 11 and newer: the plug-in.

Owns: detection (runtimes/runtime.py's contract): a process is a JVM's when
it maps libjvm.so; the symbols of the serviceability tables (the exported
gHotSpotVM* variables, read from the file once per file identity); the
tables themselves from the process (vmstructs.py), the VM's version from
them (Abstract_VM_Version::_s_vm_release and _vm_major_version, in the VM's
memory), and the Layout (layouts.py). Refused with the reason:
- JDK 8 (HotSpot 25.x): its tables lack the JEP 223 version fields, and it
  has a single code heap and nmethods without CompiledMethod's fields,
  which the reader is built on;
- JDK 9 and 10 (not supported: 11 and newer are);
- a libjvm that does not export the tables, or whose tables lack a field
  the reader needs (named in the reason);
- a JVM whose thread list or code heaps do not pass their self-checks;
- a host other than x86-64 (the interpreter frame's slots are x86-64's).
-XX:-UsePerfData does not matter: the reader never reads hsperfdata.

Must not: walk frames (reader.py does), or log.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

from runtimes import elfsyms
from runtimes.jvm import layouts, vmstructs
from runtimes.jvm.reader import BadFrame, JvmProcess
from runtimes.memory import MemoryReadError
from runtimes.runtime import ProcessContext, Refusal, first_mappings, mapped_file_facts
from shared.runtime_registry import RuntimeSpec, spec_of
from shared.safestr import process_string

SPEC: RuntimeSpec = spec_of("jvm")

# "11.0.13+8-LTS" and the like; a longer release string is cut here.
MAX_RELEASE_CHARS = 80


@dataclass(frozen=True)
class FileFacts:
    elf: elfsyms.ElfInfo


def version_of(mem: Any, vs: vmstructs.VMStructs) -> tuple[int, str]:
    """(feature version, release string) from the VM's memory."""
    release = ""
    at = vs.statics.get(("Abstract_VM_Version", "_s_vm_release"))
    if at:
        ptr = mem.u64(at)
        if ptr:
            release = process_string(mem.read(ptr, MAX_RELEASE_CHARS).split(b"\0", 1)[0])
    at = vs.statics.get(("Abstract_VM_Version", "_vm_major_version"))
    major = mem.i32(at) if at else 0
    return major, release


def decide(vs: vmstructs.VMStructs, major: int, release: str, where: str) -> layouts.Layout | Refusal:
    """The layout for these tables, or why not (no memory reads: unit tests replay recorded tables)."""
    if not layouts.is_jep223(vs):
        return Refusal(
            f"{where}: HotSpot {release or major} is JDK 8's or older (no Abstract_VM_Version::"
            f"_vm_security_version; one code heap, CodeCache::_heap, not _heaps): not supported, "
            f"JDK {layouts.MIN_MAJOR} and newer are"
        )
    if major < layouts.MIN_MAJOR:
        return Refusal(f"{where}: JDK {major} ({release}) is not supported: JDK {layouts.MIN_MAJOR} and newer are")
    try:
        return layouts.layout(vs, major)
    except layouts.MissingField as e:
        return Refusal(f"{where}: JDK {major} ({release}): libjvm's tables lack {e}, which the reader needs")


class Jvm:
    spec = SPEC

    def detect(self, process: ProcessContext) -> JvmProcess | Refusal | None:
        mods = first_mappings(process.mappings, lambda base: base == "libjvm.so")
        if not mods:
            return None
        mod = next(iter(mods.values()))
        if platform.machine() != "x86_64":
            return Refusal(f"{mod.path}: the reader knows x86-64's interpreter frames only, not {platform.machine()}'s")
        facts = mapped_file_facts(process, mod, "jvm", lambda f: FileFacts(elfsyms.read_symbols(f, vmstructs.SYMBOLS)))
        if isinstance(facts, Refusal):
            return facts
        elf = facts.elf
        bias = elf.load_bias(mod.start, mod.offset)
        mem = process.mem
        try:
            vs = vmstructs.read(mem, {k: v + bias for k, v in elf.symbols.items()})
        except vmstructs.VMStructsError as e:
            return Refusal(f"{mod.path}: {e}")
        major, release = version_of(mem, vs)
        where = f"{mod.path} (JDK {release or major})"
        decided = decide(vs, major, release, where)
        if isinstance(decided, Refusal):
            return decided
        reader = JvmProcess(release or str(major), decided)
        try:
            reader.self_check(mem)
        except (BadFrame, MemoryReadError) as e:
            if isinstance(e, MemoryReadError) and e.reason in ("gone", "budget"):
                raise
            return Refusal(f"{where}: self-check failed: {e}")
        return reader

    def stop(self) -> list[str]:
        """Nothing to undo: detect asks nothing of a process, only reads it."""
        return []

    def counters(self) -> dict[str, int]:
        """No checks of its own (its refusals are counted by the reader, by kind)."""
        return {}


def runtime(cfg: Any) -> Jvm | None:
    return Jvm() if "jvm" in cfg.runtime_stacks else None
