"""Off-CPU profiles end to end: where threads block, by stack, with blocked time only.

Given the pipeline with off-CPU profiling posting to the receiver, when C
workloads built from source block in known places, then the received offcpu
profiles charge those stacks the time they blocked — and nothing for time a
task spent runnable: preempted, or woken and waiting for a CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from receiver.store import list_profiles
from shared import pprof
from shared.config import ProfilerConfig
from tests.harness import Pipeline, Receiver, require_root, workload_fields

RATIO_SECONDS = 6.0
NS = 1e9


@dataclass
class OffcpuRun:
    samples_by_exe: dict[str, list[pprof.ReadSample]]
    types: set[str]

    def of(self, exe: Path) -> list[pprof.ReadSample]:
        return self.samples_by_exe.get(str(exe.resolve()), [])


def run_pipeline(
    work: Path,
    cfg: ProfilerConfig,
    workloads: list[list[str]],
    started: list[subprocess.Popen],
    env: dict[str, str] | None = None,
) -> tuple[OffcpuRun, list[str]]:
    """Run the pipeline around `workloads` (started together, each appended to `started`, the caller's
    fixture that ends them); their stdout, and the offcpu samples. `env`: the stages' (harness.Pipeline)."""
    receiver = Receiver(work / "received")
    try:
        # Python stacks (python_wall, of any CPython 3.13+ on the host) are test_python_stacks.py's.
        pipeline = Pipeline(work, cfg.replace(endpoint=receiver.url, python_stacks=False), env=env)
        try:
            procs = []
            for argv in workloads:
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
                started.append(procs[-1])
            outputs = [p.communicate(timeout=120)[0] for p in procs]
            assert all(p.returncode == 0 for p in procs), outputs
        finally:
            assert pipeline.stop() == 0, pipeline.log()
        by_exe: dict[str, list[pprof.ReadSample]] = {}
        types = set()
        for meta in list_profiles(str(receiver.dir)):
            types.add(meta["type"])
            if meta["type"] != "offcpu":
                continue
            for s in pprof.read(Path(meta["path"]).read_bytes()).samples:
                by_exe.setdefault(str(s.labels["process.executable"]), []).append(s)
        return OffcpuRun(by_exe, types), outputs
    finally:
        receiver.stop()


@dataclass
class Workloads:
    run: OffcpuRun
    offcpu: Path
    no_rseq: Path  # the same workload with glibc's rseq off: its stacks are read another way
    pinned: Path
    ratio_wall_s: float
    no_rseq_wall_s: float
    pinned_cpu_s: float
    tiny_loops: int
    ratio_loops: int


@pytest.fixture(scope="module")
def min_1ms(
    build: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]
) -> Iterator[Workloads]:
    """offcpu_min_ms: 1 — the 3:1:2 workload (also without rseq), two CPU hogs on one CPU, a 200 µs sleeper."""
    require_root()
    work = tmp_path_factory.mktemp("offcpu")
    offcpu = build("offcpu")
    tiny = work / "tiny_sleeper"
    shutil.copy(offcpu, tiny)
    no_rseq = work / "no_rseq"
    shutil.copy(offcpu, no_rseq)
    pinned = work / "pinned_hog"
    shutil.copy(build("hot"), pinned)
    # Frame-pointer stacks (these workloads have frame pointers): building unwind tables for
    # every process at start costs seconds of CPU, and on a loaded 2-CPU VM more 200 µs
    # timers fire over 1 ms late, which this test counts.
    run, outputs = run_pipeline(
        work,
        ProfilerConfig(sample_hz=19, upload_interval_s=5, offcpu_min_ms=1, dwarf_unwind=False),
        [
            [str(offcpu), "ratio", str(RATIO_SECONDS)],
            ["taskset", "-c", "0", str(pinned), "2"],
            ["taskset", "-c", "0", str(pinned), "2"],
            [str(tiny), "tiny", "3"],
            # A thread that never passes rseq_update (as Go's, musl's and static binaries' do not): its
            # user stack is read when it blocks, its kernel stack when it is switched back in.
            ["env", "GLIBC_TUNABLES=glibc.pthread.rseq=0", str(no_rseq), "ratio", str(RATIO_SECONDS)],
        ],
        module_started,
    )
    ratio_wall = float(workload_fields(outputs[0])["wall_seconds"])
    pinned_cpu = sum(float(workload_fields(out)["cpu_seconds"]) for out in outputs[1:3])
    yield Workloads(
        run,
        offcpu,
        no_rseq,
        pinned,
        ratio_wall,
        float(workload_fields(outputs[4])["wall_seconds"]),
        pinned_cpu,
        int(workload_fields(outputs[3])["loops"]),
        int(workload_fields(outputs[0])["loops"]),
    )


