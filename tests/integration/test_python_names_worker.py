"""A real symbolizer worker splices Python frames into a native stack and names them through a runtime reader.

Given a symbolizer worker process (as its own user, `ebpfprofiler symbolizer`), a file broker for it
(collector/filebroker.py, in the test), a ROUTER standing in for the runtime reader at
endpoints.python_names and one for the uploader, and a live python3.11 whose mappings name the native
frames, when a StackBatch with a Python stack is pushed to the worker over ZeroMQ and the stand-in
names the frames it is asked for (all but one), then the profile the worker hands out at its stop
reads `Py_BytesMain ← PyEval_EvalCode ← <module> ← run ← _PyFunction_Vectorcall ← cpu_a`, with
each Python frame's file and line, the unnamed one under its placeholder, and the worker's counters
say what happened.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from collector.filebroker import FileBroker
from shared import counters, endpoints, handoff, pprof, privileges
from shared.config import ProfilerConfig
from shared.wire import (
    Process,
    ProfileUpload,
    PyFrameRef,
    PythonNameRequest,
    PythonNames,
    PythonStack,
    Sample,
    StackBatch,
    decode,
    encode,
)
from symbolizer.pystacks import PythonFrame, placeholder
from tests.harness import DEADLINE_S, PY, give, open_dir, stderr_file, stop_process, vaddr_to_offset, write_config
from tests.unit.test_symbolize import address_in, live

pytestmark = pytest.mark.needs_root

EXE = Path("/usr/bin/python3.11")
# Code objects of the recorded stack, and what the stand-in reader names them (MYSTERY it leaves out).
CPU_A, RUN, MODULE, MYSTERY = 0x7F3A11C2B0, 0x7F3A11C1F0, 0x7F3A11E030, 0x7F3A11F000
NAMES = {CPU_A: ("cpu_a", "/srv/app.py", 7), RUN: ("run", "/srv/app.py", 12), MODULE: ("<module>", "/srv/app.py", 20)}


def dynamic_symbol(name: str) -> int:
    """The address of a dynamic symbol of EXE (Debian's interpreter has no .symtab)."""
    out = subprocess.run(["nm", "-D", str(EXE)], capture_output=True, text=True, check=True).stdout
    return int(next(ln.split()[0] for ln in out.splitlines() if ln.endswith(f" {name}")), 16)


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = open_dir("python-names")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def target() -> Iterator[Process]:
    """A live python3.11, for its mappings (the stack itself is the test's)."""
    p = subprocess.Popen(
        [str(EXE), "-c", "import time; print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE
    )
    try:
        assert p.stdout is not None and p.stdout.readline().startswith(b"ready")
        yield live(p.pid)
    finally:
        stop_process(p)


def batch_for(proc: Process) -> StackBatch:
    """cpu_a called back from C (_PyFunction_Vectorcall) by run, called by <module>; and a sample in an
    unnamed function. Native frames leaf first, return addresses a little into each function."""

    def at(name: str, into: int) -> int:
        return address_in(proc, EXE, vaddr_to_offset(EXE, dynamic_symbol(name) + into))

    eval_leaf, eval_outer = at("_PyEval_EvalFrameDefault", 0x40), at("_PyEval_EvalFrameDefault", 0x80)
    native = (
        eval_leaf,
        at("_PyFunction_Vectorcall", 0x20),
        eval_outer,
        at("PyEval_EvalCode", 0x10),
        at("Py_BytesMain", 0x10),
    )
    mixed = PythonStack((PyFrameRef(CPU_A, 24, True), PyFrameRef(RUN, 58, False), PyFrameRef(MODULE, 112, True)))
    unnamed = PythonStack((PyFrameRef(MYSTERY, 6, True),))
    return StackBatch(
        host="test",
        profile_type="cpu",
        sample_hz=99,
        time_ns=time.time_ns(),
        processes=(proc,),
        user_stacks=(native, (eval_leaf, at("Py_BytesMain", 0x10))),
        kernel_stacks=(),
        samples=(
            Sample(proc.pid, proc.pid, 0, -1, 7, 70_000_000, python_stack=0),
            Sample(proc.pid, proc.pid, 1, -1, 2, 20_000_000, python_stack=1),
        ),
        python_stacks=(mixed, unnamed),
    )


def serve_names(reader: zmq.Socket, pid: int) -> list[PythonNameRequest]:
    """Answer the worker's name requests, as the runtime reader would, until one came and a second
    has not for half a second."""
    got: list[PythonNameRequest] = []
    while reader.poll(DEADLINE_S * 1000 if not got else 500):
        peer, *frames = reader.recv_multipart()
        req = decode(frames)
        assert isinstance(req, PythonNameRequest) and req.pid == pid
        got.append(req)
        names = tuple((c, i, *NAMES[c]) for c, i in req.frames if c in NAMES)
        reader.send_multipart([peer, *encode(PythonNames(req.request_id, req.pid, req.start_ticks, names))])
    return got


def take_upload(uploads: zmq.Socket) -> ProfileUpload:
    assert uploads.poll(DEADLINE_S * 1000), "the worker handed out no profile"
    peer, *frames = uploads.recv_multipart()
    upload = handoff.decode_profile(frames)
    uploads.send_multipart([peer, handoff.encode_ack(upload.profile_id, handoff.STORED)])
    return upload


def bind(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    """A socket of the test's bound where the worker (its own user) may connect."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    give("symbolizer", Path(endpoint.removeprefix("ipc://")))
    return s


def test_a_worker_splices_and_names_python_frames(workdir: Path, target: Process) -> None:
    run_dir, state_dir = workdir / "run", workdir / "state"
    for d in (run_dir, state_dir):
        d.mkdir()
        give("symbolizer", d)
    ctx: zmq.Context = zmq.Context.instance()
    broker = FileBroker(str(run_dir), allowed_uids=privileges.uids_with("symbolizer"))
    give("symbolizer", Path(broker.path))
    reader = bind(ctx, zmq.ROUTER, endpoints.python_names(str(run_dir)))
    uploads = bind(ctx, zmq.ROUTER, endpoints.uploader(str(run_dir)))
    config = write_config(
        workdir / "agent.yaml", ProfilerConfig(plain_pid=True, symbolizer_workers=1, dwarf_unwind=False)
    )
    cmd = [PY, "-P", "-m", "cli.main", "symbolizer", "--config", str(config), "--run-dir", str(run_dir)]
    log = stderr_file(workdir, "symbolizer")
    with open(log, "wb") as err:
        worker = subprocess.Popen([*cmd, "--state-dir", str(state_dir), "--worker", "0"], stderr=err)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        ready = Path(endpoints.ready_file(str(run_dir), "symbolizer-0"))
        deadline = time.monotonic() + DEADLINE_S
        while not ready.exists():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        # Given the worker, when a batch with Python stacks is pushed to it
        push.connect(endpoints.symbolizer(str(run_dir), 0))
        push.send_multipart(encode(batch_for(target)))
        # then it asks for the names of the four frames, once, and is answered for three
        requests = serve_names(reader, target.pid)
        assert sorted(c for r in requests for c, _ in r.frames) == sorted([CPU_A, RUN, MODULE, MYSTERY])
        assert all(r.start_ticks == target.start_ticks for r in requests)
        # When it stops, it hands out its window
        os.kill(worker.pid, signal.SIGTERM)
        profile = pprof.read(take_upload(uploads).pprof_gz)
        assert worker.wait(DEADLINE_S) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        for s in (push, reader, uploads):
            s.close()
        broker.close()
    check_profile(profile, log.read_text())
    doc = json.loads(Path(counters.path(str(run_dir), "symbolizer-0")).read_text())["counters"]
    assert (doc["python_names"], doc["python_names_refused"], doc["python_unnamed"]) == (3, 1, 1), doc
    assert doc["python_names_unsolicited"] == 0 and doc["python_splice_more_calls"] == 0


def check_profile(profile: pprof.ReadProfile, log: str) -> None:
    """The stacks read root first, the Python frames in place of the eval frames, named, with lines."""
    by_value = {s.values[0]: s for s in profile.samples}
    mixed, unnamed = by_value[7], by_value[2]
    assert mixed.functions == (
        "Py_BytesMain",
        "PyEval_EvalCode",
        "<module>",
        "run",
        "_PyFunction_Vectorcall",
        "cpu_a",
    ), log
    lines = {f.function: (f.filename, f.line, f.module) for f in mixed.frames}
    assert lines["cpu_a"] == ("/srv/app.py", 7, "[python]")
    assert lines["<module>"] == ("/srv/app.py", 20, "[python]")
    assert lines["Py_BytesMain"][2] == str(EXE)
    assert unnamed.functions == ("Py_BytesMain", placeholder(PythonFrame(0, 0, MYSTERY, 6))), log
