"""Where the JVM reader finds what it reads, per HotSpot version, from the JVM's own tables.

Owns: Layout (every offset, size and constant the reader uses, each taken
from the VMStructs the JVM exported: vmstructs.py), built by `layout()`,
which names the first needed entry a libjvm lacks; the few facts HotSpot
does not export, kept here as data with the versions they hold for:
- the x86-64 interpreter frame's slots below the two it exports
  (frame::interpreter_frame_sender_sp_offset -1 and _last_sp_offset -2):
  method -3 and bcp -8 (frame_x86.hpp, unchanged from JDK 9 to 25);
- the compressed-stream coding of debug information and line tables:
  Pack200's UNSIGNED5 up to JDK 19, with the zero byte excluded (X=1) from
  JDK 20 (JDK-8292758);
- the JDK 8 refusal: HotSpot 25.x (JDK 8) has no JEP 223 version fields,
  a single code heap (CodeCache::_heap, no _heaps) and nmethods without
  CompiledMethod (their scopes begin elsewhere).
The Java threads are ThreadsSMRSupport::_java_thread_list's array from
JDK 12; JDK 11's tables name only Threads::_thread_list, linked by
JavaThread::_next.

Must not: read process memory (vmstructs.py and the reader do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtimes.jvm.vmstructs import VMStructs

# Supported HotSpot feature versions (JDK 9 and 10 are end-of-life and untested).
MIN_MAJOR = 11
# Slots of an x86-64 interpreter frame (words from fp) HotSpot does not export.
INTERP_METHOD_SLOT = -3
INTERP_BCP_SLOT = -8
# The first feature version whose compressed streams exclude the zero byte.
UNSIGNED5_X1_SINCE = 20


class MissingField(Exception):
    """A field or constant the reader needs is not in the JVM's tables."""


@dataclass(frozen=True)
class Layout:
    major: int
    stream_x: int  # the excluded-bytes bias of CompressedReadStream (0 or 1)
    # threads
    java_thread_list: int  # address of ThreadsSMRSupport::_java_thread_list (JDK 12+), else -1
    threads_head: int  # address of Threads::_thread_list (JDK 11: a list by JavaThread::_next)
    jt_next: int
    jt_thread_state: int
    state_in_java: int  # JavaThreadState's _thread_in_Java
    state_in_java_trans: int
    tl_length: int
    tl_threads: int
    jt_anchor: int
    jt_osthread: int
    jt_stack_base: int
    jt_stack_size: int
    anchor_sp: int
    anchor_pc: int
    anchor_fp: int
    os_thread_id: int
    # frames
    call_stub_return: int  # address of StubRoutines::_call_stub_return_address
    call_wrapper_slot: int  # frame::entry_frame_call_wrapper_offset (words from fp)
    wrapper_anchor: int  # JavaCallWrapper::_anchor
    sender_sp_slot: int  # frame::interpreter_frame_sender_sp_offset
    # code cache
    code_heaps: int  # address of CodeCache::_heaps
    ga_len: int
    ga_data: int
    heap_memory: int
    heap_segmap: int
    heap_log2_segment: int
    vs_low_boundary: int
    vs_high: int
    vs_low: int
    heap_block_size: int
    hb_used: int
    # code blobs
    cb_name: int
    cb_size: int
    cb_frame_size: int
    cb_frame_complete: int  # CodeBlob::_frame_complete_offset (int to JDK 22, int16_t since), else -1
    cb_code_begin: int  # pointer field (JDK 11-21), else -1
    cb_code_offset: int  # int field from the blob (JDK 23+), else -1
    cb_kind: int  # u1 kind (JDK 23+), else -1
    kind_nmethod: int
    cb_mutable_data: int  # JDK 25: metadata lives after the relocations there
    cb_relocation_size: int
    nm_method: int
    nm_scopes_data_begin: int  # pointer (JDK 11-21), else -1
    nm_immutable_data: int  # pointer (JDK 25), else -1
    nm_scopes_data_offset: int
    nm_immutable_size: int
    nm_scopes_pcs_offset: int
    nm_pcs_end_offset: int  # _dependencies_offset (JDK 11-21): the pcs end there
    nm_metadata_offset: int  # JDK 11-21, else -1
    nm_compile_id: int
    pc_desc_size: int
    pc_offset: int
    pc_scope_decode: int
    invocation_entry_bci: int
    # methods
    m_const_method: int
    cm_constants: int
    cm_code_size: int
    cm_name_index: int
    cm_flags: int
    cm_size: int  # sizeof(ConstMethod): the bytecodes follow it
    has_linenumber_table: int
    cp_pool_holder: int
    cp_size: int  # sizeof(ConstantPool): the entries follow it
    cp_source_file_index: int  # ConstantPool's (JDK 17+), else -1
    ik_source_file_index: int  # InstanceKlass's (JDK 11), else -1
    klass_name: int
    sym_length: int
    sym_body: int


