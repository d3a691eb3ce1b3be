"""On-CPU profiling end to end: real BPF, real workloads, real sockets, real HTTP.

Given the whole pipeline (collector, two symbolizer workers, uploader) posting
to the reference receiver, when native workloads built from source run, then
the received cpu profiles carry their stacks, counts, names and labels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared import endpoints, pprof
from shared.config import ProfilerConfig
from tests.harness import Pipeline, Received, Receiver, bpf_holdings, bpftool, read_received, require_root

SAMPLE_HZ = 99
HOT_CPU_SECONDS = 4.0
HOT_STACK = ("main", "top", "mid", "leaf")


@dataclass
class Run:
    profiles: list[Received]
    hot_exe: str
    hot_pid: int
    hot_cpu_seconds: float
    syscall_exe: str
    jit_exe: str
    jit_shared_exe: str  # the JIT whose code is in shared anonymous memory
    jit_symlink_exe: str
    jit_symlink_pid: int
    log: str
    collector_progs: set[int]

    def cpu(self) -> list[Received]:
        return [r for r in self.profiles if r.meta["type"] == "cpu"]

    def samples_of(self, exe: str) -> list[pprof.ReadSample]:
        return [s for r in self.cpu() for s in r.profile.samples if s.labels.get("process.executable") == exe]


def start_workload(started: list[subprocess.Popen], *argv: str, user: int | None = None) -> subprocess.Popen:
    """A workload, appended to `started` (the fixture that ends it) as soon as it runs."""
    p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, text=True, user=user, group=user)
    started.append(p)
    return p


def run_hot(started: list[subprocess.Popen], hot: Path) -> tuple[float, int]:
    """The hot loop run to its end: (the CPU seconds it says it used, its pid)."""
    p = start_workload(started, str(hot), str(HOT_CPU_SECONDS))
    out, _ = p.communicate(timeout=60)
    return float(out.split("=")[1]), p.pid


def run_syscall_and_jits(
    started: list[subprocess.Popen], syscall: Path, jit: Path, jit_shared: Path, jit_symlink: Path, stolen: Path
) -> int:
    """The syscall workload, the JIT with its own perf map (its code in private, and in shared anonymous
    memory) and the symlinking one (as nobody, its perf map pointed at `stolen`, which names its code)
    together, each to a clean end; the symlinking one's pid."""
    sc = start_workload(started, str(syscall), "3")
    jt = start_workload(started, str(jit), "3", "own")
    jh = start_workload(started, str(jit_shared), "3", "shared")
    js = start_workload(started, str(jit_symlink), "3", "symlink", str(stolen), user=65534)
    for q in (jt, jh, js):
        assert q.stdout is not None
        line = q.stdout.readline().split()
        assert line[:1] == ["ready"], line
    stolen.write_text(f"{line[1]} 10 stolen_name\n")
    for q in (sc, jt, jh, js):
        q.communicate(timeout=60)
        assert q.returncode == 0
    return js.pid


@pytest.fixture(scope="module")
def run(
    build: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]
) -> Iterator[Run]:
    """Given the pipeline with 2 workers and the receiver, when the workloads run, then stop all."""
    require_root()
    hot, syscall, jit = build("hot"), build("syscall"), build("jit")
    work = tmp_path_factory.mktemp("oncpu")
    # The symlinking "JIT" runs as nobody, from a directory nobody can enter,
    # and points its perf map at a file owned by root that names its code.
    shared_dir = Path(tempfile.mkdtemp(prefix="ebpfprofiler-test-"))
    shared_dir.chmod(0o755)
    jit_symlink, jit_shared = shared_dir / "jit_symlink", shared_dir / "jit_shared"
    shutil.copy(jit, jit_symlink)
    shutil.copy(jit, jit_shared)
    receiver = Receiver(work / "received")
    try:
        pipeline = Pipeline(
            work,
            ProfilerConfig(
                sample_hz=SAMPLE_HZ,
                upload_interval_s=5,
                symbolizer_workers=2,
                endpoint=receiver.url,
                # Python stacks (python_wall, of any CPython 3.13+ on the host) are test_python_stacks.py's.
                local_dir=str(work / "unused"),
                python_stacks=False,
            ),
        )
        try:
            hot_cpu, hot_pid = run_hot(module_started, hot)
            symlink_pid = run_syscall_and_jits(
                module_started, syscall, jit, jit_shared, jit_symlink, shared_dir / "stolen.map"
            )
            collector = int(Path(endpoints.ready_file(str(pipeline.run_dir), "collector")).read_text())
            collector_progs, _ = bpf_holdings(collector)
        finally:
            code = pipeline.stop()
        assert code == 0, pipeline.log()
        yield Run(
            read_received(receiver.dir),
            str(hot.resolve()),
            hot_pid,
            hot_cpu,
            str(syscall.resolve()),
            str(jit.resolve()),
            str(jit_shared),
            str(jit_symlink),
            symlink_pid,
            pipeline.log(),
            collector_progs,
        )
    finally:
        receiver.stop()
        shutil.rmtree(shared_dir, ignore_errors=True)


