"""runtimes/bpf_walks.py: the runtime reader's side of the Python walk in BPF, over real ZeroMQ sockets.

A real CPython 3.11 (tests/workloads/py_threads.py: a worker in run() → cpu_a()/cpu_b(), a waiter) is
announced to the stage's own Reader the way the collector does (a PUB socket on processes.sock). A PULL
socket stands in for the collector's walker (python-walk.sock), a DEALER for a symbolizer worker
(python-names.sock). Given that process, when the reader detects it, then its PythonProcess arrives with
the runtime address and offsets CPython's own detection (runtimes/cpython/version.py) gives, and again at
a full announcement, but not at two in a row; when a symbolizer asks to name the code pointers the
process's frames hold (read here by a walk of this test's own, as bpf/python.h does), then they come
back as cpu_a, cpu_b and run at lines of the workload; a request for another start time or pid is refused
(answered with nothing), a request over its read budget is answered with what was named, and garbage is
counted and skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
import zmq

from collector.procfs import read_process
from runtimes import bpf_walks
from runtimes.cpython import layouts, version
from runtimes.main import Reader
from runtimes.memory import MemoryReadError, ProcessMemory, ReadBudget
from runtimes.runtime import FileCache, ProcessContext
from shared import endpoints
from shared.config import ProfilerConfig
from shared.procstat import start_ticks
from shared.wire import (
    MAX_PYTHON_NAMES,
    PythonLayout,
    PythonNameRequest,
    PythonNames,
    PythonProcess,
    decode,
    encode,
)
from shared.wire import ProcessAnnouncement as Announcement
from tests.harness import ROOT

PYTHON311 = "/usr/bin/python3.11"
WORKLOAD = ROOT / "tests" / "workloads" / "py_threads.py"
# Seconds a socket or the reader is waited for here (all of it local; a loaded 2-CPU host takes ms).
WAIT_S = 10.0
# Walks of the workload's frames, ~5 ms apart: the worker is in cpu_a 3/4 of the time, cpu_b 1/4.
WALKS = 40

pytestmark = pytest.mark.skipif(not os.path.exists(PYTHON311), reason=f"{PYTHON311} is not installed")


def marked_lines(marker: str) -> set[int]:
    lines = WORKLOAD.read_text().splitlines()
    return {i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}")}


def def_line(name: str) -> int:
    lines = WORKLOAD.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.startswith(f"def {name}("))


def span(name: str) -> set[int]:
    """The lines of a function of the workload: its def to the line before the next blank one."""
    lines = WORKLOAD.read_text().splitlines()
    first = def_line(name)
    last = next(i for i in range(first, len(lines) + 1) if not lines[i - 1].strip()) - 1
    return set(range(first, last + 1))


@pytest.fixture(scope="module")
def workload() -> Iterator[subprocess.Popen]:
    p = subprocess.Popen([PYTHON311, str(WORKLOAD), "120"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert json.loads(p.stdout.readline())["worker"]
        yield p
    finally:
        p.communicate(timeout=30)  # closing stdin ends it


@dataclasses.dataclass
class Stage:
    reader: Reader
    publish: zmq.Socket  # the collector's announcements
    walker: zmq.Socket  # the collector's python-walk.sock
    symbolizer: zmq.Socket  # a symbolizer worker's DEALER on python-names.sock


@pytest.fixture
def stage() -> Iterator[Stage]:
    run_dir = tempfile.mkdtemp(prefix="bw", dir="/tmp")  # ipc paths are short: not under pytest's tmp_path
    ctx: zmq.Context = zmq.Context.instance()
    publish, walker, symbolizer = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL), ctx.socket(zmq.DEALER)
    for s in (publish, walker, symbolizer):
        s.setsockopt(zmq.LINGER, 0)
    publish.bind(endpoints.processes(run_dir))
    walker.bind(endpoints.python_walk(run_dir))
    cfg = ProfilerConfig(plain_pid=True, runtime_stacks=("python_legacy",), cpu_budget=100.0)
    reader = Reader(cfg, run_dir, run_dir)
    symbolizer.connect(endpoints.python_names(run_dir))
    try:
        yield Stage(reader, publish, walker, symbolizer)
    finally:  # its sockets closed (Reader.close would wait for an uploader to take its windows)
        for s in (reader.inbox, reader.outbox, publish, walker, symbolizer):
            s.close()
        reader.walks.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def announce(st: Stage, pid: int) -> None:
    """The collector's announcement of `pid`, published until the reader took it (a new SUB socket misses
    what is published before its subscription arrives)."""
    proc = read_process(pid, False)
    assert proc is not None
    deadline = time.monotonic() + WAIT_S
    while pid not in st.reader.targets.entries:
        assert time.monotonic() < deadline, "the reader took no announcement"
        st.publish.send_multipart(encode(Announcement("test", time.time_ns(), (proc,))))
        time.sleep(0.01)
        st.reader.receive()


def full_announcement(st: Stage, pid: int) -> None:
    """The collector's periodic full list (the process alone), as the reader's loop takes it."""
    proc = read_process(pid, False)
    assert proc is not None
    st.publish.send_multipart(encode(Announcement("test", time.time_ns(), (proc,), full=True)))
    time.sleep(0.05)
    st.reader.receive()


def detected(st: Stage, pid: int) -> None:
    """Announced and ticked until the reader reads it."""
    announce(st, pid)
    deadline = time.monotonic() + WAIT_S
    while st.reader.targets.entries[pid].state != "reading":
        assert time.monotonic() < deadline, st.reader.targets.entries[pid]
        st.reader.tick(time.time_ns())


def received(sock: zmq.Socket, timeout_s: float = WAIT_S) -> list[bytes] | None:
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return sock.recv_multipart()


def target_of(pid: int) -> version.Target:
    got = version.detect(
        ProcessContext(pid, "/proc", ProcessMemory(pid, ReadBudget(1 << 20)), FileCache()), modern=True, legacy=True
    )
    assert isinstance(got, version.Target), got
    return got


def frame_refs(pid: int, t: version.Target) -> set[tuple[int, int]]:
    """(code, instr or -1) of every Python frame of every thread, read as the walk in BPF reads them."""
    lay = t.layout
    size = max(lay.frame_previous, lay.frame_executable, lay.frame_instr_ptr, lay.frame_owner) + 8
    mem = ProcessMemory(pid, ReadBudget(1 << 20))
    out: set[tuple[int, int]] = set()
    tstate = mem.u64(mem.u64(t.runtime + lay.runtime_interpreters_head) + lay.interp_threads_head)
    while tstate:
        frame = mem.u64(tstate + lay.tstate_current_frame)
        if lay.cframe_current_frame is not None and frame:
            frame = mem.u64(frame + lay.cframe_current_frame)
        for _ in range(64):
            if not frame:
                break
            try:
                raw = mem.read(frame, size)  # the thread runs on: a torn frame ends its walk
            except MemoryReadError:
                break
            code, instr, previous = (
                struct.unpack_from("<Q", raw, at)[0]
                for at in (lay.frame_executable, lay.frame_instr_ptr, lay.frame_previous)
            )
            code &= ~lay.tag_mask
            offset = instr - (code + lay.code_adaptive)
            if code and raw[lay.frame_owner] not in lay.skip_owners:
                out.add((code, offset if 0 <= offset < 1 << 32 else -1))
            frame = previous
        tstate = mem.u64(tstate + lay.tstate_next)
    return out


def ask(st: Stage, request: PythonNameRequest | list[bytes]) -> PythonNames | None:
    """A request from the symbolizer, served by the reader as its loop does; its answer (None: none)."""
    st.symbolizer.send_multipart(encode(request) if isinstance(request, PythonNameRequest) else request)
    deadline = time.monotonic() + 0.5  # the reader answers in milliseconds
    while time.monotonic() < deadline:
        st.reader.walks.serve(st.reader.targets, st.reader.caps.max_bytes)
        got = received(st.symbolizer, 0.02)
        if got is not None:
            msg = decode(got)
            assert isinstance(msg, PythonNames), msg
            return msg
    return None


def test_a_detected_process_is_pushed_with_its_runtime_and_layout_again_at_full_announcements(
    stage: Stage, workload: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the workload announced to the reader
    # When the reader detects it
    detected(stage, workload.pid)
    # Then the collector's socket gets its PythonProcess: pid and start time, and what CPython's own
    # detection finds: its version, its _PyRuntime, every offset of its layout under the same name
    frames = received(stage.walker)
    assert frames is not None, "no PythonProcess arrived"
    msg = decode(frames)
    assert isinstance(msg, PythonProcess), msg
    t = target_of(workload.pid)
    assert (msg.pid, msg.start_ticks) == (workload.pid, start_ticks(workload.pid))
    assert (msg.version, msg.runtime) == (t.version, t.runtime)
    assert msg.version.startswith("3.11.")
    for f in dataclasses.fields(PythonLayout):
        assert getattr(msg.layout, f.name) == getattr(t.layout, f.name), f.name
    # When the collector announces its full list twice in a row, then once more after REOFFER_MIN_S
    monkeypatch.setattr(bpf_walks, "REOFFER_MIN_S", 0.5)
    full_announcement(stage, workload.pid)
    again = received(stage.walker)
    full_announcement(stage, workload.pid)
    too_soon = received(stage.walker, 0.3)
    time.sleep(0.5)
    full_announcement(stage, workload.pid)
    later = received(stage.walker)
    # Then the process is sent again at the first and the last, not at the second
    assert again is not None and decode(again) == msg
    assert too_soon is None, decode(too_soon)
    assert later is not None and decode(later) == msg
    assert stage.reader.walks.stats["walk_offers"] == 3
    assert stage.reader.walks.stats["walk_offers_dropped"] == 0


def test_a_symbolizers_request_is_answered_with_the_workloads_functions_and_lines(
    stage: Stage, workload: subprocess.Popen
) -> None:
    # Given the workload read by the reader, and the code pointers of its frames, walked 40 times
    detected(stage, workload.pid)
    ticks = start_ticks(workload.pid)
    assert ticks is not None
    t = target_of(workload.pid)
    refs: set[tuple[int, int]] = set()
    for _ in range(WALKS):
        refs |= frame_refs(workload.pid, t)
        time.sleep(0.005)
    # When a symbolizer asks to name them
    answer = ask(stage, PythonNameRequest(7, workload.pid, ticks, tuple(sorted(refs))))
    # Then they come back for its request, under the pairs it asked, as the worker's functions at lines
    # of the workload
    assert answer is not None, "no answer"
    assert (answer.request_id, answer.pid, answer.start_ticks) == (7, workload.pid, ticks)
    assert {(code, instr) for code, instr, *_ in answer.names} <= refs
    ours = [n for n in answer.names if n[3] == str(WORKLOAD)]
    functions = {n[2] for n in ours}
    assert {"run", "cpu_a", "cpu_b", "wait_here"} <= functions, answer.names
    for _, _, function, _, line in ours:
        if function in ("cpu_a", "cpu_b"):
            assert line in span(function), (function, line)
        if function == "run":
            run_lines = ("CALL_A", "CALL_B", "LOOP", "TIMING")
            assert line in set().union(*(marked_lines(m) for m in run_lines)), line
    assert stage.reader.walks.stats["frames_named"] == len(answer.names)
    assert stage.reader.walks.stats["frames_not_named"] == len(refs) - len(answer.names)
    # When it asks for cpu_a's code with no instruction (a frame not started)
    code_a = next(n[0] for n in ours if n[2] == "cpu_a")
    not_started = ask(stage, PythonNameRequest(8, workload.pid, ticks, ((code_a, -1),)))
    # Then it is named at its def line
    assert not_started is not None
    assert not_started.names == ((code_a, -1, "cpu_a", str(WORKLOAD), def_line("cpu_a")),)


def test_another_process_is_refused_and_garbage_is_counted_and_skipped(
    stage: Stage, workload: subprocess.Popen
) -> None:
    # Given the workload read by the reader, and one code pointer of it
    detected(stage, workload.pid)
    ticks = start_ticks(workload.pid)
    assert ticks is not None
    code, instr = next(iter(frame_refs(workload.pid, target_of(workload.pid))))
    # When a symbolizer asks with another start time (its pid reused), with a pid the reader does not
    # read, with garbage and with a message of another kind
    other_start = ask(stage, PythonNameRequest(1, workload.pid, ticks + 1, ((code, instr),)))
    other_pid = ask(stage, PythonNameRequest(2, os.getpid(), start_ticks(os.getpid()) or 0, ((code, instr),)))
    garbage = ask(stage, [b"garbage"])
    wrong_kind = ask(stage, encode(PythonNames(3, workload.pid, ticks, ())))
    fine = ask(stage, PythonNameRequest(4, workload.pid, ticks, ((code, instr),)))
    # Then the first two are answered with nothing, refused; the garbage is not answered, counted; and
    # the reader goes on answering
    assert other_start is not None and other_start.names == ()
    assert other_pid is not None and other_pid.names == ()
    assert garbage is None and wrong_kind is None
    assert fine is not None and fine.request_id == 4
    stats = stage.reader.walks.stats
    assert (stats["names_refused"], stats["names_malformed"], stats["name_requests"]) == (2, 2, 3)
    checks = stage.reader.checks()
    assert (checks["names_refused"], checks["names_malformed"]) == (2, 2)


def test_a_request_over_its_read_budget_is_answered_with_what_was_named(
    stage: Stage, workload: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the workload read by the reader, its frames, and a read budget of 2 KiB a request
    detected(stage, workload.pid)
    ticks = start_ticks(workload.pid)
    assert ticks is not None
    refs = frame_refs(workload.pid, target_of(workload.pid))
    monkeypatch.setattr(bpf_walks, "NAME_BYTES_PER_REQUEST", 2048)
    # When a symbolizer asks for its frames many times over (instructions past the code: never cached)
    many = tuple((code, 2 * i) for code, _ in sorted(refs) for i in range(100))[:MAX_PYTHON_NAMES]
    answer = ask(stage, PythonNameRequest(5, workload.pid, ticks, many))
    # Then it is answered with the part named within the budget, counted
    assert answer is not None
    assert 0 < len(answer.names) < len(many)
    assert stage.reader.walks.stats["names_over_budget"] == 1


def test_every_layout_goes_to_the_wire_with_every_offset_the_walk_reads_under_its_name() -> None:
    # Given each version's layout (3.13+ from debug offsets numbered by their position)
    for v, lay in [*layouts.LEGACY.items(), *((v, debug_layout(v)) for v in layouts.DEBUG)]:
        # When it is made the wire's PythonLayout
        got = layouts.wire_layout(lay)
        # Then every field is the layout's of that name
        for f in dataclasses.fields(PythonLayout):
            assert getattr(got, f.name) == getattr(lay, f.name), (v, f.name)


def debug_layout(v: tuple[int, int]) -> layouts.Layout:
    extras = layouts.DEBUG[v]
    values = {name: 8 * i for i, name in enumerate(layouts.debug_field_offsets(extras))}
    return layouts.layout_from_debug(values, extras)


def test_names_have_a_cpu_share_of_their_own_not_the_readers_pace(stage: Stage, workload: subprocess.Popen) -> None:
    # Given the workload read by the reader, one of its frames, and a reader whose CpuPace is spent (its
    # wall reading over budget, as on a busy host)
    detected(stage, workload.pid)
    ticks = start_ticks(workload.pid)
    assert ticks is not None
    code, instr = next(iter(frame_refs(workload.pid, target_of(workload.pid))))
    stage.reader.pace.bucket.tokens = -1.0
    # When a symbolizer asks to name it
    named = ask(stage, PythonNameRequest(1, workload.pid, ticks, ((code, instr),)))
    # Then it is answered all the same
    assert named is not None and len(named.names) == 1
    # When naming's own share is spent (and refills no more)
    stage.reader.walks.naming.rate = 0.0
    stage.reader.walks.naming.tokens = 0.0
    waiting = ask(stage, PythonNameRequest(2, workload.pid, ticks, ((code, instr),)))
    # Then the request is left unanswered, counted, for the symbolizer to ask again; and answered once the
    # share allows
    assert waiting is None
    assert stage.reader.walks.stats["names_over_share"] == 1
    stage.reader.walks.naming.tokens = bpf_walks.NAME_BURST_S
    again = ask(stage, PythonNameRequest(3, workload.pid, ticks, ((code, instr),)))
    assert again is not None and again.names == named.names
