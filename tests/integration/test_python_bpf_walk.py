"""CPython frames walked in BPF at the on-CPU sample (bpf/python.h, collector/pywalk.py), on real interpreters.

Given bpf/oncpu.c compiled with the Python walker, sampling at SAMPLE_HZ, and each workload process
named in py_procs with the layout and _PyRuntime address the runtime reader's detection finds for it,
when tests/workloads/py_threads.py and py_walk.py run under the host's CPython 3.11 and sid's 3.13, 3.14
and 3.15 (chrooted: a container stand-in, whose threads the walk finds by their thread pointer, not by a
thread id), then the walked stacks, named from their code pointers in user space:
- are in at least 90% of the busy thread's on-CPU samples;
- read run() → cpu_a()/cpu_b() in the split the workload measured in its own thread CPU time (3:1 by
  work; ±10%), down to the thread's root frame;
- mark where each call of the interpreter's eval function began: the thread's root frame, and a key
  function sorted() calls from C;
- of a recursion deeper than the frames kept, keep the root-most frames and say the stack was cut;
- of a thread blocked in time.sleep, are off-CPU under the Python function that sleeps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import zmq

from collector import pywalk
from collector.announce import Announcer
from collector.offcpu import OffCpuTracer
from collector.offcpu import bpf_defines as offcpu_defines
from collector.oncpu import OnCpuSampler
from collector.procfs import read_process
from collector.programs import Programs
from collector.pythonwalks import PythonWalks
from collector.sources import EventSource
from runtimes.cpython import version
from runtimes.cpython.layouts import wire_layout
from runtimes.cpython.reader import CPythonProcess, PyFrame
from runtimes.memory import ProcessMemory, ReadBudget
from runtimes.runtime import FileCache, ProcessContext
from shared import endpoints, wire
from shared.stage_code import default_bpf_dir
from shared.wire import PyFrameRef
from tests.harness import WORKLOADS, require_root, wait_for
from tests.python_roots import VERSIONS, assert_split_is_the_workloads, interpreters, sid_root

SAMPLE_HZ = 499
# On-CPU samples of the busy thread judged per workload: the 3:1 split is a draw with p = 3/4 per
# sample, judged to one sigma of 6.9/sqrt(N) in the ratio; 5,000 make the ±10% band 4.3 sigma wide.
WANT_SAMPLES = 5000
# Recursion levels of the deep workload, past PY_MAX_FRAMES and within PY_WALK_FRAMES: one whose root-most
# frames the walk's third part reads again in part from its first (fewer than 2 * PY_MAX_FRAMES), one
# whose are all past it (bpf/python.h py_walk).
DEPTHS = (90, 300)
THREADS = WORKLOADS / "py_threads.py"
WALK = WORKLOADS / "py_walk.py"


@dataclass
class Walked:
    """What the walk gave for one workload's busy thread: named stacks (leaf first) with their counts."""

    samples: int  # the thread's on-CPU samples
    stacks: Counter[tuple[tuple[str, bool], ...]]  # ((qualname, entry), ...) → samples
    truncated: int  # samples whose stack was cut short


class Sampler:
    """bpf/oncpu.c and bpf/offcpu.c with the walker, attached; workloads added to py_procs as they start."""

    def __init__(self) -> None:
        defines = {
            "COUNTS_ENTRIES": 16384,
            "STACK_ENTRIES": 16384,
            "START_ENTRIES": 1024,
            "OFFCPU_MIN_NS": 1_000_000,
            "OFFCPU_SAMPLE_NS": 0,
            **offcpu_defines(),
            **pywalk.bpf_defines(offcpu=True),
        }
        self.programs = Programs(default_bpf_dir(), ["oncpu", "offcpu"], defines)
        self.walker = pywalk.PyWalker(self.programs.bpf)
        self.oncpu = OnCpuSampler(self.programs.bpf, SAMPLE_HZ, python=self.walker)
        self.oncpu.attach()
        self.offcpu = OffCpuTracer(self.programs.bpf, 1, python=self.walker)

    def add(self, pid: int) -> CPythonProcess:
        """Name `pid` to the walker as the runtime reader's detection finds it; its reader names frames."""
        ctx = ProcessContext(pid, "/proc", ProcessMemory(pid, ReadBudget(1 << 30)), FileCache())
        target = version.detect(ctx, modern=True, legacy=True)
        assert isinstance(target, version.Target), f"pid {pid}: {target}"
        self.walker.add(pid, target.layout, target.runtime)
        return CPythonProcess(target)

    def close(self) -> None:
        for source in (self.oncpu, self.offcpu):
            source.detach()
            source.close()
        self.programs.close()


