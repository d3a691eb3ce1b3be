"""JVM on-CPU stacks end to end: the collector's cpu samples of real HotSpot JVMs (JDK 11, 17, 21, 25) carry
the thread's user registers and the top of its stack, and the runtime reader walks them into jvm_cpu profiles.

Given one pipeline with runtime_stacks: [jvm] (sample_hz 127, so that ~4,000 samples a JVM come in
~65 s on two CPUs, every one walked: under the reader's MAX_REGS_PER_S) and four JVMs, one per JDK (bench/assets/jdks.py), each running
tests/workloads/JvmSpin.java: a thread that never blocks, its CPU time split 3:1 by work between
splitA (a loop calling inlinedLeaf, which the JIT inlines) and splitB;
when the jvm_cpu profiles of the windows after every JVM's warm-up hold WANT_SAMPLES samples of each
JVM's spinning thread;
then, per JDK:
- at least 99% of them have named Java frames down from the thread's start (java.lang.Thread.run,
  JvmSpin.work and what it calls), not a cut-off JIT frame: the thread was running compiled code, which
  has no last Java frame to walk from, so these come from the registers; also those sampled on a
  method's first or last instructions (step() is called millions of times a second: its prologue and its
  return were 0.5-2% of the samples, cut at step before the reader decoded them, runtimes/jvm/x86edge.py);
- at most 0.2% of them are such a cut, step alone (0-0.03% measured since the decoder);
- splitA : splitB is within ±10% of the split the workload measured itself (by its thread's CPU clock,
  which is what the samples count: about 3:1, which it checks too);
- inlinedLeaf, which -XX:+PrintInlining reports inlined into splitA, is named under splitA, above the
  step() it calls, with file and lines: JvmSpin.work at the CALL_A line, splitA at CALL_LEAF,
  inlinedLeaf at CALL_STEP (return addresses: exact; the inlined frame from splitA's nmethod's scope
  descriptors at that call), step in its own lines or at line 0 (a running pc in a loop with no call or
  safepoint, where C2 keeps no debug information).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.assets import jdks
from receiver.store import list_profiles
from shared import pprof
from tests import harness
from tests.harness import Pipeline, Receiver, require_root, wait_for
from tests.runtime_harness import runtime_config, runtime_pipeline, start_logged, wait_warmed_up

VERSIONS = jdks.VERSIONS
SAMPLE_HZ = 127
# Samples of each JVM's spinning thread: 6,000 judge a 3:1 split within ±10% (3 standard deviations of a
# binomial share on the tighter side); ~95 s at SAMPLE_HZ on two CPUs.
WANT_SAMPLES = 6000
# At least this share of them has the workload's frames named (99.95-100% in four JDKs).
WANT_NAMED = 0.99
# At most this share of them is cut at step() (a stack of step alone): 0.5-2% in each JDK before the
# reader decoded prologues and epilogues, 0-0.03% since; the share above alone would miss the smaller cuts.
MAX_CUT_AT_STEP = 0.002
WORKLOAD_SECONDS = 240
# splitA, splitB and step stay methods of their own: inlined into their callers' compiled loops, their
# own loops would have no debug information of their own (the samples would name the caller).
# inlinedLeaf is inlined into splitA (-XX:+PrintInlining says so).
JAVA_FLAGS = [
    "-Xmx64m",
    "-Xss512k",
    "-XX:+UseSerialGC",
    "-XX:-UsePerfData",
    "-XX:+UnlockDiagnosticVMOptions",
    "-XX:+PrintInlining",
    "-XX:CompileCommand=quiet",
    "-XX:CompileCommand=dontinline,JvmSpin::splitA",
    "-XX:CompileCommand=dontinline,JvmSpin::splitB",
    "-XX:CompileCommand=dontinline,JvmSpin::step",
]
SOURCE_NAME = "JvmSpin.java"


def marked_lines(tag: str) -> set[int]:
    return harness.marked_lines(jdks.SPIN_SOURCE, tag)


def method_lines(name: str) -> range:
    """The lines of a method of the workload, from its declaration to its closing brace."""
    lines = jdks.SPIN_SOURCE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines, 1) if f" {name}(" in line and line.lstrip().startswith("static"))
    end = next(i for i in range(start, len(lines) + 1) if lines[i - 1] == "    }")
    return range(start, end + 1)


@dataclass
class Run:
    procs: dict[str, subprocess.Popen]
    outs: dict[str, Path]  # each JVM's output: -XX:+PrintInlining's report, "ready"
    samples: dict[int, list[pprof.ReadSample]]  # pid → jvm_cpu samples of its spinning thread, after warm-up
    log: str  # the pipeline's
    counters: dict[str, dict[str, int]]  # each stage's RUN_DIR/<stage>.counters.json at its exit


def spin_samples(directory: Path, since_ns: int) -> dict[int, list[pprof.ReadSample]]:
    by_pid: dict[int, list[pprof.ReadSample]] = {}
    for meta in list_profiles(str(directory)):
        if meta["type"] != "jvm_cpu":
            continue
        profile = pprof.read(Path(meta["path"]).read_bytes())
        if profile.time_ns < since_ns:
            continue
        assert profile.sample_types == (("samples", "count"), ("cpu", "nanoseconds")), profile.sample_types
        for s in profile.samples:
            if str(s.labels.get("thread.name", "")).startswith("spin-"):
                by_pid.setdefault(int(s.labels["pid"]), []).append(s)
    return by_pid


def count(samples: list[pprof.ReadSample]) -> int:
    return sum(s.values[0] for s in samples)


def start_jdks(
    work: Path, classes: Path, javas: dict[str, Path], started: list[subprocess.Popen]
) -> tuple[dict[str, subprocess.Popen], dict[str, Path]]:
    """JvmSpin on every JDK, each handed to `started` as it starts; (version → process, version → its
    output) once every one has warmed up."""
    procs: dict[str, subprocess.Popen] = {}
    outs: dict[str, Path] = {}
    for v, java in javas.items():
        outs[v] = work / f"jdk{v}.out"
        argv = [str(java), *JAVA_FLAGS, "-cp", str(classes), "JvmSpin", str(WORKLOAD_SECONDS), "1"]
        procs[v] = start_logged(argv, outs[v], started)
    for v, p in procs.items():
        wait_warmed_up(f"JDK {v}", p, outs[v], "ready\n")
    return procs, outs


def wait_for_spins(pipeline: Pipeline, receiver: Receiver, procs: dict[str, subprocess.Popen], since_ns: int) -> None:
    """Until every JDK's spinning thread has WANT_SAMPLES samples received since `since_ns`; when it times
    out, their counts and the pipeline's lines of the runtime reader and of registration say why."""

    def enough() -> bool:
        got = spin_samples(receiver.dir, since_ns)
        return all(count(got.get(p.pid, [])) >= WANT_SAMPLES for p in procs.values())

    try:
        wait_for("jvm_cpu profiles of every JDK", enough, timeout=240, interval=1.0)
    except AssertionError as e:
        got = spin_samples(receiver.dir, since_ns)
        runtime_log = [ln for ln in pipeline.log().splitlines() if " runtime[" in ln or "regist" in ln]
        raise AssertionError(
            f"{e}; samples {[count(got.get(p.pid, [])) for p in procs.values()]}; "
            "the pipeline said:\n" + "\n".join(runtime_log[-30:])
        ) from None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]) -> Iterator[Run]:
    """Given the pipeline sampling JVM threads on CPU, when JvmSpin runs on every JDK, then its profiles."""
    require_root()
    work = tmp_path_factory.mktemp("jvmcpu")
    classes = jdks.classes(jdks.SPIN_SOURCE)
    javas = {v: jdks.java_of(v) for v in VERSIONS}
    receiver = Receiver(work / "received")
    try:
        with runtime_pipeline(work, runtime_config(work, receiver, "jvm", sample_hz=SAMPLE_HZ)) as pipeline:
            procs, outs = start_jdks(work, classes, javas, module_started)
            warm_ns = time.time_ns()
            wait_for_spins(pipeline, receiver, procs, warm_ns)
        yield Run(procs, outs, spin_samples(receiver.dir, warm_ns), pipeline.log(), pipeline.counters())
    finally:
        receiver.stop()


