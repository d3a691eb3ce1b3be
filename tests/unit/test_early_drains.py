"""collector/drains.py: when the collector drains.

Given the new-process events (the programs send one for a process counted again EARLY_ALIVE_S
after its first count: bpf/common.h notify_new_pid), when the collector asks when the next drain
is due and whether to make it, then a process still alive brings a drain forward, never within
0.2 s of the last drain nor within a second of the last look; one gone since brings none.

Given what the last drain took (keys, the pids the host made meanwhile), when the collector asks
for the next regular drain, then a quiet host waits the longest interval (or to the window
boundary), and many keys or a fast pid churn bring it closer, never under the shortest one.
"""

from __future__ import annotations

from pathlib import Path

from collector.drains import (
    DRAIN_KEYS_TARGET,
    DRAINS_PER_PID_WRAP,
    EARLY_DRAIN_S,
    EARLY_LOOK_GAP_S,
    MAX_EARLY_PIDS,
    PID_MAX_FLOOR,
    EarlyDrains,
    forks,
    pid_max,
    regular_delay,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_process_gone_by_its_look_brings_no_drain() -> None:
    clock, living = Clock(), set[int]()
    early = EarlyDrains(alive=living.__contains__, clock=clock)
    assert early.due_at(last_drain=99.0) is None
    early.notified([41])  # it lived EARLY_ALIVE_S, and ended just after its event
    assert early.due_at(last_drain=99.0) == 100.0  # at once
    assert not early.drain_now()
    assert early.gone == 1 and early.due_at(last_drain=99.0) is None


def test_a_process_that_lives_brings_the_drain_forward_but_not_within_early_drain_s() -> None:
    clock, living = Clock(), {7}
    early = EarlyDrains(alive=living.__contains__, clock=clock)
    early.notified([7])
    just_drained = 100.0 - EARLY_DRAIN_S / 2
    assert early.due_at(last_drain=just_drained) == just_drained + EARLY_DRAIN_S
    clock.now = just_drained + EARLY_DRAIN_S
    assert early.drain_now()
    early.drained()
    assert early.due_at(last_drain=clock.now) is None


def test_looks_are_early_look_gap_s_apart() -> None:
    clock, living = Clock(), {8}
    early = EarlyDrains(alive=living.__contains__, clock=clock)
    early.notified([41])  # gone by its look
    assert not early.drain_now()
    clock.now += 0.09
    early.notified([8])  # alive: looked at a look gap after the last look
    assert early.due_at(last_drain=0.0) == 100.0 + EARLY_LOOK_GAP_S
    clock.now = 100.0 + EARLY_LOOK_GAP_S
    assert early.drain_now()


def test_waiting_pids_are_capped() -> None:
    early = EarlyDrains(alive=lambda pid: False, clock=Clock())
    early.notified(range(MAX_EARLY_PIDS * 2))
    assert len(early._pending) == MAX_EARLY_PIDS


def delay(
    *,
    keys: int = 0,
    pids_made: int = 0,
    stretch_s: float = 60.0,
    pid_max: int = 32768,
    until_boundary_s: float = 1000.0,
    shortest_s: float = 1.0,
    longest_s: float = 60.0,
) -> float:
    return regular_delay(
        keys=keys,
        pids_made=pids_made,
        stretch_s=stretch_s,
        pid_max=pid_max,
        until_boundary_s=until_boundary_s,
        shortest_s=shortest_s,
        longest_s=longest_s,
    )


def test_a_quiet_host_drains_at_the_longest_interval_or_at_the_window_boundary() -> None:
    assert delay(keys=40, pids_made=3) == 60.0
    assert delay(keys=40, pids_made=3, until_boundary_s=12.5) == 12.5
    assert delay(until_boundary_s=0.01) == 0.05  # never a drain loop


def test_many_keys_bring_the_next_drain_closer_so_that_it_takes_about_the_target() -> None:
    # 1,000 keys in 10 s: the target is taken in ~20 s
    assert abs(delay(keys=1000, stretch_s=10.0) - DRAIN_KEYS_TARGET * 10.0 / 1000) < 1e-9
    assert delay(keys=10**6, stretch_s=1.0) == 1.0  # never under the shortest interval


def test_a_fast_pid_churn_drains_several_times_per_pid_wrap() -> None:
    # a shell loop: 500 pids a second wrap pid_max 32768 in ~65 s
    d = delay(pids_made=4000, stretch_s=8.0)
    assert abs(d - 32768 / 500 / DRAINS_PER_PID_WRAP) < 1e-9 and d < 20
    # the same churn under a large pid_max (systemd's 4194304) does not matter
    assert delay(pids_made=4000, stretch_s=8.0, pid_max=4194304) == 60.0


def test_the_fork_counter_and_pid_max_come_from_proc_and_fall_back(tmp_path: Path) -> None:
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "stat").write_text(
        "cpu  1 2 3 4\ncpu0 1 2 3 4\nintr 5 0 0\nctxt 99\nbtime 1\nprocesses 4531195\nprocs_running 1\n"
    )
    (tmp_path / "sys" / "kernel" / "pid_max").write_text("4194304\n")
    assert forks(str(tmp_path)) == 4531195 and pid_max(str(tmp_path)) == 4194304
    (tmp_path / "stat").write_text("cpu  1 2 3 4\nprocesses many\n")
    (tmp_path / "sys" / "kernel" / "pid_max").unlink()
    assert forks(str(tmp_path)) is None and pid_max(str(tmp_path)) == PID_MAX_FLOOR
    assert forks(str(tmp_path / "none")) is None
    before = forks()
    after = forks()
    assert before is not None and after is not None and after >= before  # this host's, counting up
