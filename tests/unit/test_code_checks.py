"""The checks that keep the code as the reviewers left it, run on the checkout as it is.

`make lint` runs the same tools (ruff check, ruff format --check, mypy) from the command line;
here they run inside `make test` and `make unit` too, with the configuration in pyproject.toml.
Each fails on any finding, so a new one fails the suite. No link tree and no install is needed:
every top-level folder is the package it names (docs/architecture.md, "Packages and imports").

The layering check reads ruff's own import graph (`ruff analyze graph`), so it sees what an editor
sees: a module of one layer may import only from its own package and the layers below it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.harness import ROOT

# Each checker's own time limit: a cold mypy run of the whole tree takes ~40 s on a loaded 2-CPU host.
CHECK_TIMEOUT_S = 300

# What each top-level package may import besides itself (docs/architecture.md, "Layers").
# shared is the bottom; the stages sit on it side by side and never import each other; cli
# starts them; bench measures them all; tests may use anything, bench's harness included.
STAGES = ("collector", "symbolizer", "uploader", "runtimes", "report", "receiver")
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "shared": frozenset(),
    **{stage: frozenset({"shared"}) for stage in STAGES},
    "cli": frozenset({"shared", *STAGES}),
    "bench": frozenset({"shared", "cli", *STAGES}),
    "tests": frozenset({"shared", "cli", "bench", *STAGES}),
}
# The packages whose modules must not reach into another module's private names.
SHIPPED = ("shared", "cli", *STAGES)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(sys.executable), name)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)


def test_ruff_finds_nothing() -> None:
    r = _run([_tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."])
    assert r.returncode == 0, f"ruff check:\n{r.stdout}{r.stderr}"


def test_the_tree_is_formatted() -> None:
    r = _run([_tool("ruff"), "format", "--no-cache", "--check", "."])
    assert r.returncode == 0, f"ruff format --check:\n{r.stdout}{r.stderr}"


def test_mypy_finds_nothing() -> None:
    # the cache stays in the checkout's .venv (which `make clean` removes), so a second run is quick
    r = _run([sys.executable, "-m", "mypy", "--cache-dir", str(Path(ROOT) / ".venv" / "mypy-cache")])
    assert r.returncode == 0, f"mypy:\n{r.stdout}{r.stderr}"


def import_graph() -> dict[str, list[str]]:
    """file → the project's files it imports, as ruff resolves them."""
    r = _run([_tool("ruff"), "analyze", "graph", "."])
    assert r.returncode == 0, r.stderr
    graph: dict[str, list[str]] = json.loads(r.stdout)
    return graph


def back_edges(graph: dict[str, list[str]]) -> list[str]:
    """The imports that go against ALLOWED_IMPORTS, as "importer -> imported"."""
    out = []
    for src, deps in sorted(graph.items()):
        layer = src.split("/", 1)[0]
        allowed = ALLOWED_IMPORTS.get(layer)
        if allowed is None:
            continue
        out += [f"{src} -> {dep}" for dep in deps if dep.split("/", 1)[0] not in allowed | {layer}]
    return out


def test_ruff_resolves_the_imports_between_the_stages() -> None:
    # Given ruff's graph of the checkout as it is (no install, no link tree)
    graph = import_graph()
    # Then every stage's imports of shared/ are edges of it, file to file
    assert any(dep == "shared/config.py" for dep in graph["collector/main.py"]), graph["collector/main.py"]
    assert any(dep.startswith("shared/") for dep in graph["runtimes/main.py"]), graph["runtimes/main.py"]
    assert "symbolizer/elf.py" in graph["symbolizer/main.py"] or any(
        d.startswith("symbolizer/") for d in graph["symbolizer/main.py"]
    )


def first_party_imports(path: Path) -> list[tuple[int, str]]:
    """(line, file) of each import in `path` of one of our modules, the file being the one it names."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules: list[tuple[str, str | None]]
        if isinstance(node, ast.Import):
            modules = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in modules:
            if module.split(".", 1)[0] not in ALLOWED_IMPORTS:
                continue
            base = Path(ROOT, *module.split("."))
            candidates = [base / name / "__init__.py", base / f"{name}.py"] if name else []
            candidates += [base.with_suffix(".py"), base / "__init__.py"]
            target = next(c for c in candidates if c.exists())
            out.append((node.lineno, target.relative_to(ROOT).as_posix()))
    return out


def test_ruff_resolves_every_import_of_our_modules_to_its_file() -> None:
    # Given ruff's graph of the checkout as it is, and every import of our own modules read from the source
    graph = import_graph()
    missing = []
    for src in sorted(graph):
        for line, target in first_party_imports(Path(ROOT) / src):
            if target not in graph[src]:
                missing.append(f"{src}:{line} -> {target}")
    # Then each one is an edge of the graph, to the file it names: no link tree, no install needed
    assert missing == []


def test_no_import_goes_against_the_layers() -> None:
    assert back_edges(import_graph()) == []


def test_a_new_back_edge_is_caught() -> None:
    # Given a graph in which shared/ imports a stage and bench/ imports tests/
    graph = {"shared/x.py": ["collector/main.py"], "bench/y.py": ["tests/harness.py"], "cli/z.py": ["shared/x.py"]}
    # Then both are named, and the allowed edge is not
    assert back_edges(graph) == ["bench/y.py -> tests/harness.py", "shared/x.py -> collector/main.py"]


def private_imports() -> list[str]:
    """`from a.b import _name` in a shipped package, where a.b is another first-party module."""
    out = []
    for pkg in SHIPPED:
        for path in sorted((Path(ROOT) / pkg).rglob("*.py")):
            if "vendor" in path.parts:
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or node.module is None or node.level:
                    continue
                if node.module.split(".", 1)[0] not in ALLOWED_IMPORTS:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}")
    return out


def test_no_module_imports_another_modules_private_names() -> None:
    assert private_imports() == []
