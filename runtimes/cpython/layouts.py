"""CPython struct layouts, per minor version, as data.

Owns: what the reader needs to know of each supported CPython minor version
(x86-64 and arm64, default GIL build):
- 3.11 and 3.12 (python_legacy): every offset, as a Layout, from CPython's
  own headers of that version (3.11 checked with offsetof() against Debian's
  libpython3.11-dev headers; 3.12 from Include/cpython/code.h,
  pycore_frame.h, pystate.h and pycore_interp.h of the 3.12 branch);
- 3.13, 3.14 and 3.15: the field order of the _Py_DebugOffsets struct that
  the interpreter carries at the start of _PyRuntime (the values are read from
  the target, so a patch release with other offsets needs no change here;
  the order checked with offsetof() against Debian sid's libpython3.14-dev
  and libpython3.15-dev headers),
  plus the few facts the debug offsets do not give (DebugExtras): how the
  thread state reaches its frame, which frame owners are not Python frames,
  and the tag bits of a tagged frame reference.
- wire_layout: a Layout as the collector's walk in BPF is given it (shared/wire.py PythonLayout: the
  offsets that walk reads, under the same names), made here alone.

Must not: read memory or decide which version a process runs (version.py does).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from shared.wire import PythonLayout

COOKIE = b"xdebugpy"


@dataclass(frozen=True)
class Layout:
    """Every offset the frame walker uses, in bytes."""

    runtime_interpreters_head: int
    interp_next: int
    interp_threads_head: int
    tstate_next: int
    tstate_current_frame: int  # 3.13+: the frame pointer; 3.11/3.12: the _PyCFrame pointer
    cframe_current_frame: int | None  # 3.11/3.12: offset of current_frame inside _PyCFrame; else None
    tstate_native_thread_id: int
    tstate_thread_id: int  # pthread_self() of the thread: its TCB, the thread pointer (x86-64 fs base)
    frame_previous: int
    frame_executable: int  # f_code (3.11/3.12) or f_executable (3.13+)
    frame_instr_ptr: int  # prev_instr (3.11/3.12) or instr_ptr (3.13+)
    frame_owner: int
    frame_is_entry: int | None  # 3.11: the frame an _PyEval_EvalFrameDefault call began with; else None
    code_filename: int
    code_name: int
    code_qualname: int
    code_linetable: int
    code_firstlineno: int
    code_adaptive: int  # co_code_adaptive: the first code unit
    ob_type: int
    type_name: int  # tp_name
    unicode_state: int
    unicode_length: int
    unicode_ascii_size: int  # sizeof(PyASCIIObject): where compact ASCII data starts
    unicode_compact_size: int  # sizeof(PyCompactUnicodeObject): where other compact data starts
    bytes_size: int  # ob_size of a bytes object
    bytes_data: int  # ob_sval
    skip_owners: frozenset[int]  # frame owners that are not Python frames (shim/entry frames)
    tag_mask: int  # low bits of a tagged frame reference (3.14 _PyStackRef), else 0


# Shared by 3.11 and 3.12 where the headers agree.
_OBJECT = {"ob_type": 8, "type_name": 24, "bytes_size": 16, "bytes_data": 32}

LEGACY: dict[tuple[int, int], Layout] = {
    (3, 11): Layout(
        runtime_interpreters_head=40,
        interp_next=0,
        interp_threads_head=16,
        tstate_next=8,
        tstate_current_frame=56,
        cframe_current_frame=8,
        tstate_native_thread_id=160,
        tstate_thread_id=152,
        frame_previous=48,
        frame_executable=32,
        frame_instr_ptr=56,
        frame_owner=69,
        frame_is_entry=68,
        code_filename=112,
        code_name=120,
        code_qualname=128,
        code_linetable=136,
        code_firstlineno=72,
        code_adaptive=184,
        unicode_state=32,
        unicode_length=16,
        unicode_ascii_size=48,
        unicode_compact_size=72,
        skip_owners=frozenset(),
        tag_mask=0,
        **_OBJECT,
    ),
    # 3.12: ceval state moved out of the interpreter's head, PyASCIIObject lost wstr,
    # _PyCFrame lost use_tracing, shim frames are owned by the C stack (3).
    (3, 12): Layout(
        runtime_interpreters_head=40,
        interp_next=0,
        interp_threads_head=72,
        tstate_next=8,
        tstate_current_frame=56,
        cframe_current_frame=0,
        tstate_native_thread_id=144,
        tstate_thread_id=136,
        frame_previous=8,
        frame_executable=0,
        frame_instr_ptr=56,
        frame_owner=70,
        frame_is_entry=None,
        code_filename=112,
        code_name=120,
        code_qualname=128,
        code_linetable=136,
        code_firstlineno=68,
        code_adaptive=192,
        unicode_state=32,
        unicode_length=16,
        unicode_ascii_size=40,
        unicode_compact_size=56,
        skip_owners=frozenset({3}),
        tag_mask=0,
        **_OBJECT,
    ),
}

# The _Py_DebugOffsets struct of each minor version: after cookie[8] and version,
# groups of uint64 fields in declaration order.
_DEBUG_313: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("", ("free_threaded",)),
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
    (
        "interpreter_state",
        (
            "size",
            "id",
            "next",
            "threads_head",
            "gc",
            "imports_modules",
            "sysdict",
            "builtins",
            "ceval_gil",
            "gil_runtime_state",
            "gil_runtime_state_enabled",
            "gil_runtime_state_locked",
            "gil_runtime_state_holder",
        ),
    ),
    (
        "thread_state",
        (
            "size",
            "prev",
            "next",
            "interp",
            "current_frame",
            "thread_id",
            "native_thread_id",
            "datastack_chunk",
            "status",
        ),
    ),
    ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus", "owner")),
    (
        "code_object",
        (
            "size",
            "filename",
            "name",
            "qualname",
            "linetable",
            "firstlineno",
            "argcount",
            "localsplusnames",
            "localspluskinds",
            "co_code_adaptive",
        ),
    ),
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags")),
    ("tuple_object", ("size", "ob_item", "ob_size")),
    ("list_object", ("size", "ob_item", "ob_size")),
    ("dict_object", ("size", "ma_keys", "ma_values")),
    ("float_object", ("size", "ob_fval")),
    ("long_object", ("size", "lv_tag", "ob_digit")),
    ("bytes_object", ("size", "ob_size", "ob_sval")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size")),
)
_DEBUG_314: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("", ("free_threaded",)),
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
    (
        "interpreter_state",
        (
            "size",
            "id",
            "next",
            "threads_head",
            "threads_main",
            "gc",
            "imports_modules",
            "sysdict",
            "builtins",
            "ceval_gil",
            "gil_runtime_state",
            "gil_runtime_state_enabled",
            "gil_runtime_state_locked",
            "gil_runtime_state_holder",
            "code_object_generation",
            "tlbc_generation",
        ),
    ),
    (
        "thread_state",
        (
            "size",
            "prev",
            "next",
            "interp",
            "current_frame",
            "thread_id",
            "native_thread_id",
            "datastack_chunk",
            "status",
        ),
    ),
    (
        "interpreter_frame",
        ("size", "previous", "executable", "instr_ptr", "localsplus", "owner", "stackpointer", "tlbc_index"),
    ),
    (
        "code_object",
        (
            "size",
            "filename",
            "name",
            "qualname",
            "linetable",
            "firstlineno",
            "argcount",
            "localsplusnames",
            "localspluskinds",
            "co_code_adaptive",
            "co_tlbc",
        ),
    ),
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags")),
    ("tuple_object", ("size", "ob_item", "ob_size")),
    ("list_object", ("size", "ob_item", "ob_size")),
    ("set_object", ("size", "used", "table", "mask")),
    ("dict_object", ("size", "ma_keys", "ma_values")),
    ("float_object", ("size", "ob_fval")),
    ("long_object", ("size", "lv_tag", "ob_digit")),
    ("bytes_object", ("size", "ob_size", "ob_sval")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size")),
)


# 3.15: the thread state gained base_frame, the profiler's last frame and GIL fields; the exception
# stack item, the heap type and sizeof(PyCompactUnicodeObject) are new groups and fields; the groups
# named from _AS_314 are as 3.14's.
_AS_314 = dict(_DEBUG_314)
_DEBUG_315: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("", ("free_threaded",)),
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
    ("interpreter_state", _AS_314["interpreter_state"]),
    (
        "thread_state",
        (
            "size",
            "prev",
            "next",
            "interp",
            "current_frame",
            "base_frame",
            "last_profiled_frame",
            "last_profiled_frame_seq",
            "thread_id",
            "native_thread_id",
            "datastack_chunk",
            "status",
            "holds_gil",
            "gil_requested",
            "current_exception",
            "exc_state",
        ),
    ),
    ("err_stackitem", ("exc_value",)),
    ("interpreter_frame", _AS_314["interpreter_frame"]),
    ("code_object", _AS_314["code_object"]),
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags", "tp_basicsize", "tp_dictoffset")),
    ("heap_type_object", ("size", "ht_cached_keys")),
    *((g, _AS_314[g]) for g in ("tuple_object", "list_object", "set_object", "dict_object")),
    *((g, _AS_314[g]) for g in ("float_object", "long_object", "bytes_object")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size", "compactunicodeobject_size")),
)


@dataclass(frozen=True)
class DebugExtras:
    """What a minor version's debug offsets do not say."""

    fields: tuple[tuple[str, tuple[str, ...]], ...]
    skip_owners: frozenset[int]
    tag_mask: int
    # sizeof(PyCompactUnicodeObject) - sizeof(PyASCIIObject): utf8_length and utf8.
    compact_extra: int = 16