def test_hot_loop_stack_is_main_top_mid_leaf(run: Run) -> None:
    samples = run.samples_of(run.hot_exe)
    total = sum(s.values[0] for s in samples)
    assert total > 0, f"no samples of {run.hot_exe}; services: {[r.meta['service'] for r in run.profiles]}"

    def own_frames(s: pprof.ReadSample) -> tuple[str, ...]:
        # The workload's own frames from main up; below main are libc's start-up frames
        # and, once DWARF unwinding walks through them, the workload's _start.
        own = tuple(f.function for f in s.frames if f.module == run.hot_exe)
        return own[own.index("main") :] if "main" in own else own

    exact = sum(
        s.values[0]
        for s in samples
        if own_frames(s) == HOT_STACK and all(f.module == run.hot_exe or "libc" in f.module for f in s.frames)
    )
    stacks: Counter[tuple[str, ...]] = Counter()
    for s in samples:
        stacks[own_frames(s)] += s.values[0]
    assert exact / total >= 0.90, f"only {exact}/{total} on {HOT_STACK}; top stacks: {stacks.most_common(5)}"


def test_sample_count_matches_rate_times_cpu_time(run: Run) -> None:
    total = sum(s.values[0] for s in run.samples_of(run.hot_exe))
    expected = SAMPLE_HZ * run.hot_cpu_seconds  # one busy thread
    assert abs(total - expected) <= 0.15 * expected, f"{total} samples, expected {expected:.0f} ±15%"
    cpu_ns = sum(s.values[1] for s in run.samples_of(run.hot_exe))
    assert cpu_ns == total * (1_000_000_000 // SAMPLE_HZ)


def test_profiles_are_per_service_and_typed(run: Run) -> None:
    hot = [r for r in run.cpu() if r.meta["service"] == run.hot_exe]
    assert hot, "no cpu profile for the hot workload's service"
    assert {r.meta["type"] for r in run.profiles} == {"cpu", "offcpu"}  # offcpu is on by default
    for r in run.profiles:
        assert r.meta["source"] == "ebpf"
        kind = r.meta["type"]
        assert r.profile.sample_types == (("samples", "count"), (kind, "nanoseconds"))
        if kind == "cpu":
            assert r.profile.period == 1_000_000_000 // SAMPLE_HZ
        # every sample of a profile is of its service; kernel threads ([kworker/0:1] …) are one: [kernel]
        for smp in r.profile.samples:
            exe = str(smp.labels["process.executable"])
            kernel_thread = exe.startswith("[") and exe != "[unknown]"
            service = smp.labels.get("container") or ("[kernel]" if kernel_thread else exe)
            assert service == r.meta["service"]
    # Two workers share the services, and each service's window comes from one of them.
    windows = Counter((r.meta["type"], r.meta["service"], r.meta["start"]) for r in run.profiles)
    assert max(windows.values()) == 1, f"a service window was split: {windows.most_common(3)}"


def test_go_tool_pprof_reads_every_profile(run: Run) -> None:
    assert run.profiles
    for r in run.profiles:  # cpu and offcpu
        out = subprocess.run(
            ["go", "tool", "pprof", "-top", r.meta["path"]], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        if r.meta["service"] == run.hot_exe and r.meta["type"] == "cpu":
            for fn in HOT_STACK:
                assert fn in out.stdout, out.stdout


def test_labels_hash_pid_and_omit_command_line_by_default(run: Run) -> None:
    samples = run.samples_of(run.hot_exe)
    labels = samples[0].labels
    assert labels["host"] == os.uname().nodename
    assert labels["process.executable"] == run.hot_exe
    assert labels["pid"] != str(run.hot_pid) and len(str(labels["pid"])) == 16
    assert all("process.command_line" not in s.labels for r in run.profiles for s in r.profile.samples)
    assert len({s.labels["pid"] for s in samples}) == 1


def test_syscall_workload_has_named_kernel_frames_under_user_frames(run: Run) -> None:
    samples = run.samples_of(run.syscall_exe)
    total = sum(s.values[0] for s in samples)
    assert total > 0
    in_kernel = [s for s in samples if any(f.module == "[kernel.kallsyms]" for f in s.frames)]
    share = sum(s.values[0] for s in in_kernel) / total
    assert share > 0.5, f"only {share:.0%} of the syscall workload's samples are in the kernel"
    names: Counter[str] = Counter()
    callers: Counter[tuple[str, ...]] = Counter()
    for s in in_kernel:
        kinds = ["k" if f.module == "[kernel.kallsyms]" else "u" for f in s.frames]
        # root first: user frames, then the kernel frames above them
        assert kinds == sorted(kinds, reverse=True), [f.function for f in s.frames]
        own = tuple(f.function for f in s.frames if f.module == run.syscall_exe)
        callers[own[own.index("main") :] if "main" in own else own] += s.values[0]
        names.update(f.function for f in s.frames if f.module == "[kernel.kallsyms]")
    # Start-up and exit (exec, page faults before main) are in the kernel too, but rare.
    in_read = callers[("main", "read_loop", "raw_read")]
    assert in_read / sum(callers.values()) >= 0.9, callers.most_common(5)
    assert all(names), "a kernel frame without a name"
    assert names.keys() & {"ksys_read", "vfs_read", "__x64_sys_read", "read_zero", "do_syscall_64"}, names


@pytest.mark.parametrize("exe", ["jit_exe", "jit_shared_exe"])
def test_jit_frames_named_from_perf_map(run: Run, exe: str) -> None:
    # the JIT's code in private anonymous memory, and in shared ("/dev/zero (deleted)" in its maps):
    # both named as perf names them, from the perf map, not as an offset into a file called "zero"
    samples = run.samples_of(getattr(run, exe))
    leaves: Counter[str] = Counter()
    for s in samples:
        leaves[s.frames[-1].function if s.frames else ""] += s.values[0]
    assert leaves.most_common(1)[0][0] == "jit_spin_loop", leaves
    assert all(s.frames[-1].module == "[jit]" for s in samples if s.frames[-1].function == "jit_spin_loop")
    assert not [f.function for s in samples for f in s.frames if f.function.startswith("zero+")], leaves


def test_symlinked_perf_map_is_refused(run: Run) -> None:
    samples = run.samples_of(run.jit_symlink_exe)
    assert samples, "the symlinking process was not profiled"
    names = {f.function for s in samples for f in s.frames}
    assert "stolen_name" not in names and "jit_spin_loop" not in names, names
    refusals = [ln for ln in run.log.splitlines() if f"perf-{run.jit_symlink_pid}.map" in ln]
    # the log line is the feature: a refused perf map is logged once with the reason
    assert refusals and "symlink" in refusals[0], "the refusal was not logged"
    assert len(refusals) == 1, f"logged {len(refusals)} times, not once"


def test_stopping_leaves_no_bpf_program_or_perf_event(run: Run) -> None:
    # the collector held its programs while it ran (ids from its own fd table) …
    # on-CPU sampler, the off-CPU tp_btf programs (sched_switch, rseq_update), and the DWARF
    # unwinder's on-CPU step program and off-CPU step and finish programs
    assert len(run.collector_progs) == 6
    # … and after the stop none of them, nor a perf link to one, is left
    assert not run.collector_progs & {p["id"] for p in bpftool("prog", "show")}
    assert not [e for e in bpftool("perf") if e.get("prog_id") in run.collector_progs]
    assert not [e for e in bpftool("link", "show") if e.get("prog_id") in run.collector_progs]
