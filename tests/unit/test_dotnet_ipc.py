""".NET's diagnostics IPC, against recorded answers and hostile peers; what the environment decides.

The answers are the bytes .NET 8.0.4 and .NET Core 3.1.23 sent to EnablePerfMap
(recorded from the runtimes of bench/assets/dotnet_runtimes.py). The hostile peers
are real Unix sockets at the name a .NET process with this test's pid and
start time would use, in this process's /tmp, reached by the real connector
(a forked process that becomes this process's user): one that answers right,
one that never answers (its EnablePerfMap retried after a pause, then refused), one that floods, one that answers EnablePerfMap with
garbage (and is told to stop at stop all the same), a symlink and a regular
file where the socket should be.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.polling import wait_for
from runtimes import dotnet as dotnet_plugin
from runtimes.dotnet import DotNet, environment_refusal, ipc, parse_environ
from runtimes.dotnet.connect import Connector, ConnectRefused, socket_name
from runtimes.runtime import FileCache, Mapping, Pending, ProcessContext, Refusal, Served
from runtimes.targets import start_ticks

OK_8_0_4 = bytes.fromhex("444f544e45545f4950435f5631001800ff00000000000000")
UNKNOWN_COMMAND_3_1_23 = bytes.fromhex("444f544e45545f4950435f5631001800ffff000085131380")


def test_commands_are_the_protocols_bytes() -> None:
    assert ipc.enable_perf_map() == b"DOTNET_IPC_V1\0" + bytes([24, 0, 0x04, 0x05, 0, 0, 3, 0, 0, 0])
    assert ipc.disable_perf_map() == b"DOTNET_IPC_V1\0" + bytes([20, 0, 0x04, 0x06, 0, 0])


def test_recorded_answers() -> None:
    ok = ipc.parse_answer(OK_8_0_4)
    assert ok.ok and ok.hresult == 0 and ok.text() == "OK"
    err = ipc.parse_answer(UNKNOWN_COMMAND_3_1_23)
    assert not err.ok and err.hresult == ipc.UNKNOWN_COMMAND
    assert err.text() == "error HRESULT 0x80131385 (unknown command)"


@pytest.mark.parametrize(
    "data, why",
    [
        (b"", "shorter than a header"),
        (OK_8_0_4[:19], "shorter than a header"),
        (b"DOTNET_IPC_V2\0" + OK_8_0_4[14:], "magic"),
        (OK_8_0_4 + b"\0", "the header says 24 bytes, the peer sent 25"),
        (OK_8_0_4[:14] + bytes([24, 0, 0x04, 0x00, 0, 0]) + bytes(4), "is not a server OK or error"),
        (OK_8_0_4[:14] + bytes([24, 0, 0xFF, 0x01, 0, 0]) + bytes(4), "is not a server OK or error"),
        (OK_8_0_4[:14] + bytes([24, 0, 0xFF, 0x00, 1, 0]) + bytes(4), "reserved"),
        (OK_8_0_4[:14] + bytes([20, 0, 0xFF, 0x00, 0, 0]), "a payload of 0 bytes"),
        (OK_8_0_4[:14] + bytes([28, 0, 0xFF, 0x00, 0, 0]) + bytes(8), "a payload of 8 bytes"),
    ],
)
def test_malformed_answers_say_how(data: bytes, why: str) -> None:
    with pytest.raises(ipc.MalformedAnswer, match=why):
        ipc.parse_answer(data)


# --- peers at the socket name --------------------------------------------------------------------

SELF = os.getpid()


@pytest.fixture(scope="module")
def connector() -> Iterator[Connector]:
    c = Connector()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def name() -> Iterator[Path]:
    """Where a .NET process with this process's pid and start time has its socket."""
    path = Path("/tmp") / socket_name(SELF, start_ticks(SELF) or 0)
    path.unlink(missing_ok=True)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def serve(path: Path, handle: Callable[[socket.socket], object]) -> threading.Thread:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def run() -> None:
        with srv:
            srv.settimeout(5)
            conn, _ = srv.accept()
            with conn:
                handle(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def ask(connector: Connector, message: bytes, timeout: float = 5.0) -> ipc.Answer:
    """The peer's answer; a time limit longer than the stage's (this process's peer thread may be slow
    to run on a loaded host) unless the time limit is what is tested."""
    with connector.connect(SELF, start_ticks(SELF) or 0) as s:
        return ipc.exchange(s, message, timeout)


@pytest.mark.needs_root
def test_a_peer_that_answers_like_the_runtime(connector: Connector, name: Path) -> None:
    got: list[bytes] = []

    def runtime_like(conn: socket.socket) -> None:
        got.append(conn.recv(64))
        conn.sendall(OK_8_0_4)

    t = serve(name, runtime_like)
    answer = ask(connector, ipc.enable_perf_map())
    t.join(5)
    assert got == [ipc.enable_perf_map()] and answer.ok and answer.hresult == 0


@pytest.mark.needs_root
def test_a_peer_that_never_answers_costs_the_timeout(connector: Connector, name: Path) -> None:
    done = threading.Event()
    t = serve(name, lambda conn: done.wait(10))
    started = time.monotonic()
    with pytest.raises(ipc.AnswerTimeout):
        ask(connector, ipc.enable_perf_map(), ipc.ANSWER_TIMEOUT_S)
    took = time.monotonic() - started
    done.set()
    t.join(5)
    assert took < ipc.ANSWER_TIMEOUT_S + 1.5, took


@pytest.mark.needs_root
def test_a_peer_that_floods_is_malformed_after_the_cap(connector: Connector, name: Path) -> None:
    def flood(conn: socket.socket) -> None:
        try:  # noqa: SIM105
            conn.sendall(OK_8_0_4[:14] + bytes([0xFF, 0xFF]) + b"x" * (1 << 20))
        except OSError:
            pass  # the reader stopped reading and closed: as it should

    t = serve(name, flood)
    with pytest.raises(ipc.MalformedAnswer, match="or more"):
        ask(connector, ipc.enable_perf_map())
    t.join(5)


@pytest.mark.needs_root
def test_a_symlink_or_a_file_at_the_name_is_not_connected_to(connector: Connector, name: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(target))
    srv.listen(1)
    with srv:
        name.symlink_to(target)
        with pytest.raises(ConnectRefused, match="is not a socket"):
            connector.connect(SELF, start_ticks(SELF) or 0)
        name.unlink()
        name.write_bytes(b"")
        with pytest.raises(ConnectRefused, match="is not a socket"):
            connector.connect(SELF, start_ticks(SELF) or 0)
        name.unlink()
        with pytest.raises(ConnectRefused, match="no diagnostics socket"):
            connector.connect(SELF, start_ticks(SELF) or 0)


def test_a_reused_pid_is_not_connected_to(connector: Connector) -> None:
    with pytest.raises(ConnectRefused, match="another process"):
        connector.connect(SELF, (start_ticks(SELF) or 0) + 1)


@pytest.mark.needs_root
def test_the_environment_is_read_as_the_processs_user(connector: Connector) -> None:
    env = parse_environ(connector.environ(SELF, start_ticks(SELF) or 0))
    assert env.get(b"PATH") == os.environ["PATH"].encode()


# --- what the environment decides ----------------------------------------------------------------


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, None),
        ({b"TMPDIR": b"/tmp/"}, None),
        ({b"DOTNET_EnableDiagnostics": b"1"}, None),
        ({b"DOTNET_EnableDiagnostics": b"0"}, "DOTNET_EnableDiagnostics=0: the runtime opened no diagnostics socket"),
        ({b"COMPlus_EnableDiagnostics": b"0"}, "COMPlus_EnableDiagnostics=0"),
        ({b"DOTNET_EnableDiagnostics_IPC": b"0"}, "DOTNET_EnableDiagnostics_IPC=0"),
        ({b"TMPDIR": b"/var/tmp"}, "TMPDIR is '/var/tmp': its diagnostics socket is there"),
        ({b"TMPDIR": b"/x\xff\n"}, r"TMPDIR is '/x\\xff\\x0a'"),
        ({b"DOTNET_PerfMapJitDumpPath": b"/srv"}, "DOTNET_PerfMapJitDumpPath is '/srv'"),
    ],
)
def test_environment_refusals(env: dict[bytes, bytes], want: str | None) -> None:
    got = environment_refusal(env)
    if want is None:
        assert got is None
    else:
        assert isinstance(got, Refusal) and want in got.reason, got