def own_frames(s: pprof.ReadSample) -> list[pprof.Frame]:
    """The sample's frames of the workload's class, root first."""
    return [f for f in s.frames if f.function.startswith("JvmSpin.")]


@pytest.mark.parametrize("version", VERSIONS)
def test_running_java_threads_are_walked_from_their_registers(run: Run, version: str) -> None:
    samples = run.samples[run.procs[version].pid]
    named = sum(
        s.values[0] for s in samples if s.functions[0] == "java.lang.Thread.run" and "JvmSpin.work" in s.functions
    )
    total = count(samples)
    assert named >= WANT_NAMED * total, (
        f"JDK {version}: {named} of {total} samples are whole from Thread.run through JvmSpin.work; "
        f"others: {[s.functions for s in samples if 'JvmSpin.work' not in s.functions][:5]}"
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_a_method_sampled_entering_or_returning_keeps_its_callers(run: Run, version: str) -> None:
    samples = run.samples[run.procs[version].pid]
    cut = sum(s.values[0] for s in samples if s.functions == ("JvmSpin.step",))
    assert cut <= MAX_CUT_AT_STEP * count(samples), (
        f"JDK {version}: {cut} of {count(samples)} samples are step() alone, cut from its callers"
    )


# The frames the workload's own timing ends in (JvmSpin's ThreadMXBean.getCurrentThreadCpuTime calls).
TIMING_FRAMES = ("sun.management.ThreadImpl.", "java.lang.System.nanoTime")


def measured_split(out: Path) -> float:
    """splitA's time over splitB's, as the workload last measured it (its "split A_NS B_NS" lines)."""
    lines = re.findall(r"^split (\d+) (\d+)$", out.read_text(), re.MULTILINE)
    assert lines, f"the workload printed no split line: {out.read_text()[-500:]}"
    a, b = (int(v) for v in lines[-1])
    return a / b


@pytest.mark.parametrize("version", VERSIONS)
def test_spinning_thread_splits_three_to_one(run: Run, version: str) -> None:
    samples = run.samples[run.procs[version].pid]
    a = sum(s.values[0] for s in samples if "JvmSpin.splitA" in s.functions)
    b = sum(s.values[0] for s in samples if "JvmSpin.splitB" in s.functions)
    # The workload times each split with the thread's CPU clock: those calls, named under it, are its own
    # work too (a system call each, dearer on some VMs: 1.1% of the samples on one).
    neither = Counter(
        s.functions[-1]
        for s in samples
        for _ in range(s.values[0])
        if not {"JvmSpin.splitA", "JvmSpin.splitB"} & set(s.functions)
    )
    timing = sum(n for leaf, n in neither.items() if leaf.startswith(TIMING_FRAMES))
    assert a + b + timing >= WANT_NAMED * count(samples), (
        f"JDK {version}: splitA {a}, splitB {b}, the workload's timing {timing} of {count(samples)}; "
        f"the others end in {neither.most_common(5)}"
    )
    truth = measured_split(run.outs[version])
    assert 2.7 <= truth <= 3.3, f"JDK {version}: the workload itself split {truth:.2f}:1"
    se = (a / b) * (1 / a + 1 / b) ** 0.5  # the sampled ratio's standard error (binomial counts)
    assert 0.9 * truth <= a / b <= 1.1 * truth, (
        f"JDK {version}: splitA:splitB = {a}:{b} = {a / b:.2f} ± {se:.2f} (1 standard error), the workload "
        f"measured {truth:.2f} (±10%); {count(samples) - a - b} samples named neither"
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_inlined_method_is_named_under_its_caller_with_file_and_lines(run: Run, version: str) -> None:
    report = run.outs[version].read_text()
    assert re.search(r"JvmSpin::inlinedLeaf \(\d+ bytes\)\s+inline \(hot\)", report), (
        f"JDK {version}: -XX:+PrintInlining did not report inlinedLeaf inlined"
    )
    samples = run.samples[run.procs[version].pid]
    call_a, call_leaf, call_step, step = (
        marked_lines("CALL_A"),
        marked_lines("CALL_LEAF"),
        marked_lines("CALL_STEP"),
        method_lines("step"),
    )
    good = 0
    seen = []
    for s in samples:
        own = own_frames(s)
        names = [f.function for f in own]
        if "JvmSpin.splitA" not in names:
            continue
        seen.append([(f.function, f.line) for f in own[-4:]])
        if (
            names[-4:] == ["JvmSpin.work", "JvmSpin.splitA", "JvmSpin.inlinedLeaf", "JvmSpin.step"]
            and own[-4].line in call_a
            and own[-3].line in call_leaf
            and own[-2].line in call_step
            and (own[-1].line in step or own[-1].line == 0)
            and all(f.filename == SOURCE_NAME for f in own)
        ):
            good += s.values[0]
    a = sum(s.values[0] for s in samples if "JvmSpin.splitA" in s.functions)
    assert good >= 0.9 * a, f"JDK {version}: {good} of {a} splitA samples named right; some: {seen[:5]}"


def test_every_sample_was_walked_not_a_subsample(run: Run) -> None:
    assert all(run.samples.values()), "a JVM's spinning thread has no samples"
    assert run.counters["runtime"]["regs_subsampled"] == 0, run.counters["runtime"]
