"""The size limits of docs/development.md: no function over 60 lines, no class over 300.

tests/code_shape.py measures (from a `def`/`class` line to its last line, over every package of
ours, tests and benchmarks included); `python -m tests.code_shape` prints what is over.
"""

from __future__ import annotations

from tests.code_shape import CLASS_MAX_LINES, FUNCTION_MAX_LINES, over_limits


def test_no_function_or_class_over_its_limit() -> None:
    functions, classes = over_limits()
    assert functions == {}, f"functions over {FUNCTION_MAX_LINES} lines: {functions}"
    assert classes == {}, f"classes over {CLASS_MAX_LINES} lines: {classes}"
