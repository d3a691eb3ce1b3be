"""The /proc sweep that finds processes which never run (collector/discovery.py), on a /proc of real files.

Given a directory laid out as /proc (a stat, status and cgroup file and an exe link per pid),
when sweeps run, then a pid is read once it was in two listings in a row, once in its life (again
only after it left the listing), never when already announced, at most MAX_READS_PER_SWEEP a sweep,
and a pid gone between the listing and the read is counted, not returned.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from collector.discovery import MAX_READS_PER_SWEEP, ProcessSweep


def add_process(proc: Path, pid: int, exe: str = "/usr/bin/php8.2") -> None:
    d = proc / str(pid)
    d.mkdir()
    (d / "stat").write_bytes(f"{pid} (php) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 {1000 + pid} 20".encode())
    (d / "status").write_bytes(f"Uid:\t33\t33\t33\t33\nNSpid:\t{pid}\n".encode())
    (d / "cgroup").write_bytes(b"0::/system.slice/php-fpm.service\n")
    (d / "exe").symlink_to(exe)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sweeper(proc: Path) -> tuple[ProcessSweep, Clock]:
    clock = Clock()
    return ProcessSweep(with_cmdline=False, proc=str(proc), every_s=5.0, clock=clock), clock


def test_a_process_is_read_once_it_was_listed_twice_and_only_once(tmp_path: Path) -> None:
    add_process(tmp_path, 100)
    sweep, clock = sweeper(tmp_path)
    assert sweep.due()
    assert sweep.run() == []  # listed once: a short-lived process is never read
    assert not sweep.due()
    clock.now = 5.0
    assert sweep.due()
    found = sweep.run()
    assert [(p.pid, p.executable, p.start_ticks, p.uid) for p in found] == [(100, "/usr/bin/php8.2", 1100, 33)]
    clock.now = 10.0
    assert sweep.run() == []  # read already
    assert sweep.stats == {"sweeps": 3, "read": 1, "gone": 0, "deferred": 0}


def test_a_pid_that_left_the_listing_is_new_when_it_comes_back(tmp_path: Path) -> None:
    add_process(tmp_path, 100)
    sweep, _ = sweeper(tmp_path)
    sweep.run()
    assert [p.pid for p in sweep.run()] == [100]
    shutil.rmtree(tmp_path / "100")
    assert sweep.run() == []
    add_process(tmp_path, 100, exe="/usr/bin/python3.13")  # the pid reused
    assert sweep.run() == []  # listed once
    assert [p.executable for p in sweep.run()] == ["/usr/bin/python3.13"]


def test_announced_processes_are_not_read(tmp_path: Path) -> None:
    for pid in (100, 101):
        add_process(tmp_path, pid)
    sweep, _ = sweeper(tmp_path)
    sweep.run()
    assert [p.pid for p in sweep.run(known=lambda pid: pid == 100)] == [101]
    assert sweep.stats["read"] == 1


def test_reads_per_sweep_are_capped_and_the_rest_read_at_the_next(tmp_path: Path) -> None:
    many = MAX_READS_PER_SWEEP + 36
    for pid in range(1000, 1000 + many):
        add_process(tmp_path, pid)
    sweep, _ = sweeper(tmp_path)
    sweep.run()
    first = sweep.run()
    second = sweep.run()
    assert len(first) == MAX_READS_PER_SWEEP and len(second) == 36
    assert {p.pid for p in first + second} == set(range(1000, 1000 + many))
    assert sweep.stats["deferred"] == 36


def test_a_process_gone_before_its_read_is_counted_not_returned(tmp_path: Path) -> None:
    add_process(tmp_path, 100)
    (tmp_path / "100" / "stat").unlink()  # listed, but its files are gone (it exited meanwhile)
    sweep, _ = sweeper(tmp_path)
    sweep.run()
    assert sweep.run() == []
    assert sweep.stats["gone"] == 1


def test_kernel_threads_and_non_pid_entries_are_harmless(tmp_path: Path) -> None:
    add_process(tmp_path, 2)
    (tmp_path / "2" / "exe").unlink()  # a kernel thread has no executable
    (tmp_path / "self").mkdir()
    (tmp_path / "sys").mkdir()
    sweep, _ = sweeper(tmp_path)
    sweep.run()
    found = sweep.run()
    assert [(p.pid, p.executable) for p in found] == [(2, "")]  # the announcer skips it (no executable)