@pytest.fixture(scope="module")
def sampler() -> Iterator[Sampler]:
    require_root()
    s = Sampler()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def argvs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, tuple[list[str], str]]]]:
    """script name → version → (argv, the script as that interpreter sees it)."""
    root = sid_root()
    work = tmp_path_factory.mktemp("pywalk")
    inside = Path("/tmp") / f"ebpfprofiler-test-walk-{os.getpid()}"
    try:
        yield {s.name: interpreters(s, work, root, inside) for s in (THREADS, WALK)}
    finally:
        shutil.rmtree(root / inside.relative_to("/"), ignore_errors=True)


def walk(
    sampler: Sampler, reader: CPythonProcess, pid: int, tid: int, enough: int, source: EventSource | None = None
) -> Walked:
    """Drain `source` (on-CPU) until the thread `tid` of `pid` has `enough` samples with a Python stack (or
    60 s pass), naming each stack's frames from its code pointers as it comes."""
    source = source or sampler.oncpu
    mem = ProcessMemory(pid, ReadBudget(1 << 30))
    names: dict[tuple[int, int | None], PyFrame | None] = {}
    got = Walked(0, Counter(), 0)

    def name(f: PyFrameRef) -> tuple[str, bool]:
        if (f.code, f.instr) not in names:
            names[(f.code, f.instr)] = reader.name(mem, f.code, f.instr)
        frame = names[(f.code, f.instr)]
        return (frame.function if frame else "?", f.entry)

    def drained() -> bool:
        raw = source.drain()
        for s in raw.samples:
            if s[0] != pid or s[1] != tid:
                continue
            got.samples += s[4]
            stack = raw.python_stacks.get(s[7]) if len(s) > 7 else None
            if stack is not None:
                got.stacks[tuple(name(f) for f in stack.frames)] += s[4]
                got.truncated += s[4] if stack.truncated else 0
        return sum(got.stacks.values()) >= enough

    wait_for(f"{enough} walked samples of pid {pid}", drained, timeout=60, interval=0.5)
    return got


