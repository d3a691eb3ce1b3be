"""Soak (issue 15, "Must show"): 60 s of hostile processes beside an ordinary workload.

Given the whole pipeline with the runtime reader, posting to the reference
receiver, when for SOAK_S these run at once:
- a program in a directory named with the bytes ff fe;
- a program under a path of 1,400 newlines (a maps line over 4 KiB);
- a fake `python3.13`: a 40 MB file with a 16 MiB string table without NUL and
  1M symbols, mapped executable by a running process;
- a JIT whose /tmp/perf-PID.map is a FIFO;
- a program that claims libc's build id;
beside an ordinary CPU-bound workload, then every stage keeps its pid, the
ordinary workload's samples are within ±10% of rate × CPU time and its stacks
are main→top→mid→leaf, the FIFO is refused and logged once, and the hostile
programs are profiled under their escaped names.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared import endpoints, pprof
from shared.config import ProfilerConfig
from shared.safestr import process_string
from tests.harness import (
    FRAME_POINTER_FLAGS,
    Pipeline,
    Receiver,
    open_dir,
    read_received,
    require_root,
    wait_for,
    workload_fields,
)
from tests.integration.test_hostile_processes import NEWLINE_DIRS, NEWLINES_PER_DIR, stage_pids
from tests.unit.test_runtime_probe import crafted_elf

SOAK_S = 60
SAMPLE_HZ = 99
ORDINARY_CPU_S = 20.0
STAGES = ["collector", "symbolizer-0", "uploader", "runtime"]
HOT_STACK = ("main", "top", "mid", "leaf")
LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")


@dataclass
class Soak:
    profiles: list
    ordinary_exe: str
    ordinary_cpu_s: float
    hostile_names: dict[str, str]
    fifo_pid: int
    fake_python: str
    pids_before: dict[str, int]
    pids_after: dict[str, int]
    log: str
    exits: dict[str, int]  # stage → exits `run` counted (RUN_DIR/run.counters.json)

    def samples(self, exe: str) -> list[pprof.ReadSample]:
        return [
            s
            for r in self.profiles
            if r.meta["type"] == "cpu"
            for s in r.profile.samples
            if s.labels.get("process.executable") == exe
        ]


def libc_build_id() -> str:
    out = subprocess.run(["readelf", "-n", str(LIBC)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert m, out
    return m.group(1)


def ready_line(p: subprocess.Popen) -> str:
    assert p.stdout is not None
    return p.stdout.readline()


def hostile_copies(home: Path, duty: Path, libc_id_copy: Path) -> dict[str, bytes]:
    """`duty` under a directory named ff fe (not UTF-8) and under 1,400 newlines, and the copy with
    libc's build id: their paths by kind."""
    root = os.fsencode(home)
    bytes_dir = os.path.join(root, b"\xff\xfe")
    os.mkdir(bytes_dir, 0o755)
    newline_dir = root
    for _ in range(NEWLINE_DIRS):
        newline_dir = os.path.join(newline_dir, b"\n" * NEWLINES_PER_DIR)
        os.mkdir(newline_dir, 0o755)
    exes = {
        "bytes": os.path.join(bytes_dir, b"duty"),
        "newlines": os.path.join(newline_dir, b"duty"),
        "libc_id": os.fsencode(home / "libc-id-copy"),
    }
    shutil.copy(os.fsencode(duty), exes["bytes"])
    shutil.copy(os.fsencode(duty), exes["newlines"])
    shutil.copy(os.fsencode(libc_id_copy), exes["libc_id"])
    return exes


def soak_pipeline(work: Path, receiver: Receiver) -> Pipeline:
    """The whole pipeline, one symbolizer worker, Python stacks read, 10 s windows, posting to `receiver`."""
    return Pipeline(
        work,
        ProfilerConfig(
            sample_hz=SAMPLE_HZ,
            upload_interval_s=10,
            symbolizer_workers=1,
            endpoint=receiver.url,
            local_dir=str(work / "unused"),
            python_stacks=True,
            offcpu=False,
        ),
    )


def start_the_soak_programs(
    procs: list[subprocess.Popen], exes: dict[str, bytes], duty: Path, fake_python: Path, jit: Path
) -> subprocess.Popen:
    """The hostile copies, the fake Python's caller and the JIT, each in `procs` once started, and
    ready: the JIT (its map becomes a FIFO)."""
    for exe in exes.values():
        procs.append(subprocess.Popen([exe, str(SOAK_S)], stdout=subprocess.PIPE, text=True))
    procs.append(subprocess.Popen([duty, str(SOAK_S), fake_python], stdout=subprocess.PIPE, text=True))
    fifo_jit = subprocess.Popen([str(jit), str(SOAK_S), "own"], stdout=subprocess.PIPE, text=True)
    procs.append(fifo_jit)
    for p in procs:
        assert ready_line(p).split()[:1] == ["ready"]
    return fifo_jit


