"""The runtime reader at its edges, with real processes: exits, pid reuse, refusals, bad frames.

The reader here is the stage's own Reader (runtimes/main.py) driven tick by
tick in the test process (tests/runtime_harness.py's DrivenReader), fed the
announcements the collector would send (built from /proc by the collector's
own read_process), reading real processes with process_vm_readv; its
profiles are its closed windows.

- A process that exits while it is read: killed between two ticks but not
  yet reaped (its pid and start time still name it, its memory is gone), and
  processes that end by themselves (os._exit, or a normal exit that tears
  the interpreter down) while the reader ticks without pause: no exception,
  every stack is one the process had, and the reader forgets them.
- A reused pid, made deterministic in a pid namespace of its own (unshare
  --pid --fork; ns_last_pid gives the second process the first one's pid):
  no stack of the second process is labelled as the first, and the control
  shows what the (pid, start time) check prevents: the first process's
  reader, pointed at the reused pid, reads the second one's functions
  (/usr/bin/python3.11 is not PIE: _PyRuntime is at the same address).
- Processes the reader must refuse, from tests/workloads/fake_python.c
  (CPython 3.10 and free-threaded builds are not packaged here): named
  python3.10; a 3.13 whose debug offsets say free-threaded; a failing
  self-check (PyCode_Type is not a type object; Py_Version disagrees with the
  file); hostile debug offsets. Each is refused with its reason, logged once
  at info level however often it is announced, and never read again.
- Frames that fail validation (not a code object, an instruction pointer
  outside the code, a line the table does not give, an unmapped code
  pointer, a loop) are dropped and counted by reason; the good frames of the
  same stack are kept, with their lines.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimes.runtime import StackReader
from runtimes.targets import start_ticks
from tests.harness import PY, ROOT, WORKLOADS, kill_and_reap, namespace_host_gaps, require_root, wait_for
from tests.runtime_harness import PYTHON311, SPINNER_FUNCTIONS, DrivenReader, go, spinner, start

FAKE_SOURCE = WORKLOADS / "fake_python.c"
# A process's own deadline: it ends by itself even if the test cannot end it.
WORKLOAD_SECONDS = 120
# Processes that end by themselves while the reader ticks (the last 0.35 s after the first).
EXITING_PROCESSES = 8
# The pid-namespace driver's whole run.
DRIVER_TIMEOUT_S = 120

# ------------------------------------------------------------------ helpers


@pytest.fixture
def driven(tmp_path: Path) -> Iterator[DrivenReader]:
    d = DrivenReader(tmp_path)
    try:
        yield d
    finally:
        d.close()


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


@pytest.fixture(scope="session")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/workloads/fake_python.c built as DIR/python3.13 and DIR/python3.10 (the reader goes by the name)."""
    out = tmp_path_factory.mktemp("fake-python")
    subprocess.run(
        ["gcc", "-O0", "-g", "-Wall", "-Werror", "-o", str(out / "python3.13"), str(FAKE_SOURCE)],
        check=True,
        timeout=120,
    )
    os.link(out / "python3.13", out / "python3.10")
    out.chmod(0o755)
    return out


# ------------------------------------------------------------------ refusals

REFUSALS = {
    # (file name, variant): what the reason must say
    ("python3.10", "ok"): "CPython 3.10 and older are not supported",
    ("python3.13", "free-threaded"): "a free-threaded build (no GIL): not supported",
    ("python3.13", "selfcheck"): "self-check failed: PyCode_Type is not a type object",
    ("python3.13", "py310"): "self-check failed: Py_Version in memory says 3.10.0",
    ("python3.13", "hostile-offsets"): "self-check failed: implausible debug offsets",
}


