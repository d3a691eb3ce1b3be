"""Register-sampling slots go to processes that run, not to the first that ask (issue 40, case 8).

With runtime_stacks: [jvm] the collector sends the registers of every on-CPU sample of a process that
maps libjvm.so (collector/regs.py), for at most ONCPU_REGS_PIDS processes at once (1,024; here 4, set
in the collector this test starts, so that a few real processes fill them, and IDLE_EVICT_S 3 s).
Processes that map a fake libjvm.so, run for a second and then sleep take every slot
(tests/workloads/fake_runtime.c, burst); then a process that maps one and runs (spin) appears. Its
on-CPU samples come with registers within a deadline, the slot taken from an idle holder: the
eviction is logged and counted as regs_evicted_idle in the collector's counters (`ebpfprofiler status`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import zmq

from shared import counters, endpoints
from shared.config import ProfilerConfig, dump
from shared.wire import RegsBatch, WireError, decode
from tests.harness import PY, open_dir, require_root, stop_process, wait_for

# Slots in the collector under test, and seconds without an on-CPU sample that make a holder idle.
SLOTS = 4
IDLE_EVICT_S = 3.0
# The processes' own deadline: they end by themselves even if the test cannot end them.
WORKLOAD_SECONDS = 120
# Seconds from the busy process's start to its first sample with registers: IDLE_EVICT_S, then a drain
# (one follows every window boundary: windows of 1 s), with room for a loaded host.
SLOT_DEADLINE_S = 30.0
# The collector's start (compiling and loading BPF programs: ~3 s here, more on a loaded host).
READY_TIMEOUT_S = 120.0

COLLECTOR = f"""
import sys
from collector import regs
regs.ONCPU_REGS_PIDS = {SLOTS}
regs.IDLE_EVICT_S = {IDLE_EVICT_S}
from collector.main import main
sys.exit(main(sys.argv[1:]))
"""


def start_collector(work: Path, started: list[subprocess.Popen]) -> tuple[subprocess.Popen, Path, Path]:
    """The collector with SLOTS slots, reading JVM registers, windows of 1 s: (it, its run dir, its log)."""
    cfg = work / "agent.yaml"
    cfg.write_text(
        dump(
            ProfilerConfig(
                sample_hz=49,
                offcpu=False,
                dwarf_unwind=False,
                python_stacks=False,
                runtime_stacks=("jvm",),
                upload_interval_s=1,
            )
        )
    )
    run_dir = work / "run"
    run_dir.mkdir()
    shutil.chown(run_dir, group="ebpfprofiler")
    run_dir.chmod(0o3770)
    log_path = work / "collector.err"
    with open(log_path, "wb") as err:
        collector = subprocess.Popen([PY, "-c", COLLECTOR, "--config", str(cfg), "--run-dir", str(run_dir)], stderr=err)
    started.append(collector)
    wait_for(
        "the collector to be ready",
        lambda: collector.poll() is not None or os.path.exists(endpoints.ready_file(str(run_dir), "collector")),
        timeout=READY_TIMEOUT_S,
    )
    assert collector.poll() is None, log_path.read_text()
    return collector, run_dir, log_path


def fill_slots_with_idle(fake: Path, libjvm: Path, log_path: Path, started: list[subprocess.Popen]) -> list[int]:
    """Every slot taken by a process that ran for a second and sleeps since: their pids."""

    def marked() -> set[int]:
        return {int(m) for m in re.findall(r"registers with on-CPU samples: pid (\d+) \(maps", log_path.read_text())}

    idle = []
    for _ in range(SLOTS):
        p = subprocess.Popen(
            [str(fake), "burst", str(libjvm), str(WORKLOAD_SECONDS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        started.append(p)
        idle.append(p.pid)
    try:
        wait_for("every idle process to hold a slot", lambda: set(idle) <= marked(), timeout=SLOT_DEADLINE_S)
    except AssertionError as e:
        said = [ln for ln in log_path.read_text().splitlines() if "overhead:" not in ln]
        raise AssertionError(f"{e}; the collector said: " + "\n".join(said[-30:])) from None
    return idle


def wait_for_registers_of(sub: zmq.Socket, pid: int) -> None:
    """On-CPU samples of `pid` come with registers on the processes channel within the deadline."""
    seen: set[int] = set()

    def has_registers() -> bool:
        while sub.poll(0):
            try:
                msg = decode(sub.recv_multipart())
            except WireError:
                continue
            if isinstance(msg, RegsBatch):
                seen.update(s.pid for s in msg.samples)
        return pid in seen

    wait_for("registers with the busy process's on-CPU samples", has_registers, timeout=SLOT_DEADLINE_S, interval=0.1)


def test_a_busy_process_gets_a_register_slot_from_idle_holders(
    build: Callable[..., Path], started: list[subprocess.Popen]
) -> None:
    require_root()
    fake = build("fake_runtime", ["-O1", "-Wall", "-Werror"])
    work = open_dir("regs-slots")
    ctx: zmq.Context = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        libjvm = work / "jdk" / "lib" / "server" / "libjvm.so"
        libjvm.parent.mkdir(parents=True)
        libjvm.write_bytes(bytes(4096))
        collector, run_dir, log_path = start_collector(work, started)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoints.processes(str(run_dir)))
        # Given every slot taken by a process that ran for a second and sleeps since
        fill_slots_with_idle(fake, libjvm, log_path, started)
        # When a process that maps a libjvm.so and runs appears
        busy = subprocess.Popen(
            [str(fake), "spin", str(libjvm), str(WORKLOAD_SECONDS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        started.append(busy)
        # Then its on-CPU samples come with registers within the deadline
        wait_for_registers_of(sub, busy.pid)
        # from a slot taken back from an idle holder (every slot was an idle one's), counted for status
        wait_for(
            "the collector's counters to say so",
            lambda: counters.read_all(str(run_dir)).get("collector", {}).get("regs_evicted_idle", 0) >= 1,
            timeout=10,
        )
        assert stop_process(collector) == 0, log_path.read_text()[-3000:]
    finally:
        sub.close()
        shutil.rmtree(work, ignore_errors=True)
