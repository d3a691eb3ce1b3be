"""The checks that keep the code as the reviewers left it: ruff on the whole tree, mypy on the stages.

Both run with the configuration in pyproject.toml ([tool.ruff], [tool.mypy]) and fail on any
finding, so `make test` fails on a new one. mypy needs the import names the installed package
has (collector is collector/): it is run on a tree of links named so, made in a
temporary directory; its cache stays in the checkout's .venv (which `make clean` removes and no copy
of the checkout takes along), so a second run is quick.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.harness import ROOT

# The packages mypy checks (setup.cfg's package_dir: ebpfprofiler.<name> is <name>/).
TYPED_PACKAGES = ("shared", "collector", "symbolizer", "uploader", "runtimes")
# Each checker's own time limit: a cold mypy run takes ~15 s on a loaded 2-CPU host.
CHECK_TIMEOUT_S = 300


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(sys.executable), name)


def test_ruff_finds_nothing() -> None:
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert r.returncode == 0, f"ruff check:\n{r.stdout}{r.stderr}"


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    tree = tmp_path / "ebpfprofiler"
    tree.mkdir()
    for name in TYPED_PACKAGES:
        (tree / name).symlink_to(Path(ROOT) / name, target_is_directory=True)
    args = [sys.executable, "-m", "mypy", "--config-file", str(Path(ROOT) / "pyproject.toml"),
            "--cache-dir", str(Path(ROOT) / ".venv" / "mypy-cache")]
    for name in TYPED_PACKAGES:
        args += ["-p", f"ebpfprofiler.{name}"]
    r = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert r.returncode == 0, f"mypy:\n{r.stdout}{r.stderr}"
