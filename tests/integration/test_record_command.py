"""`ebpfprofiler record -- COMMAND ARGS...`: the command and its children, from start to exit.

Given a Python script that forks a child burning CPU in a named function, when `record --runtime
python -o out.pb.gz -- python3 script.py` runs as root (an unrelated Python process burning CPU in
another function meanwhile), then:
- record exits with the script's status (3), and its stdout is the script's alone;
- the child's function is in the python_wall profile under the child's pid, and the child has cpu
  samples; no sample names a pid outside the script's tree, and the unrelated function is nowhere;
- a command killed by a signal gives 128 + the signal, as a shell says it;
- a SIGINT sent to record (not from a terminal) is passed on to the command, whose own exit status
  (here 7, from its KeyboardInterrupt handler) record exits with, the result written.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from report import profiles as profiles_mod
from tests.harness import PY, require_root

RECORD_TIMEOUT_S = 240  # BPF compile, the command, the last windows written
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's CPython 3.11: read with --runtime python (python_legacy)

SCRIPT = textwrap.dedent(
    """\
    import os, sys, time

    def child_burns_cpu(seconds):
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            n += 1
        return n

    pid = os.fork()
    if pid == 0:
        child_burns_cpu(4.0)
        os._exit(0)
    print(f"parent {os.getpid()} child {pid}", flush=True)
    os.waitpid(pid, 0)
    sys.exit(3)
    """
)

UNRELATED = textwrap.dedent(
    """\
    import time

    def unrelated_burns_cpu(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    unrelated_burns_cpu(300)
    """
)

WAITS_FOR_SIGINT = textwrap.dedent(
    """\
    import sys, time

    def burns_before_ready(seconds):  # long enough to be sampled and read (the collector reads a new process ~1 s in)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    def waits_for_sigint():
        end = time.monotonic() + 120  # ends by itself if nobody interrupts it
        n = 0
        while time.monotonic() < end:
            n += 1
        return n

    burns_before_ready(2.0)
    try:
        print("ready", flush=True)  # inside the try: a SIGINT the moment it is read is caught
        waits_for_sigint()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(7)
    sys.exit(0)
    """
)


@pytest.fixture
def cwd() -> Iterator[Path]:
    require_root()
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} is missing")
    path = Path(tempfile.mkdtemp(prefix="ebpfprofiler-record-cmd-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def record(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "cli.main", "record", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=RECORD_TIMEOUT_S,
        start_new_session=True,  # no terminal: a SIGINT to record alone is passed on
    )


def samples_by_pid(path: Path) -> dict[int, set[str]]:
    """pid label → every function its samples name, in one pprof file."""
    out: dict[int, set[str]] = {}
    for item in profiles_mod.load([str(path)]):
        for s in item.profile.samples:
            out.setdefault(int(s.labels["pid"]), set()).update(s.functions)
    return out


def test_record_a_command_keeps_its_childs_stacks_and_passes_its_exit_status(
    cwd: Path, started: list[subprocess.Popen]
) -> None:
    (cwd / "script.py").write_text(SCRIPT)
    (cwd / "unrelated.py").write_text(UNRELATED)
    unrelated = subprocess.Popen([SYSTEM_PYTHON, str(cwd / "unrelated.py")])
    started.append(unrelated)

    r = record(cwd, "--runtime", "python", "-o", "out.pb.gz", "--", SYSTEM_PYTHON, "script.py")

    assert r.returncode == 3, r.stdout + r.stderr
    # stdout is the script's alone; record's own lines are on stderr, with no progress line (not a terminal)
    m = re.fullmatch(r"parent (\d+) child (\d+)\n", r.stdout)
    assert m, r.stdout + r.stderr
    parent, child = int(m[1]), int(m[2])
    assert "exited (exit 3)" in r.stderr and "\r" not in r.stderr, r.stderr
    assert "recording " not in r.stderr.replace(": recording the command", ""), r.stderr

    wall = samples_by_pid(cwd / "out.python_wall.pb.gz")
    assert "child_burns_cpu" in wall.get(child, set()), (child, wall)
    cpu = samples_by_pid(cwd / "out.pb.gz")
    assert child in cpu, (child, sorted(cpu))
    # nothing of any other process: not the unrelated one, not the agent's stages, not [unknown]
    assert set(wall) | set(cpu) <= {parent, child}, (parent, child, sorted(set(wall) | set(cpu)))
    assert unrelated.pid not in set(wall) | set(cpu)
    assert not any("unrelated_burns_cpu" in fs for fs in wall.values())


def test_a_command_killed_by_a_signal_exits_128_plus_the_signal(cwd: Path) -> None:
    r = record(cwd, "-o", "out.folded", "--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + signal.SIGTERM, r.stdout + r.stderr
    assert "killed by SIGTERM, exit 143" in r.stderr, r.stderr


def test_sigint_to_record_is_passed_to_the_command_and_the_result_is_written(
    cwd: Path, started: list[subprocess.Popen]
) -> None:
    (cwd / "waits.py").write_text(WAITS_FOR_SIGINT)
    p = subprocess.Popen(
        [PY, "-m", "cli.main", "record", "--python", "-o", "out.folded", "--", SYSTEM_PYTHON, "waits.py"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    started.append(p)
    assert p.stdout is not None and p.stderr is not None
    out = b""
    deadline = time.monotonic() + RECORD_TIMEOUT_S
    while b"ready\n" not in out:
        assert time.monotonic() < deadline and p.poll() is None, (out, p.poll())
        if select.select([p.stdout], [], [], 1.0)[0]:
            out += os.read(p.stdout.fileno(), 4096)
    os.kill(p.pid, signal.SIGINT)
    rest, err = p.communicate(timeout=RECORD_TIMEOUT_S)
    assert p.returncode == 7, (out + rest, err)
    assert out + rest == b"ready\ninterrupted\n", (out + rest, err)
    assert (cwd / "out.folded").read_text(), err
    wall = (cwd / "out.python_wall.folded").read_text()
    assert "burns_before_ready" in wall, wall  # the command's stacks, recorded before the SIGINT
