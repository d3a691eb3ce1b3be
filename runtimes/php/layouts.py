"""PHP 8.2 to 8.5 struct offsets, per minor version, as data (x86-64 and arm64, NTS builds).

Owns: what the reader needs of each supported PHP minor version: where
executor_globals keeps current_execute_data, the fields of zend_execute_data
(opline, func, prev_execute_data), of zend_function (type, function_name,
scope; op_array's filename, line_start, line_end), of zend_class_entry
(name), zend_string (type info, len, val) and zend_op (lineno).

Sources: php-src's Zend/zend_globals.h, zend_compile.h and zend_types.h of
each branch; the OTel eBPF profiler's interpreter/php tables for 8.2 to 8.4
(op_array.filename at 152, 144, 168; current_execute_data at 488). 8.5 is
past their tables: its offsets (current_execute_data at 512, filename at 168)
were found on Debian experimental's php8.5 8.5.7 by looking for the
executing frame's pointer in executor_globals and the script's path in its
op_array. 8.2, 8.4 and 8.5 are read end to end by
tests/integration/test_php_stacks.py (bookworm's php8.2-cli, trixie's
php8.4, experimental's php8.5); 8.3 is data only.
The self-check in the reader (every string a zend_string, every line inside
its function's lines) catches a layout that is wrong for a patch release.

Must not: read memory or decide which version a process runs (detect does).
"""

from __future__ import annotations

from dataclasses import dataclass

# zend_string: refcount (u32), type_info (u32), h (u64), len (u64), val[].
STRING_TYPE_INFO = 4
STRING_LEN = 16
STRING_VAL = 24
IS_STRING = 6  # GC type, the low 4 bits of type_info
# zend_function.common.type
INTERNAL_FUNCTION, USER_FUNCTION, EVAL_CODE = 1, 2, 4


@dataclass(frozen=True)
class Layout:
    eg_current_execute_data: int  # in executor_globals
    ex_opline: int  # zend_execute_data
    ex_func: int
    ex_prev: int
    fn_type: int  # zend_function (common part)
    fn_name: int
    fn_scope: int
    fn_filename: int  # op_array.filename; line_start and line_end follow it
    fn_line_start: int
    fn_line_end: int
    ce_name: int  # zend_class_entry.name
    op_lineno: int  # zend_op.lineno

    @property
    def fn_bytes(self) -> int:
        return self.fn_line_end + 4


def _layout(filename: int, current_execute_data: int = 488) -> Layout:
    return Layout(
        eg_current_execute_data=current_execute_data,
        ex_opline=0,
        ex_func=24,
        ex_prev=48,
        fn_type=0,
        fn_name=8,
        fn_scope=16,
        fn_filename=filename,
        fn_line_start=filename + 8,
        fn_line_end=filename + 12,
        ce_name=8,
        op_lineno=24,
    )


LAYOUTS: dict[tuple[int, int], Layout] = {
    (8, 2): _layout(152),
    (8, 3): _layout(144),  # as data only: no 8.3 is packaged where the tests run
    (8, 4): _layout(168),
    (8, 5): _layout(168, 512),  # 8.5 grew executor_globals before current_execute_data
}