def blocked_ns_by_waiter(samples: list[pprof.ReadSample]) -> Counter[str]:
    out: Counter[str] = Counter()
    for s in samples:
        names = set(s.functions)
        for waiter in ("slow_wait", "fast_wait", "pipe_wait"):
            if waiter in names:
                out[waiter] += s.values[1]
    return out


@pytest.mark.parametrize("rseq", [True, False], ids=["rseq", "no_rseq"])
def test_blocked_time_splits_3_1_2_and_sums_to_wall_time(min_1ms: Workloads, rseq: bool) -> None:
    assert min_1ms.run.types == {"cpu", "offcpu"}
    exe, wall = (min_1ms.offcpu, min_1ms.ratio_wall_s) if rseq else (min_1ms.no_rseq, min_1ms.no_rseq_wall_s)
    by = blocked_ns_by_waiter(min_1ms.run.of(exe))
    unit = (by["slow_wait"] / 3 + by["fast_wait"] + by["pipe_wait"] / 2) / 3
    for waiter, share in (("slow_wait", 3), ("fast_wait", 1), ("pipe_wait", 2)):
        assert abs(by[waiter] / unit - share) <= 0.10 * share, f"{waiter}: {by[waiter] / NS:.3f}s of {dict(by)}"
    total = sum(by.values()) / NS
    assert abs(total - wall) <= 0.10 * wall, f"blocked {total:.3f}s vs wall {wall:.3f}s"


@pytest.fixture(scope="module")
def records_by_thread_id(
    build: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]
) -> Iterator[Workloads]:
    """The 3:1:2 workload (also without rseq) as a kernel before 5.11 profiles it: no task storage, so
    bpf/offcpu.c keeps its per-thread records in LRU hashes by thread id, and no prev_state argument of
    sched_switch (5.18), so the blocking task's state is read from its task_struct (collector/features.py)."""
    require_root()
    work = tmp_path_factory.mktemp("offcpu_by_tid")
    offcpu = build("offcpu")
    no_rseq = work / "no_rseq"
    shutil.copy(offcpu, no_rseq)
    run, outputs = run_pipeline(
        work,
        ProfilerConfig(sample_hz=19, upload_interval_s=5, offcpu_min_ms=1, dwarf_unwind=False),
        [
            [str(offcpu), "ratio", str(RATIO_SECONDS)],
            ["env", "GLIBC_TUNABLES=glibc.pthread.rseq=0", str(no_rseq), "ratio", str(RATIO_SECONDS)],
        ],
        module_started,
        env={"EBPFPROFILER_DISABLE_FEATURES": "task_storage,switch_prev_state"},
    )
    yield Workloads(
        run,
        offcpu,
        no_rseq,
        offcpu,
        float(workload_fields(outputs[0])["wall_seconds"]),
        float(workload_fields(outputs[1])["wall_seconds"]),
        0.0,
        0,
        int(workload_fields(outputs[0])["loops"]),
    )


@pytest.mark.parametrize("rseq", [True, False], ids=["rseq", "no_rseq"])
def test_without_task_storage_blocked_time_still_splits_3_1_2(records_by_thread_id: Workloads, rseq: bool) -> None:
    """Given a kernel without task storage nor sched_switch's prev_state (Debian 11's 5.10), when threads block
    3:1:2 in three places,
    then the records by thread id charge the same split, and the blocked time sums to the wall time."""
    test_blocked_time_splits_3_1_2_and_sums_to_wall_time(records_by_thread_id, rseq)


def test_samples_count_blocking_intervals(min_1ms: Workloads) -> None:
    counts: Counter[str] = Counter()
    # (intervals, ms) of each sample, for a failure: one CI run in ~16 has missed one 100-ms block
    # (its loop's other two charged, nothing lost by the kernel's count); a weighted charge or a
    # missing one tells a sampled block from an uncharged one
    charges: dict[str, list[tuple[int, float]]] = {}
    for s in min_1ms.run.of(min_1ms.offcpu):
        for waiter in ("slow_wait", "fast_wait", "pipe_wait"):
            if waiter in s.functions:
                counts[waiter] += s.values[0]
                charges.setdefault(waiter, []).append((s.values[0], round(s.values[1] / 1e6, 1)))
    loops = min_1ms.ratio_loops  # one interval of each wait per loop
    assert all(counts[w] == loops for w in ("slow_wait", "fast_wait", "pipe_wait")), (counts, loops, charges)