def start(argv: list[str], script: str, *args: str, started: list[subprocess.Popen]) -> subprocess.Popen:
    p = subprocess.Popen([*argv, script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None
    return p


def walk_mode(
    sampler: Sampler,
    interpreter: tuple[list[str], str],
    args: tuple[str, ...],
    enough: int,
    started: list[subprocess.Popen],
    source: EventSource | None = None,
) -> Walked:
    """py_walk.py run in a mode (`args`) until its main thread has `enough` walked samples; then ended."""
    argv, script = interpreter
    p = start(argv, script, *args, started=started)
    assert p.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    try:
        return walk(sampler, sampler.add(p.pid), p.pid, p.pid, enough, source)
    finally:
        p.communicate(timeout=30)
        sampler.walker.remove(p.pid)


@pytest.mark.parametrize("version_", VERSIONS)
def test_the_busy_thread_reads_run_cpu_a_cpu_b_three_to_one_down_to_its_root(
    sampler: Sampler, argvs: dict, version_: str, started: list[subprocess.Popen]
) -> None:
    argv, script = argvs[THREADS.name][version_]
    p = start(argv, script, "120", "timed", started=started)
    tids = json.loads(p.stdout.readline())  # type: ignore[union-attr]
    reader = sampler.add(p.pid)
    got = walk(sampler, reader, p.pid, tids["worker"], WANT_SAMPLES)
    output, _ = p.communicate(timeout=30)
    sampler.walker.remove(p.pid)

    walked = sum(got.stacks.values())
    assert walked >= 0.9 * got.samples, f"{version_}: {walked} of {got.samples} samples have Python frames"
    leaf: Counter[str] = Counter()
    for stack, n in got.stacks.items():
        functions = [f for f, _ in stack]
        # the thread's root is threading's bootstrap, called from C, so it begins an eval call; cpu_a and
        # cpu_b are called from Python. (Thread.run calls run() with f(*args): through C on 3.11 and 3.12.)
        assert functions[-1] == "Thread._bootstrap", f"{version_}: root {functions[-1]} in {functions}"
        assert stack[-1][1], f"{version_}: entries in {stack}"
        assert not any(e for f, e in stack if f in ("cpu_a", "cpu_b")), f"{version_}: entries in {stack}"
        if functions[0] in ("cpu_a", "cpu_b"):
            assert functions[1] == "run", f"{version_}: {functions}"
        leaf[functions[0]] += n
    a, b = leaf["cpu_a"], leaf["cpu_b"]
    assert a + b >= 0.95 * walked, f"{version_}: leaves {leaf.most_common(5)}"
    assert_split_is_the_workloads(version_, a, b, output)
    assert got.truncated == 0


@pytest.mark.parametrize("version_", VERSIONS)
def test_a_python_callback_from_c_begins_its_own_eval_call(
    sampler: Sampler, argvs: dict, version_: str, started: list[subprocess.Popen]
) -> None:
    got = walk_mode(sampler, argvs[WALK.name][version_], ("callback",), 500, started)

    want = (("leaf_spin", False), ("key_of", True), ("sort_loop", False), ("main", False), ("<module>", True))
    top = got.stacks.most_common(1)[0][0]
    assert top == want, f"{version_}: {got.stacks.most_common(3)}"
    assert got.stacks[want] >= 0.8 * sum(got.stacks.values()), f"{version_}: {got.stacks.most_common(3)}"


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("version_", VERSIONS)
def test_a_recursion_deeper_than_the_frames_kept_keeps_its_root(
    sampler: Sampler, argvs: dict, version_: str, depth: int, started: list[subprocess.Popen]
) -> None:
    got = walk_mode(sampler, argvs[WALK.name][version_], ("deep", str(depth)), 200, started)

    stack = got.stacks.most_common(1)[0][0]
    functions = [f for f, _ in stack]
    # the frames kept are the walk's root-most ones, 3.12+'s shims below <module> among them (one; 3.15 has
    # a thread's base frame too)
    assert pywalk.PY_MAX_FRAMES - 2 <= len(functions) <= pywalk.PY_MAX_FRAMES, f"{version_}: {len(functions)} frames"
    assert functions[-2:] == ["main", "<module>"], f"{version_}: root end {functions[-4:]}"
    assert set(functions[:-2]) == {"descend"}, f"{version_}: {Counter(functions)}"
    assert got.truncated == sum(got.stacks.values())


@pytest.mark.parametrize("version_", VERSIONS)
def test_a_thread_blocked_in_time_sleep_is_off_cpu_under_its_python_function(
    sampler: Sampler, argvs: dict, version_: str, started: list[subprocess.Popen]
) -> None:
    got = walk_mode(sampler, argvs[WALK.name][version_], ("sleep",), 50, started, sampler.offcpu)

    want = (("nap", False), ("sleep_loop", False), ("main", False), ("<module>", True))
    assert got.stacks.most_common(1)[0][0] == want, f"{version_}: {got.stacks.most_common(3)}"
    assert got.stacks[want] >= 0.9 * sum(got.stacks.values()), f"{version_}: {got.stacks.most_common(3)}"


@dataclass
class CollectorEnd:
    """The collector's end of python-walk.sock and its announcer, and a runtime reader's PUSH to it."""

    walks: PythonWalks
    announcer: Announcer
    push: zmq.Socket


@pytest.fixture
def collector_end(sampler: Sampler, tmp_path: Path) -> Iterator[CollectorEnd]:
    ctx: zmq.Context = zmq.Context.instance()
    end = CollectorEnd(
        PythonWalks(sampler.programs.bpf, str(tmp_path), ctx),
        Announcer(ctx, str(tmp_path), "test"),
        ctx.socket(zmq.PUSH),
    )
    end.push.setsockopt(zmq.LINGER, 0)
    end.push.connect(endpoints.python_walk(str(tmp_path)))
    try:
        yield end
    finally:
        end.push.close(0)
        end.walks.close()
        end.announcer.close()


def test_a_runtime_readers_answer_is_walked_only_for_a_process_the_collector_announced(
    sampler: Sampler, collector_end: CollectorEnd, started: list[subprocess.Popen]
) -> None:
    """Given the collector's end of python-walk.sock and its announcer, when a PythonProcess arrives for a
    process it announced, for one it did not, for a stale start time and as garbage, then only the first
    is walked (its py_procs entry written), the others counted; and the entry goes when the process exits."""
    walks, announcer = collector_end.walks, collector_end.announcer
    p = start(["/usr/bin/python3.11"], str(THREADS), "120", started=started)
    tids = json.loads(p.stdout.readline())  # type: ignore[union-attr]
    proc = read_process(p.pid, with_cmdline=False)
    assert proc is not None
    announcer.observe([proc])
    ctx = ProcessContext(p.pid, "/proc", ProcessMemory(p.pid, ReadBudget(1 << 30)), FileCache())
    target = version.detect(ctx, modern=True, legacy=True)
    assert isinstance(target, version.Target)
    answer = wire.PythonProcess(p.pid, proc.start_ticks, target.version, target.runtime, wire_layout(target.layout))
    for msg in (answer, replace(answer, pid=os.getpid()), replace(answer, start_ticks=proc.start_ticks + 1)):
        collector_end.push.send_multipart(wire.encode(msg))
    collector_end.push.send_multipart([b'{"v":1,"kind":"python_process","body":{}}'])

    def taken() -> bool:
        walks.receive(announcer)
        return sum(walks.stats[k] for k in ("python_walked", "python_unasked", "python_malformed")) >= 4

    wait_for("the four answers", taken, timeout=10, interval=0.1)
    assert (walks.stats["python_walked"], walks.stats["python_unasked"], walks.stats["python_malformed"]) == (1, 2, 1)
    assert set(walks.walker.walked) == {p.pid}
    got = walk(sampler, CPythonProcess(target), p.pid, tids["worker"], 50)
    assert {stack[0][0] for stack in got.stacks} <= {"cpu_a", "cpu_b", "run"}

    p.communicate(timeout=30)

    def forgotten() -> bool:
        announcer.flush()
        walks.forget_exited(announcer)
        return not walks.walker.walked

    wait_for("the exited process's entry to go", forgotten, timeout=10, interval=0.5)
    assert walks.stats["python_exited"] == 1


def test_a_kernel_that_refuses_the_walker_gets_the_rest_of_the_programs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a walker no verifier takes (a walk of a million frames), when the collector loads its programs
    for a config asking for Python stacks, then it loads them without the walker: refused alone, with the
    verifier's words, and the on-CPU sampler is there."""
    from collector import features
    from collector import main as collector_main
    from shared.config import ProfilerConfig

    defines = pywalk.bpf_defines()
    monkeypatch.setattr(pywalk, "bpf_defines", lambda: {**defines, "PY_WALK_FRAMES": 1 << 20})
    cfg = ProfilerConfig(python_stacks=True, offcpu=False, dwarf_unwind=False)
    collector = collector_main._load(cfg, default_bpf_dir(), str(tmp_path), features.probe())
    assert collector is not None
    try:
        assert collector.python is None and collector.oncpu.python is None
        refused = dict(collector.refused)
        assert "the kernel refused the programs with the walker" in refused["Python frames in cpu profiles"]
    finally:
        collector.close()
