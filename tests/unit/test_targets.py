"""Alloc and lock targets: which processes a target spec names, and the /proc scan that follows them.

The /proc trees here are recorded shapes (stat, cgroup, an exe link) written
to a temporary directory; the matching and the scan read them as they would
read the host's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ebpfprofiler.collector.alloc import exp_quantiles
from ebpfprofiler.collector.targets import TargetWatcher

CONTAINER = "3f5e0c1b2a4d6e8f" + "0" * 48
CGROUP_V2 = f"0::/system.slice/docker-{CONTAINER}.scope\n"


def add_proc(root: Path, pid: int, exe: str, comm: str, start: int = 1000, cgroup: str = "0::/user.slice\n") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 20
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (d / "cgroup").write_text(cgroup)
    if (d / "exe").is_symlink():
        (d / "exe").unlink()
    os.symlink(exe, d / "exe")


def remove_proc(root: Path, pid: int) -> None:
    d = root / str(pid)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def test_specs_match_name_path_container_and_cgroup(tmp_path: Path) -> None:
    # given processes of every kind of identity
    add_proc(tmp_path, 10, "/usr/bin/myapp", "myapp")
    add_proc(tmp_path, 11, "/opt/other/bin/server", "server")
    add_proc(tmp_path, 12, "/usr/bin/python3.11", "python3", cgroup=CGROUP_V2)
    add_proc(tmp_path, 13, "/usr/bin/nginx", "nginx", cgroup="0::/system.slice/nginx.service/worker\n")
    add_proc(tmp_path, 14, "/usr/bin/bash", "bash")
    cases = {
        "myapp": {10},                              # the executable's file name
        "/opt/other/bin/server": {11},              # its path, exactly
        "/usr/bin/server": set(),                   # another path with the same name is not it
        CONTAINER[:12]: {12},                       # a prefix of the container id
        "cgroup:/system.slice/nginx.service": {13},   # the cgroup or one under it
        "cgroup:/system.slice/nginx": set(),          # not a path prefix of a cgroup name
        "python3": {12},                            # the process name (comm) too
    }
    for spec, want in cases.items():
        # when a watcher with only that spec scans, then exactly those processes appear
        appeared, gone = TargetWatcher([spec], proc=str(tmp_path), self_pid=1).scan()
        assert {t.pid for t in appeared} == want, spec
        assert gone == []


def test_targets_appear_once_and_go_on_exit_exec_and_pid_reuse(tmp_path: Path) -> None:
    w = TargetWatcher(["myapp"], proc=str(tmp_path), self_pid=1)
    # given a target and a process that is not one
    add_proc(tmp_path, 20, "/usr/bin/myapp", "myapp", start=100)
    add_proc(tmp_path, 21, "/usr/bin/python3.11", "python3")
    assert [t.pid for t in w.scan()[0]] == [20]
    # when nothing changes, nothing is reported again
    assert w.scan() == ([], [])
    # when the other process execs into the target, it appears
    add_proc(tmp_path, 21, "/usr/bin/myapp", "myapp")
    appeared, gone = w.scan()
    assert [t.pid for t in appeared] == [21] and gone == []
    # when a target execs into something else, it is gone
    add_proc(tmp_path, 21, "/usr/bin/bash", "bash")
    appeared, gone = w.scan()
    assert appeared == [] and [t.pid for t in gone] == [21]
    # when a target exits and its pid is reused by another of the same executable, one goes, one comes
    add_proc(tmp_path, 20, "/usr/bin/myapp", "myapp", start=200)
    appeared, gone = w.scan()
    assert [(t.pid, t.start_ticks) for t in gone] == [(20, 100)]
    assert [(t.pid, t.start_ticks) for t in appeared] == [(20, 200)]
    # when it exits, it is gone
    remove_proc(tmp_path, 20)
    appeared, gone = w.scan()
    assert appeared == [] and [t.pid for t in gone] == [20]


def test_no_specs_scan_nothing(tmp_path: Path) -> None:
    add_proc(tmp_path, 30, "/usr/bin/myapp", "myapp")
    assert TargetWatcher([], proc=str(tmp_path)).scan() == ([], [])


def test_sampling_gaps_average_the_configured_bytes() -> None:
    # The gaps between sample points are drawn from these quantiles (16.16 fixed point): their mean
    # must be exactly 1, or every estimate of bytes and objects is off by the same factor.
    q = exp_quantiles()
    assert len(q) == 256 and all(v > 0 for v in q)
    assert abs(sum(q) / len(q) / 65536 - 1) < 1e-4
    # and they are exponential: the median is ln 2 of the mean
    assert abs(sorted(q)[128] / 65536 - math.log(2)) < 0.02
