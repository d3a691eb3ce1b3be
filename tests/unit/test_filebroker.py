"""The file broker: what a symbolizer may get from the collector, over a real Unix socket."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from ebpfprofiler.collector.filebroker import FileBroker
from ebpfprofiler.collector.procfs import parse_stat, read_maps
from ebpfprofiler.shared import endpoints
from ebpfprofiler.shared.wire import FileReply, Mapping, Process, decode
from ebpfprofiler.symbolizer.files import FileClient, FileRefused
from tests.harness import stop_process


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
def jit(build) -> Iterator[subprocess.Popen]:
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


def test_a_mapped_module_comes_back_as_the_file_itself(broker, jit, build) -> None:
    _, client = broker
    exe = build("jit")
    text = next(m for m in read_maps(jit.pid) if m.path == str(exe.resolve()))
    with client.module(process(jit.pid), text) as f:
        assert f.read() == exe.read_bytes()


def test_only_executable_file_mappings_are_served(broker, jit) -> None:
    b, client = broker
    proc = process(jit.pid)
    stack = next(ln for ln in Path(f"/proc/{jit.pid}/maps").read_text().splitlines() if ln.endswith("[stack]"))
    lo, hi = (int(x, 16) for x in stack.split()[0].split("-"))
    with pytest.raises(FileRefused, match="no executable file mapping"):
        client.module(proc, Mapping(lo, hi, 0, "[stack]"))
    assert b.stats["refused"] == 1


def test_a_reused_pid_is_refused(broker, jit, build) -> None:
    _, client = broker
    text = next(m for m in read_maps(jit.pid) if m.path == str(build("jit").resolve()))
    stale = process(jit.pid)
    stale = Process(**{**{f: getattr(stale, f) for f in stale.__slots__}, "start_ticks": stale.start_ticks - 1})
    with pytest.raises(FileNotFoundError, match="another process"):
        client.module(stale, text)


def test_perf_map_is_served_and_a_symlinked_one_refused(broker, jit) -> None:
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


def test_a_malformed_request_is_answered_and_the_broker_goes_on(broker, jit, tmp_path: Path) -> None:
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
    os.close(client.perf_map(proc.pid, proc.start_ticks))   # still serving


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
