"""DWARF unwinding end to end: whole user stacks of binaries built without frame pointers.

Given the pipeline with dwarf_unwind and offcpu_dwarf on, posting to the
reference receiver, when a workload built with -O2 -fomit-frame-pointer runs
(a hot path, a recursion 40 deep, a call through libc's qsort into its
comparator, and waits in usleep() and read()), then from the second upload
window on its stacks are whole down to main and __libc_start_call_main, agree
with `perf record --call-graph dwarf`, and its off-CPU stacks keep the
functions that blocked; a copy whose .eh_frame is scribbled over is a counted
skip with frame-pointer stacks, and the symbolizer goes on.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from receiver.store import list_profiles
from shared import pprof
from shared.config import ProfilerConfig
from tests.harness import Pipeline, Receiver, require_root, wait_for

NOFP_FLAGS = ["-O2", "-fomit-frame-pointer"]
# Tables come a few drains after a process starts (its module, then libc once the stacks
# reach it): 8 s windows leave room on a busy 2-CPU machine.
INTERVAL_S = 8
SAMPLE_HZ = 99
CPU_SECONDS = 18.0
OFFCPU_SECONDS = 24.0
START = ("__libc_start_call_main", "main")  # root side of every whole stack
HOT = ("main", "hot_path", "top", "mid", "leaf")
RECURSION = ("main", "recurse") + ("rec",) * 41 + ("rec_leaf",)


@dataclass
class Run:
    exe: str
    corrupt: str
    windows: dict[str, dict[int, list[pprof.ReadSample]]]  # profile type → window start → samples of exe
    corrupt_samples: list[pprof.ReadSample]
    log: str
    offcpu_loops: int
    counters: dict[str, dict[str, int]]  # each stage's RUN_DIR/<stage>.counters.json at its exit


def names(s: pprof.ReadSample) -> tuple[str, ...]:
    return tuple(f.function for f in s.frames)


def whole(s: pprof.ReadSample) -> bool:
    """The stack reaches main, and below it __libc_start_call_main (frames are root first)."""
    n = names(s)
    return any(n[i : i + 2] == START for i in range(len(n) - 1))


def own(s: pprof.ReadSample, exe: str) -> tuple[str, ...]:
    """The workload's own frames from main up (its _start sits below libc's start-up frames)."""
    n = tuple(f.function for f in s.frames if f.module == exe)
    return n[n.index("main") :] if "main" in n else n


def scribble_eh_frame(src: Path, dst: Path) -> None:
    """A copy of src whose .eh_frame is 0xff bytes (the program runs: nothing unwinds it), and
    whose build id differs in its last byte: tables are cached by build id, and the copy must
    not be taken for the original."""
    shutil.copy(src, dst)
    with open(dst, "rb") as f:
        elf = ELFFile(f)
        sec = elf.get_section_by_name(".eh_frame")
        note = elf.get_section_by_name(".note.gnu.build-id")
        assert sec is not None and note is not None
        offset, size = sec["sh_offset"], sec["sh_size"]
        id_end = note["sh_offset"] + note["sh_size"]
    with open(dst, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * size)
        f.seek(id_end - 1)
        last = f.read(1)[0]
        f.seek(id_end - 1)
        f.write(bytes([last ^ 0xFF]))


def loops_of(output: str) -> int:
    """The workload's count of loops, from its `loops=N` line."""
    m = re.search(r"loops=(\d+)", output)
    assert m is not None, output
    return int(m.group(1))


