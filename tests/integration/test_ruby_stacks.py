"""Ruby stacks end to end: Debian's stripped libruby, chrooted, the whole pipeline, ruby_wall profiles.

With runtime_stacks: [ruby], the pipeline reads Ruby 3.3 (Debian trixie) and
3.4 (Debian experimental), each run chrooted in its cached Debian root as in
a container (bench/assets/runtime_roots.py). Debian's libruby exports no
ruby_current_vm_ptr (hidden, .symtab stripped): the reader finds the VM by
its scan of libruby's writable data. The received ruby_wall profiles show,
per version, methods named with their class as Ruby's own profiling API
names them: the main thread in <main> → Work.run (a class method) →
Work#cpu_a / Spin#cpu_b (a method of a module Work includes) in a 3:1 ratio
(±10%) with the script's file and lines; a second thread asleep in
Object#blocked_here → Array#each → "block in Object#blocked_here" →
Kernel#sleep (C functions named through the VM's symbol table, with the class
of their method entry); in a second process, the thread of a second ractor
busy in Crunch.in_ractor (the reader walks the VM's ring of ractors) while
the main ractor's thread waits in Ractor#take; in a third, threads waiting in
C functions (ruby_waits.rb): the main thread's stack ends <main> (at its JOIN
line, with the script's file) → Thread#join, a thread's Object#park_here →
Kernel#sleep, another's Cycle#each_round → Array#each → "block in
Cycle#each_round" → Kernel#sleep.

Refusal, logged once with the reason (the stage's Reader driven tick by
tick): Ruby 3.1 (Debian bookworm's, in its root).

The symbol path, on a built fixture (no libruby that keeps ruby_current_vm_ptr
was reachable): a copy of trixie's libruby 3.3 with the symbol added to its
.symtab is read through it; one whose symbol points a word off is refused.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.assets import runtime_roots
from collector.procfs import read_maps
from receiver.store import list_profiles
from runtimes import elfsyms
from runtimes import ruby as ruby_plugin
from runtimes.memory import ProcessMemory, ReadBudget
from runtimes.ruby.layouts import LAYOUTS
from runtimes.runtime import FileCache, ProcessContext, first_mappings
from shared import pprof
from tests import harness
from tests.harness import WORKLOADS, Pipeline, Receiver, require_root, wait_for
from tests.runtime_harness import DrivenReader, runtime_config, runtime_pipeline, start, wait_for_stacks

SCRIPT = WORKLOADS / "ruby_split.rb"
RACTOR_SCRIPT = WORKLOADS / "ruby_ractor.rb"
WAITS_SCRIPT = WORKLOADS / "ruby_waits.rb"
# Processes per version: sampled at random phases of their cycle (a loaded host moves them), each
# stack is a draw with p = 3/4, so N stacks judge 3:1 to one sigma of 6.9/sqrt(N) (binomial; 2,400
# put +-10% at under two sigma). Twelve give 6,400 in ~28 s, where +-10% is 3.5 sigma.
COPIES = 12
# Main-thread stacks per version before the ratio is judged.
WANT_STACKS = 6400
# Stacks of the blocked threads at least.
WANT_BLOCKED = 1800
# Stacks of the second ractor's thread at least (one process read 19 times a second for ~28 s).
WANT_RACTOR = 200
# Stacks of each thread of ruby_waits.rb at least (one process read 19 times a second for ~28 s).
WANT_WAITS = 200
# The workload's own deadline: it ends by itself even if the test cannot end it.
WORKLOAD_SECONDS = 180


def marked_lines(tag: str, script: Path = SCRIPT) -> set[int]:
    return harness.marked_lines(script, tag, "#")


def method_lines(qualified: str) -> range:
    """The lines of a method ("Work#cpu_a", "Work.run", "Object#blocked_here"), def to end."""
    name = qualified.replace(".", "#").split("#")[-1]
    lines = SCRIPT.read_text().splitlines()
    start = next(i for i, line in enumerate(lines, 1) if line.strip().startswith((f"def {name}(", f"def self.{name}(")))
    end = next(
        i
        for i, line in enumerate(lines[start:], start + 1)
        if line.strip() == "end"
        and len(line) - len(line.lstrip()) == len(lines[start - 1]) - len(lines[start - 1].lstrip())
    )
    return range(start, end + 1)


@dataclass
class Workload:
    version: str
    procs: list[subprocess.Popen]
    filename: str
    ractor: subprocess.Popen | None = None  # ruby_ractor.rb
    ractor_filename: str = ""
    waits: subprocess.Popen | None = None  # ruby_waits.rb
    waits_filename: str = ""


@dataclass
class Run:
    workloads: list[Workload]
    samples: dict[int, list[pprof.ReadSample]]  # pid → ruby_wall samples


def received_samples(directory: Path) -> dict[int, list[pprof.ReadSample]]:
    by_pid: dict[int, list[pprof.ReadSample]] = {}
    for meta in list_profiles(str(directory)):
        if meta["type"] != "ruby_wall":
            continue
        for s in pprof.read(Path(meta["path"]).read_bytes()).samples:
            by_pid.setdefault(int(s.labels["pid"]), []).append(s)
    return by_pid


def main_samples(run: Run, w: Workload) -> list[pprof.ReadSample]:
    return [s for p in w.procs for s in run.samples.get(p.pid, []) if s.labels.get("thread.id") == str(p.pid)]


def other_samples(run: Run, w: Workload) -> list[pprof.ReadSample]:
    return [s for p in w.procs for s in run.samples.get(p.pid, []) if s.labels.get("thread.id") != str(p.pid)]


def ractor_samples(samples: dict[int, list[pprof.ReadSample]], w: Workload, main: bool) -> list[pprof.ReadSample]:
    """The ractor process's stacks of its main thread (main) or of the others (the second ractor's)."""
    assert w.ractor is not None
    return [s for s in samples.get(w.ractor.pid, []) if (s.labels.get("thread.id") == str(w.ractor.pid)) == main]


def waits_per_thread(samples: dict[int, list[pprof.ReadSample]], w: Workload) -> Counter[str]:
    """Stacks of the waits process per thread (its three, once each has been read)."""
    assert w.waits is not None
    got: Counter[str] = Counter()
    for s in samples.get(w.waits.pid, []):
        got[str(s.labels.get("thread.id", ""))] += s.values[0]
    return got if len(got) >= 3 else Counter()


def start_ruby(started: list[subprocess.Popen], root: Path, version: str, filename: str) -> subprocess.Popen:
    """ruby<version> running `filename` in `root`, handed to `started` (module_started) as it starts."""
    p = subprocess.Popen(
        ["chroot", str(root), f"/usr/bin/ruby{version}", filename, str(WORKLOAD_SECONDS)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    started.append(p)
    assert p.stdout is not None and p.stdout.readline().startswith("ready "), f"ruby{version} {filename} did not start"
    return p


def profile_version(
    pipeline: Pipeline,
    receiver: Receiver,
    version: str,
    root: Path,
    inside: Path,
    workloads: list[Workload],
    started: list[subprocess.Popen],
) -> None:
    """Ruby `version`'s ractor process, its waits process and COPIES copies of the workload in `root`
    (appended to `workloads` as they start), until WANT_STACKS of the copies' main threads, WANT_RACTOR
    of the second ractor and WANT_WAITS of each thread of the waits process are received; then they
    are killed."""
    filename = str(inside / SCRIPT.name)
    w = Workload(
        version,
        [],
        filename,
        ractor_filename=str(inside / RACTOR_SCRIPT.name),
        waits_filename=str(inside / WAITS_SCRIPT.name),
    )
    workloads.append(w)
    w.ractor = start_ruby(started, root, version, w.ractor_filename)
    w.waits = start_ruby(started, root, version, w.waits_filename)
    for _ in range(COPIES):
        w.procs.append(start_ruby(started, root, version, filename))

    def enough() -> bool:
        got = received_samples(receiver.dir)
        return (
            sum(s.values[0] for p in w.procs for s in got.get(p.pid, []) if s.labels.get("thread.id") == str(p.pid))
            >= WANT_STACKS
            and sum(s.values[0] for s in ractor_samples(got, w, main=False)) >= WANT_RACTOR
            and min(waits_per_thread(got, w).values(), default=0) >= WANT_WAITS
        )

    wait_for_stacks(pipeline, f"ruby_wall profiles of Ruby {version}", enough, timeout=120)
    for p in [*w.procs, w.ractor, w.waits]:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, module_started: list[subprocess.Popen]) -> Iterator[Run]:
    """Given the pipeline reading Ruby stacks, when the workloads run on each Ruby, then its profiles."""
    require_root()
    work = tmp_path_factory.mktemp("ruby")
    inside = Path("/tmp") / f"ebpfprofiler-test-{os.getpid()}"
    roots = {"3.3": runtime_roots.trixie(), "3.4": runtime_roots.experimental()}
    for root in roots.values():
        (root / inside.relative_to("/")).mkdir(parents=True, exist_ok=True)
        shutil.copy(SCRIPT, root / inside.relative_to("/") / SCRIPT.name)
        shutil.copy(RACTOR_SCRIPT, root / inside.relative_to("/") / RACTOR_SCRIPT.name)
        shutil.copy(WAITS_SCRIPT, root / inside.relative_to("/") / WAITS_SCRIPT.name)
    receiver = Receiver(work / "received")
    workloads: list[Workload] = []
    try:
        with runtime_pipeline(work, runtime_config(work, receiver, "ruby")) as pipeline:
            for v, root in roots.items():  # one version at a time
                profile_version(pipeline, receiver, v, root, inside, workloads, module_started)
        yield Run(workloads, received_samples(receiver.dir))
    finally:
        receiver.stop()
        for root in roots.values():
            shutil.rmtree(root / inside.relative_to("/"), ignore_errors=True)


VERSIONS = ["3.3", "3.4"]


def workload(run: Run, version: str) -> Workload:
    return next(w for w in run.workloads if w.version == version)


@pytest.mark.parametrize("version", VERSIONS)
def test_main_thread_is_in_cpu_a_and_cpu_b_three_to_one(run: Run, version: str) -> None:
    w = workload(run, version)
    inside: Counter[str] = Counter()
    for s in main_samples(run, w):
        names = [f.function for f in s.frames]
        # The script's <main>, or, in Ruby's start-up, gem_prelude's (as rb_profile_frames reads them: the
        # VM's bottom frame, an empty "<main>" with the script's path, is under neither).
        assert names[0] in ("<main>", "<internal:gem_prelude>"), f"{version}: {names}"
        # Not in Work.run: Ruby's start-up (gem_prelude requiring rubygems), or run's own loop.
        inside[names[-1] if names[-1] in ("Work#cpu_a", "Spin#cpu_b") and "Work.run" in names else "other"] += s.values[
            0
        ]
    a, b = inside["Work#cpu_a"], inside["Spin#cpu_b"]
    assert a + b >= 0.95 * sum(inside.values()), f"{version}: {inside.most_common(5)}"
    print(f"Ruby {version}: cpu_a {a} / cpu_b {b} = {a / max(b, 1):.2f}")
    assert 2.7 <= a / max(b, 1) <= 3.3, f"{version}: cpu_a {a} / cpu_b {b} = {a / max(b, 1):.2f}, expected 3 ±10%"


@pytest.mark.parametrize("version", VERSIONS)
def test_frames_carry_file_and_lines(run: Run, version: str) -> None:
    w = workload(run, version)
    calls = {"Work#cpu_a": marked_lines("CALL_A"), "Spin#cpu_b": marked_lines("CALL_B")}
    bodies = {"Work#cpu_a": marked_lines("LINE_A"), "Spin#cpu_b": marked_lines("LINE_B")}
    consistent = torn = 0
    body_lines: Counter[tuple[str, int]] = Counter()
    for s in main_samples(run, w):
        leaf = s.frames[-1]
        if leaf.function not in bodies:
            continue
        caller = s.frames[-2]
        assert caller.function == "Work.run" and leaf.filename == caller.filename == w.filename, s.frames
        assert caller.line in method_lines("Work.run"), s.frames
        assert leaf.line in method_lines(leaf.function), f"{version}: {leaf.function} at line {leaf.line}"
        body_lines[(leaf.function, leaf.line)] += s.values[0]
        if caller.line in calls[leaf.function]:
            consistent += s.values[0]
        else:
            torn += s.values[0]
    assert consistent and torn <= 0.05 * (consistent + torn), f"{version}: {torn} of {consistent + torn} torn"
    for fn, lines in bodies.items():  # mostly in its loop (its first line, i = 0, now and then)
        top = max((n, line) for (f, line), n in body_lines.items() if f == fn)[1]
        assert top in lines, f"{version}: {fn} mostly at line {top}, not its loop {sorted(lines)}"


@pytest.mark.parametrize("version", VERSIONS)
def test_second_thread_is_blocked_in_blocked_here(run: Run, version: str) -> None:
    w = workload(run, version)
    samples = other_samples(run, w)
    n = sum(s.values[0] for s in samples)
    assert n >= WANT_BLOCKED, f"{version}: only {n} stacks of the second threads"
    wait = marked_lines("WAIT")
    asleep = 0
    for s in samples:
        # Kernel#sleep (a C function: no file, no line), or, between two sleeps, Process.clock_gettime.
        leaf, block, each, method = s.frames[-1], s.frames[-2], s.frames[-3], s.frames[-4]
        assert leaf.function in ("Kernel#sleep", "Process.clock_gettime") and (leaf.filename, leaf.line) == ("", 0), (
            s.frames
        )
        assert block.function == "block in Object#blocked_here" and block.filename == w.filename, s.frames
        assert block.line in wait, s.frames
        assert each.function == "Array#each" and (each.filename, each.line) == ("", 0), s.frames
        assert method.function == "Object#blocked_here" and method.line in method_lines("blocked_here"), s.frames
        assert s.labels["thread.name"], s.labels
        asleep += s.values[0] if leaf.function == "Kernel#sleep" else 0
    assert asleep >= 0.99 * n, f"{version}: {asleep} of {n} in Kernel#sleep"


@pytest.mark.parametrize("version", VERSIONS)
def test_second_ractor_thread_is_in_crunch_in_ractor(run: Run, version: str) -> None:
    w = workload(run, version)
    crunch, take = marked_lines("CRUNCH", RACTOR_SCRIPT), marked_lines("TAKE", RACTOR_SCRIPT)
    others = ractor_samples(run.samples, w, main=False)
    n = sum(s.values[0] for s in others)
    print(f"Ruby {version}: {n} stacks of the second ractor's thread")
    assert n >= WANT_RACTOR, f"{version}: only {n} stacks of the second ractor's thread"
    block = marked_lines("RACTOR", RACTOR_SCRIPT)
    for s in others:
        frames = s.frames
        if frames[-1].function == "Process.clock_gettime":  # the loop's test, a C function: no file, no line
            assert (frames[-1].filename, frames[-1].line) == ("", 0) and frames[-2].function == "Crunch.in_ractor", s
            frames = frames[:-1]
        leaf, caller = frames[-1], frames[-2] if len(frames) > 1 else None
        if leaf.function == "block in <main>":  # the ractor's block, read before it called in_ractor
            assert leaf.line in block and leaf.filename == w.ractor_filename, s.frames
            continue
        assert leaf.function == "Crunch.in_ractor" and leaf.filename == w.ractor_filename and leaf.line in crunch, (
            s.frames
        )
        assert (
            caller is not None
            and caller.function == "block in <main>"
            and caller.line in block
            and caller.filename == w.ractor_filename
        ), s.frames
    # The main ractor's thread waits in Ractor#take at the script's TAKE line; stacks of Ruby's start-up
    # (gem_prelude's requires, before the script runs) are the few others.
    mains = ractor_samples(run.samples, w, main=True)
    waiting = 0
    for s in mains:
        script = [f for f in s.frames if f.filename == w.ractor_filename]
        if script:
            assert script[-1].function == "<main>" and script[-1].line in take, s.frames
            # (or, for a moment, in the C function respond_to? the line calls first)
            assert s.frames[-1].function in ("Ractor#take", "Kernel#respond_to?"), s.frames
            waiting += s.values[0] if s.frames[-1].function == "Ractor#take" else 0
    n = sum(s.values[0] for s in mains)
    assert waiting >= 0.9 * n and waiting, f"{version}: {waiting} of {n} main-thread stacks in Ractor#take"


@pytest.mark.parametrize("version", VERSIONS)
def test_threads_waiting_in_c_functions_are_named(run: Run, version: str) -> None:
    """The user's outcome of issue 43: C functions' frames named with their class (a C function has no
    file or line), blocks as "block in" their method, the main thread's <main> with its file."""
    w = workload(run, version)
    assert w.waits is not None
    join, park, each, rnd = (marked_lines(tag, WAITS_SCRIPT) for tag in ("JOIN", "PARK", "EACH", "ROUND"))
    threads = marked_lines("THREAD", WAITS_SCRIPT)
    c_frame = ("", 0)
    got: Counter[str] = Counter()
    seen: Counter[tuple[str, ...]] = Counter()
    for s in run.samples.get(w.waits.pid, []):
        f = s.frames
        names = tuple(x.function for x in f)
        seen[names] += s.values[0]
        if s.labels.get("thread.id") == str(w.waits.pid):
            script = [x for x in f if x.filename == w.waits_filename]
            if not script or script[-1].line not in join:  # Ruby's start-up, or the script before its join
                got["main, elsewhere"] += s.values[0]
                continue
            # One <main> (the VM's bottom frame, an empty "<main>" at line 0, is not one), with its file.
            assert names == ("<main>", "Thread#join") and (f[-1].filename, f[-1].line) == c_frame, f
            assert f[0].filename == w.waits_filename, f
            got["main in Thread#join"] += s.values[0]
        elif names == ("block in <main>", "Object#park_here", "Kernel#sleep"):
            assert f[-3].filename == f[-2].filename == w.waits_filename and f[-3].line in threads, f
            assert f[-2].line in park and (f[-1].filename, f[-1].line) == c_frame, f
            got["Object#park_here → Kernel#sleep"] += s.values[0]
        elif names == (
            "block in <main>",
            "Cycle#each_round",
            "Array#each",
            "block in Cycle#each_round",
            "Kernel#sleep",
        ):
            assert f[-4].line in each and f[-2].line in rnd and f[-2].filename == w.waits_filename, f
            assert (f[-3].filename, f[-3].line) == (f[-1].filename, f[-1].line) == c_frame, f
            got["Cycle#each_round → Array#each → block → Kernel#sleep"] += s.values[0]
        else:  # between two sleeps (Process.clock_gettime), or a thread before its first call
            got["other thread, elsewhere"] += s.values[0]
    print(f"Ruby {version}: {dict(got)}; most seen: {seen.most_common(4)}")
    main = got["main in Thread#join"] + got["main, elsewhere"]
    assert got["main in Thread#join"] >= 0.9 * main and main >= WANT_WAITS, f"{version}: {got}"
    assert got["Object#park_here → Kernel#sleep"] >= WANT_WAITS, f"{version}: {got}"
    assert got["Cycle#each_round → Array#each → block → Kernel#sleep"] >= WANT_WAITS, f"{version}: {got}"
    assert got["other thread, elsewhere"] <= 0.02 * sum(got.values()), f"{version}: {got}; {seen.most_common(8)}"