@pytest.fixture(scope="module")
def soak(
    build: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]
) -> Iterator[Soak]:
    require_root()
    hot, jit = build("hot"), build("jit")
    duty = build("duty")
    libc_id_copy = build("duty", [*FRAME_POINTER_FLAGS, f"-Wl,--build-id=0x{libc_build_id()}"])
    work = tmp_path_factory.mktemp("soak")
    home = open_dir("soak")
    exes = hostile_copies(home, duty, libc_id_copy)
    fake_python = home / "python3.13"
    crafted_elf(fake_python)
    receiver = Receiver(work / "received")
    procs = module_started  # killed and reaped at the module's end (conftest.py)
    perf_map: Path | None = None
    try:
        pipeline = soak_pipeline(work, receiver)
        try:
            wait_for(
                "the runtime reader", lambda: os.path.exists(endpoints.ready_file(str(pipeline.run_dir), "runtime")), 60
            )
            before = stage_pids(pipeline.run_dir, STAGES)
            fifo_jit = start_the_soak_programs(procs, exes, duty, fake_python, jit)
            perf_map = Path(f"/tmp/perf-{fifo_jit.pid}.map")
            perf_map.unlink()
            os.mkfifo(perf_map, 0o644)
            ordinary = subprocess.Popen([str(hot), str(ORDINARY_CPU_S)], stdout=subprocess.PIPE, text=True)
            procs.append(ordinary)
            out, _ = ordinary.communicate(timeout=SOAK_S * 3)
            for p in procs:
                assert p.wait(timeout=SOAK_S * 2) == 0
            after = stage_pids(pipeline.run_dir, STAGES)
        finally:
            code = pipeline.stop()
        assert code == 0, pipeline.log()
        names = {k: process_string(v) for k, v in exes.items()}
        yield Soak(
            read_received(receiver.dir),
            str(hot.resolve()),
            float(workload_fields(out)["cpu_seconds"]),
            names,
            fifo_jit.pid,
            str(fake_python),
            before,
            after,
            pipeline.log(),
            pipeline.exits(),
        )
    finally:
        receiver.stop()
        shutil.rmtree(home, ignore_errors=True)
        if perf_map is not None:
            perf_map.unlink(missing_ok=True)


def test_every_stage_keeps_its_pid(soak: Soak) -> None:
    assert all(soak.pids_before.values()), soak.pids_before
    assert soak.pids_after == soak.pids_before, soak.log
    assert soak.exits == {}, soak.exits


def test_the_ordinary_workload_keeps_its_samples_and_stacks(soak: Soak) -> None:
    samples = soak.samples(soak.ordinary_exe)
    total = sum(s.values[0] for s in samples)
    expected = SAMPLE_HZ * soak.ordinary_cpu_s
    assert abs(total - expected) <= 0.10 * expected, f"{total} samples, expected {expected:.0f} ±10%"

    def own(s: pprof.ReadSample) -> tuple[str, ...]:
        fns = tuple(f.function for f in s.frames if f.module == soak.ordinary_exe)
        return fns[fns.index("main") :] if "main" in fns else fns

    exact = sum(
        s.values[0]
        for s in samples
        if own(s) == HOT_STACK and all(f.module == soak.ordinary_exe or "libc" in f.module for f in s.frames)
    )
    stacks: Counter[tuple[str, ...]] = Counter()
    for s in samples:
        stacks[own(s)] += s.values[0]
    assert exact / total >= 0.90, stacks.most_common(5)


def test_the_fifo_perf_map_is_refused_and_logged_once(soak: Soak) -> None:
    lines = [ln for ln in soak.log.splitlines() if f"perf map of pid {soak.fifo_pid}" in ln]
    # the log line is the feature: a refused perf map is logged once with the reason
    assert len(lines) == 1 and "not a regular file" in lines[0], lines


def test_hostile_programs_are_profiled_under_their_escaped_names(soak: Soak) -> None:
    for kind, name in soak.hostile_names.items():
        assert sum(s.values[0] for s in soak.samples(name)) > 0, f"no samples of the {kind} program {name[:80]}"


def test_the_fake_python_is_refused_once_within_the_read_budget(soak: Soak) -> None:
    # (the runtime reader's lines: the collector may also say it found no unwind table in that file)
    lines = [ln for ln in soak.log.splitlines() if soak.fake_python in ln and " runtime[" in ln]
    # one line, and not a read: with the runtime plug-ins the reason is the CPython plug-in's (its symbol
    # reading, under the time budget, finds no Py_Version in the crafted file)
    # the log line is the feature: the fake runtime's refusal is logged once with the reason
    assert len(lines) == 1 and "reading CPython" not in lines[0], lines
    assert "unreadable ELF file" in lines[0] or "no Py_Version symbol" in lines[0], lines