def test_a_map_asked_for_by_the_environment_is_left_alone() -> None:
    got = environment_refusal({b"DOTNET_PerfMapEnabled": b"1"})
    assert isinstance(got, Served) and "writes its perf map already" in got.message
    assert environment_refusal({b"DOTNET_PerfMapEnabled": b"0"}) is None


def test_parse_environ_keeps_the_first_of_a_name() -> None:
    assert parse_environ(b"A=1\0B=x=y\0A=2\0junk\0\0") == {b"A": b"1", b"B": b"x=y"}


@pytest.mark.needs_root
def test_a_process_sent_enable_without_a_good_answer_is_told_to_stop(name: Path) -> None:
    # Given a peer at the name that answers EnablePerfMap with garbage, then takes DisablePerfMap
    got: list[bytes] = []
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(name))
    srv.listen(2)

    def peer() -> None:
        with srv:
            srv.settimeout(10)
            for answer in (b"garbage that is no answer", OK_8_0_4[:14] + bytes([24, 0, 0xFF, 0, 0, 0]) + bytes(4)):
                conn, _ = srv.accept()
                with conn:
                    got.append(conn.recv(64))
                    conn.sendall(answer)

    t = threading.Thread(target=peer, daemon=True)
    t.start()
    plugin = DotNet()
    # the .NET plug-in reads no memory: no ProcessMemory for it
    ctx = ProcessContext(
        SELF,
        "/proc",
        None,  # type: ignore[arg-type]  # no memory to read
        FileCache(),
        start_ticks(SELF) or 0,
        [Mapping(0x1000, 0x2000, "r-xp", 0, 1, "/opt/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so")],
    )
    # When it is detected (the command is sent; the answer is read as it arrives, at the reader's ticks)
    pending = plugin.detect(ctx)
    assert isinstance(pending, Pending), pending
    res = wait_for("the answer", pending.poll, timeout=10)
    # Then the outcome is a counted refusal that says how it was malformed
    assert (
        isinstance(res, Refusal)
        and "(.NET 8.0.4): EnablePerfMap not sent or not answered: a malformed "
        "answer (1 so far): magic b'garbage that i'"
        in res.reason
    ), res
    assert plugin.stats["malformed"] == 1
    # And at stop it is told to stop all the same (it may have turned its map on)
    lines = plugin.stop()
    t.join(10)
    assert got == [ipc.enable_perf_map(), ipc.disable_perf_map()]
    assert plugin.stats["disabled"] == 1, lines