@pytest.mark.parametrize("rseq", [True, False], ids=["rseq", "no_rseq"])
def test_kernel_frames_of_a_sleeping_stack_are_named(min_1ms: Workloads, rseq: bool) -> None:
    samples = min_1ms.run.of(min_1ms.offcpu if rseq else min_1ms.no_rseq)
    # One thread blocks in nanosleep twice, then in a pipe read, over and over: the kernel stack
    # read for a block is reused only while the thread blocks in the same place (offcpu_same_block),
    # so each wait keeps its own.
    nanosleep = ["do_syscall_64", "__x64_sys_nanosleep", "hrtimer_nanosleep"]
    for waiter in ("slow_wait", "fast_wait", "pipe_wait"):
        mine = [s for s in samples if waiter in s.functions]
        assert mine, waiter
        for s in mine:
            kernel = [f.function for f in s.frames if f.module == "[kernel.kallsyms]"]
            assert kernel and all(kernel), s.functions
            user = [f.function for f in s.frames if f.module != "[kernel.kallsyms]"]
            # The blocked thread's kernel stack as the kernel saves it (bpf_get_task_stack when it
            # is switched back in): the syscall's path down to the scheduler, whose own __sched
            # functions (schedule, do_nanosleep) the kernel's unwinder leaves out of it.
            if waiter == "pipe_wait":
                assert "vfs_read" in kernel and kernel[-1].endswith("pipe_read"), kernel
                assert user[-3:] == ["main", waiter, "raw_syscall3"], user
            else:
                assert kernel[-3:] == nanosleep, (waiter, kernel)
                assert user[-4:] == ["main", waiter, "sleep_ns", "raw_syscall3"], user


def test_preempted_cpu_hogs_are_not_off_cpu(min_1ms: Workloads) -> None:
    blocked = sum(s.values[1] for s in min_1ms.run.of(min_1ms.pinned)) / NS
    # Two hogs on one CPU ran 2 s of CPU each, preempting each other throughout.
    run_time = 2 * min_1ms.pinned_cpu_s
    assert blocked < 0.02 * run_time, f"{blocked:.3f}s off-CPU of {run_time:.1f}s"


def test_intervals_under_min_ms_are_dropped(min_1ms: Workloads) -> None:
    tiny = [s for samples in min_1ms.run.samples_by_exe.values() for s in samples if "tiny_wait" in s.functions]
    intervals = sum(s.values[0] for s in tiny)
    # On a loaded VM a rare 200 µs sleep really blocks for over 1 ms (its timer
    # fires late while the vCPU waits for the host): those count, nothing shorter.
    # (Checked with the off-CPU programs alone: of 23 such intervals in 9,828 sleeps beside two
    # pinned hogs, every one had a wakeup 1 ms or more after the thread blocked; under the suite's
    # load the share reached 1.9%.)
    # What decides it is that every interval counted was itself 1 ms or more (the last check); the
    # share of such late sleeps is the VM's (1.9% to 3.8% seen in CI), so only "most are dropped".
    assert min_1ms.tiny_loops > 2000
    assert intervals <= 0.10 * min_1ms.tiny_loops, (
        f"{intervals} of {min_1ms.tiny_loops} 200 µs sleeps counted with offcpu_min_ms: 1"
    )
    assert all(s.values[1] >= 1_000_000 * s.values[0] for s in tiny), [s.values for s in tiny]


