"""Serving unwind requests (symbolizer/unwind.py) end to end: a real process, the real file broker,
the collector's real PULL socket; the answers decode and cover what they should."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from collector.filebroker import FileBroker
from collector.procfs import parse_stat, read_maps
from shared import endpoints
from shared import unwind_table as ut
from shared.wire import (
    Mapping,
    Process,
    StackBatch,
    UnwindRequest,
    UnwindTable,
    decode,
)
from symbolizer import cfi
from symbolizer.files import FileClient
from symbolizer.unwind import UnwindServer
from tests.harness import stop_process

LIB_SOURCE = "int cfi_test_lib(int x) { return x * 3 + 1; }\n"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture
def libs(tmp_path: Path) -> dict[str, Path]:
    """A library without any CFI, and one whose .eh_frame has an entry running past its end."""
    src = tmp_path / "lib.c"
    src.write_text(LIB_SOURCE)
    nocfi, good, corrupt = tmp_path / "libnocfi.so", tmp_path / "libgood.so", tmp_path / "libcorrupt.so"
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-shared",
            "-fPIC",
            "-nostdlib",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
            "-o",
            str(nocfi),
            str(src),
        ],
        check=True,
    )
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(good), str(src)], check=True)
    with good.open("rb") as f:
        eh = cfi.read_module(f).eh_frame
    assert eh is not None
    data = bytearray(good.read_bytes())
    data[eh.offset : eh.offset + 4] = (0x7FFFFFF0).to_bytes(4, "little")
    corrupt.write_bytes(bytes(data))
    return {"nocfi": nocfi, "corrupt": corrupt}


@pytest.fixture
def prog(build: Callable[..., Path], libs: dict[str, Path]) -> Iterator[subprocess.Popen]:
    """The -O2 -fomit-frame-pointer test program, waiting, with both libraries preloaded."""
    env = {**os.environ, "LD_PRELOAD": f"{libs['nocfi']}:{libs['corrupt']}"}
    p = subprocess.Popen(
        [str(build("cfi_prog", ["-O2", "-fomit-frame-pointer"])), "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield p
    finally:
        if p.stdin:
            p.stdin.close()
        stop_process(p)


@pytest.fixture
def collector_socket(run_dir: Path, zctx: zmq.Context) -> Iterator[zmq.Socket]:
    s = zctx.socket(zmq.PULL)
    s.bind(endpoints.unwind(str(run_dir)))
    try:
        yield s
    finally:
        s.close(linger=0)


@pytest.fixture
def broker(run_dir: Path) -> Iterator[FileBroker]:
    b = FileBroker(str(run_dir), allowed_uids={os.getuid()})
    try:
        yield b
    finally:
        b.close()


def process(pid: int) -> Process:
    start = parse_stat(Path(f"/proc/{pid}/stat").read_text())[1]
    maps = tuple(m for m in read_maps(pid) if m.path.startswith("/"))
    return Process(
        pid=pid,
        start_ticks=start,
        uid=os.getuid(),
        nspid=pid,
        comm="cfi_prog",
        executable="",
        service="cfi_prog",
        mappings=maps,
    )


def text_mapping(proc: Process, path: Path) -> Mapping:
    want = str(path.resolve())
    # the mapping at the largest executable segment's file offset
    with path.open("rb") as f:
        m = cfi.read_module(f)
    return next(x for x in proc.mappings if x.path == want and x.offset <= m.text_offset < x.offset + x.end - x.start)


def batch(proc: Process, mappings: list[Mapping]) -> StackBatch:
    return StackBatch(
        host="h",
        profile_type="cpu",
        sample_hz=19,
        time_ns=time.time_ns(),
        processes=(proc,),
        user_stacks=(),
        kernel_stacks=(),
        samples=(),
        unwind_requests=tuple(
            UnwindRequest(proc.pid, proc.start_ticks, m.start, m.end, m.dev, m.inode) for m in mappings
        ),
    )


def receive(sock: zmq.Socket, n: int, timeout: float = 30.0) -> list[UnwindTable]:
    got: list[UnwindTable] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"got {len(got)} of {n} unwind tables"
        if sock.poll(int(left * 1000)):
            msg = decode(sock.recv_multipart())
            assert isinstance(msg, UnwindTable)
            got.append(msg)
    return got


def main_address(exe: Path) -> int:
    out = subprocess.run(["nm", "--defined-only", str(exe)], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[0], 16) for line in out.splitlines() if line.endswith(" T main"))


@pytest.mark.needs_root
def test_a_request_is_answered_with_a_table_that_covers_main(
    prog: subprocess.Popen,
    broker: FileBroker,
    collector_socket: zmq.Socket,
    run_dir: Path,
    tmp_path: Path,
    zctx: zmq.Context,
    build: Callable[..., Path],
) -> None:
    # given a running program built without frame pointers, and a request for its executable's text
    exe = build("cfi_prog", ["-O2", "-fomit-frame-pointer"])
    proc = process(prog.pid)
    text = text_mapping(proc, exe)
    server = UnwindServer(FileClient(str(run_dir)), str(run_dir), str(tmp_path / "state"), ctx=zctx)
    try:
        # when the symbolizer serves it
        server.serve(batch(proc, [text]))
        (answer,) = receive(collector_socket, 1)
        # then the collector gets an ok table for that file, and its row at main's pc is main's entry
        assert (answer.status, answer.dev, answer.inode, answer.path) == ("ok", text.dev, text.inode, text.path)
        assert answer.build_id and len(answer.build_id) == 40
        table = ut.decode(answer.table, ut.ARCH_X86_64)
        with exe.open("rb") as f:
            m = cfi.read_module(f)
        main_pc = text.start + (main_address(exe) - m.text_vaddr) + (m.text_offset - text.offset)
        row = table.row_for(main_pc - ut.bias(table, text.start, text.offset))
        assert row is not None
        assert (row.cfa_kind, row.cfa_off, row.ra_kind, row.ra_off) == (ut.CFA_SP, 8, ut.RA_SAVED, -8)
        assert server.stats["built"] == 1

        # and the same file asked again right away is not built or sent again
        server.serve(batch(proc, [text]))
        assert server.stats["built"] == 1 and server.stats["recently_answered"] == 1
    finally:
        server.close()

    # and a restarted worker answers from its disk cache without building
    again = UnwindServer(FileClient(str(run_dir)), str(run_dir), str(tmp_path / "state"), ctx=zctx)
    try:
        again.serve(batch(proc, [text]))
        (answer2,) = receive(collector_socket, 1)
        assert answer2.table == answer.table
        assert again.stats["from_cache"] == 1 and again.stats["built"] == 0
    finally:
        again.close()


@pytest.mark.needs_root
def test_modules_without_usable_cfi_are_answered_none_or_failed_and_serving_goes_on(
    prog: subprocess.Popen,
    broker: FileBroker,
    collector_socket: zmq.Socket,
    run_dir: Path,
    tmp_path: Path,
    zctx: zmq.Context,
    libs: dict[str, Path],
    build: Callable[..., Path],
) -> None:
    # given requests for a library without CFI, one with a corrupt .eh_frame, and the program itself
    proc = process(prog.pid)
    wanted = [
        text_mapping(proc, libs["nocfi"]),
        text_mapping(proc, libs["corrupt"]),
        text_mapping(proc, build("cfi_prog", ["-O2", "-fomit-frame-pointer"])),
    ]
    server = UnwindServer(FileClient(str(run_dir)), str(run_dir), str(tmp_path / "state"), ctx=zctx)
    try:
        server.serve(batch(proc, wanted))
        answers = {a.inode: a for a in receive(collector_socket, 3)}
    finally:
        server.close()
    # then each is answered: none with the reason, failed (counted by kind), and ok
    nocfi, corrupt, ok = (answers[m.inode] for m in wanted)
    assert (nocfi.status, nocfi.reason) == ("none", "no .eh_frame or .debug_frame")
    assert corrupt.status == "failed" and "past the end" in corrupt.reason and not corrupt.table
    assert ok.status == "ok" and ut.decode(ok.table).row_count > 10
    assert server.failed_by_reason == {"malformed": 1} and server.stats["none"] == 1


def test_a_process_that_is_gone_gets_no_answer_and_is_counted(
    broker: FileBroker, collector_socket: zmq.Socket, run_dir: Path, tmp_path: Path, zctx: zmq.Context
) -> None:
    gone = Process(pid=999_999, start_ticks=1, uid=0, nspid=1, comm="", executable="", service="")
    server = UnwindServer(FileClient(str(run_dir)), str(run_dir), str(tmp_path / "state"), ctx=zctx)
    try:
        server.serve(batch(gone, [Mapping(0x1000, 0x2000, 0, "/x", "fd:01", 7)]))
        assert server.stats["unreadable"] == 1 and server.stats["sent"] == 0
        assert not collector_socket.poll(200)
    finally:
        server.close()


@pytest.mark.needs_root
def test_answers_to_an_absent_collector_are_dropped_without_blocking(
    broker: FileBroker,
    prog: subprocess.Popen,
    run_dir: Path,
    tmp_path: Path,
    zctx: zmq.Context,
    build: Callable[..., Path],
) -> None:
    # given no collector socket at all, when a request is served
    proc = process(prog.pid)
    text = text_mapping(proc, build("cfi_prog", ["-O2", "-fomit-frame-pointer"]))
    server = UnwindServer(FileClient(str(run_dir)), str(run_dir), str(tmp_path / "state"), ctx=zctx)
    try:
        started = time.monotonic()
        server.serve(batch(proc, [text]))
        # then the send fails at once, counted, and the file is not marked answered (it will be asked again)
        assert time.monotonic() - started < 10
        assert server.stats["send_failed"] == 1
        server.serve(batch(proc, [text]))
        assert server.stats["recently_answered"] == 0 and server.stats["from_cache"] == 1
    finally:
        server.close()


@pytest.mark.needs_root
def test_the_batch_budget_cuts_a_build_inside_a_module_and_defers_it(
    prog: subprocess.Popen,
    broker: FileBroker,
    collector_socket: zmq.Socket,
    run_dir: Path,
    tmp_path: Path,
    zctx: zmq.Context,
    build: Callable[..., Path],
) -> None:
    # given a batch asking for the program, then libc, when the first build has used all but 1 ms of the
    # batch's budget (a clock that jumps once something was built)
    from symbolizer.unwind import BUILD_SECONDS_PER_BATCH

    proc = process(prog.pid)
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    wanted = [text_mapping(proc, build("cfi_prog", ["-O2", "-fomit-frame-pointer"])), text_mapping(proc, libc)]
    server: UnwindServer | None = None

    def clock() -> float:
        return BUILD_SECONDS_PER_BATCH - 0.001 if server is not None and server.stats["built"] else 0.0

    server = UnwindServer(FileClient(str(run_dir)), str(run_dir), str(tmp_path / "state"), ctx=zctx, clock=clock)
    try:
        server.serve(batch(proc, wanted))
        (answer,) = receive(collector_socket, 1)
        # then the program is answered, and libc's build, cut inside by what was left, is deferred: no
        # answer, not failed, nothing cached (the collector asks again)
        assert answer.inode == wanted[0].inode and answer.status == "ok"
        assert server.stats["deferred"] == 1 and server.stats["failed"] == 0 and server.stats["built"] == 1
        assert not collector_socket.poll(200)
    finally:
        server.close()
