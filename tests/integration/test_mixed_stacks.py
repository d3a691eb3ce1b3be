"""Mixed stacks end to end: Python frames walked in BPF, spliced into the cpu profile's native stacks.

Given `ebpfprofiler run` (collector, symbolizer, runtime reader, uploader) posting to the reference
receiver with python_stacks and python_legacy on, native stacks walked with frame pointers or with
unwind tables (DWARF), when tests/workloads/py_threads.py and py_walk.py run under the host's CPython
3.11 and sid's 3.13, 3.14 and 3.15 (chrooted), then the received `cpu` profiles show, per interpreter:
- the busy thread's hot Python function in at least 90% of its samples, under its real caller, with the
  split of cpu_a and cpu_b the workload measured in its own thread CPU time (3:1 by work; ±10%), and the
  same Python functions in the same order as py-spy's;
- a Python callback sorted() calls from C under its caller, with the C frames of the sort between them
  (required with DWARF: frame pointers do not reach through Debian's 3.11 and 3.13, built without them;
  sid's stripped 3.13+ run the eval loop in a part split away from its symbol, named by
  symbolizer/elf.py's SPLIT_FUNCTIONS: 100% of samples for every version here);
- every Python frame with its file and a line in its function.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared import pprof
from tests import harness
from tests.harness import PY, WORKLOADS, Receiver, require_root
from tests.python_roots import VERSIONS, assert_split_is_the_workloads, interpreters, samples_by_pid, sid_root
from tests.runtime_harness import runtime_config, runtime_pipeline, wait_for_stacks

THREADS = WORKLOADS / "py_threads.py"
WALK = WORKLOADS / "py_walk.py"
SAMPLE_HZ = 199
# The busy thread's cpu samples judged per interpreter: the 3:1 split to ±10% at 3.5 sigma (6.9/sqrt(N)).
WANT_SAMPLES = 3000
WANT_CALLBACK_SAMPLES = 300
WORKLOAD_SECONDS = 240  # the workloads' own deadline: they end by themselves if the test cannot end them
PY_SPY = str(Path(PY).parent / "py-spy")
MODES = ("fp", "dwarf")


@dataclass
class Got:
    tids: dict[str, int]  # py_threads.py's thread name → native id
    threads_pid: int
    callback_pid: int
    filename: str  # py_threads.py as the interpreter sees it
    py_spy: list[str] = field(default_factory=list)  # the worker's function names, leaf first
    threads_output: str = ""  # py_threads.py's output, ending with the CPU time it measured per function


@dataclass
class Run:
    mode: str  # native unwinding: "fp" or "dwarf"
    got: dict[str, Got]  # version → its workloads
    samples: dict[int, list[pprof.ReadSample]]  # pid → cpu samples


def cpu_samples(directory: Path) -> dict[int, list[pprof.ReadSample]]:
    return samples_by_pid(directory, "cpu")


def is_python(f: pprof.Frame) -> bool:
    return f.filename.endswith(".py")


def python_functions(s: pprof.ReadSample) -> list[str]:
    """The sample's Python frames, root first."""
    return [f.function for f in s.frames if is_python(f)]


def worker_of(samples: list[pprof.ReadSample]) -> list[pprof.ReadSample]:
    """py_threads.py's busy thread's samples (cpu profiles carry no thread label; its other threads are
    blocked): those under threading's bootstrap."""
    return [s for s in samples if "Thread._bootstrap" in python_functions(s)]