def test_intervals_are_kept_with_min_ms_0(
    build: Callable[..., Path], tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    require_root()
    offcpu = build("offcpu")
    run, _ = run_pipeline(
        tmp_path,
        ProfilerConfig(sample_hz=19, upload_interval_s=5, offcpu_min_ms=0),
        [[str(offcpu), "tiny", "2"]],
        started,
    )
    tiny = [s for s in run.of(offcpu) if "tiny_wait" in s.functions]
    intervals = sum(s.values[0] for s in tiny)
    # ~2 s of 200 µs sleeps (plus timer slack): thousands of intervals
    assert intervals > 2000, intervals
    assert sum(s.values[1] for s in tiny) / intervals < 1_000_000


SAMPLED_SECONDS = 40.0


def test_blocks_under_sample_ms_are_sampled_and_weighted_to_their_true_time(
    build: Callable[..., Path], tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    """Blocks of 6 and 2 ms, under offcpu_sample_ms 10: each is charged with the chance
    length / 10 ms, as 10 ms and 10 ms / length intervals (the default, 50 ms, samples the same way,
    with five times fewer charges: this test would need five times as long for the same error). Over 40 s (~5,000 of each) the blocked
    time and the count of each come out within 10% of the truth (the 2-ms one, kept ~1,000 times,
    has a standard error of ~3%)."""
    require_root()
    offcpu = build("offcpu")
    cfg = ProfilerConfig(sample_hz=19, upload_interval_s=5, offcpu_min_ms=1, offcpu_sample_ms=10, dwarf_unwind=False)
    run, outputs = run_pipeline(tmp_path, cfg, [[str(offcpu), "short", str(SAMPLED_SECONDS)]], started)
    out = workload_fields(outputs[0])
    loops = int(out["loops"])
    truth = {"six_ms_wait": float(out["six_ns"]), "two_ms_wait": float(out["two_ns"])}
    blocked: Counter[str] = Counter()
    intervals: Counter[str] = Counter()
    whole: Counter[str] = Counter()
    for s in run.of(offcpu):
        for waiter in truth:
            if waiter in s.functions:
                intervals[waiter] += s.values[0]
                blocked[waiter] += s.values[1]
                whole[waiter] += s.values[1] % 10_000_000 == 0
    # Charged as samples of 10 ms each, not as their own lengths: a window's sum is a whole number
    # of 10 ms (unless a sleep woke 4 ms late on a loaded VM, and was charged in full as a long block).
    assert all(whole[w] for w in truth), (whole, run.of(offcpu))
    for waiter, ns in truth.items():
        assert abs(blocked[waiter] - ns) <= 0.10 * ns, (waiter, blocked[waiter] / NS, ns / NS)
        assert abs(intervals[waiter] - loops) <= 0.10 * loops, (waiter, intervals[waiter], loops)


# A CPython loop of 20-ms sleeps for WAIT_TEST_S seconds; prints its loops and wall time per loop.
SLEEPER = """import sys, time
start, n = time.monotonic(), 0
while time.monotonic() - start < float(sys.argv[1]):
    time.sleep(0.02)
    n += 1
print(f"loops={n} wall_per_loop_ns={int((time.monotonic() - start) / n * 1e9)}")
"""
SLEEP_NS = 20_000_000
WAIT_TEST_S = 8


def test_a_woken_threads_wait_for_a_cpu_is_not_blocked_time(
    build: Callable[..., Path], tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    require_root()
    # given a sleeper of 20-ms sleeps at nice 19 on a CPU two hogs keep busy: after each wakeup it
    # waits for the CPU (bpf/offcpu.c offcpu_waited)
    sleeper = tmp_path / "waiting_sleeper"
    shutil.copy(os.path.realpath(sys.executable), sleeper)
    hog = build("hot")
    # (every 20-ms sleep charged in full, not sampled under the default offcpu_sample_ms: the test
    # asks what each one is charged)
    run, outputs = run_pipeline(
        tmp_path,
        ProfilerConfig(sample_hz=19, upload_interval_s=5, offcpu_min_ms=1, offcpu_sample_ms=0, dwarf_unwind=False),
        [
            ["taskset", "-c", "1", str(hog), str(WAIT_TEST_S + 2)],
            ["taskset", "-c", "1", str(hog), str(WAIT_TEST_S + 2)],
            ["taskset", "-c", "1", "nice", "-n", "19", str(sleeper), "-I", "-S", "-c", SLEEPER, str(WAIT_TEST_S)],
        ],
        started,
    )
    fields = workload_fields(outputs[2])
    wall_per_loop = int(fields["wall_per_loop_ns"])
    sleeps = [s for s in run.of(sleeper) if "hrtimer_nanosleep" in s.functions]
    intervals = sum(s.values[0] for s in sleeps)
    blocked_per_sleep = sum(s.values[1] for s in sleeps) / max(1, intervals)
    # (the wait was there to leave out: a loop took a millisecond or more over its sleep)
    assert wall_per_loop - SLEEP_NS >= 1_000_000, fields
    # then each sleep is charged its 20 ms (and the timer's slack), not the wait after it
    assert intervals >= 0.9 * int(fields["loops"]), (intervals, fields)
    assert SLEEP_NS <= blocked_per_sleep <= SLEEP_NS + (wall_per_loop - SLEEP_NS) / 2, (blocked_per_sleep, fields)