def test_refused_processes_are_logged_once_with_their_reason_and_left_alone(
    fake_python: Path, driven: DrivenReader, started: list[subprocess.Popen], caplog: pytest.LogCaptureFixture
) -> None:
    # Given a process of every kind the reader must refuse
    caplog.set_level(logging.INFO, logger="ebpfprofiler.runtime")
    pids = {}
    for (name, variant), reason in REFUSALS.items():
        p, _ = start(started, [str(fake_python / name), variant])
        pids[p.pid] = reason
    # When the collector announces them again and again (as its full re-announcements do)
    # and the reader ticks
    for _ in range(20):
        driven.announce(*pids, full=True)
        driven.tick()
    # Then each is refused with its reason, logged once at info level, and never detected again
    for pid, reason in pids.items():
        lines = [r for r in caplog.records if r.getMessage().startswith(f"pid {pid} ")]
        # the log line is the feature: each refusal is logged once, at info level, with its reason
        assert [(r.levelno, reason in r.getMessage()) for r in lines] == [(logging.INFO, True)], [
            r.getMessage() for r in lines
        ]
        assert driven.reader.targets.entries[pid].state == "refused"
        assert driven.reader.targets.entries[pid].reader is None
    assert driven.reader.targets.stats["refused"] == len(pids)
    assert driven.reader.stats["stacks"] == 0
    assert all(p.poll() is None for p in started), "a refused process was disturbed"


# ------------------------------------------------------------------ validation


def test_frames_that_fail_validation_are_dropped_and_counted(
    fake_python: Path, driven: DrivenReader, started: list[subprocess.Popen]
) -> None:
    # Given a process whose one thread's frame chain holds a frame of every kind that fails validation
    p, line = start(started, [str(fake_python / "python3.13"), "ok"])
    tid = json.loads(line)["tid"]
    driven.announce(p.pid)
    # When the reader reads it at 10 ticks
    driven.tick()  # detection
    assert driven.reader.targets.entries[p.pid].state == "reading"
    for _ in range(10):
        driven.tick()
    # Then every stack holds only the two good frames, with their lines, and every bad frame
    # was dropped and counted by its reason, once per stack
    stacks = driven.stacks()
    frames = {tuple((f.function, f.filename, f.line) for f in fr): n for (_, fr), n in stacks.items()}
    assert frames == {(("leaf_fn", "/fake/app.py", 12), ("Outer.root_fn", "/fake/app.py", 20)): 11}
    ((labels, _),) = stacks
    assert dict(labels)["thread.id"] == str(tid)
    assert driven.reader.dropped() == {
        "not_code": 11,
        "bad_instruction_pointer": 11,
        "impossible_line": 11,
        "bad_pointer": 11,
        "loop": 11,
    }


# ------------------------------------------------------------------ exits


def test_a_process_killed_between_ticks_is_forgotten_without_a_stack(
    driven: DrivenReader, started: list[subprocess.Popen], tmp_path: Path
) -> None:
    # Given a CPython 3.11 process the reader reads
    p, _ = start(started, [PYTHON311, str(spinner(tmp_path)), str(WORKLOAD_SECONDS), "return"])
    go(p)
    ticks = start_ticks(p.pid)
    driven.announce(p.pid)
    wait_for("stacks of the spinner", lambda: (driven.tick(), driven.reader.stats["stacks"] >= 3)[1], timeout=10)
    before = driven.reader.stats["stacks"]
    # When it is killed and has exited, but is not reaped: its pid and start time still name it
    os.kill(p.pid, signal.SIGKILL)
    wait_for("the spinner to be a zombie", lambda: proc_state(p.pid) == "Z", timeout=10)
    assert start_ticks(p.pid) == ticks
    driven.tick()
    # Then the read fails as "gone", the reader forgets it, and no stack was added
    assert driven.reader.targets.stats["gone_while_reading"] == 1
    assert p.pid not in driven.reader.targets.entries
    assert driven.reader.stats["stacks"] == before
    p.wait()
    driven.tick()
    assert driven.reader.stats["stacks"] == before


