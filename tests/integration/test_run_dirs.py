"""`ebpfprofiler run`'s directories: never made, chowned or chmodded through a symlink.

Given a directory of another user (nobody's, 0700) and a symlink to it, when
`ebpfprofiler run --run-dir <symlink>` starts as root, then it refuses in
seconds, naming the symlink, before any stage starts, and the directory's
owner, mode and content are as they were.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared import config as config_mod
from tests.harness import PY, open_dir, require_root, write_config

REFUSAL_S = 10.0  # config load and directory checks: well under a second; the stages' start is seconds


@pytest.fixture
def reachable() -> Iterator[Path]:
    require_root()
    path = open_dir("run-dirs")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_run_with_a_run_dir_symlinked_to_another_users_directory_refuses_and_changes_nothing(reachable: Path) -> None:
    nobodys = reachable / "nobodys"
    nobodys.mkdir()
    os.chown(nobodys, pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid)
    nobodys.chmod(0o700)
    link = reachable / "run"
    link.symlink_to(nobodys)
    config = write_config(
        reachable / "agent.yaml", config_mod.ProfilerConfig(endpoint="", local_dir=str(reachable / "profiles"))
    )
    before = nobodys.lstat()
    started = time.monotonic()
    r = subprocess.run(
        [
            PY,
            "-m",
            "cli.main",
            "run",
            "--config",
            str(config),
            "--run-dir",
            str(link),
            "--state-dir",
            str(reachable / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - started < REFUSAL_S, r.stdout + r.stderr
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{link} is a symbolic link" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "profiles go to" not in r.stdout, r.stdout  # printed once the stages are about to start
    after = nobodys.lstat()
    assert (after.st_uid, after.st_gid, stat.S_IMODE(after.st_mode)) == (
        before.st_uid,
        before.st_gid,
        stat.S_IMODE(before.st_mode),
    )
    assert list(nobodys.iterdir()) == [] and link.is_symlink()
    assert not (reachable / "state").exists() and not (reachable / "profiles").exists()
