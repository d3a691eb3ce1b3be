"""What the v8dbg_ symbols of a Node.js binary say, as the reader uses it.

Owns: V8Info (frame slots, object fields, instance types and tags, from
the v8dbg_ values detect read from the file), built by `from_values`, which
names the first needed symbol a file lacks (KeyError); `check`, which names
a value no V8 has (a crafted file's).

Must not: read process memory, or log.
"""

from __future__ import annotations

from dataclasses import dataclass

# What v8dbg_ values can be: frame slots within a few words of fp, object fields within an object's
# first KiB, ScopeInfo indices within its header (V8 11 to 14: 1 to 5).
MAX_FRAME_SLOT = 256
MAX_FIELD_OFFSET = 1024
MAX_SCOPE_INDEX = 16


def _field(values: dict[str, int], cls: str, name: str) -> int:
    key = f"class_{cls}__{name}__"
    for k, v in values.items():
        if k.startswith(key):
            return v
    raise KeyError(key + "*")


def _type(values: dict[str, int], cls: str) -> int:
    key = f"type_{cls}__"
    for k, v in values.items():
        if k.startswith(key):
            return v
    raise KeyError(key + "*")


@dataclass(frozen=True)
class V8Info:
    """What the v8dbg_ symbols say, as the reader uses it."""

    off_function: int
    off_context: int
    off_bytecode_array: int
    off_bytecode_offset: int
    ft_entry: frozenset[int]
    ft_exit: int
    ft_builtin_exit: int
    map_instance_type: int
    js_function_types: tuple[int, int]
    t_sfi: int
    t_script: int
    t_scope_info: int
    t_bytecode_array: int
    t_fixed_array: int | None
    first_nonstring: int
    str_encoding_mask: int
    str_one_byte: int
    str_repr_mask: int
    str_cons: int
    str_sliced: int
    str_thin: int
    str_length: int
    seq_chars: int
    cons_first: int
    cons_second: int
    sliced_parent: int
    sliced_offset: int
    thin_actual: int
    fn_shared: int
    fn_code: int | None
    sfi_name: int
    sfi_script: int
    script_name: int
    script_source: int
    script_line_ends: int
    fixed_length: int
    fixed_data: int
    scope_first_vars: int
    scope_ncontextlocals: int
    code_flags: int | None
    code_kind_mask: int
    code_kind_baseline: int

    def check(self) -> str | None:
        """What is implausible about these values (a crafted file's), or None."""
        for name in ("off_function", "off_context", "off_bytecode_array", "off_bytecode_offset"):
            if not -MAX_FRAME_SLOT <= getattr(self, name) <= MAX_FRAME_SLOT or getattr(self, name) % 8:
                return f"frame slot {name} {getattr(self, name)}"
        for name in (
            "map_instance_type",
            "str_length",
            "seq_chars",
            "cons_first",
            "cons_second",
            "sliced_parent",
            "sliced_offset",
            "thin_actual",
            "fn_shared",
            "sfi_name",
            "sfi_script",
            "script_name",
            "script_source",
            "script_line_ends",
            "fixed_length",
            "fixed_data",
            "fn_code",
            "code_flags",
        ):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_FIELD_OFFSET:
                return f"field offset {name} {value}"
        if not 0 < self.scope_ncontextlocals < self.scope_first_vars <= MAX_SCOPE_INDEX:
            return f"ScopeInfo indices {self.scope_ncontextlocals}, {self.scope_first_vars}"
        return None

    @classmethod
    def from_values(cls, v: dict[str, int]) -> V8Info:
        def opt(c: str, n: str) -> int | None:
            try:
                return _field(v, c, n)
            except KeyError:
                return None

        jsf = _type(v, "JSFunction")
        sfi_script = opt("SharedFunctionInfo", "script_or_debug_info")
        if sfi_script is None:
            sfi_script = _field(v, "SharedFunctionInfo", "script")
        return cls(
            off_function=v["off_fp_function"],
            off_context=v["off_fp_context"],
            off_bytecode_array=v["off_fp_bytecode_array"],
            off_bytecode_offset=v["off_fp_bytecode_offset"],
            ft_entry=frozenset((v["frametype_EntryFrame"], v["frametype_ConstructEntryFrame"])),
            ft_exit=v["frametype_ExitFrame"],
            ft_builtin_exit=v["frametype_BuiltinExitFrame"],
            map_instance_type=_field(v, "Map", "instance_type"),
            js_function_types=(v.get("FirstJSFunctionType", jsf), v.get("LastJSFunctionType", jsf)),
            t_sfi=_type(v, "SharedFunctionInfo"),
            t_script=_type(v, "Script"),
            t_scope_info=_type(v, "ScopeInfo"),
            t_bytecode_array=_type(v, "BytecodeArray"),
            t_fixed_array=v.get("type_FixedArray__FIXED_ARRAY_TYPE"),
            first_nonstring=v["FirstNonstringType"],
            str_encoding_mask=v["StringEncodingMask"],
            str_one_byte=v["OneByteStringTag"],
            str_repr_mask=v["StringRepresentationMask"],
            str_cons=v["ConsStringTag"],
            str_sliced=v["SlicedStringTag"],
            str_thin=v["ThinStringTag"],
            str_length=_field(v, "String", "length"),
            seq_chars=_field(v, "SeqOneByteString", "chars"),
            cons_first=_field(v, "ConsString", "first"),
            cons_second=_field(v, "ConsString", "second"),
            sliced_parent=_field(v, "SlicedString", "parent"),
            sliced_offset=_field(v, "SlicedString", "offset"),
            thin_actual=_field(v, "ThinString", "actual"),
            fn_shared=_field(v, "JSFunction", "shared"),
            fn_code=opt("JSFunction", "code"),
            sfi_name=_field(v, "SharedFunctionInfo", "name_or_scope_info"),
            sfi_script=sfi_script,
            script_name=_field(v, "Script", "name"),
            script_source=_field(v, "Script", "source"),
            script_line_ends=_field(v, "Script", "line_ends"),
            fixed_length=_field(v, "FixedArrayBase", "length"),
            fixed_data=_field(v, "FixedArray", "data"),
            scope_first_vars=v["scopeinfo_idx_first_vars"],
            scope_ncontextlocals=v["scopeinfo_idx_ncontextlocals"],
            code_flags=opt("Code", "flags"),
            code_kind_mask=v["CodeKindFieldMask"],
            code_kind_baseline=v["CodeKindBaseline"],
        )