def is_jep223(vs: VMStructs) -> bool:
    """Whether the tables are of a JEP 223 (JDK 9+) HotSpot: JDK 8's have no _vm_security_version."""
    return ("Abstract_VM_Version", "_vm_security_version") in vs.statics


@dataclass(frozen=True)
class Source:
    """Where one Layout value is in the JVM's tables: the first of `names` the tables have."""

    kind: str  # "field", "opt" (a field, -1 when the tables lack it), "static", "size" or "const"
    names: tuple[Any, ...]  # (type, name) pairs for fields and statics; names for sizes and constants
    when: str | None = None  # the tables' condition (layout()'s `holds`) it is read under; else -1


def _field(*names: tuple[str, str], when: str | None = None) -> Source:
    return Source("field", names, when)


def _opt(*names: tuple[str, str]) -> Source:
    return Source("opt", names)


def _static(name: tuple[str, str]) -> Source:
    return Source("static", (name,))


def _size(name: str) -> Source:
    return Source("size", (name,))


def _const(*names: str, when: str | None = None) -> Source:
    return Source("const", names, when)


# Every Layout value read straight from the tables, in the order they are checked (the first one a
# libjvm lacks is named); the others are derived by _derived(). Conditions: "jdk11_threads" (no
# ThreadsSMRSupport::_java_thread_list: JDK 11), "smr_threads" (JDK 12+), "blob_kinds" (CodeBlob::_kind:
# JDK 23+), "immutable_data" (nmethod::_immutable_data: JDK 25), "inline_data" (JDK 11-24).
SOURCES: dict[str, Source] = {
    "jt_next": _field(("JavaThread", "_next"), when="jdk11_threads"),
    "jt_thread_state": _field(("JavaThread", "_thread_state")),
    "state_in_java": _const("_thread_in_Java"),
    "state_in_java_trans": _const("_thread_in_Java_trans"),
    "tl_length": _field(("ThreadsList", "_length"), when="smr_threads"),
    "tl_threads": _field(("ThreadsList", "_threads"), when="smr_threads"),
    "jt_anchor": _field(("JavaThread", "_anchor")),
    "jt_osthread": _field(("JavaThread", "_osthread"), ("Thread", "_osthread")),
    "jt_stack_base": _field(("JavaThread", "_stack_base"), ("Thread", "_stack_base")),
    "jt_stack_size": _field(("JavaThread", "_stack_size"), ("Thread", "_stack_size")),
    "anchor_sp": _field(("JavaFrameAnchor", "_last_Java_sp")),
    "anchor_pc": _field(("JavaFrameAnchor", "_last_Java_pc")),
    "anchor_fp": _field(("JavaFrameAnchor", "_last_Java_fp")),
    "os_thread_id": _field(("OSThread", "_thread_id")),
    "call_stub_return": _static(("StubRoutines", "_call_stub_return_address")),
    "call_wrapper_slot": _const("frame::entry_frame_call_wrapper_offset"),
    "wrapper_anchor": _field(("JavaCallWrapper", "_anchor")),
    "sender_sp_slot": _const("frame::interpreter_frame_sender_sp_offset"),
    "code_heaps": _static(("CodeCache", "_heaps")),
    "ga_len": _field(("GrowableArrayBase", "_len"), ("GenericGrowableArray", "_len")),
    "ga_data": _field(("GrowableArray<int>", "_data")),
    "heap_memory": _field(("CodeHeap", "_memory")),
    "heap_segmap": _field(("CodeHeap", "_segmap")),
    "heap_log2_segment": _field(("CodeHeap", "_log2_segment_size")),
    "vs_low_boundary": _field(("VirtualSpace", "_low_boundary")),
    "vs_high": _field(("VirtualSpace", "_high")),
    "vs_low": _field(("VirtualSpace", "_low")),
    "heap_block_size": _size("HeapBlock"),
    "hb_used": _field(("HeapBlock::Header", "_used")),
    "cb_name": _field(("CodeBlob", "_name")),
    "cb_size": _field(("CodeBlob", "_size")),
    "cb_frame_size": _field(("CodeBlob", "_frame_size")),
    "cb_frame_complete": _opt(("CodeBlob", "_frame_complete_offset")),
    "kind_nmethod": _const("CodeBlobKind::Nmethod", when="blob_kinds"),
    "cb_mutable_data": _opt(("CodeBlob", "_mutable_data")),
    "cb_relocation_size": _opt(("CodeBlob", "_relocation_size")),
    "nm_method": _field(("CompiledMethod", "_method"), ("nmethod", "_method")),
    "nm_scopes_data_offset": _field(("nmethod", "_scopes_data_offset"), when="immutable_data"),
    "nm_immutable_size": _field(("nmethod", "_immutable_data_size"), when="immutable_data"),
    "nm_scopes_pcs_offset": _field(("nmethod", "_scopes_pcs_offset")),
    "nm_pcs_end_offset": _field(("nmethod", "_dependencies_offset"), when="inline_data"),
    "nm_compile_id": _field(("nmethod", "_compile_id")),
    "pc_desc_size": _size("PcDesc"),
    "pc_offset": _field(("PcDesc", "_pc_offset")),
    "pc_scope_decode": _field(("PcDesc", "_scope_decode_offset")),
    "invocation_entry_bci": _const("InvocationEntryBci"),
    "m_const_method": _field(("Method", "_constMethod")),
    "cm_constants": _field(("ConstMethod", "_constants")),
    "cm_code_size": _field(("ConstMethod", "_code_size")),
    "cm_name_index": _field(("ConstMethod", "_name_index")),
    "cm_flags": _field(("ConstMethod", "_flags"), ("ConstMethod", "_flags._flags")),
    "cm_size": _size("ConstMethod"),
    "has_linenumber_table": _const(
        "ConstMethod::_has_linenumber_table", "ConstMethodFlags::_misc_has_linenumber_table"
    ),
    "cp_pool_holder": _field(("ConstantPool", "_pool_holder")),
    "cp_size": _size("ConstantPool"),
    "cp_source_file_index": _opt(("ConstantPool", "_source_file_name_index")),
    "ik_source_file_index": _opt(("InstanceKlass", "_source_file_name_index")),
    "klass_name": _field(("Klass", "_name")),
    "sym_length": _field(("Symbol", "_length")),
    "sym_body": _field(("Symbol", "_body")),
}


