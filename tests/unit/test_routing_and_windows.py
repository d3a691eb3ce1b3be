"""Routing of services to workers, and the windows a worker sums samples into."""

from __future__ import annotations

import os
import subprocess
from collections import Counter

import pytest

from collector.batcher import UNKNOWN_PID, UNKNOWN_SERVICE, build_batches
from collector.bpfmaps import RawDrain
from collector.procfs import ProcessTable
from collector.routing import worker_for
from shared import window as window_mod
from shared.window import Windows

SERVICES = [f"/usr/bin/svc{i}" for i in range(400)]
S = 1_000_000_000


def test_every_service_has_one_worker_and_the_load_is_spread() -> None:
    owners = {s: worker_for(s, [0, 1, 2]) for s in SERVICES}
    assert owners == {s: worker_for(s, [0, 1, 2]) for s in SERVICES}  # stable
    spread = Counter(owners.values())
    assert set(spread) == {0, 1, 2} and min(spread.values()) > len(SERVICES) / 3 * 0.7


def test_a_missing_worker_moves_only_its_own_services_and_they_move_back() -> None:
    before = {s: worker_for(s, [0, 1, 2]) for s in SERVICES}
    during = {s: worker_for(s, [0, 2]) for s in SERVICES}
    assert all(during[s] == before[s] for s in SERVICES if before[s] != 1)
    assert all(during[s] != 1 for s in SERVICES)
    assert {s: worker_for(s, [0, 1, 2]) for s in SERVICES} == before


def test_batches_land_in_wall_clock_aligned_windows_and_close_after_grace() -> None:
    w = Windows(interval_s=10)
    w.service("cpu", 103 * S, "a").add(("l",), ("f",), 2, 20)
    w.service("cpu", 109 * S, "a").add(("l",), ("f",), 1, 10)
    w.service("cpu", 111 * S, "a").add(("l",), ("f",), 5, 50)
    assert list(w.close_due(now_ns=111 * S, grace_ns=2 * S)) == []  # 100..110 + grace not over
    closed = list(w.close_due(now_ns=112 * S, grace_ns=2 * S))
    assert [(c.service, c.start_ns, c.end_ns, c.data.rows) for c in closed] == [
        ("a", 100 * S, 110 * S, {(("l",), ("f",)): [3, 30]})
    ]
    # a batch for the closed window arrives late: it joins the open one, never reopens the old
    w.service("cpu", 108 * S, "a").add(("l",), ("f",), 1, 10)
    assert w.late_batches == 1
    rest = list(w.close_all())
    assert [(c.start_ns, c.data.rows) for c in rest] == [(110 * S, {(("l",), ("f",)): [6, 60]})]


def test_rows_are_bounded_per_service_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(window_mod, "MAX_ROWS_PER_SERVICE_WINDOW", 3)
    sw = window_mod.ServiceWindow()
    for i in range(10):
        sw.add(("l",), (f"f{i}",), 1, 1)
    assert len(sw.rows) == 4 and sw.truncated == 7
    assert sw.rows[(("l",), window_mod.TRUNCATED)] == [7, 7]


def test_a_drain_is_stamped_into_the_window_holding_most_of_its_stretch() -> None:
    from collector.drains import drain_stamp_ns

    s = 1_000_000_000
    # given 4 s windows: a drain with no boundary since the last one is stamped now
    assert drain_stamp_ns(9 * s, 10 * s + s // 2, 4 * s) == 10 * s + s // 2
    # a quiet drain 50 ms after the boundary at 12 s, the last one 5 s earlier: the window before it
    assert drain_stamp_ns(7 * s, 12 * s + s // 20, 4 * s) == 12 * s - 1
    # a busy drain 0.9 s after the boundary, the last 0.1 s before it: the window after it
    assert drain_stamp_ns(12 * s - s // 10, 12 * s + 9 * s // 10, 4 * s) == 12 * s + 9 * s // 10
    # and what a quiet host's drains then hand in: every boundary-following drain into its window
    last, windows = 0, []
    for now in (5 * s, 8 * s + s // 20, 12 * s + s // 20, 16 * s + s // 20):
        stamp = drain_stamp_ns(last, now, 4 * s)
        windows.append(stamp // (4 * s))
        last = now
    assert windows == [0, 1, 2, 3]


def test_samples_of_processes_gone_before_they_were_read_are_merged_into_one_unknown_process() -> None:
    # given a drain with this (live) process and two that exited before the collector read them,
    # the two with the same stacks
    gone = []
    for _ in range(2):
        p = subprocess.Popen(["true"])
        p.wait()
        gone.append(p.pid)
    me = os.getpid()
    drain = RawDrain(
        samples=[
            (me, me, 1, -1, 3, 30),
            (gone[0], gone[0], 1, 2, 2, 20),
            (gone[1], gone[1] + 1, 1, 2, 5, 50),
            (gone[1], gone[1], 1, -1, 1, 10),
        ],
        user_stacks={1: (0x1000, 0x2000)},
        kernel_stacks={2: (0xFFFF0000,)},
    )
    # when it is batched
    [batch] = build_batches(
        drain,
        ProcessTable(with_cmdline=False),
        lambda a: "k",
        host="h",
        profile_type="offcpu",
        sample_hz=19,
        time_ns=1,
        live_workers=[0],
    ).values()
    # then this process keeps its pid; the gone ones are one [unknown] process, their samples summed by stack
    assert sorted(p.pid for p in batch.processes) == [UNKNOWN_PID, me]
    assert next(p for p in batch.processes if p.pid == UNKNOWN_PID).service == UNKNOWN_SERVICE
    merged = sorted((s.kernel_stack >= 0, s.count, s.value) for s in batch.samples if s.pid == UNKNOWN_PID)
    assert merged == [(False, 1, 10), (True, 7, 70)]
    assert [(s.count, s.value) for s in batch.samples if s.pid == me] == [(3, 30)]
