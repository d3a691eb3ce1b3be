"""`ebpfprofiler top` on a real terminal: tmux draws it, its screen is captured (capture-pane).

Given tests/workloads/hot.c (main → top → mid → leaf, leaf hottest) running from an executable whose
name carries an escape sequence that would retitle the terminal, when `ebpfprofiler top -p PID` runs
in a tmux pane, then:
- its first row is `leaf`, with most of the own share;
- `p` switches to processes, whose one row is the workload, its name shown escaped (the pane's
  title is not changed), and `t` sorts by total;
- `q` ends it with status 0, and its workspace and agent are gone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness import PY, ROOT, require_root, wait_for

WIDTH, HEIGHT = 160, 30
# top's agent starts in a few seconds, its first windows a second or two later.
SCREEN_TIMEOUT_S = 120
# An escape sequence that sets the terminal's title (OSC 0), in the executable's name.
HOSTILE_NAME = "hot\x1b]0;pwned\x07"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True, timeout=30).stdout


@pytest.fixture
def session() -> Iterator[str]:
    name = f"ebpfprofiler-top-{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True, timeout=30)


def screen(session: str) -> list[str]:
    return tmux("capture-pane", "-p", "-t", session).splitlines()


def wait_screen(session: str, what: str, ok: Callable[[list[str]], bool]) -> list[str]:
    got: list[list[str]] = [[]]

    def check() -> bool:
        got[0] = screen(session)
        return ok(got[0])

    try:
        wait_for(what, check, timeout=SCREEN_TIMEOUT_S, interval=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}; the screen:\n" + "\n".join(got[0])) from None
    return got[0]


ROW = re.compile(r"\s*(?P<own>[\d.]+)%\s+(?P<total>[\d.]+)%\s+[\d.]+s\s+[\d.]+s\s+(?P<name>.+)")


def rows(lines: list[str]) -> list[re.Match[str]]:
    return [m for m in map(ROW.fullmatch, lines) if m]


def test_top_shows_the_hot_function_switches_views_and_quits_clean(
    build: Callable[..., Path], tmp_path: Path, started: list[subprocess.Popen], session: str
) -> None:
    require_root()
    exe = tmp_path / HOSTILE_NAME
    shutil.copy(build("hot"), exe)
    hot = subprocess.Popen([str(exe), "600"], stdout=subprocess.DEVNULL)
    started.append(hot)
    workspaces_before = set(Path("/tmp").glob("ebpfprofiler-record-*"))
    status = tmp_path / "status"
    tmux(
        "new-session", "-d", "-s", session, "-x", str(WIDTH), "-y", str(HEIGHT),
        f"cd {ROOT} && {PY} -m cli.main top -p {hot.pid}; echo $? > {status}; sleep 600",
    )  # fmt: skip
    # Then its first row is leaf, with most of the own share
    lines = wait_screen(session, "leaf on top", lambda ls: bool(rows(ls)) and rows(ls)[0]["name"] == "leaf")
    assert float(rows(lines)[0]["own"]) >= 50, "\n".join(lines)
    assert {"main", "top", "mid", "leaf"} <= {m["name"] for m in rows(lines)}, "\n".join(lines)
    # When p is pressed, the one process is the workload, its name escaped
    tmux("send-keys", "-t", session, "p")
    escaped = f"{hot.pid} hot\\x1b]0;pwned\\x07"
    lines = wait_screen(session, "the processes view", lambda ls: any(m["name"] == escaped for m in rows(ls)))
    assert [m["name"] for m in rows(lines)] == [escaped], "\n".join(lines)
    assert "pwned" not in tmux("display-message", "-p", "-t", session, "#{pane_title}")
    # When t is pressed, rows are sorted by total
    tmux("send-keys", "-t", session, "t")
    wait_screen(session, "sorted by total", lambda ls: any(ln.startswith("sorted by total") for ln in ls))
    # When q is pressed, top ends with status 0 and leaves nothing
    tmux("send-keys", "-t", session, "q")
    wait_for("top to exit", status.exists, timeout=SCREEN_TIMEOUT_S, interval=0.5)
    assert status.read_text().strip() == "0", "\n".join(screen(session))
    assert set(Path("/tmp").glob("ebpfprofiler-record-*")) <= workspaces_before
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_tops_agent(int(p))]


def _is_tops_agent(pid: int) -> bool:
    """A `run` of a record-style workspace (top's agent) still alive."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"/tmp/ebpfprofiler-record-" in cmdline and b"\0run\0" in cmdline
