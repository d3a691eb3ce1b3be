"""collector/drains.py: a new process brings a drain forward only if it still lives 0.25 s later.

Given the new-process events of a shell loop (children alive for a millisecond) and of a
long-lived process, when the collector asks when the next drain is due and whether to make it,
then only the long-lived one brings a drain forward, and never within 0.2 s of the last drain.
"""

from __future__ import annotations

from ebpfprofiler.collector.drains import EARLY_ALIVE_S, EARLY_DRAIN_S, MAX_EARLY_PIDS, EarlyDrains


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_process_gone_before_it_lived_early_alive_s_brings_no_drain() -> None:
    clock, living = Clock(), set()
    early = EarlyDrains(alive=living.__contains__, clock=clock)
    assert early.due_at(last_drain=99.0) is None
    early.notified([41])               # a shell's child, alive when its event is taken
    assert early.due_at(last_drain=99.0) == 100.0 + EARLY_ALIVE_S
    clock.now = 100.0 + EARLY_ALIVE_S  # and gone since
    assert not early.drain_now()
    assert early.gone == 1 and early.due_at(last_drain=99.0) is None


def test_a_process_that_lives_brings_the_drain_forward_but_not_within_early_drain_s() -> None:
    clock, living = Clock(), {7}
    early = EarlyDrains(alive=living.__contains__, clock=clock)
    early.notified([7])
    just_drained = 100.0 + EARLY_ALIVE_S - EARLY_DRAIN_S / 2
    assert early.due_at(last_drain=just_drained) == just_drained + EARLY_DRAIN_S
    clock.now = just_drained + EARLY_DRAIN_S
    assert early.drain_now()
    early.drained()
    assert early.due_at(last_drain=clock.now) is None


def test_a_younger_process_waits_for_its_own_look() -> None:
    clock, living = Clock(), {8}
    early = EarlyDrains(alive=living.__contains__, clock=clock)
    early.notified([41])               # gone by its look
    clock.now += 0.09
    early.notified([8])                # alive, but not yet EARLY_ALIVE_S old at 41's look
    clock.now = 100.0 + EARLY_ALIVE_S
    assert not early.drain_now()
    assert early.due_at(last_drain=0.0) == 100.0 + 0.09 + EARLY_ALIVE_S
    clock.now = 100.0 + 0.09 + EARLY_ALIVE_S
    assert early.drain_now()


def test_waiting_pids_are_capped() -> None:
    early = EarlyDrains(alive=lambda pid: False, clock=Clock())
    early.notified(range(MAX_EARLY_PIDS * 2))
    assert len(early._pending) == MAX_EARLY_PIDS