def test_processes_exiting_while_read_cause_no_error_and_no_foreign_stack(
    driven: DrivenReader, started: list[subprocess.Popen], tmp_path: Path
) -> None:
    # Given CPython 3.11 processes that end by themselves at staggered moments, half with
    # os._exit and half with a normal exit that tears the interpreter down
    script = spinner(tmp_path)
    procs = []
    for i in range(EXITING_PROCESSES):
        # -I -S: no site, so its interpreter runs only the standard library and the script
        # (a host's .pth files may import packages whose exit handlers would run at teardown)
        p, _ = start(started, [PYTHON311, "-I", "-S", str(script), f"{0.05 * i:.2f}", "_exit" if i % 2 else "return"])
        procs.append(p)
    driven.announce(*(p.pid for p in procs))
    wait_for(
        "every spinner read",
        lambda: (driven.tick(), len(driven.reader.targets.readable()))[1] == EXITING_PROCESSES,
        timeout=10,
        interval=0.01,
    )
    # When they are let go and the reader ticks without pause until every one has exited
    for p in procs:
        go(p)
    ticks = 0
    deadline = time.monotonic() + 30
    while any(proc_state(p.pid) not in ("", "Z") for p in procs):
        assert time.monotonic() < deadline, "the spinners did not end"
        driven.tick()
        ticks += 1
    for p in procs:
        p.wait()
    for _ in range(3):
        driven.tick()
    # Then nothing raised, every one was read, every stack is the spinner's (or the interpreter's own
    # code while it ends), and the reader holds none of them any more
    stacks = driven.stacks()
    read = {dict(labels)["pid"] for labels, _ in stacks}
    assert len(read) == EXITING_PROCESSES, (
        f"{len(read)} of {EXITING_PROCESSES} read in {ticks} ticks; {driven.reader.targets.stats}"
    )
    stdlib = "/usr/lib/python3.11/"
    for (_, frames), n in stacks.items():
        for f in frames:
            assert f.line > 0, (f, n)
            if f.filename == str(script):
                assert f.function in SPINNER_FUNCTIONS, (f, n)
            else:
                assert f.filename.startswith(stdlib), (f, n)
    assert not any(p.pid in driven.reader.targets.entries for p in procs)
    st = driven.reader.targets.stats
    assert st["exited"] + st["gone_while_reading"] + st["reused_pid"] == EXITING_PROCESSES, st
    assert st["read_errors"] == 0, st


# ------------------------------------------------------------------ pid reuse


def test_a_reused_pid_never_gets_the_old_process_stacks(tmp_path: Path, started: list[subprocess.Popen]) -> None:
    require_root()
    # Given a pid namespace of our own, where a second CPython process gets the first one's pid
    work = Path(tempfile.mkdtemp(prefix="ebpfprofiler-reuse-"))
    try:
        script = spinner(work)
        p = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                PY,
                "-m",
                "tests.integration.test_runtime_edges",
                "pid-reuse",
                str(script),
                str(work),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(p)  # its group killed at the end: unshare, the driver (pid 1 of the namespace), all of it
        out, err = p.communicate(timeout=DRIVER_TIMEOUT_S)
        assert p.returncode == 0, f"{err[-4000:]}\n{namespace_host_gaps()}"
        got = json.loads(out.strip().splitlines()[-1])
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    # Then the second process had the first one's pid, with another start time
    assert got["pid_a"] == got["pid_b"] and got["ticks_a"] != got["ticks_b"], got
    # and the reader noticed the reuse before reading, and read nothing of B as A
    assert got["stats"]["reused_pid"] == 1, got["stats"]
    assert got["functions"][got["label_a"]] and got["functions"][got["label_b"]], got
    assert set(got["functions"][got["label_a"]]) == SPINNER_FUNCTIONS | {"a_only"}, got
    assert "b_only" not in got["functions"][got["label_a"]], got
    assert "b_only" in got["functions"][got["label_b"]] and "a_only" not in got["functions"][got["label_b"]], got
    # Control: without the check, A's reader at the reused pid reads B's functions as A's
    assert "b_only" in got["control"], got


