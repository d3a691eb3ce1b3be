"""The start-up progress contract (shared/ready.py) and `run`'s wait on it (cli/run.py wait_ready).

Every stage here is a real child process that runs ready.progress() as the collector runs it around
its compile; the test tells it (on its stdin) when its step ends, and reads what it wrote as `run`
and `record` read it (StartWatch), and what it sent systemd on a socket the test binds as
$NOTIFY_SOCKET. Waiting is polling with a deadline; every child is killed and reaped at the end
(the `started` fixture), whatever failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from cli import run as run_mod
from shared import endpoints, ready
from tests.harness import wait_for

T = TypeVar("T")

# The children beat this often, so that staleness (STALE_BEATS beats) shows in a fraction of a second.
BEAT_S = 0.05
# The quiet limit `run` is given in these tests, in place of its READY_TIMEOUT_S.
QUIET_S = 0.3
# Deadline of every wait here: a loaded 2-CPU host starts a Python child in ~1 s.
DEADLINE_S = 20.0
DOING = "compiling and loading BPF programs"

# A stage-like child: a start-up step with a heartbeat, ended when the parent writes a line ("end":
# then ready; "fail": the step raises), then it stays until its stdin closes.
STAGE = f"""
import sys
from shared import ready
run_dir, beat_s = sys.argv[1], float(sys.argv[2])
with ready.progress(run_dir, "collector", {DOING!r}, beat_s=beat_s):
    print("working", flush=True)
    if sys.stdin.readline().strip() == "fail":
        raise SystemExit(3)