@pytest.fixture(scope="module")
def run(
    build: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]
) -> Iterator[Run]:
    require_root()
    exe = build("nofp", NOFP_FLAGS)
    work = tmp_path_factory.mktemp("dwarf")
    corrupt = work / "nofp-corrupt"
    scribble_eh_frame(exe, corrupt)
    receiver = Receiver(work / "received")
    try:
        pipeline = Pipeline(
            work,
            ProfilerConfig(
                sample_hz=SAMPLE_HZ,
                upload_interval_s=INTERVAL_S,
                offcpu=True,
                offcpu_dwarf=True,
                endpoint=receiver.url,
                local_dir=str(work / "unused"),
            ),
        )
        try:
            # Start just after a window boundary, so "the first window" is the one it starts in.
            wait_for(
                "the start of an upload window",
                lambda: 0.1 <= time.time() % INTERVAL_S < 1.0,
                timeout=INTERVAL_S + 1,
                interval=0.02,
            )
            procs = []
            for argv in (
                [str(exe), "cpu", str(CPU_SECONDS)],
                [str(exe), "offcpu", str(OFFCPU_SECONDS)],
                [str(corrupt), "cpu", "8"],
            ):
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
                module_started.append(procs[-1])
            outputs = [p.communicate(timeout=120)[0] for p in procs]
            assert all(p.returncode == 0 for p in procs), outputs
        finally:
            code = pipeline.stop()
        log = pipeline.log()
        assert code == 0, log
        windows: dict[str, dict[int, list[pprof.ReadSample]]] = {"cpu": {}, "offcpu": {}}
        corrupt_samples: list[pprof.ReadSample] = []
        for meta in list_profiles(str(receiver.dir)):
            if meta["type"] not in windows:
                continue
            profile = pprof.read(Path(meta["path"]).read_bytes())
            for s in profile.samples:
                path = s.labels.get("process.executable")
                if path == str(exe.resolve()):
                    windows[meta["type"]].setdefault(profile.time_ns, []).append(s)
                elif path == str(corrupt) and meta["type"] == "cpu":
                    corrupt_samples.append(s)
        loops = loops_of(outputs[1])
        yield Run(str(exe.resolve()), str(corrupt), windows, corrupt_samples, log, loops, pipeline.counters())
    finally:
        receiver.stop()


def later_windows(run: Run, kind: str) -> list[pprof.ReadSample]:
    starts = sorted(run.windows[kind])
    assert len(starts) >= 3, f"{kind}: windows {starts}"
    return [s for start in starts[1:] for s in run.windows[kind][start]]


def test_whole_named_stacks_from_the_second_window_on(run: Run) -> None:
    samples = later_windows(run, "cpu")
    total = sum(s.values[0] for s in samples)
    complete = sum(s.values[0] for s in samples if whole(s))
    broken: Counter[tuple[str, ...]] = Counter()
    for s in samples:
        if not whole(s):
            broken[names(s)] += s.values[0]
    assert total > 0
    print(f"whole stacks from the second window on: {complete}/{total} = {complete / total:.3f}")
    assert complete / total >= 0.95, f"{complete}/{total} whole; broken: {broken.most_common(5)}"
    unnamed = sum(s.values[0] for s in samples if whole(s) and not all(names(s)))
    assert unnamed / total <= 0.01, [names(s) for s in samples if not all(names(s))][:5]


def test_each_path_has_its_expected_stack(run: Run) -> None:
    samples = [s for s in later_windows(run, "cpu") if whole(s)]
    total = sum(s.values[0] for s in samples)
    by_leaf: Counter[str] = Counter()
    for s in samples:
        by_leaf[names(s)[-1]] += s.values[0]
    hot = [s for s in samples if names(s)[-1] == "leaf"]
    assert hot and all(own(s, run.exe) == HOT for s in hot), Counter(own(s, run.exe) for s in hot).most_common(3)
    deep = [s for s in samples if names(s)[-1] == "rec_leaf"]
    assert deep and all(own(s, run.exe) == RECURSION for s in deep), Counter(own(s, run.exe) for s in deep).most_common(
        3
    )
    # compare() is called by libc's qsort, which sort_path called: libc frames sit between them.
    sorting = [s for s in samples if names(s)[-1] == "compare"]
    assert sorting
    for s in sorting:
        n, mods = names(s), [f.module for f in s.frames]
        i, j = n.index("sort_path"), len(n) - 1
        assert n[: n.index("main") + 1][-2:] == START and i < j - 1, n
        assert all("libc" in m for m in mods[i + 1 : j]), list(zip(n, mods))
    for leaf in ("leaf", "rec_leaf", "compare"):
        assert by_leaf[leaf] / total >= 0.15, by_leaf.most_common(6)


def perf_stacks(exe: str, seconds: float, work: Path) -> Counter[tuple[str, ...]]:
    """Stacks (root first, function names) of `exe` sampled by perf record --call-graph dwarf."""
    data = work / "perf.data"
    subprocess.run(
        [
            "perf",
            "record",
            "-q",
            "-F",
            str(SAMPLE_HZ),
            "--call-graph",
            "dwarf",
            "-o",
            str(data),
            "--",
            exe,
            "cpu",
            str(seconds),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=120,
    )
    out = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "ip,sym"], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    stacks: Counter[tuple[str, ...]] = Counter()
    for block in out.strip().split("\n\n"):
        frames = [
            line.split(None, 1)[1].strip() if len(line.split(None, 1)) > 1 else ""
            for line in block.strip().splitlines()
        ]
        stacks[tuple(reversed(frames))] += 1
    return stacks


