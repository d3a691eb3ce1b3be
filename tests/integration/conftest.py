"""Fixtures of the integration tests only (tests/conftest.py has those every test shares).

Owns: module_started, the module-scoped counterpart of tests/conftest.py's `started`: the
processes a module-scoped fixture starts are ended when the module's tests are done, also when
the fixture or a test failed, without a `finally` of the fixture's own.

Must not: start processes itself, or end them any other way than harness.kill_and_reap (by
their own pids).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

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
