"""shared/procstat.py: the one reader of /proc/<pid>/stat's start time."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from shared import procstat


def test_start_ticks_of_a_live_and_of_an_exited_process(started: list[subprocess.Popen]) -> None:
    p = subprocess.Popen(["sleep", "30"])
    started.append(p)
    line = Path(f"/proc/{p.pid}/stat").read_text()
    assert procstat.start_ticks(p.pid) == int(line.rsplit(")", 1)[1].split()[19])
    p.kill()
    p.wait()
    assert procstat.start_ticks(p.pid) is None  # reaped: its pid names nothing (or another process)


def test_a_pid_is_alive_until_its_process_is_reaped_whoever_owns_it(started: list[subprocess.Popen]) -> None:
    p = subprocess.Popen(["sleep", "30"])
    started.append(p)
    assert procstat.alive(p.pid) and procstat.alive(os.getpid())
    assert procstat.alive(1)  # init: another user's process for an unprivileged test, EPERM
    p.kill()
    p.wait()
    assert not procstat.alive(p.pid)  # reaped (a pid reused meanwhile would be alive: the callers know)
    assert not procstat.alive(1 << 40)  # no such pid can exist


def test_a_comm_with_spaces_and_parentheses_does_not_shift_the_fields(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (a) b (c) S " + " ".join(str(n) for n in range(4, 53)) + "\n")
    assert procstat.start_ticks(42, str(tmp_path)) == 22
    assert procstat.parse_stat((tmp_path / "42" / "stat").read_text()) == ("a) b (c", 22)
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text("43 (truncated")
    assert procstat.start_ticks(43, str(tmp_path)) is None
    assert procstat.read_stat(os.getpid()) is not None
