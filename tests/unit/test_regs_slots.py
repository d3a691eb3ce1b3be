"""collector/regs.py's slots, against constructed drains: who gets a slot when all are taken (issue 40, case 8).

The BPF side is a dict standing in for the oncpu_regs_pids map (the forwarder only puts and deletes
keys); the processes are real (sleeping children), as their start times are checked. The end-to-end
test is tests/integration/test_regs_slots.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from collector import regs
from shared.procstat import start_ticks
from shared.wire import Mapping, Process

SLOTS = 3


class PidMap(dict[int, Any]):  # keys: pids
    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key.value, value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key.value)


class Bpf:
    def __init__(self) -> None:
        self.pids = PidMap()

    def __getitem__(self, name: str) -> Any:
        if name == "oncpu_regs_pids":
            return self.pids
        return self

    def open_ring_buffer(self, _cb: Any) -> None:
        pass

    def ring_buffer_consume(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen]]:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(SLOTS + 2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def jvm(p: subprocess.Popen) -> Process:
    ticks = start_ticks(p.pid)
    assert ticks is not None
    return Process(
        pid=p.pid,
        start_ticks=ticks,
        uid=0,
        nspid=p.pid,
        comm="java",
        executable="/usr/bin/java",
        service="/usr/bin/java",
        mappings=(Mapping(0x1000, 0x2000, 0, "/jdk/lib/server/libjvm.so", "", 4096),),
    )


def test_a_slot_goes_from_an_idle_holder_to_a_process_that_runs(
    sleepers: list[subprocess.Popen], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(regs, "ONCPU_REGS_PIDS", SLOTS)
    monkeypatch.setattr(regs.time, "monotonic", clock)
    bpf = Bpf()
    fwd = regs.RegsForwarder(bpf, frozenset({"libjvm.so"}), lambda _: None, "host")
    holders, newcomer, other = [jvm(p) for p in sleepers[:SLOTS]], jvm(sleepers[SLOTS]), jvm(sleepers[SLOTS + 1])
    # Given every slot taken; one holder keeps running, the others do not
    fwd.observe(holders)
    assert set(bpf.pids) == {p.pid for p in holders}
    clock.t += regs.IDLE_EVICT_S / 2
    fwd.observe(holders[:1])  # on a CPU in this drain
    # When a process that runs asks before the others were idle IDLE_EVICT_S: it waits
    fwd.observe([newcomer])
    assert newcomer.pid not in bpf.pids and fwd.stats["not_marked_full"] == 1
    # and once they were, it gets the slot of the one idle longest, never the running one's
    clock.t += regs.IDLE_EVICT_S / 2 + 1
    fwd.observe([newcomer])
    assert newcomer.pid in bpf.pids and holders[0].pid in bpf.pids
    assert len(bpf.pids) == SLOTS and fwd.stats["evicted_idle"] == 1
    assert fwd.checks() == {"regs_not_marked_full": 2, "regs_evicted_idle": 1}
    # A process seen only off a CPU (an off-CPU drain) takes no slot, though a holder is idle
    clock.t += regs.IDLE_EVICT_S + 1
    fwd.observe([other], on_cpu=False)
    assert other.pid not in bpf.pids
    # while one seen on a CPU does
    fwd.observe([other])
    assert other.pid in bpf.pids and fwd.stats["evicted_idle"] == 2
