"""Processes that never run are read too: found by the collector's /proc sweep (collector/discovery.py).

A process reaches the runtime reader when a drain sees it, that is when it runs on a CPU or ends a
wait. Wall profiles exist to show where processes wait, and some never run at all while profiled.

Given a Python process (the host's CPython 3.11) whose only thread sleeps in idle_here(), and a PHP
process (the host's PHP 8.2 CLI) that forked a child sleeping in sleep_here() and waits for it in
wait_child(), all three asleep before the agent starts (off-CPU profiling off: no wait of theirs
ends), when `ebpfprofiler run` reads CPython and PHP stacks, then within one default upload window
(60 s) the python_wall profile has the Python thread in idle_here() and the php_wall profile has the
child in sleep_here() → sleep and the parent in wait_child() → pcntl_waitpid, each at the
workload's line; and none of the three ran meanwhile (its CPU time in /proc did not move), so no
drain could have announced it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from receiver.store import list_profiles
from shared import pprof
from shared.procstat import read_stat, start_ticks, stat_fields
from tests import harness
from tests.harness import WORKLOADS, Receiver, require_root, wait_for
from tests.runtime_harness import runtime_config, runtime_pipeline, wait_for_stacks

PY_SCRIPT = WORKLOADS / "py_idle.py"
PHP_SCRIPT = WORKLOADS / "php_sleeper.php"
PHP = "/usr/bin/php8.2"
# The workloads' own sleep: they end by themselves even if the test cannot end them.
SLEEP_S = 240
# One upload window at the defaults (deploy/agent.yaml): what "within one window" means to a user.
DEFAULT_WINDOW_S = 60


@dataclass
class Sleepers:
    python: int
    php_parent: int
    php_child: int
    cpu_ticks: dict[int, int]  # pid → utime + stime before the agent started
    samples: dict[int, list[pprof.ReadSample]]  # pid → samples of its *_wall profile
    swept: int  # processes the collector's sweep read (collector.counters.json)


def cpu_ticks(pid: int) -> int:
    text = read_stat(pid)
    assert text is not None, f"pid {pid} is gone"
    fields = stat_fields(text)
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)


def asleep(pid: int) -> bool:
    text = read_stat(pid)
    return text is not None and stat_fields(text)[0] == "S"


def wall_samples(directory: Path) -> dict[int, list[pprof.ReadSample]]:
    by_pid: dict[int, list[pprof.ReadSample]] = {}
    for meta in list_profiles(str(directory)):
        if meta["type"] not in ("python_wall", "php_wall"):
            continue
        for s in pprof.read(Path(meta["path"]).read_bytes()).samples:
            by_pid.setdefault(int(s.labels["pid"]), []).append(s)
    return by_pid


@pytest.fixture(scope="module")
def sleepers(tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]) -> Iterator[Sleepers]:
    require_root()
    work = tmp_path_factory.mktemp("idle")
    py = subprocess.Popen(["/usr/bin/python3.11", str(PY_SCRIPT), str(SLEEP_S)], stdout=subprocess.PIPE, text=True)
    module_started.append(py)
    php = subprocess.Popen([PHP, str(PHP_SCRIPT), str(SLEEP_S)], stdout=subprocess.PIPE, text=True)
    module_started.append(php)
    assert py.stdout is not None and php.stdout is not None
    assert py.stdout.readline().strip() == "sleeping", f"the Python sleeper ended: {py.poll()}"
    child = int(php.stdout.readline())
    child_start = start_ticks(child)
    try:
        pids = (py.pid, php.pid, child)
        wait_for("the sleepers asleep", lambda: all(asleep(p) for p in pids), timeout=30, interval=0.1)
        ticks = {p: cpu_ticks(p) for p in pids}
        receiver = Receiver(work / "received")
        cfg = runtime_config(work, receiver, "php", runtime_stacks=("php", "python_legacy"))
        try:
            with runtime_pipeline(work, cfg) as pipeline:

                def all_read() -> bool:
                    got = wall_samples(receiver.dir)
                    return all(got.get(p) for p in pids)

                wait_for_stacks(pipeline, "the sleepers' wall profiles", all_read, timeout=DEFAULT_WINDOW_S)
            swept = pipeline.counters().get("collector", {}).get("processes_swept", 0)
            yield Sleepers(py.pid, php.pid, child, ticks, wall_samples(receiver.dir), swept)
        finally:
            receiver.stop()
    finally:
        # Not a child of ours (module_started ends its parent): ended here, if its pid still names it.
        if child_start is not None and start_ticks(child) == child_start:
            os.kill(child, signal.SIGKILL)


def stacks(s: Sleepers, pid: int) -> set[tuple[str, ...]]:
    return {tuple(f.function for f in sample.frames) for sample in s.samples[pid]}


def test_a_python_process_that_only_sleeps_is_in_python_wall(sleepers: Sleepers) -> None:
    got = stacks(sleepers, sleepers.python)
    assert got == {("<module>", "idle_here")}, got
    lines = {f.line for sample in sleepers.samples[sleepers.python] for f in sample.frames if f.function == "idle_here"}
    assert lines == harness.marked_lines(PY_SCRIPT, "IDLE", "#"), lines


def test_a_forked_php_child_that_only_sleeps_is_in_php_wall(sleepers: Sleepers) -> None:
    got = stacks(sleepers, sleepers.php_child)
    assert all(st[-2:] == ("sleep_here", "sleep") for st in got), got
    lines = {
        f.line for sample in sleepers.samples[sleepers.php_child] for f in sample.frames if f.function == "sleep_here"
    }
    assert lines == harness.marked_lines(PHP_SCRIPT, "SLEEP", "//"), lines


def test_the_waiting_php_parent_is_in_php_wall(sleepers: Sleepers) -> None:
    got = stacks(sleepers, sleepers.php_parent)
    assert all(st[-2:] == ("wait_child", "pcntl_waitpid") for st in got), got


def test_none_of_them_ran_so_only_the_sweep_found_them(sleepers: Sleepers) -> None:
    for pid, before in sleepers.cpu_ticks.items():
        assert cpu_ticks(pid) == before, f"pid {pid} ran while profiled"


def test_the_sweep_read_them(sleepers: Sleepers) -> None:
    assert sleepers.swept >= 3, f"the collector's sweep read {sleepers.swept} processes"