DEBUG: dict[tuple[int, int], DebugExtras] = {
    # FRAME_OWNED_BY_CSTACK = 3 (shim frames).
    (3, 13): DebugExtras(_DEBUG_313, frozenset({3}), 0),
    # FRAME_OWNED_BY_INTERPRETER = 3, FRAME_OWNED_BY_CSTACK = 4; f_executable is a
    # _PyStackRef whose low two bits are tags.
    (3, 14): DebugExtras(_DEBUG_314, frozenset({3, 4}), 0b11),
    # FRAME_OWNED_BY_INTERPRETER = 3 (3.15 has no FRAME_OWNED_BY_CSTACK); tags as 3.14.
    (3, 15): DebugExtras(_DEBUG_315, frozenset({3}), 0b11),
}

# Bytes of _Py_DebugOffsets the reader reads: the largest layout above, with room.
DEBUG_OFFSETS_BYTES = 16 + 8 * 128


def debug_field_offsets(extras: DebugExtras) -> dict[str, int]:
    """'group.field' → byte offset inside _Py_DebugOffsets."""
    out: dict[str, int] = {}
    at = 16  # cookie, version
    for group, names in extras.fields:
        for name in names:
            out[f"{group}.{name}" if group else name] = at
            at += 8
    return out


def layout_from_debug(values: dict[str, int], extras: DebugExtras) -> Layout:
    """A Layout from the debug offsets read out of a target ('group.field' → value)."""
    v = values
    return Layout(
        runtime_interpreters_head=v["runtime_state.interpreters_head"],
        interp_next=v["interpreter_state.next"],
        interp_threads_head=v["interpreter_state.threads_head"],
        tstate_next=v["thread_state.next"],
        tstate_current_frame=v["thread_state.current_frame"],
        cframe_current_frame=None,
        tstate_native_thread_id=v["thread_state.native_thread_id"],
        tstate_thread_id=v["thread_state.thread_id"],
        frame_previous=v["interpreter_frame.previous"],
        frame_executable=v["interpreter_frame.executable"],
        frame_instr_ptr=v["interpreter_frame.instr_ptr"],
        frame_owner=v["interpreter_frame.owner"],
        frame_is_entry=None,
        code_filename=v["code_object.filename"],
        code_name=v["code_object.name"],
        code_qualname=v["code_object.qualname"],
        code_linetable=v["code_object.linetable"],
        code_firstlineno=v["code_object.firstlineno"],
        code_adaptive=v["code_object.co_code_adaptive"],
        ob_type=v["pyobject.ob_type"],
        type_name=v["type_object.tp_name"],
        unicode_state=v["unicode_object.state"],
        unicode_length=v["unicode_object.length"],
        unicode_ascii_size=v["unicode_object.asciiobject_size"],
        unicode_compact_size=v.get(
            "unicode_object.compactunicodeobject_size", v["unicode_object.asciiobject_size"] + extras.compact_extra
        ),
        bytes_size=v["bytes_object.ob_size"],
        bytes_data=v["bytes_object.ob_sval"],
        skip_owners=extras.skip_owners,
        tag_mask=extras.tag_mask,
    )


def wire_layout(layout: Layout) -> PythonLayout:
    """The offsets of `layout` the walk in BPF reads (bpf/python.h, collector/pywalk.py), as the wire carries
    them to the collector: every PythonLayout field is the Layout field of its name."""
    return PythonLayout(**{f.name: getattr(layout, f.name) for f in fields(PythonLayout)})
