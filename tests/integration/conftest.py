"""Fixtures of the integration tests only (tests/conftest.py has those every test shares).

Owns: module_started, the module-scoped counterpart of tests/conftest.py's `started`: the
processes a module-scoped fixture starts are ended when the module's tests are done, also when
the fixture or a test failed, without a `finally` of the fixture's own; ratio_workload, the 3:1
workload the report tests record.

Must not: start processes itself, or end them any other way than harness.kill_and_reap (by
their own pids).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness import kill_and_reap


@pytest.fixture(scope="module")
def module_started() -> Iterator[list[subprocess.Popen]]:
    """Processes the module's fixtures start (they append them); each is killed by pid and reaped
    at the module's end."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        kill_and_reap(procs)


@pytest.fixture
def ratio_workload(build: Callable[..., Path], started: list[subprocess.Popen]) -> subprocess.Popen[bytes]:
    """tests/workloads/ratio.c (main → work → heavy takes 3x main → work → light), running for 600 s at
    most; ended with the test."""
    p = subprocess.Popen([str(build("ratio")), "600"], stdout=subprocess.DEVNULL)
    started.append(p)
    return p
