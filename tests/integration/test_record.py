"""`ebpfprofiler record`: the agent's stages in the foreground, one file at the end.

Given native workloads built by the test, when `record -d 5 -p PID` runs as
root in a 0700 working directory, then:
- `-o out.pb.gz` is a pprof that `go tool pprof -top` (an independent
  reader) lists the workload's functions from, main→top→mid→leaf, leaf hottest;
- `-o out.folded` holds the workload's folded stacks, heavy:light 3:1 ±10%;
- on a terminal the progress line is redrawn in place; Ctrl-C ends the
  recording early, the result is still written, and nothing it started is left;
- `-o` at a symlink to a file root cares about replaces the link with a
  regular 0600 file and leaves the target as it was; `-o` into a missing
  directory is refused in seconds, naming it, with nothing recorded or left.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cli.record import sweep_stale_workspaces
from tests.harness import PY, bpf_holdings, bpftool, require_root, wait_for

RECORD_TIMEOUT_S = 240  # BPF compile, 5 s of recording, the last windows written
HOT_STACK = ["main", "top", "mid", "leaf"]


@pytest.fixture
def private_cwd() -> Iterator[Path]:
    """A 0700 working directory, like root's home."""
    require_root()
    path = Path(tempfile.mkdtemp(prefix="ebpfprofiler-record-cwd-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workload(build: Callable[..., Path], started: list[subprocess.Popen]) -> Callable[[str], subprocess.Popen[bytes]]:
    def start(name: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([str(build(name)), "600"], stdout=subprocess.DEVNULL)
        started.append(p)
        return p

    return start


def record(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "cli.main", "record", *args], cwd=cwd, capture_output=True, text=True, timeout=RECORD_TIMEOUT_S
    )


def test_record_to_pprof_is_read_by_go_tool_pprof(
    private_cwd: Path, workload: Callable[[str], subprocess.Popen[bytes]]
) -> None:
    hot = workload("hot")
    r = record(private_cwd, "-d", "5", "-p", str(hot.pid), "-o", "out.pb.gz")
    assert r.returncode == 0, r.stdout + r.stderr
    top = subprocess.run(
        ["go", "tool", "pprof", "-top", str(private_cwd / "out.pb.gz")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = [line.split()[-1] for line in top.splitlines() if re.match(r"\s*[\d.]+(m|u)?s?\s+[\d.]+%", line)]
    assert rows and rows[0] == "leaf", top  # the hottest by self time
    assert set(HOT_STACK) <= set(rows), top
    # the end of the recording prints the top functions (self and total) and a plain progress line
    table = r.stdout.split("top 15 functions, cpu (cpu):\n", 1)[1].splitlines()
    assert table[0].split() == ["self", "self%", "total", "total%", "function"], r.stdout
    assert re.fullmatch(r"\s+[\d.]+s\s+(?:[5-9]\d|100)\.\d%\s+[\d.]+s\s+\d+\.\d%\s+leaf", table[1]), r.stdout
    assert "recording: " in r.stdout and "recorded: " in r.stdout, r.stdout
    assert "\r" not in r.stdout  # not a terminal: plain lines only


def test_record_to_folded_stacks_keeps_the_workloads_ratio(
    private_cwd: Path, workload: Callable[[str], subprocess.Popen[bytes]]
) -> None:
    ratio = workload("ratio")
    other = workload("hot")  # another process, left out by -p
    r = record(private_cwd, "-d", "5", "--hz", "499", "-p", str(ratio.pid), "-o", "out.folded")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (private_cwd / "out.folded").read_text().splitlines()
    counts: dict[str, int] = {}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        assert stack and n.isdigit(), line
        counts[stack] = counts.get(stack, 0) + int(n)
    heavy = sum(n for s, n in counts.items() if re.search(r"(^|;)main;work;heavy(;|$)", s))
    light = sum(n for s, n in counts.items() if re.search(r"(^|;)main;work;light(;|$)", s))
    assert heavy + light > 0.9 * sum(counts.values()), lines
    assert heavy / light == pytest.approx(3.0, rel=0.10), (heavy, light)
    assert not [s for s in counts if ";leaf" in s], "another process's samples"
    del other


class Terminal:
    """A pseudo-terminal: its program's side (slave, closed here once handed over), and what the
    program has drawn on it so far (read)."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        self.screen = b""

    def read(self) -> bytes:
        while select.select([self.master], [], [], 0)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.screen += chunk
        return self.screen

    def close(self) -> None:
        os.close(self.master)


def record_on(terminal: Terminal, cwd: Path, pid: int, started: list[subprocess.Popen]) -> subprocess.Popen:
    """`record` of `pid` for 120 s to out.folded, on `terminal`, in a session of its own."""
    p = subprocess.Popen(
        [PY, "-m", "cli.main", "record", "-d", "120", "-p", str(pid), "-o", "out.folded"],
        cwd=cwd,
        stdout=terminal.slave,
        stderr=terminal.slave,
        start_new_session=True,
    )
    started.append(p)  # killed with its session at the end, if a check failed before the Ctrl-C
    os.close(terminal.slave)
    return p


def recording(p: subprocess.Popen, terminal: Terminal) -> tuple[dict[int, int], set[int]]:
    """Once two progress lines with samples are drawn: (record's descendants, pid → start time; the BPF
    programs its collector holds, asserted some)."""
    # the progress line is redrawn in place (carriage return, erase line) with live figures
    wait_for(
        "two progress lines with samples",
        lambda: (
            len(re.findall(rb"\r\x1b\[Krecording: +\d+ s left, [1-9]\d* cpu samples, 1 processes", terminal.read()))
            >= 2
        ),
        RECORD_TIMEOUT_S,
        0.2,
    )
    tree = _descendants(p.pid)  # record → its `run` (a session of its own) → the stages
    collector = next(pid for pid in tree if b"collector.main" in _cmdline(pid))
    progs, _ = bpf_holdings(collector)
    assert progs, "the recording's collector holds no BPF program"
    return tree, progs


def assert_nothing_left(session: int, tree: dict[int, int], workspaces_before: set[Path], progs: set[int]) -> None:
    """No process of the recording's session or of the agent it ran, no workspace, and none of its BPF
    programs (the kernel frees a tail-call array's programs a moment later)."""
    left = [
        pid
        for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
        if _sid(pid) == session or (pid, _start(pid)) in tree.items()
    ]
    assert not left, left
    assert set(Path("/tmp").glob("ebpfprofiler-record-*")) <= workspaces_before
    wait_for(
        "the recording's BPF programs to be freed",
        lambda: not progs & {q["id"] for q in bpftool("prog", "show")},
        10,
    )


def test_ctrl_c_on_a_terminal_ends_early_writes_the_result_and_leaves_nothing(
    private_cwd: Path, workload: Callable[[str], subprocess.Popen[bytes]], started: list[subprocess.Popen]
) -> None:
    hot = workload("hot")
    workspaces_before = set(Path("/tmp").glob("ebpfprofiler-record-*"))
    terminal = Terminal()
    p = record_on(terminal, private_cwd, hot.pid, started)
    try:
        tree, progs = recording(p, terminal)
        interrupted = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's foreground group
        assert p.wait(RECORD_TIMEOUT_S) == 0, terminal.read().decode(errors="replace")
        assert time.monotonic() - interrupted < 60
        out = (private_cwd / "out.folded").read_text()
        assert "main;top;mid;leaf " in out, out
        assert_nothing_left(p.pid, tree, workspaces_before, progs)
    finally:
        terminal.close()


def test_record_killed_outright_takes_its_agent_and_bpf_programs_with_it(
    private_cwd: Path, workload: Callable[[str], subprocess.Popen[bytes]], started: list[subprocess.Popen]
) -> None:
    # Given a recording under way (its agent runs in a session of its own, under `run`)
    hot = workload("hot")
    workspaces_before = set(Path("/tmp").glob("ebpfprofiler-record-*"))
    p = subprocess.Popen(
        [PY, "-m", "cli.main", "record", "-d", "120", "-p", str(hot.pid), "-o", "out.folded"],
        cwd=private_cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started.append(p)
    tree: dict[int, int] = {}
    try:
        assert p.stdout is not None
        for line in p.stdout:
            if ": recording " in line:
                break
        else:
            raise AssertionError(f"record ended before recording (exit {p.wait()})")
        tree = _descendants(p.pid)
        collector = next(pid for pid in tree if b"collector.main" in _cmdline(pid))
        progs, _ = bpf_holdings(collector)
        assert progs, "the recording's collector holds no BPF program"
        # When it is killed with SIGKILL (no chance to stop anything itself)
        p.kill()
        p.wait()
        # Then its agent stops (`run` is told by the kernel that its parent died) and frees its programs
        wait_for(
            "the recording's agent to stop",
            lambda: not [pid for pid, start in tree.items() if _start(pid) == start],
            60,
        )
        wait_for(
            "the recording's BPF programs to be freed",
            lambda: not progs & {q["id"] for q in bpftool("prog", "show")},
            10,
        )
        # and the workspace it could not remove goes with the next recording's start
        left = set(Path("/tmp").glob("ebpfprofiler-record-*")) - workspaces_before
        assert len(left) == 1, left
        assert [str(x) for x in left] == [x for x in sweep_stale_workspaces() if Path(x) in left]
        assert not left & set(Path("/tmp").glob("ebpfprofiler-record-*"))
    finally:
        for pid, start in tree.items():  # what a failed check left: `run` stops its stages
            if _start(pid) == start and b"cli.main" in _cmdline(pid):
                os.kill(pid, signal.SIGTERM)


def test_record_o_at_a_symlink_writes_a_0600_file_in_its_place_and_never_touches_the_target(
    private_cwd: Path, workload: Callable[[str], subprocess.Popen[bytes]]
) -> None:
    # Given a file root cares about (a stand-in for /etc/shadow) and -o naming a symlink to it
    hot = workload("hot")
    precious = private_cwd / "precious"
    precious.write_bytes(b"root:$6$precious:19000:0:99999:7:::\n")
    precious.chmod(0o640)
    link = private_cwd / "out.folded"
    link.symlink_to(precious)
    r = record(private_cwd, "-d", "2", "-p", str(hot.pid), "-o", str(link))
    assert r.returncode == 0, r.stdout + r.stderr
    # Then the target is as it was, and the output is a regular file of root's alone in the link's place
    assert precious.read_bytes() == b"root:$6$precious:19000:0:99999:7:::\n"
    assert stat.S_IMODE(precious.stat().st_mode) == 0o640
    st = link.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert "main;top;mid;leaf " in link.read_text()


def test_record_into_a_missing_directory_is_refused_before_recording(private_cwd: Path) -> None:
    workspaces_before = set(Path("/tmp").glob("ebpfprofiler-record-*"))
    started = time.monotonic()
    r = record(private_cwd, "-d", "20", "-o", "out/profile.html")
    assert time.monotonic() - started < 10, f"it recorded first: {r.stdout}{r.stderr}"
    assert r.returncode == 2, r.stdout + r.stderr
    assert "out/profile.html" in r.stderr and "the directory out does not exist" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert list(private_cwd.iterdir()) == []
    assert set(Path("/tmp").glob("ebpfprofiler-record-*")) <= workspaces_before


def _stat(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _start(pid: int) -> int:
    f = _stat(pid)
    return int(f[19]) if len(f) > 19 else 0


def _descendants(root: int) -> dict[int, int]:
    """pid → start time of every process below `root` now."""
    children: dict[int, list[int]] = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        f = _stat(pid)
        if len(f) > 1:
            children.setdefault(int(f[1]), []).append(pid)
    out: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = _start(pid)
        todo.extend(children.get(pid, []))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _sid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return 0
