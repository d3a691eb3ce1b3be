"""The size of the code's units: functions over 60 lines and classes over 300, by file.

Run as `python -m tests.code_shape` for the figures; tests/unit/test_code_shape.py holds the
limits. A unit is measured from its `def`/`class` line to its last line, decorators excluded.

Owns: the measuring. Must not: decide which units may stay long (the test's list does).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What is measured: every package of ours, tests and benchmarks included.
PACKAGES = ("cli", "collector", "symbolizer", "uploader", "receiver", "runtimes", "shared", "report", "bench", "tests")
# Programs the tests run as they are written, and vendored code.
SKIPPED_PARTS = frozenset({"workloads", "fixtures", "vendor"})
FUNCTION_MAX_LINES = 60
CLASS_MAX_LINES = 300


def python_files() -> Iterator[Path]:
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if not SKIPPED_PARTS & set(path.relative_to(ROOT).parts):
                yield path


def units() -> Iterator[tuple[str, str, int]]:
    """(kind, "path:qualified.name", lines) for every function and class."""
    for path in python_files():
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT).as_posix()

        def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str, int]]:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    name = f"{prefix}{child.name}"
                    yield kind, f"{rel}:{name}", (child.end_lineno or child.lineno) - child.lineno + 1
                    yield from walk(child, name + ".")
                else:
                    yield from walk(child, prefix)

        yield from walk(tree, "")


def over_limits() -> tuple[dict[str, int], dict[str, int]]:
    """The functions over FUNCTION_MAX_LINES and the classes over CLASS_MAX_LINES, with their lengths."""
    functions, classes = {}, {}
    for kind, name, lines in units():
        if kind == "function" and lines > FUNCTION_MAX_LINES:
            functions[name] = lines
        elif kind == "class" and lines > CLASS_MAX_LINES:
            classes[name] = lines
    return functions, classes


def main() -> int:
    functions, classes = over_limits()
    print(
        f"functions over {FUNCTION_MAX_LINES} lines: {len(functions)}; classes over {CLASS_MAX_LINES}: {len(classes)}"
    )
    for name, lines in sorted({**functions, **classes}.items(), key=lambda kv: -kv[1]):
        print(f"  {lines:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
