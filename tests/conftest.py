"""Fixtures shared by unit and integration tests (helpers live in tests/harness.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.harness import FRAME_POINTER_FLAGS, WORKLOADS, Receiver


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """build(name, flags=FRAME_POINTER_FLAGS) compiles tests/workloads/<name>.c once per session."""
    out = tmp_path_factory.mktemp("workloads")
    built: dict[tuple[str, tuple[str, ...]], Path] = {}

    def _build(name: str, flags: list[str] | None = None) -> Path:
        flags = FRAME_POINTER_FLAGS if flags is None else flags
        key = (name, tuple(flags))
        if key not in built:
            exe = out / f"{name}-{len(built)}"
            subprocess.run(["gcc", *flags, "-o", str(exe), str(WORKLOADS / f"{name}.c"), "-lpthread"],
                           check=True)
            built[key] = exe
        return built[key]

    return _build


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(tmp_path / "received")
    try:
        yield r
    finally:
        r.stop()