ready.announce(run_dir, "collector")
print("ready", flush=True)
sys.stdin.read()
"""
# A stage that never says anything until its stdin closes.
SILENT = "import sys; sys.stdin.read()"


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "notify"))
    s.setblocking(False)
    try:
        yield s
    finally:
        s.close()


def start_stage(
    run_dir: Path, started: list[subprocess.Popen], code: str = STAGE, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir), str(BEAT_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    started.append(p)
    return p


def tell(p: subprocess.Popen[str], line: str) -> None:
    assert p.stdin is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()


def received(s: socket.socket, into: list[str]) -> list[str]:
    while True:
        try:
            into.append(s.recv(4096).decode())
        except BlockingIOError:
            return into


def test_a_working_step_beats_tells_systemd_and_its_file_goes_when_it_ends(
    tmp_path: Path, notify: socket.socket, started: list[subprocess.Popen]
) -> None:
    # given a stage in its start-up step
    p = start_stage(tmp_path, started, env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    watch = ready.StartWatch(str(tmp_path), "collector", p.pid)
    # then a reader sees it working, saying what it does, its heartbeat renewed and its time growing
    wait_for("the step to be seen working", lambda: watch.check().state is ready.State.WORKING, DEADLINE_S, 0.01)
    beats = wait_for(
        "three beats",
        lambda: g if (g := ready.read_progress(str(tmp_path), "collector")) and g.beat >= 3 else None,
        DEADLINE_S,
        0.01,
    )
    assert beats.pid == p.pid and beats.doing == DOING and beats.elapsed_s >= 2 * BEAT_S
    looked = watch.check()
    assert looked.state is ready.State.WORKING and looked.doing == DOING and looked.elapsed_s >= 2 * BEAT_S
    # and systemd hears the status and an extension of its start timeout with each beat
    said: list[str] = []
    wait_for("beats on the notify socket", lambda: len(received(notify, said)) >= 3, DEADLINE_S, 0.01)
    assert said[0].startswith(f"STATUS={DOING} (") and "so far)" in said[0], said
    assert f"\nEXTEND_TIMEOUT_USEC={round(ready.STALE_BEATS * BEAT_S * 1e6)}" in said[0], said
    # when the step ends and the stage is ready
    tell(p, "end")
    wait_for("the ready file", lambda: watch.check().state is ready.State.READY, DEADLINE_S, 0.01)
    # then its progress file is gone, and systemd was told how long the step took, then READY=1
    assert not os.path.exists(endpoints.progress_file(str(tmp_path), "collector"))
    received(notify, said)
    end = next(i for i, m in enumerate(said) if m.startswith(f"STATUS={DOING}: done in "))
    assert said[end + 1 :] == ["READY=1"], said
    assert not [m for m in said[end + 1 :] if "EXTEND_TIMEOUT_USEC" in m]  # no beat after the end


def test_a_step_that_fails_removes_its_progress_file(
    tmp_path: Path, notify: socket.socket, started: list[subprocess.Popen]
) -> None:
    p = start_stage(tmp_path, started, env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    assert p.stdout is not None and p.stdout.readline() == "working\n"
    assert ready.read_progress(str(tmp_path), "collector") is not None
    tell(p, "fail")
    assert p.wait(DEADLINE_S) == 3
    assert not os.path.exists(endpoints.progress_file(str(tmp_path), "collector"))
    assert not os.path.exists(endpoints.ready_file(str(tmp_path), "collector"))
    said = received(notify, [])
    assert said[-1].startswith(f"STATUS={DOING}: failed after "), said


def test_a_stage_that_stops_beating_is_stale(tmp_path: Path, started: list[subprocess.Popen]) -> None:
    # given a stage in its start-up step, seen working
    p = start_stage(tmp_path, started)
    watch = ready.StartWatch(str(tmp_path), "collector", p.pid)
    wait_for("the step to be seen working", lambda: watch.check().state is ready.State.WORKING, DEADLINE_S, 0.01)
    # when it stops (alive, but its heartbeat no longer renewed: hung, or starved)
    os.kill(p.pid, signal.SIGSTOP)
    # then within a few beats the reader calls its heartbeat stale, saying what it was doing
    stale = wait_for(
        "a stale heartbeat", lambda: g if (g := watch.check()).state is ready.State.STALE else None, DEADLINE_S, 0.01
    )
    assert stale.doing == DOING and stale.quiet_s > ready.STALE_BEATS * BEAT_S
    assert p.poll() is None  # still alive: stale is the heartbeat's judgement, not the process's
    # and when it runs again its next beat makes it working again
    os.kill(p.pid, signal.SIGCONT)
    wait_for("the heartbeat renewed", lambda: watch.check().state is ready.State.WORKING, DEADLINE_S, 0.01)


def test_a_progress_file_left_by_another_process_or_not_one_is_not_taken_for_a_heartbeat(tmp_path: Path) -> None:
    # a progress file another process of the stage left (it was killed outright) does not speak for this one
    path = endpoints.progress_file(str(tmp_path), "collector")
    Path(path).write_text('{"pid": 1, "doing": "compiling", "elapsed_s": 3, "beat": 9, "beat_s": 5}\n')
    assert ready.read_progress(str(tmp_path), "collector") == ready.Progress(1, "compiling", 3.0, 9, 5.0)
    assert ready.StartWatch(str(tmp_path), "collector", pid=os.getpid()).check().state is ready.State.QUIET
    # forget() clears it before the stage starts again
    ready.forget(str(tmp_path), "collector")
    assert not os.path.exists(path)
    # and a file that is not one is read as none
    for text in ("not json", '{"pid": 1}', '{"pid": 1, "doing": "x", "elapsed_s": 0, "beat": 0, "beat_s": 0}'):
        Path(path).write_text(text)
        assert ready.read_progress(str(tmp_path), "collector") is None, text


def polled(step: Callable[[], None], value: Callable[[], T]) -> Callable[[], T]:
    """A check for wait_for that takes a step (a poll), then reads `value`."""

    def check() -> T:
        step()
        return value()

    return check


def stage_for(run_dir: Path, p: subprocess.Popen[str]) -> run_mod.Stage:
    stage = run_mod.Stage("collector", ["collector", "--run-dir", str(run_dir)], proc=p)
    stage.started = time.monotonic()
    return stage


def in_thread(stage: run_mod.Stage, stop: threading.Event) -> tuple[threading.Thread, list[str | None]]:
    """run's wait for `stage`, with QUIET_S for its quiet limit, in a thread; its answer in the list."""
    answer: list[str | None] = []
    t = threading.Thread(target=lambda: answer.append(run_mod.wait_ready(stage, stop, QUIET_S)), daemon=True)
    t.start()
    return t, answer