def _value(vs: VMStructs, src: Source) -> int:
    """The value `src` names in the tables (-1 for an absent "opt"), or MissingField naming it."""
    tables: dict[str, dict[Any, int]] = {
        "field": vs.fields,
        "opt": vs.fields,
        "static": vs.statics,
        "size": vs.sizes,
        "const": vs.ints,
    }
    table = tables[src.kind]
    for name in src.names:
        if name in table:
            return table[name]
    if src.kind == "opt":
        return -1
    if src.kind == "static":
        raise MissingField(f"{src.names[0][0]}::{src.names[0][1]} (static)")
    if src.kind == "size":
        raise MissingField(f"sizeof({src.names[0]})")
    if src.kind == "const":
        raise MissingField(" / ".join(src.names))
    raise MissingField(" / ".join(f"{t}::{n}" for t, n in src.names))


def _derived(vs: VMStructs, major: int) -> dict[str, int]:
    """The Layout values that depend on which of the tables' alternatives a JDK has, checked first."""
    f, s = vs.fields, vs.statics
    smr = s.get(("ThreadsSMRSupport", "_java_thread_list"), -1)
    if smr < 0:
        _value(vs, _static(("Threads", "_thread_list")))
    cb_code_begin = f.get(("CodeBlob", "_code_begin"), -1)
    cb_code_offset = f.get(("CodeBlob", "_code_offset"), -1) if cb_code_begin < 0 else -1
    if cb_code_begin < 0 and cb_code_offset < 0:
        raise MissingField("CodeBlob::_code_begin / CodeBlob::_code_offset")
    scopes_begin = f.get(("CompiledMethod", "_scopes_data_begin"), -1)
    immutable = f.get(("nmethod", "_immutable_data"), -1)
    if scopes_begin < 0 and immutable < 0:
        raise MissingField("CompiledMethod::_scopes_data_begin / nmethod::_immutable_data")
    if ("ConstantPool", "_source_file_name_index") not in f and ("InstanceKlass", "_source_file_name_index") not in f:
        raise MissingField("ConstantPool::_source_file_name_index / InstanceKlass::_source_file_name_index")
    metadata = f.get(("nmethod", "_metadata_offset"), -1)
    if metadata < 0 and immutable >= 0:
        _value(vs, _field(("CodeBlob", "_mutable_data")))
    return {
        "major": major,
        "stream_x": 1 if major >= UNSIGNED5_X1_SINCE else 0,
        "java_thread_list": smr,
        "threads_head": s.get(("Threads", "_thread_list"), -1) if smr < 0 else -1,
        "cb_code_begin": cb_code_begin,
        "cb_code_offset": cb_code_offset,
        "cb_kind": f.get(("CodeBlob", "_kind"), -1),
        "nm_scopes_data_begin": scopes_begin,
        "nm_immutable_data": immutable,
        "nm_metadata_offset": metadata,
    }


def layout(vs: VMStructs, major: int) -> Layout:
    """The Layout of a JVM with these tables, or MissingField naming the first entry they lack."""
    derived = _derived(vs, major)
    holds = {
        "jdk11_threads": derived["java_thread_list"] < 0,
        "smr_threads": derived["java_thread_list"] >= 0,
        "blob_kinds": derived["cb_kind"] >= 0,
        "immutable_data": derived["nm_immutable_data"] >= 0,
        "inline_data": derived["nm_immutable_data"] < 0,
    }
    values = {name: _value(vs, src) if src.when is None or holds[src.when] else -1 for name, src in SOURCES.items()}
    return Layout(**derived, **values)
