"""One process per stage per run directory (shared/runlock.py): the second refuses, naming the first's pid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared import runlock

HOLD = (
    "import sys; from shared import runlock; runlock.hold(sys.argv[1], 'collector'); "
    "print('held', flush=True); sys.stdin.read()"
)


def test_second_holder_refuses_with_the_pid_of_the_first_and_a_crash_frees_it(tmp_path: Path) -> None:
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None and first.stdout.readline() == "held\n"
        second = subprocess.run(
            [sys.executable, "-c", HOLD, str(tmp_path)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode != 0
        assert f"collector is already running on {tmp_path} (pid {first.pid})" in second.stderr
    finally:
        first.kill()  # a crash: nothing is released by hand
        first.wait()
    again = subprocess.run(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert again.returncode == 0 and again.stdout == "held\n", again.stderr


def test_a_symlinked_lock_file_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    (tmp_path / "collector.lock").symlink_to(target)
    with pytest.raises(OSError):
        runlock.hold(str(tmp_path), "collector")
    assert not target.exists()
