"""The file broker: what a symbolizer may get from the collector, over a real Unix socket."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from collector.filebroker import DEBUG_DIR, FileBroker, Refused, open_debug
from collector.procfs import parse_stat, read_maps
from shared import endpoints
from shared.wire import FileReply, Mapping, Process, decode
from symbolizer.files import FileClient, FileRefused
from tests.harness import stop_process, wait_for


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[FileBroker, FileClient]]:
    b = FileBroker(str(tmp_path), allowed_uids={os.getuid()})
    c = FileClient(str(tmp_path))
    try:
        yield b, c
    finally:
        c.close()
        b.close()


@pytest.fixture
def jit(build: Callable[..., Path]) -> Iterator[subprocess.Popen]:
    p = subprocess.Popen([str(build("jit")), "30", "own"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().startswith("ready")
        yield p
    finally:
        stop_process(p)
        Path(f"/tmp/perf-{p.pid}.map").unlink(missing_ok=True)


def process(pid: int) -> Process:
    start = parse_stat(Path(f"/proc/{pid}/stat").read_text())[1]
    return Process(pid=pid, start_ticks=start, uid=os.getuid(), nspid=pid, comm="", executable="", service="")


@pytest.mark.needs_root
def test_a_mapped_module_comes_back_as_the_file_itself(
    broker: tuple[FileBroker, FileClient], jit: subprocess.Popen, build: Callable[..., Path]
) -> None:
    _, client = broker
    exe = build("jit")
    text = next(m for m in read_maps(jit.pid) if m.path == str(exe.resolve()))
    with client.module(process(jit.pid), text) as f:
        assert f.read() == exe.read_bytes()


def test_only_executable_file_mappings_are_served(broker: tuple[FileBroker, FileClient], jit: subprocess.Popen) -> None:
    b, client = broker
    proc = process(jit.pid)
    stack = next(ln for ln in Path(f"/proc/{jit.pid}/maps").read_text().splitlines() if ln.endswith("[stack]"))
    lo, hi = (int(x, 16) for x in stack.split()[0].split("-"))
    with pytest.raises(FileRefused, match="no executable file mapping"):
        client.module(proc, Mapping(lo, hi, 0, "[stack]"))
    assert b.stats["refused"] == 1


def test_a_reused_pid_is_refused(
    broker: tuple[FileBroker, FileClient], jit: subprocess.Popen, build: Callable[..., Path]
) -> None:
    _, client = broker
    text = next(m for m in read_maps(jit.pid) if m.path == str(build("jit").resolve()))
    stale = process(jit.pid)
    stale = Process(**{**{f: getattr(stale, f) for f in stale.__slots__}, "start_ticks": stale.start_ticks - 1})
    with pytest.raises(FileNotFoundError, match="another process"):
        client.module(stale, text)


def test_perf_map_is_served_and_a_symlinked_one_refused(
    broker: tuple[FileBroker, FileClient], jit: subprocess.Popen
) -> None:
    _, client = broker
    proc = process(jit.pid)
    fd = client.perf_map(proc.pid, proc.start_ticks)
    try:
        assert b"jit_spin_loop" in os.read(fd, 4096)
    finally:
        os.close(fd)
    path = Path(f"/tmp/perf-{jit.pid}.map")
    path.unlink()
    path.symlink_to("/etc/hostname")
    with pytest.raises(FileRefused, match=f"perf-{jit.pid}.map is a symlink"):
        client.perf_map(proc.pid, proc.start_ticks)


def test_a_malformed_request_is_answered_and_the_broker_goes_on(
    broker: tuple[FileBroker, FileClient], jit: subprocess.Popen, tmp_path: Path
) -> None:
    b, client = broker
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(endpoints.file_broker(str(tmp_path)))
        for junk in (b"", b"{", b'{"v":1,"kind":"file_request","body":{"pid":-1}}', b"x" * 10000):
            if junk:
                s.send(junk)
                reply = decode([s.recv(9000)])
                assert isinstance(reply, FileReply) and reply.error == "bad_request"
    assert b.stats["bad_requests"] == 3
    proc = process(jit.pid)
    os.close(client.perf_map(proc.pid, proc.start_ticks))  # still serving


def test_a_peer_of_another_uid_is_turned_away(tmp_path: Path) -> None:
    # given a broker that serves only uid 12345, when this process (another uid) asks
    b = FileBroker(str(tmp_path), allowed_uids={12345})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(endpoints.file_broker(str(tmp_path)))
            try:
                s.send(b"{}")
                answer = s.recv(100)
            except (BrokenPipeError, ConnectionResetError):
                answer = b""
        # then the connection is closed without an answer, and counted
        assert answer == b""
        assert b.stats["peers_refused"] == 1
    finally:
        b.close()


# --- debug files by build id: open_debug with temporary directories standing in for roots ---

BUILD_ID = "abcdef0123"
as_root = pytest.mark.needs_root  # root-owned debug files need root to make


def debug_file(root: Path, content: bytes = b"debug", build_id: str = BUILD_ID) -> Path:
    """root/usr/lib/debug/.build-id/ab/cdef0123.debug, a regular file readable by everyone."""
    path = root / DEBUG_DIR / build_id[:2] / f"{build_id[2:]}.debug"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    path.chmod(0o644)
    return path


def served(roots: list[Path]) -> bytes:
    fd = open_debug([str(r) for r in roots], BUILD_ID)
    with os.fdopen(fd, "rb") as f:
        return f.read()


@as_root
def test_a_debug_file_comes_from_the_process_root_before_the_host(tmp_path: Path) -> None:
    # given a process root and a host root that both have a debug file for the build id
    proc_root, host_root = tmp_path / "proc_root", tmp_path / "host"
    debug_file(proc_root, b"container's")
    debug_file(host_root, b"host's")
    # when asked / then the process root's is served; without it, the host's; without both, none
    assert served([proc_root, host_root]) == b"container's"
    (proc_root / DEBUG_DIR).rename(proc_root / "elsewhere")
    assert served([proc_root, host_root]) == b"host's"
    with pytest.raises(FileNotFoundError):
        served([proc_root])


def test_a_debug_file_not_owned_by_root_is_refused(tmp_path: Path) -> None:
    # given a debug file owned by another user (nobody, or this non-root user)
    path = debug_file(tmp_path)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    # when asked / then it is refused, naming the owner
    with pytest.raises(Refused, match="not root") as refused:
        served([tmp_path])
    assert refused.value.error == "refused"


@as_root
def test_an_untrusted_debug_file_in_the_process_root_gives_way_to_the_host_one(tmp_path: Path) -> None:
    # given a process root whose debug file is not root's, and a host root with a trusted one
    proc_root, host_root = tmp_path / "proc_root", tmp_path / "host"
    os.chown(debug_file(proc_root, b"planted"), 65534, 65534)
    debug_file(host_root, b"host's")
    # when asked / then the host's is served
    assert served([proc_root, host_root]) == b"host's"


@as_root
def test_a_debug_file_nobody_else_may_read_a_fifo_or_an_oversized_one_is_refused(tmp_path: Path) -> None:
    # given a root-owned debug file only root may read
    path = debug_file(tmp_path)
    path.chmod(0o600)
    # when asked / then refused: the symbolizer gets nothing a user could not read
    with pytest.raises(Refused, match="not readable by everyone"):
        served([tmp_path])
    # given a FIFO in its place / when asked / then refused at once, never opened (it would block)
    path.unlink()
    os.mkfifo(path, 0o644)
    with pytest.raises(Refused, match="not a regular file"):
        served([tmp_path])


@as_root
def test_debug_symlinks_are_followed_inside_their_root_only(tmp_path: Path) -> None:
    # given a root whose build-id entry is a relative symlink into ../../.., as Debian ships them
    root = tmp_path / "root"
    target = root / "usr/lib/debug/usr/lib/libfoo.so.debug"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"by symlink")
    target.chmod(0o644)
    link = debug_file(root)
    link.unlink()
    link.symlink_to("../../../debug/usr/lib/libfoo.so.debug")
    # when asked / then the file it points to is served
    assert served([root]) == b"by symlink"
    # given links that would leave the root for a host file that is root's and readable by all
    assert Path("/etc/hostname").stat().st_uid == 0
    for escape in ("/etc/hostname", "../../../../../../../../../../etc/hostname"):
        link.unlink()
        link.symlink_to(escape)
        # when asked / then they resolve inside the root, where there is no such file
        with pytest.raises(FileNotFoundError):
            served([root])


def test_a_perf_map_that_is_a_fifo_is_refused_without_being_opened(
    broker: tuple[FileBroker, FileClient], started: list[subprocess.Popen]
) -> None:
    # given a process whose perf map is a FIFO, and a writer blocked in open() until someone opens it to read
    # (a process without JIT code: other profilers on this host never look up its perf map)
    _, client = broker
    sleeper = subprocess.Popen(["sleep", "60"])
    started.append(sleeper)
    proc = process(sleeper.pid)
    path = Path(f"/tmp/perf-{sleeper.pid}.map")
    os.mkfifo(path, 0o644)
    opened = threading.Event()

    def writer() -> None:
        fd = os.open(path, os.O_WRONLY)  # returns only once a reader opened the FIFO
        opened.set()
        os.close(fd)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        # when the symbolizer asks for it, then it is refused at once, and nobody opened it to read
        with pytest.raises(FileRefused, match="not a regular file"):
            client.perf_map(proc.pid, proc.start_ticks)
        assert not opened.wait(0.5), "the broker opened the FIFO"
    finally:
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # let the writer go
        t.join(10)
        os.close(reader)
        path.unlink()
    assert opened.is_set()


def test_connections_past_the_cap_are_closed_and_the_broker_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jit: subprocess.Popen
) -> None:
    # given a broker that serves at most 2 connections at once, held open by a peer
    from collector import filebroker

    monkeypatch.setattr(filebroker, "MAX_CONNECTIONS", 2)
    b = FileBroker(str(tmp_path), allowed_uids={os.getuid()})
    held = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    try:
        for s in held:
            s.connect(endpoints.file_broker(str(tmp_path)))
        # when a third connects, then it is closed unserved, and counted
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as extra:
            extra.connect(endpoints.file_broker(str(tmp_path)))
            extra.settimeout(10)
            assert extra.recv(100) == b""
        wait_for("the refusal to be counted", lambda: b.stats["peers_refused"] == 1)
        # and once the held ones go, a client is served again
        for s in held:
            s.close()
        client = FileClient(str(tmp_path))
        proc = process(jit.pid)
        wait_for("a served perf map", lambda: _served(client, proc))
        client.close()
    finally:
        for s in held:
            s.close()
        b.close()


def _served(client: FileClient, proc: Process) -> bool:
    try:
        os.close(client.perf_map(proc.pid, proc.start_ticks))
        return True
    except OSError:
        return False