def start(argv: list[str], *args: str, started: list[subprocess.Popen]) -> subprocess.Popen:
    p = subprocess.Popen([*argv, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started.append(p)  # killed and reaped at the module's end (conftest.py)
    return p


def py_spy_worker(pid: int, tid: int) -> list[str]:
    out = subprocess.run(
        [PY_SPY, "dump", "--nonblocking", "--json", "--pid", str(pid)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return next([f["name"] for f in t["frames"]] for t in json.loads(out.stdout) if t["os_thread_id"] == tid)


def profile_version(
    pipeline: harness.Pipeline, receiver: Receiver, argvs: dict, version: str, started: list[subprocess.Popen]
) -> Got:
    """Both workloads of one interpreter, until the cpu profiles hold enough of their samples."""
    argv, threads = argvs[THREADS.name][version]
    t = start(argv, threads, str(WORKLOAD_SECONDS), "timed", started=started)
    tids = json.loads(t.stdout.readline())  # type: ignore[union-attr]
    argv, walk = argvs[WALK.name][version]
    c = start(argv, walk, "callback", started=started)
    assert c.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    got = Got(tids, t.pid, c.pid, threads, py_spy_worker(t.pid, tids["worker"]))

    def enough() -> bool:
        by_pid = cpu_samples(receiver.dir)
        worker = worker_of(by_pid.get(t.pid, []))
        callback = [s for s in by_pid.get(c.pid, []) if "key_of" in python_functions(s)]
        return (
            sum(s.values[0] for s in worker) >= WANT_SAMPLES
            and len(callback) > 0
            and sum(s.values[0] for s in callback) >= WANT_CALLBACK_SAMPLES
        )

    wait_for_stacks(pipeline, f"cpu profiles with Python frames of CPython {version}", enough, timeout=120)
    got.threads_output, _ = t.communicate(timeout=30)  # closing stdin ends it
    c.communicate(timeout=30)
    return got


@pytest.fixture(scope="module", params=MODES)
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]
) -> Iterator[Run]:
    require_root()
    root = sid_root()
    work = tmp_path_factory.mktemp(f"mixed-{request.param}")
    inside = Path("/tmp") / f"ebpfprofiler-test-mixed-{os.getpid()}"
    argvs = {s.name: interpreters(s, work, root, inside) for s in (THREADS, WALK)}
    receiver = Receiver(work / "received")
    cfg = runtime_config(
        work,
        receiver,
        "python_legacy",
        python_stacks=True,
        sample_hz=SAMPLE_HZ,
        dwarf_unwind=request.param == "dwarf",
    )
    try:
        with runtime_pipeline(work, cfg) as pipeline:
            got = {v: profile_version(pipeline, receiver, argvs, v, module_started) for v in VERSIONS}
        yield Run(request.param, got, cpu_samples(receiver.dir))
    finally:
        receiver.stop()
        shutil.rmtree(root / inside.relative_to("/"), ignore_errors=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_hot_python_function_is_in_the_cpu_profile_under_its_caller_three_to_one(run: Run, version: str) -> None:
    g = run.got[version]
    samples = run.samples[g.threads_pid]
    total = sum(s.values[0] for s in samples)
    leaf: Counter[str] = Counter()
    for s in samples:
        py = python_functions(s)
        if py and py[-1] in ("cpu_a", "cpu_b"):
            assert py[-2] == "run", f"{version}: {py}"
            leaf[py[-1]] += s.values[0]
    a, b = leaf["cpu_a"], leaf["cpu_b"]
    assert a + b >= 0.9 * total, f"{version}: cpu_a/cpu_b in {a + b} of {total} samples"
    assert_split_is_the_workloads(version, a, b, g.threads_output)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_python_frames_are_py_spys_in_its_order(run: Run, version: str) -> None:
    g = run.got[version]
    leaf = g.py_spy[0]
    ours = Counter(
        tuple(python_functions(s)) for s in worker_of(run.samples[g.threads_pid]) if python_functions(s)[-1:] == [leaf]
    )
    assert ours, f"{version}: no sample ends in py-spy's leaf {leaf}"
    top = list(ours.most_common(1)[0][0])
    assert list(reversed(top)) == g.py_spy, f"{version}: ours {top}, py-spy {g.py_spy}"


@pytest.mark.parametrize("version", VERSIONS)
def test_a_callback_from_c_keeps_the_c_frames_between_it_and_its_caller(run: Run, version: str) -> None:
    g = run.got[version]
    samples = [s for s in run.samples[g.callback_pid] if "key_of" in python_functions(s)]
    n = sum(s.values[0] for s in samples)
    between = 0
    for s in samples:
        names = [(f.function, is_python(f)) for f in s.frames]
        i = names.index(("sort_loop", True))
        j = names.index(("key_of", True))
        assert i < j, f"{version}: {names}"
        if any(not py for _, py in names[i + 1 : j]):
            between += s.values[0]
    print(f"{run.mode} {version}: C frames between sort_loop and key_of in {between} of {n}")
    if run.mode == "dwarf":
        assert between >= 0.9 * n, f"{version}: C frames between sort_loop and key_of in {between} of {n}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_python_frame_has_its_file_and_a_line(run: Run, version: str) -> None:
    g = run.got[version]
    lines = {name: harness.marked_lines(THREADS, tag, "#") for name, tag in (("cpu_a", "LINE_A"), ("cpu_b", "LINE_B"))}
    at: Counter[tuple[str, int]] = Counter()
    for s in worker_of(run.samples[g.threads_pid]):
        for f in s.frames:
            if is_python(f):
                assert f.line > 0, f"{version}: {f}"
        top = next((f for f in reversed(s.frames) if is_python(f)), None)  # the leaf-most Python frame
        if top is not None and top.function in lines:
            assert top.filename == g.filename
            at[(top.function, top.line)] += s.values[0]
    for fn, want in lines.items():
        line = max((n, line) for (f, line), n in at.items() if f == fn)[1]
        assert line in want, f"{version}: {fn} mostly at line {line}, not its loop {sorted(want)}"
