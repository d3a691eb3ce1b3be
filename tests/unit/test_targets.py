"""Alloc and lock targets: which processes a target spec names, and the /proc scan that follows them.

The /proc trees here are recorded shapes (stat, cgroup, an exe link) written
to a temporary directory; the matching and the scan read them as they would
read the host's. The sampling arithmetic of allocation profiling (bursts,
scale, first countdowns, frees the bursts could not see) is checked here too.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest

from collector.alloc import BurstPlan, SampledTime, exp_quantiles, first_countdowns, survivors_to_forget
from collector.targets import TargetWatcher
from shared.config import DEFAULT_ALLOC_DUTY_PCT, DEFAULT_ALLOC_SAMPLE_BYTES

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
        "myapp": {10},  # the executable's file name
        "/opt/other/bin/server": {11},  # its path, exactly
        "/usr/bin/server": set(),  # another path with the same name is not it
        CONTAINER[:12]: {12},  # a prefix of the container id
        "cgroup:/system.slice/nginx.service": {13},  # the cgroup or one under it
        "cgroup:/system.slice/nginx": set(),  # not a path prefix of a cgroup name
        "python3": {12},  # the process name (comm) too
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


def test_bursts_at_the_defaults_sample_a_sixty_seventh_of_the_time_and_scale_it_back() -> None:
    plan = BurstPlan(DEFAULT_ALLOC_DUTY_PCT)
    # 3% of each second attached: 15 ms sampling, then a 15-ms tail
    assert plan.attached_s == pytest.approx(0.03) and plan.sampling_s == pytest.approx(0.015)
    assert plan.scale == 67 and plan.seen_free_share == pytest.approx(0.03)
    # one sample per 64 KiB overall: one per ~1 KiB while sampling, each standing for 67 times its bytes
    assert plan.in_burst_sample_bytes(DEFAULT_ALLOC_SAMPLE_BYTES) * plan.scale == pytest.approx(
        DEFAULT_ALLOC_SAMPLE_BYTES, rel=1e-3
    )
    assert plan.in_burst_sample_bytes(0) == 0
    # every phase keeps the burst inside its period
    rng = random.Random(1)
    assert all(0 <= plan.phase(rng) <= plan.period_s - plan.attached_s for _ in range(1000))
    always = BurstPlan(100)
    assert always.always and always.scale == 1 and always.in_burst_sample_bytes(4096) == 4096


def test_a_sample_stands_for_the_time_profiled_over_the_time_sampled_as_it_was() -> None:
    # given a clock the test moves, and a target attached at t=0
    now = [0.0]
    t = SampledTime(clock=lambda: now[0])
    t.set("profiled", True)
    # when, in a 10-s drain, bursts sample 25 ms each but only 6 of them run (a loaded host: late)
    for start in (0.5, 2.1, 3.9, 5.2, 7.7, 9.3):
        now[0] = start
        t.set("sampled", True)
        now[0] = start + 0.025
        t.set("sampled", False)
    now[0] = 10.0
    profiled, sampled = t.take()
    # then a sample stands for 10 s / 0.15 s, not the plan's 40
    assert (profiled, round(sampled, 9)) == (10.0, 0.15)
    assert SampledTime.scale(profiled, sampled, 40) == pytest.approx(10 / 0.15)
    # given a pause from 12 to 18 s and a sampling phase in progress at the next drain (20 s)
    now[0] = 12.0
    t.set("profiled", False)
    now[0] = 18.0
    t.set("profiled", True)
    now[0] = 19.99
    t.set("sampled", True)
    now[0] = 20.0
    # then the pause is not profiled time, and the phase is counted up to the drain, the rest to the next
    profiled, sampled = t.take()
    assert (round(profiled, 9), round(sampled, 9)) == (4.0, 0.01)
    now[0] = 20.015
    t.set("sampled", False)
    assert [round(x, 9) for x in t.take()] == [0.015, 0.015]
    assert round(t.total["profiled"], 9) == 14.015 and round(t.total["sampled"], 9) == 0.175
    # and a drain with nothing sampled takes the plan's scale
    assert SampledTime.scale(4.0, 0.0, 40) == 40


def test_the_first_countdown_of_each_cpu_is_a_draw_not_zero() -> None:
    # A countdown of 0 samples every CPU's first allocation (a 32-byte one stands for 64 KiB).
    first = first_countdowns(64, 1638, random.Random(2))
    assert len(first) == 64 and all(v >= 1 for v in first)
    assert len(set(first)) > 20 and 0.6 < sum(first) / len(first) / 1638 < 1.4


def test_each_seen_survivor_free_stands_for_the_unseen_ones() -> None:
    # Probes on 5% of the time: a free of a long-lived allocation is seen 1 time in 20, so each one
    # seen stands for 19 that went unseen; fractions carry over.
    n, debt = survivors_to_forget(0.0, 1, 0.05)
    assert n == 19 and debt == pytest.approx(0.0, abs=1e-9)
    n, debt = survivors_to_forget(0.0, 1, 0.3)  # 2.33 each
    assert n == 2 and debt == pytest.approx(1 / 3, abs=1e-9)
    n, debt = survivors_to_forget(debt, 2, 0.3)
    assert n == 5 and debt == pytest.approx(0.0, abs=1e-9)
    assert survivors_to_forget(0.0, 5, 1.0) == (0, 0.0)  # always attached: every free is seen
