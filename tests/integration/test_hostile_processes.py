"""Processes a local user can make to stop, blind or mislead the profiler (issue 15), beside an ordinary one.

Given the whole pipeline posting to the reference receiver, when a program runs
from a directory whose name is not UTF-8 (the bytes ff fe) and another from
under a path of 1,400 newlines (its /proc/PID/maps line is over 4 KiB), beside
an ordinary CPU-bound workload, then no stage restarts (each keeps its pid),
the ordinary workload's samples all arrive (rate × CPU time), and the hostile
programs are profiled too, under their names escaped by the one string rule
(shared/safestr.py). Meanwhile a member of the agent's group pushes an unwind
table the collector never asked for (dropped, counted, logged once), and a
second `ebpfprofiler run` and a second collector on the same run directory
refuse, naming the pid of the one running, without taking over its sockets.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from shared import endpoints, pprof, unwind_table, wire
from shared.config import ProfilerConfig
from shared.safestr import CUT_MARKER, process_string
from tests.harness import PY, Pipeline, Receiver, open_dir, read_received, require_root, workload_fields

SAMPLE_HZ = 99
ORDINARY_CPU_S = 4.0
HOSTILE_CPU_S = 3.0
# 7 directories of 200 newlines: names within NAME_MAX, a path within PATH_MAX, a maps line of 5,600+ bytes.
NEWLINE_DIRS, NEWLINES_PER_DIR = 7, 200


@dataclass
class Run:
    profiles: list
    ordinary_exe: str
    ordinary_cpu_s: float
    bytes_exe: bytes
    newline_exe: bytes
    pids_before: dict[str, int]
    pids_after: dict[str, int]
    run_pid: int
    second_run: subprocess.CompletedProcess
    second_collector: subprocess.CompletedProcess
    log: str
    counters: dict[str, dict[str, int]]  # each stage's RUN_DIR/<stage>.counters.json at its exit

    def samples(self, exe: str) -> list[pprof.ReadSample]:
        return [
            s
            for r in self.profiles
            if r.meta["type"] == "cpu"
            for s in r.profile.samples
            if s.labels.get("process.executable") == exe
        ]


def stage_pids(run_dir: Path, stages: list[str]) -> dict[str, int]:
    """The pid in each stage's ready file; 0 for a stage that has none (it died, or is restarting)."""

    def pid(stage: str) -> int:
        try:
            return int(Path(endpoints.ready_file(str(run_dir), stage)).read_text())
        except (OSError, ValueError):
            return 0

    return {s: pid(s) for s in stages}


# A module nobody maps; its answer carries a valid one-row table.
UNASKED_DEV, UNASKED_INODE, UNASKED_PATH = "fe:ff", 4242, "/unasked/module"


def push_unasked_unwind_table(run_dir: Path) -> None:
    header = unwind_table.Header(
        unwind_table.ARCH_X86_64, span=16, pc_base=0, text_offset=0, text_vaddr=0, text_size=16
    )
    table = unwind_table.encode(header, [unwind_table.Row(0, 0, 0, 0, unwind_table.CFA_FALLBACK, 0, 0)])
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(endpoints.unwind(str(run_dir)))
        for _ in range(3):
            sock.send_multipart(
                wire.encode(wire.UnwindTable(UNASKED_DEV, UNASKED_INODE, UNASKED_PATH, "ab", "ok", "", table))
            )
        sock.close()
    finally:
        ctx.term()


def hostile_copies(hot: Path, home: Path) -> tuple[bytes, bytes]:
    """Copies of `hot` under a directory named ff fe (not UTF-8) and under 1,400 newlines: their paths."""
    bytes_dir = os.path.join(os.fsencode(home), b"\xff\xfe")
    os.mkdir(bytes_dir, 0o755)
    bytes_exe = os.path.join(bytes_dir, b"hot")
    shutil.copy(os.fsencode(hot), bytes_exe)
    newline_dir = os.fsencode(home)
    for _ in range(NEWLINE_DIRS):
        newline_dir = os.path.join(newline_dir, b"\n" * NEWLINES_PER_DIR)
        os.mkdir(newline_dir, 0o755)
    newline_exe = os.path.join(newline_dir, b"hot")
    shutil.copy(os.fsencode(hot), newline_exe)
    return bytes_exe, newline_exe


