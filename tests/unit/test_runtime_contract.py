"""Every registered runtime through the same contract (runtimes/runtime.py's Runtime), with real processes.

Each runtime of shared/runtime_registry.py, turned on by its opt-ins, is a
plug-in whose whole life holds what the reader relies on:
- detect: on real processes that are not its own (a `sleep`, and this test's
  CPython for every runtime but CPython) it returns one of the declared
  results, and that result is None: not mine; on a process that vanished it
  returns a declared result or raises MemoryReadError/OSError only;
- stop: returns log lines; a second call returns none; what the plug-in
  started (a helper process, sockets) is gone after it: the test process has
  the children and descriptors it had before the plug-in was made;
- counters: a dict of int by name, each name starting with the runtime's
  name and "_", and those names are in what `ebpfprofiler status` shows: the
  runtime reader's RUN_DIR/runtime.counters.json (read by shared/counters.py
  as status reads it), written by the stage's own Reader with every plug-in
  loaded; closing that Reader stops each plug-in, and a later stop() has
  nothing left to do;
- reading: a process of the runtime at hand (this test's CPython) is read
  into ThreadStacks, leaf first, whose frames carry the registry's frame
  fields (every runtime's own integration test reads its real runtimes).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimes.main import Reader
from runtimes.memory import MemoryReadError, ProcessMemory, ReadBudget
from runtimes.runtime import DETECTED_TYPES, FileCache, ProcessContext, Runtime, StackReader
from shared import counters, runtime_registry
from shared.config import ProfilerConfig
from shared.runtime_registry import RuntimeSpec

# Bytes a detection may read from a process here (a refusal's self-check reads a few hundred).
DETECT_READ_BYTES = 1 << 20

SPECS = runtime_registry.RUNTIMES


def plugin(spec: RuntimeSpec) -> Runtime:
    """The runtime's plug-in as the reader loads it, turned on by its opt-ins."""
    cfg = ProfilerConfig(runtime_stacks=tuple(name for name, _ in spec.opt_ins))
    got = importlib.import_module(spec.package).runtime(cfg)
    assert got is not None, f"{spec.name}: runtime(cfg) gave None with its opt-ins on"
    return got


def context(pid: int) -> ProcessContext:
    return ProcessContext(pid, "/proc", ProcessMemory(pid, ReadBudget(DETECT_READ_BYTES)), FileCache())


def children() -> set[int]:
    """This process's children, zombies included (those of its main thread, which makes the plug-ins)."""
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(c) for c in f.read().split()}


def descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A real process of no runtime (coreutils' sleep maps its own file and libc only)."""
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_detect_says_not_mine_of_processes_of_no_runtime_or_another(
    spec: RuntimeSpec, sleeper: subprocess.Popen
) -> None:
    runtime = plugin(spec)
    try:
        assert runtime.spec is spec
        others = [sleeper.pid] if spec.name == "cpython" else [sleeper.pid, os.getpid()]  # this test is CPython
        for pid in others:
            got = runtime.detect(context(pid))
            assert isinstance(got, DETECTED_TYPES), (spec.name, got)
            assert got is None, (spec.name, pid, got)
    finally:
        runtime.stop()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_detect_of_a_vanished_process_gives_a_declared_result_or_the_vanished_errors(spec: RuntimeSpec) -> None:
    runtime = plugin(spec)
    p = subprocess.Popen(["true"])
    p.wait()  # exited and reaped: its pid names nothing now
    try:
        got = runtime.detect(context(p.pid))
    except (MemoryReadError, OSError):
        pass
    else:
        assert isinstance(got, DETECTED_TYPES), (spec.name, got)
    finally:
        runtime.stop()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_stop_is_idempotent_and_leaves_nothing(spec: RuntimeSpec) -> None:
    before = (children(), descriptors())
    runtime = plugin(spec)
    lines = runtime.stop()
    assert isinstance(lines, list) and all(isinstance(line, str) for line in lines), lines
    assert runtime.stop() == []
    assert (children(), descriptors()) == before, f"{spec.name} left a process or a descriptor behind"


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_counters_are_ints_by_names_of_the_runtime(spec: RuntimeSpec) -> None:
    runtime = plugin(spec)
    try:
        got = runtime.counters()
        assert isinstance(got, dict)
        for name, value in got.items():
            assert isinstance(name, str) and name.startswith(f"{spec.name}_"), (spec.name, name)
            assert type(value) is int and value >= 0, (spec.name, name, value)
    finally:
        runtime.stop()


def test_the_readers_status_counters_hold_every_runtimes_and_closing_stops_them(tmp_path: Path) -> None:
    # Given the stage's Reader with every runtime turned on
    cfg = ProfilerConfig(plain_pid=True, runtime_stacks=runtime_registry.OPT_INS)
    reader = Reader(cfg, str(tmp_path), str(tmp_path))
    assert [r.spec for r in reader.runtimes] == list(SPECS)
    own = {name for r in reader.runtimes for name in r.counters()}
    # When it writes its counters, as at every tick, and is closed, as at a stop
    reader.counters.update(reader.checks(), force=True)
    shown = counters.read_all(str(tmp_path))["runtime"]
    reader.close()
    # Then what status reads holds every plug-in's counters, as ints, and every plug-in was stopped
    assert own <= set(shown), sorted(own - set(shown))
    assert all(type(v) is int for v in shown.values()), shown
    for r in reader.runtimes:
        assert r.stop() == [], f"{r.spec.name}: closing the reader did not stop it"


# A CPython process parked in a known function until its stdin closes (then it ends by itself).
PARKED = """
import sys

def parked_here():
    print("parked", flush=True)
    sys.stdin.read()

parked_here()
"""


def test_a_process_of_the_runtime_is_read_into_stacks_with_the_registrys_frame_fields() -> None:
    # Given CPython's plug-in with 3.11 and 3.12 on, and a process of this test's own interpreter (the
    # runtime at hand) parked in parked_here()
    spec = runtime_registry.spec_of("cpython")
    runtime = plugin(spec)
    parked = subprocess.Popen([sys.executable, "-c", PARKED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parked.stdout is not None and parked.stdout.readline() == "parked\n"
        # When it detects that process and reads its stacks
        reader = runtime.detect(context(parked.pid))
        assert isinstance(reader, StackReader), reader
        stacks = reader.sample(ProcessMemory(parked.pid, ReadBudget(DETECT_READ_BYTES)))
    finally:
        runtime.stop()
        parked.communicate(timeout=30)  # closing stdin ends it
    # Then it is read: a version, counts of what it dropped, and its thread's stack, leaf first, whose
    # frames carry the fields the registry names
    assert reader.version == platform.python_version()
    assert isinstance(reader.dropped, dict)
    (main,) = [st for st in stacks if st.native_tid == parked.pid]
    assert [f.function for f in main.frames] == ["parked_here", "<module>"], main.frames
    for frame in main.frames:
        assert tuple(f.name for f in dataclasses.fields(frame)) == spec.frame_fields, frame
        assert isinstance(frame.function, str) and isinstance(frame.filename, str)
        assert type(frame.line) is int and frame.line >= 0
