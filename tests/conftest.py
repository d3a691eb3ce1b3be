"""Fixtures shared by unit and integration tests (helpers live in tests/harness.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared import privileges, stage_code
from shared.config import ProfilerConfig
from shared.stage_code import default_bpf_dir
from tests.harness import (
    FRAME_POINTER_FLAGS,
    WORKLOADS,
    Pipeline,
    Receiver,
    UploaderProcess,
    kill_and_reap,
    launch_uploader,
    open_dir,
)

_code_view: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Stages that tests start as root import their code from where their users can read it
    (shared/stage_code.py): a checkout under a 0700 directory works as one anywhere else."""
    if os.geteuid() != 0:
        return
    try:
        gid = privileges.ids("uploader")[1]
    except privileges.PrivilegeError:
        return  # no agent users: the tests that need them say so
    parent = tempfile.mkdtemp(prefix="ebpfprofiler-test-code-", dir="/tmp")
    os.chown(parent, 0, gid)
    os.chmod(parent, 0o750)
    _code_view.append(parent)
    code = stage_code.prepare(os.path.join(parent, "view"), default_bpf_dir())
    os.environ.update({k: v for k, v in code.env().items() if k == "PYTHONPATH"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An ordinary user's run (`make unit` in a dev venv) leaves out the tests marked needs_root,
    and says how many: they run in `make test`, as root, where nothing is left out."""
    if os.geteuid() == 0:
        return
    kept = [item for item in items if item.get_closest_marker("needs_root") is None]
    left = [item for item in items if item.get_closest_marker("needs_root") is not None]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"{len(left)} tests need root and the agent's set-up: `make test` runs them")


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _code_view:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts (it appends them); each is killed by pid and reaped at the end."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        kill_and_reap(procs)


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
            subprocess.run(["gcc", *flags, "-o", str(exe), str(WORKLOADS / f"{name}.c"), "-lpthread"], check=True)
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


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Config, runtime and state directories of the processes a test starts (see harness.open_dir)."""
    path = open_dir("test")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def procs() -> Iterator[list]:
    """Uploaders, receivers and pipelines a test starts; each is ended by pid at the end
    (an uploader the test froze with SIGSTOP is let go on first)."""
    started: list = []
    try:
        yield started
    finally:
        for p in reversed(started):
            if isinstance(p, UploaderProcess):
                if p.proc.poll() is None:
                    os.kill(p.proc.pid, signal.SIGCONT)
                p.kill()
            elif isinstance(p, (Receiver, Pipeline)):
                p.stop()


@pytest.fixture
def start_uploader(workdir: Path, procs: list) -> Callable[..., UploaderProcess]:
    """start_uploader(cfg, env=..., state_dir=...): an uploader process in `workdir`, killed by pid at the end."""

    def start(cfg: ProfilerConfig, **kwargs: Any) -> UploaderProcess:
        u = launch_uploader(workdir, cfg, **kwargs)
        procs.append(u)
        return u

    return start