def test_run_waits_past_its_quiet_limit_for_a_stage_whose_heartbeat_is_fresh(
    tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    # given `run` waiting for a stage whose start-up step works far longer than run's limit for silence
    p = start_stage(tmp_path, started)
    stop = threading.Event()
    t, answer = in_thread(stage_for(tmp_path, p), stop)
    try:
        wait_for(
            f"the step to have run {4 * QUIET_S} s",
            lambda: (g := ready.read_progress(str(tmp_path), "collector")) is not None and g.elapsed_s > 4 * QUIET_S,
            DEADLINE_S,
            0.01,
        )
        # then run still waits
        assert t.is_alive() and not answer
        # and when the step ends and the stage is ready, run's wait ends with it ready
        tell(p, "end")
        t.join(DEADLINE_S)
        assert answer == [None]
    finally:
        stop.set()
        t.join(DEADLINE_S)


def test_run_reports_a_stale_heartbeat_a_silent_stage_and_an_exit(
    tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    stop = threading.Event()
    try:
        # a stage whose heartbeat stops (SIGSTOP) is reported stale, with what it was doing
        (tmp_path / "a").mkdir()
        hung = start_stage(tmp_path / "a", started)
        assert hung.stdout is not None and hung.stdout.readline() == "working\n"
        os.kill(hung.pid, signal.SIGSTOP)
        t, answer = in_thread(stage_for(tmp_path / "a", hung), stop)
        t.join(DEADLINE_S)
        assert answer and answer[0] and answer[0].startswith("its heartbeat stopped ") and DOING in answer[0], answer
        # a stage that says nothing is reported after the quiet limit
        (tmp_path / "b").mkdir()
        silent = start_stage(tmp_path / "b", started, code=SILENT)
        t, answer = in_thread(stage_for(tmp_path / "b", silent), stop)
        t.join(DEADLINE_S)
        assert answer == [f"said nothing for {QUIET_S:g} s and is not ready"], answer
        # a stage that exits in its step is reported with its exit status
        (tmp_path / "c").mkdir()
        failing = start_stage(tmp_path / "c", started)
        t, answer = in_thread(stage_for(tmp_path / "c", failing), stop)
        tell(failing, "fail")
        t.join(DEADLINE_S)
        assert answer == ["exited with 3 before it was ready"], answer
    finally:
        stop.set()


def test_record_shows_the_step_and_calls_a_stale_heartbeat_stuck(
    tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    from cli.record import StartProgress

    p = start_stage(tmp_path, started)
    starting = StartProgress(str(tmp_path), ["collector"])
    # while the step works: its line says what and for how long, and the start is not stuck
    wait_for(
        "the step in record's line",
        polled(starting.check, lambda: f"collector {DOING} (" in starting.line()),
        DEADLINE_S,
        0.01,
    )
    assert starting.line().startswith("starting: 0 of 1 stages ready; ") and starting.stuck() is None
    # when its heartbeat stops, record calls the start stuck, naming the stage and what it was doing
    os.kill(p.pid, signal.SIGSTOP)
    why = wait_for("a stuck start", polled(starting.check, starting.stuck), DEADLINE_S, 0.01)
    assert why.startswith("collector's heartbeat stopped ") and why.endswith(f"into {DOING}"), why
    # and once the stage is ready, so is the start
    os.kill(p.pid, signal.SIGCONT)
    tell(p, "end")
    wait_for("the start to be ready", polled(starting.check, starting.ready), DEADLINE_S, 0.01)