def start_second_instances(
    pipeline: Pipeline,
) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """A second `ebpfprofiler run` and a second collector on the pipeline's run directory, to their end."""
    cfg, run_dir = str(pipeline.config_path), str(pipeline.run_dir)
    second_run = subprocess.run(
        [PY, "-m", "cli.main", "run", "--config", cfg, "--run-dir", run_dir, "--state-dir", str(pipeline.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    second_collector = subprocess.run(
        [PY, "-m", "cli.main", "collector", "--config", cfg, "--run-dir", run_dir],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return second_run, second_collector


@pytest.fixture(scope="module")
def run(
    build: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]
) -> Iterator[Run]:
    require_root()
    hot = build("hot")
    work = tmp_path_factory.mktemp("hostile")
    home = open_dir("hostile")
    bytes_exe, newline_exe = hostile_copies(hot, home)
    receiver = Receiver(work / "received")
    procs = module_started  # killed and reaped at the module's end (conftest.py)
    stages = ["collector", "symbolizer-0", "uploader"]
    try:
        pipeline = Pipeline(
            work,
            ProfilerConfig(
                sample_hz=SAMPLE_HZ,
                upload_interval_s=5,
                symbolizer_workers=1,
                endpoint=receiver.url,
                local_dir=str(work / "unused"),
                python_stacks=False,
                offcpu=False,
            ),
        )
        try:
            before = stage_pids(pipeline.run_dir, stages)
            for exe in (bytes_exe, newline_exe):
                procs.append(subprocess.Popen([exe, str(HOSTILE_CPU_S)], stdout=subprocess.DEVNULL))
            push_unasked_unwind_table(pipeline.run_dir)
            second_run, second_collector = start_second_instances(pipeline)
            ordinary = subprocess.Popen([str(hot), str(ORDINARY_CPU_S)], stdout=subprocess.PIPE, text=True)
            procs.append(ordinary)
            out, _ = ordinary.communicate(timeout=120)
            for p in procs:
                assert p.wait(timeout=120) == 0
            after = stage_pids(pipeline.run_dir, stages)
        finally:
            code = pipeline.stop()
        assert code == 0, pipeline.log()
        yield Run(
            read_received(receiver.dir),
            str(hot.resolve()),
            float(workload_fields(out)["cpu_seconds"]),
            bytes_exe,
            newline_exe,
            before,
            after,
            pipeline.proc.pid,
            second_run,
            second_collector,
            pipeline.log(),
            pipeline.counters(),
        )
    finally:
        receiver.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_no_stage_restarts(run: Run) -> None:
    assert run.pids_after == run.pids_before, run.log
    assert run.counters.get("run", {}) == {}, run.counters  # `run` counted no stage's exit


def test_ordinary_workload_keeps_all_its_samples(run: Run) -> None:
    total = sum(s.values[0] for s in run.samples(run.ordinary_exe))
    expected = SAMPLE_HZ * run.ordinary_cpu_s
    assert abs(total - expected) <= 0.10 * expected, f"{total} samples, expected {expected:.0f} ±10%"


def test_non_utf8_path_is_profiled_under_its_escaped_name(run: Run) -> None:
    name = process_string(run.bytes_exe)
    assert name.endswith("/\\xff\\xfe/hot")
    samples = run.samples(name)
    assert sum(s.values[0] for s in samples) >= 0.5 * SAMPLE_HZ * HOSTILE_CPU_S
    # its own frames carry the escaped module path and are named from its symbols
    assert any(f.module == name and f.function == "leaf" for s in samples for f in s.frames)


def test_newline_path_is_profiled_under_a_cut_name(run: Run) -> None:
    name = process_string(run.newline_exe)
    assert CUT_MARKER in name and "\n" not in name
    samples = run.samples(name)
    assert sum(s.values[0] for s in samples) >= 0.5 * SAMPLE_HZ * HOSTILE_CPU_S
    assert any(f.module == name and f.function == "leaf" for s in samples for f in s.frames)


def test_unwind_answers_never_asked_for_are_dropped_and_logged_once(run: Run) -> None:
    # counted, not loaded (late answers for processes that exited while asked count too)
    assert run.counters["collector"]["unwind_answers_unasked"] >= 1, run.counters
    dropped = [ln for ln in run.log.splitlines() if "not asked for" in ln]
    assert len(dropped) == 1 and UNASKED_PATH in dropped[0], dropped


def test_second_run_and_second_stage_on_a_run_dir_in_use_refuse_with_its_pid(run: Run) -> None:
    assert run.second_run.returncode == 1
    assert "run is already running on" in run.second_run.stderr
    assert f"(pid {run.run_pid})" in run.second_run.stderr, run.second_run.stderr
    assert run.second_collector.returncode == 1
    assert f"(pid {run.pids_before['collector']})" in run.second_collector.stderr, run.second_collector.stderr