def start_a_silent_peer(name: Path, connected: list[float], done: threading.Event) -> threading.Thread:
    """A peer at `name` that takes two connections (their times into `connected`) and never answers,
    holding them until `done` (10 s at most): its thread, started."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(name))
    srv.listen(4)

    def peer() -> None:
        held = []
        with srv:
            srv.settimeout(10)
            for _ in range(2):
                conn, _ = srv.accept()
                connected.append(time.monotonic())
                held.append(conn)
            done.wait(10)
        for c in held:
            c.close()

    t = threading.Thread(target=peer, daemon=True)
    t.start()
    return t


def dotnet8_context() -> ProcessContext:
    """This process as the reader sees a .NET 8 process: libcoreclr.so mapped, no memory to read."""
    return ProcessContext(
        SELF,
        "/proc",
        None,  # type: ignore[arg-type]  # no memory to read
        FileCache(),
        start_ticks(SELF) or 0,
        [Mapping(0x1000, 0x2000, "r-xp", 0, 1, "/opt/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so")],
    )


@pytest.mark.needs_root
def test_a_peer_that_never_answers_is_retried_with_backoff_then_refused(
    name: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a peer at the name that takes every connection and never answers (time limits made short)
    monkeypatch.setattr(ipc, "ENABLE_ANSWER_TIMEOUT_S", 0.3)
    monkeypatch.setattr(dotnet_plugin, "RETRY_AFTER_S", 0.5)
    monkeypatch.setattr(dotnet_plugin, "ENABLE_ATTEMPTS", 2)
    connected: list[float] = []
    done = threading.Event()
    t = start_a_silent_peer(name, connected, done)
    plugin = DotNet()
    try:
        # When it is detected and polled as the reader's ticks do: no poll waits for the peer
        pending = plugin.detect(dotnet8_context())
        assert isinstance(pending, Pending), pending
        longest = 0.0

        def poll() -> Served | Refusal | None:
            nonlocal longest
            began = time.monotonic()
            got = pending.poll()
            longest = max(longest, time.monotonic() - began)
            return got

        res = wait_for("the outcome", poll, timeout=10, interval=0.02)
        # Then it was asked twice, the second time RETRY_AFTER_S after the first went unanswered, each
        # counted as stalled, then refused with a reason counted by its kind
        assert isinstance(res, Refusal) and res.kind == "dotnet_stalled", res
        assert "no answer within 0.3 s, 2 times; left alone" in res.reason, res.reason
        assert plugin.stats["stalled"] == 2
        assert len(connected) == 2 and connected[1] - connected[0] >= 0.3 + 0.5 - 0.05, connected
        assert longest < 0.25, f"a poll took {longest:.2f} s"
    finally:
        done.set()
        plugin.stop()
        t.join(5)