def test_ruby_3_1_is_refused_once_with_the_reason(
    tmp_path: Path, started: list[subprocess.Popen], caplog: pytest.LogCaptureFixture
) -> None:
    require_root()
    caplog.set_level(logging.INFO, logger="ebpfprofiler.runtime")
    root = runtime_roots.bookworm_ruby()
    driven = DrivenReader(tmp_path, runtime_stacks=("ruby",), python_stacks=False)
    try:
        p, _ = start(
            started, ["chroot", str(root), "/usr/bin/ruby3.1", "-e", 'puts "ready"; $stdout.flush; $stdin.read']
        )
        for _ in range(20):
            driven.announce(p.pid, full=True)
            driven.tick()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"pid {p.pid} ")]
        # the log line is the feature: a refused process is logged once with the reason and the supported versions
        assert len(lines) == 1, lines
        assert "refused: Ruby: " in lines[0] and "Ruby 3.1 is not supported (3.3 and 3.4 are" in lines[0], lines
        assert driven.reader.targets.entries[p.pid].state == "refused"
        assert p.poll() is None, "a refused process was disturbed"
    finally:
        driven.close()


# The name ruby3.3 asks the loader for (the copy is found under it in LD_LIBRARY_PATH).
SONAME = "libruby-3.3.so.3.3"
# A method the fixture process spins in until its deadline (it ends by itself).
SPIN_SCRIPT = (
    'def spin_here(t); x = 0; x += 1 while Time.now < t; end; puts "ready"; $stdout.flush; spin_here(Time.now + 120)'
)