def _pid_reuse_driver(script: str, work: str) -> None:
    """Pid 1 of a fresh pid namespace: A at pid P, then B at pid P; print what the reader made of it."""
    from runtimes.memory import ProcessMemory, ReadBudget

    a_src, b_src = _two_programs(Path(script), Path(work))
    driven = DrivenReader(Path(work))
    procs: list[subprocess.Popen] = []
    try:
        a, ticks_a, label_a, reader_a = _read_until_stacks(driven, procs, a_src)
        a.kill()
        a.wait()
        # The next pid this namespace hands out is A's.
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(a.pid - 1))
        b, _ = start(procs, [PYTHON311, str(b_src), str(WORKLOAD_SECONDS), "return"])
        go(b)
        ticks_b = start_ticks(b.pid)
        assert ticks_b is not None

        def control_read() -> list[str]:
            got = [f.function for st in reader_a.sample(ProcessMemory(b.pid, ReadBudget(1 << 20))) for f in st.frames]
            return got if "inner" in got else []  # B past its go, in its own functions

        control = wait_for("A's reader reading B's stack", control_read, timeout=10, interval=0.01)
        # The reader ticks before the collector's announcement of B reaches it, then reads B.
        driven.tick()
        driven.announce(b.pid)
        before = driven.reader.stats["stacks"]
        wait_for("stacks of B", lambda: driven.tick() >= before + 5, timeout=20, interval=0.01)
        label_b = dict(driven.labels_of(b.pid, ticks_b))["pid"]
        functions: dict[str, list[str]] = {}
        for labels, frames in driven.stacks():
            functions.setdefault(dict(labels)["pid"], [])
            functions[dict(labels)["pid"]] += [f.function for f in frames]
        got = {
            "pid_a": a.pid,
            "pid_b": b.pid,
            "ticks_a": ticks_a,
            "ticks_b": ticks_b,
            "label_a": label_a,
            "label_b": label_b,
            "control": control,
            "functions": {k: sorted(set(v)) for k, v in functions.items()},
            "stats": driven.reader.targets.stats,
        }
        print(json.dumps(got), flush=True)
    finally:
        kill_and_reap(procs)
        driven.close()


def _two_programs(script: Path, work: Path) -> tuple[Path, Path]:
    """Two programs with a function each of their own (a_only, b_only), both the spinner underneath."""
    a_src, b_src = work / "a.py", work / "b.py"
    base = script.read_text()
    for src, own in ((a_src, "a_only"), (b_src, "b_only")):
        src.write_text(
            base.replace(
                "def outer(end):\n    inner(end)",
                f"def outer(end):\n    {own}(end)\n\ndef {own}(end):\n    inner(end)",
            )
        )
    return a_src, b_src


def _read_until_stacks(
    driven: DrivenReader, procs: list[subprocess.Popen], src: Path
) -> tuple[subprocess.Popen, int, str, StackReader]:
    """src started, let go and announced; the reader ticks until it has 5 of its stacks: (the process, its
    start time, its pid label, the reader's StackReader of it)."""
    p, _ = start(procs, [PYTHON311, str(src), str(WORKLOAD_SECONDS), "return"])
    go(p)
    ticks = start_ticks(p.pid)
    assert ticks is not None
    label = dict(driven.labels_of(p.pid, ticks))["pid"]
    driven.announce(p.pid)
    entry = None

    def read() -> bool:
        nonlocal entry
        driven.tick()
        entry = driven.reader.targets.entries.get(p.pid)
        return driven.reader.stats["stacks"] >= 5

    wait_for("stacks of A", read, timeout=20, interval=0.01)
    assert entry is not None and entry.reader is not None
    return p, ticks, label, entry.reader


if __name__ == "__main__" and sys.argv[1:2] == ["pid-reuse"]:
    _pid_reuse_driver(sys.argv[2], sys.argv[3])
