"""The collector's main loop (collector/loop.py MainLoop) over a stand-in for the loaded collector:
when it drains, what follows a drain, what remote config's overrides do, and what a stop leaves."""

from __future__ import annotations

import threading
from typing import Any, cast

from collector.drains import DrainPace, EarlyDrains
from collector.loop import MainLoop
from collector.stage import Collector
from shared import remote_config
from shared.config import ProfilerConfig


class NoNewProcessEvents:
    """A kernel without ring buffers: new processes wait for the regular drains."""

    def fd(self) -> int | None:
        return None

    def take(self) -> None:
        pass


class StandIn:
    """What MainLoop uses of collector/stage.py's Collector; stops the loop after `drains` drains."""

    unwind = None
    regs = None

    def __init__(self, stop: threading.Event, drains: int) -> None:
        self.stop = stop
        self.drains_left = drains
        self.early = EarlyDrains(alive=lambda _pid: True)
        self.new_processes = NoNewProcessEvents()
        self.pace = DrainPace()
        self.sampling = True
        self.interval_s = 60
        self.calls: list[str] = []

    def drain_once(self) -> None:
        self.calls.append("drain")
        self.drains_left -= 1
        if self.drains_left == 0:
            self.stop.set()

    def snapshots_if_due(self, interval_s: int, final: bool = False) -> None:
        self.calls.append(f"snapshots {interval_s}{' final' if final else ''}")

    def end_window_if_due(self, interval_s: int) -> None:
        self.calls.append(f"window {interval_s}")

    def next_drain_delay(self, _now_wall: float, _interval_s: int) -> float:
        return 0.01

    def pause(self) -> None:
        self.sampling = False
        self.calls.append("pause")

    def resume(self) -> None:
        self.sampling = True
        self.calls.append("resume")


class Overrides:
    """remote_config.Watcher whose overrides file changes to `later` at the check after `after` checks."""

    follows = True
    wake_s = 0.05

    def __init__(self, later: dict[str, Any], after: int) -> None:
        self.overrides: dict[str, Any] = {}
        self.later = later
        self.checks_left = after

    def check(self) -> bool:
        self.checks_left -= 1
        if self.checks_left != 0:
            return False
        self.overrides = self.later
        return True


def run(collector: StandIn, watcher: Overrides, stop: threading.Event) -> None:
    loop = MainLoop(
        cast(Collector, collector),
        ProfilerConfig(remote_config_url="http://backend.invalid/agent.yaml"),
        cast(remote_config.Watcher, watcher),
        stop,
        threading.Event(),
        "/nonexistent/agent.yaml",
    )
    loop.run()


def test_each_drain_is_followed_by_the_windows_steps_and_a_stop_drains_once_more() -> None:
    # given a loop whose overrides never change, stopped at its third drain
    stop = threading.Event()
    c = StandIn(stop, drains=3)
    run(c, Overrides({}, after=-1), stop)
    # then each drain was followed by the window's snapshots and end, and the stop by one more
    # drain and the last snapshots
    assert c.calls == [
        "drain",
        "snapshots 60",
        "window 60",
        "drain",
        "snapshots 60",
        "window 60",
        "drain",
        "snapshots 60",
        "window 60",
        "drain",
        "snapshots 60 final",
    ]


def test_remote_config_pauses_sampling_and_its_window_length_applies_from_the_next_drain() -> None:
    # given a loop whose overrides turn profiling off and windows to 10 s after a few checks
    stop = threading.Event()
    c = StandIn(stop, drains=4)
    run(c, Overrides({"enabled": False, "upload_interval_s": 10}, after=3), stop)
    # then sampling was paused once, and the drains after it use 10-s windows, the last snapshots too
    assert c.calls.count("pause") == 1 and not c.sampling
    after = c.calls[c.calls.index("pause") + 1 :]
    assert after[:3] == ["drain", "snapshots 10", "window 10"]
    assert c.calls[-2:] == ["drain", "snapshots 10 final"]
    assert c.interval_s == 10