def _vm_place(root: Path, started: list[subprocess.Popen]) -> tuple[Path, int]:
    """(trixie's libruby 3.3, the link-time address of its VM pointer): the scan's find, on a process
    of the library as Debian ships it (no symbol)."""
    lib = next(p for p in (root / "usr/lib/x86_64-linux-gnu").glob("libruby-3.3.so.3.3*") if not p.is_symlink())
    p, _ = start(started, ["chroot", str(root), "/usr/bin/ruby3.3", "-e", 'puts "ready"; $stdout.flush; $stdin.read'])
    ctx = ProcessContext(p.pid, "/proc", ProcessMemory(p.pid, ReadBudget(1 << 30)), FileCache())
    mod = next(iter(first_mappings(ctx.mappings, lambda base: base.startswith("libruby-3.3")).values()))
    with open(lib, "rb") as f:
        elf = elfsyms.read_symbols(f, ())
    found = ruby_plugin._scan(ctx, mod, LAYOUTS[(3, 3)])
    assert len(found) == 1, found
    p.kill()
    return lib, found[0][0] - elf.load_bias(mod.start, mod.offset)


@pytest.mark.parametrize("off_by", [0, 8], ids=["symbol", "symbol_off_by_a_word"])
def test_libruby_with_the_symbol_is_read_through_it_and_checked(
    tmp_path: Path, started: list[subprocess.Popen], caplog: pytest.LogCaptureFixture, off_by: int
) -> None:
    """Debian's libruby has no ruby_current_vm_ptr; a build that keeps it stands here as a built
    fixture: a copy of trixie's libruby 3.3 with the symbol added to its .symtab (objcopy) at the
    place the scan finds the VM pointer. The reader takes the VM from the symbol and reads the
    stacks; a copy whose symbol points a word off is refused by the self-check, with the reason, and
    not read by a scan."""
    require_root()
    caplog.set_level(logging.INFO, logger="ebpfprofiler.runtime")
    root = runtime_roots.trixie()
    lib, place = _vm_place(root, started)
    libdir = root / "tmp" / f"symbol-libruby-{os.getpid()}-{off_by}"
    libdir.mkdir(parents=True)
    driven = DrivenReader(tmp_path, runtime_stacks=("ruby",), python_stacks=False)
    try:
        subprocess.run(
            [
                "objcopy",
                "--add-symbol",
                f"ruby_current_vm_ptr={place + off_by:#x},global,object",
                str(lib),
                str(libdir / SONAME),
            ],
            check=True,
            timeout=60,
        )
        with open(libdir / SONAME, "rb") as f:
            assert elfsyms.read_symbols(f, ("ruby_current_vm_ptr",)).symbols == {"ruby_current_vm_ptr": place + off_by}
        p, _ = start(
            started,
            ["chroot", str(root), "env", f"LD_LIBRARY_PATH=/tmp/{libdir.name}", "/usr/bin/ruby3.3", "-e", SPIN_SCRIPT],
        )
        assert any(m.path.endswith(f"/tmp/{libdir.name}/{SONAME}") for m in read_maps(p.pid)), "not the copy"

        def read_some() -> bool:
            driven.announce(p.pid, full=True)
            driven.tick()
            state = driven.reader.targets.entries[p.pid].state if p.pid in driven.reader.targets.entries else ""
            return state == "refused" or (len(driven.stacks()) > 0 and sum(driven.stacks().values()) >= 20)

        wait_for("the reader to read or refuse the process", read_some, timeout=30, interval=0.05)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"pid {p.pid} ")]
        if off_by == 0:
            frames = [[f.function for f in fr] for (_, fr) in driven.stacks()]
            assert frames and all("Object#spin_here" in f for f in frames), frames[:5]
            assert driven.reader.targets.entries[p.pid].state != "refused", lines
        else:
            # the log line is the feature: the self-check's refusal is logged once, saying why the process is not read
            assert len(lines) == 1 and "self-check failed: ruby_current_vm_ptr does not point at a VM" in lines[0], (
                lines
            )
            assert not driven.stacks()
        assert p.poll() is None, "the process was disturbed"
    finally:
        driven.close()
        shutil.rmtree(libdir, ignore_errors=True)