def test_stacks_agree_with_perf_dwarf(run: Run, tmp_path: Path) -> None:
    """The most common stacks are the same frames as perf's own DWARF unwinder finds."""
    theirs = perf_stacks(run.exe, 4.0, tmp_path)
    ours: Counter[tuple[str, ...]] = Counter()
    for s in later_windows(run, "cpu"):
        ours[names(s)] += s.values[0]

    def from_start(stack: tuple[str, ...]) -> tuple[str, ...]:
        """From __libc_start_call_main up (perf names the frames below it differently), each name
        in one spelling: perf reads libc's DWARF, so it names internal aliases (__GI___qsort_r)
        and inlined copies ("msort_with_tmp (inlined)") where we name the symbol
        (qsort_r, msort_with_tmp.part.0); runs of one name (recursion) count once."""
        stack = stack[stack.index(START[0]) :] if START[0] in stack else stack
        out: list[str] = []
        for name in stack:
            name = re.sub(r"\.(part|isra|constprop|cold)\.\d+$", "", name.removesuffix(" (inlined)"))  # noqa: PLW2901
            name = name.removeprefix("__GI_").lstrip("_")  # noqa: PLW2901
            if not out or out[-1] != name:
                out.append(name)
        return tuple(out)

    top_theirs = [from_start(st) for st, _ in theirs.most_common(3)]
    top_ours = {from_start(st) for st, _ in ours.most_common(10)}
    for st in top_theirs:
        assert st in top_ours, f"perf's stack {st} is not among ours: {sorted(top_ours)}"


def test_offcpu_stacks_through_libc_keep_the_waiting_functions(run: Run) -> None:
    samples = later_windows(run, "offcpu")
    blocked: Counter[str] = Counter()
    for s in samples:
        n = names(s)
        for fn in ("slow_wait", "fast_wait", "pipe_wait"):
            if fn in n and whole(s):
                blocked[fn] += s.values[1]
    total = sum(blocked.values())
    assert total > 0, [names(s) for s in samples][:5]
    shares = {fn: blocked[fn] / total for fn in ("slow_wait", "fast_wait", "pipe_wait")}
    # 300 : 100 : 200 ms per loop
    for fn, want in (("slow_wait", 3 / 6), ("fast_wait", 1 / 6), ("pipe_wait", 2 / 6)):
        assert abs(shares[fn] - want) <= 0.1 * want + 0.02, shares
    # and each wait's kernel stack is its own system call's, though the thread blocks in turn in
    # nanosleep and read (a kernel stack is read again unless the thread blocked where it did last)
    syscalls: dict[str, set[str]] = {}
    for s in samples:
        n = names(s)
        wait = next((fn for fn in ("slow_wait", "fast_wait", "pipe_wait") if fn in n), None)
        kernel = {f.function for f in s.frames if f.module == "[kernel.kallsyms]"}
        if wait is not None:
            syscalls.setdefault(wait, set()).update(k for k in kernel if k.startswith("__x64_sys_"))
    assert syscalls.get("slow_wait") == syscalls.get("fast_wait") == {"__x64_sys_clock_nanosleep"}, syscalls
    assert "__x64_sys_clock_nanosleep" not in syscalls.get("pipe_wait", set()), syscalls


def test_corrupt_eh_frame_is_a_counted_skip_with_frame_pointer_stacks(run: Run) -> None:
    # the corrupt file's table is refused (its CFI cannot be read), counted by the
    # worker that read it (by cause) and by the collector, whose frames then use frame pointers
    failed = sum(
        v
        for stage, c in run.counters.items()
        if stage.startswith("symbolizer-")
        for k, v in c.items()
        if k.startswith("unwind_failed_")
    )
    assert failed >= 1 and run.counters["collector"]["unwind_tables_failed"] >= 1, run.counters
    assert run.corrupt_samples, "the corrupt copy was not profiled"
    # Frame-pointer steps through code without frame pointers: its stacks do not reach main.
    total = sum(s.values[0] for s in run.corrupt_samples)
    reaching = sum(s.values[0] for s in run.corrupt_samples if whole(s))
    assert reaching / total < 0.5
    # The symbolizer went on: no worker restarted, and the healthy workload's windows kept coming.
    assert run.counters.get("run", {}) == {}, run.counters
    assert len(run.windows["cpu"]) >= 3
