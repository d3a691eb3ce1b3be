"""The uploader stage, run as `ebpfprofiler uploader`: fed by a test worker (a real DEALER socket
and shared.handoff.ProfileSender) over a real ipc:// socket, delivering to a local directory, to the
reference receiver, or to a scripted HTTP(S) server on 127.0.0.1.

The helpers at the top (make_upload, TestWorker, UploaderProcess, ReceiverProcess, reserve_port)
are shared with tests/unit/test_spool*.py and tests/integration/test_upload_faults.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, urlsplit

import pytest
import zmq

from ebpfprofiler.receiver.server import make_server
from ebpfprofiler.receiver.store import list_profiles
from ebpfprofiler.shared import endpoints, handoff
from ebpfprofiler.shared.config import ProfilerConfig, dump
from ebpfprofiler.shared.pprof import ProfileBuilder
from ebpfprofiler.shared.privileges import ids as stage_ids
from ebpfprofiler.shared.wire import ProfileUpload, StackBatch, encode
from ebpfprofiler.uploader.local import MAX_SERVICE_DIR_CHARS, safe_name

DEADLINE_S = 15
START_NS = 1_700_000_000_000_000_000      # 2023-11-14T22:13:20Z
END_NS = START_NS + 60_000_000_000
# Retries in tests wait milliseconds, not seconds.
FAST_BACKOFF = {"EBPFPROFILER_UPLOAD_BACKOFF_S": "0.01"}
# A test worker offers unacknowledged profiles again after this (the stages use 10 s).
TEST_ACK_TIMEOUT_S = 1.0


def wait_for(check: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def make_upload(service: str = "/usr/bin/python3.11", n_samples: int = 2, *, start_ns: int = START_NS,
                length_ns: int = END_NS - START_NS, padding: bytes = b"") -> ProfileUpload:
    """A valid gzip pprof; `padding` (incompressible, if random) goes into a function name to size it."""
    b = ProfileBuilder([("samples", "count"), ("cpu", "nanoseconds")], ("cpu", "nanoseconds"),
                       period=52_631_578, time_ns=start_ns, duration_ns=length_ns)
    m = b.mapping("main", service, "abcdef")
    for i in range(n_samples):
        b.sample([b.location(i, m, 0x1000 + i, [b.function(f"fn{i}")])], [1, 52_631_578], {"pid": 7})
    if padding:
        b.sample([b.location("pad", m, 0x9000, [b.function("pad_" + padding.hex())])], [1, 1], {"pid": 7})
        n_samples += 1
    return ProfileUpload(profile_id=uuid.uuid4().hex, host="web-1", service=service, profile_type="cpu",
                         window_start_ns=start_ns, window_end_ns=start_ns + length_ns, samples=n_samples,
                         pprof_gz=b.gzipped())


def write_config(path: Path, cfg: ProfilerConfig) -> Path:
    path.write_text(dump(cfg))
    path.chmod(0o644)    # the stages read it as their own users
    return path


def give(stage: str, *paths: Path) -> None:
    """Hand `paths` to `stage`'s user: a stage started as root runs as its own user
    (shared/privileges.py), and `ebpfprofiler run` or the systemd units prepare its directories."""
    if os.geteuid() != 0:
        return
    uid, gid = stage_ids(stage)
    for p in paths:
        os.chown(p, uid, gid)


def open_workdir(prefix: str) -> Path:
    """A directory the stages' users can enter (pytest's tmp_path is root-only); the caller removes it."""
    path = Path(tempfile.mkdtemp(prefix=f"ebpfprofiler-{prefix}-", dir="/tmp"))
    path.chmod(0o755)
    return path


def reserve_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a receiver started later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ListHandler(logging.Handler):
    """Keeps the messages of one logger, for a test worker's log lines."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def text(self) -> str:
        return "\n".join(self.lines)


class TestWorker:
    """A symbolizer worker's hand-off side: a DEALER socket and a ProfileSender, used from one thread."""

    __test__ = False

    def __init__(self, run_dir: Path, ctx: zmq.Context, **sender_args: Any) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, sender_args.get("max_profiles", handoff.MAX_UNACKED_PROFILES))
        self.sock.connect(endpoints.uploader(str(run_dir)))
        self.logs = ListHandler()
        self.log = logging.getLogger(f"test-worker-{id(self)}")
        self.log.addHandler(self.logs)
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        sender_args.setdefault("ack_timeout_s", TEST_ACK_TIMEOUT_S)
        self.sender = handoff.ProfileSender(self.sock, self.log, **sender_args)

    def send(self, *uploads: ProfileUpload) -> None:
        for u in uploads:
            self.sender.send(u)

    def wait_acked(self, timeout: float = DEADLINE_S) -> None:
        def done() -> bool:
            self.sender.poll(20)
            return self.sender.pending_profiles == 0
        wait_for(done, f"acknowledgements ({self.sender.pending_profiles} pending; {self.sender.counts})", timeout)

    def close(self) -> None:
        self.sock.close()


@dataclass
class UploaderProcess:
    """`ebpfprofiler uploader` with its stderr in a file; ended by pid by the fixture that started it."""
    proc: subprocess.Popen[bytes]
    run_dir: Path
    state_dir: Path
    stderr: Path

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def dead_letter_dir(self) -> Path:
        return self.state_dir / "dead-letter"

    def spooled(self) -> list[str]:
        return sorted(p.name for p in self.spool_dir.glob("*.prof")) if self.spool_dir.exists() else []

    def log(self) -> str:
        return self.stderr.read_text()

    def stop(self, timeout: float = DEADLINE_S) -> int:
        """SIGTERM, then the exit code (killed after a deadline if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"uploader ignored SIGTERM; log:\n{self.log()}")
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def uploader_command(config: Path, run_dir: Path, state_dir: Path) -> list[str]:
    return [sys.executable, "-m", "ebpfprofiler.cli.main", "uploader", "--config", str(config),
            "--run-dir", str(run_dir), "--state-dir", str(state_dir)]


def launch_uploader(workdir: Path, cfg: ProfilerConfig, *, state_dir: Path | None = None,
                    env: dict[str, str] | None = None, name: str = "uploader") -> UploaderProcess:
    """Start an uploader and wait for its ready file; the caller ends it (kill() or stop())."""
    run_dir = workdir / "run"
    state_dir = state_dir or workdir / "state"
    for d in (run_dir, state_dir):
        if not d.exists():
            d.mkdir()
            give("uploader", d)
    ready = Path(endpoints.ready_file(str(run_dir), "uploader"))
    if ready.exists():
        ready.unlink()   # left by a killed predecessor
    n = len(list(workdir.glob(f"{name}*.err")))
    stderr = workdir / f"{name}{n or ''}.err"
    config = write_config(workdir / f"{name}.yaml", cfg)
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(uploader_command(config, run_dir, state_dir), stdout=subprocess.DEVNULL,
                                stderr=err, env={**os.environ, **(env or {})})
    u = UploaderProcess(proc, run_dir, state_dir, stderr)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, "the uploader's ready file")
    except AssertionError:
        u.kill()
        raise
    if proc.poll() is not None:
        raise AssertionError(f"uploader exited with {proc.returncode}:\n{u.log()}")
    return u


@dataclass
class ReceiverProcess:
    """`ebpfprofiler receiver` on 127.0.0.1 (optionally a given port and fault options)."""
    proc: subprocess.Popen[bytes]
    url: str
    dir: Path
    stderr: Path

    @classmethod
    def start(cls, workdir: Path, *faults: str, port: int = 0, name: str = "receiver") -> "ReceiverProcess":
        n = len(list(workdir.glob(f"{name}*.err")))
        stderr = workdir / f"{name}{n or ''}.err"
        store = workdir / "received"
        with open(stderr, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ebpfprofiler.cli.main", "receiver", "--listen", f"127.0.0.1:{port}",
                 "--dir", str(store), *faults], stdout=subprocess.PIPE, stderr=err)
        line = b""
        deadline = time.monotonic() + DEADLINE_S
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)   # type: ignore[arg-type]
            while not line.endswith(b"\n") and time.monotonic() < deadline:
                if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    chunk = os.read(proc.stdout.fileno(), 4096)   # type: ignore[union-attr]
                    if not chunk:
                        break
                    line += chunk
        m = re.search(rb"listening on (http://\S+)", line)
        if not m:
            proc.kill()
            proc.wait()
            raise AssertionError(f"receiver did not start: {line!r}; {stderr.read_text()}")
        return cls(proc, m.group(1).decode(), store, stderr)

    def received(self) -> list[dict[str, Any]]:
        return list_profiles(str(self.dir)) if self.dir.exists() else []

    def received_ids(self) -> list[str]:
        return [m["id"] for m in self.received()]

    def log(self) -> str:
        return self.stderr.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode


def http_config(tmp_path: Path, url: str, **changes: Any) -> ProfilerConfig:
    return ProfilerConfig(endpoint=url, local_dir=str(tmp_path / "unused"), **changes)


# ---------------------------------------------------------------- fixtures

@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Config, runtime and state directories of the processes a test starts (see open_workdir)."""
    path = open_workdir("test")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_uploader(workdir: Path) -> Iterator[Callable[..., UploaderProcess]]:
    """start_uploader(cfg, env=..., state_dir=...): an uploader process, killed by pid at the end."""
    started: list[UploaderProcess] = []

    def start(cfg: ProfilerConfig, **kwargs: Any) -> UploaderProcess:
        u = launch_uploader(workdir, cfg, **kwargs)
        started.append(u)
        return u

    try:
        yield start
    finally:
        for u in started:
            u.kill()


@pytest.fixture
def worker(workdir: Path, zctx: zmq.Context) -> Iterator[TestWorker]:
    w = TestWorker(workdir / "run", zctx)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The reference receiver in a thread: (url, store dir)."""
    store = tmp_path / "store"
    server = make_server("127.0.0.1:0", str(store))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.url, store
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE_S)


@dataclass
class Post:
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class FaultServer:
    """Answers POSTs with scripted (status, headers) in turn, then 200; records every POST."""
    url: str = ""
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    posts: list[Post] = field(default_factory=list)
    hold_first: threading.Event | None = None     # when set, the first POST waits for it
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ids(self) -> list[str]:
        with self.lock:
            return [p.headers["X-Profile-Id"] for p in self.posts]


def serve_faults(state: FaultServer, tls: ssl.SSLContext | None = None) -> Callable[[], None]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with state.lock:
                state.posts.append(Post(parse_qs(urlsplit(self.path).query), dict(self.headers), body,
                                        time.monotonic()))
                first = len(state.posts) == 1
                status, headers = state.script.pop(0) if state.script else (200, {})
            if first and state.hold_first is not None:
                state.hold_first.wait(timeout=DEADLINE_S)
            reply = json.dumps({"error": f"scripted {status}"} if status >= 400 else {"stored": True}).encode()
            self.send_response(status)
            for k, v in {"Content-Type": "application/json", "Content-Length": str(len(reply)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    state.url = f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()

    def stop() -> None:
        if state.hold_first is not None:
            state.hold_first.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE_S)

    return stop


@pytest.fixture
def fault_server() -> Iterator[FaultServer]:
    state = FaultServer()
    stop = serve_faults(state)
    try:
        yield state
    finally:
        stop()


# ---------------------------------------------------------------- local mode

def test_local_mode_writes_the_exact_bytes_and_then_acks(workdir: Path, start_uploader, worker: TestWorker) -> None:
    # given an uploader with endpoint "" writing to local_dir
    local_dir = workdir / "profiles"
    local_dir.mkdir()
    give("uploader", local_dir)
    u = start_uploader(ProfilerConfig(endpoint="", local_dir=str(local_dir)))
    assert f"profiles go to the local directory {local_dir}" in u.log()
    # when a profile is handed to it
    upload = make_upload("/usr/bin/python3.11")
    worker.send(upload)
    worker.wait_acked()
    # then by the time it is acknowledged it is written, byte for byte, under a readable service dir
    path = local_dir / "usr_bin_python3.11" / f"cpu-20231114T221320Z-{upload.profile_id}.pb.gz"
    assert path.read_bytes() == upload.pprof_gz
    assert [p.name for p in path.parent.iterdir()] == [path.name]    # no temporary files left
    assert worker.sender.counts["acked"] == 1
    assert u.stop() == 0
    assert "exiting: 1 written, 0 refused, 0 not written for now" in u.log()
    assert not u.spool_dir.exists()     # local mode has no spool


def test_local_mode_that_cannot_write_says_retry_and_the_worker_keeps_the_profile(
        workdir: Path, start_uploader, worker: TestWorker) -> None:
    # given a local_dir whose service directory cannot be created (a file is in the way)
    local_dir = workdir / "profiles"
    local_dir.mkdir()
    give("uploader", local_dir)
    blocker = local_dir / "usr_bin_python3.11"
    blocker.write_text("not a directory")
    u = start_uploader(ProfilerConfig(endpoint="", local_dir=str(local_dir)))
    # when a profile is handed over
    upload = make_upload("/usr/bin/python3.11")
    worker.send(upload)
    # then the uploader answers "retry" and the worker keeps it and says so
    wait_for(lambda: (worker.sender.poll(20), worker.sender.counts["nacked"])[1], "a retry answer")
    assert worker.sender.pending_profiles == 1
    assert "the uploader cannot take profiles now (cannot write under local_dir" in worker.logs.text()
    # and when the obstacle is gone, the next offer is written and acknowledged
    blocker.unlink()
    worker.wait_acked()
    assert (local_dir / "usr_bin_python3.11" / f"cpu-20231114T221320Z-{upload.profile_id}.pb.gz").exists()
    assert "the uploader takes profiles again" in worker.logs.text()
    assert u.stop() == 0


# ---------------------------------------------------------------- HTTP mode

def test_http_mode_spools_acks_and_delivers_with_the_right_params(workdir: Path, start_uploader,
                                                                  worker: TestWorker,
                                                                  fault_server: FaultServer) -> None:
    u = start_uploader(http_config(workdir, fault_server.url))
    assert f"profiles go to the endpoint {fault_server.url}/v1/profiles" in u.log()
    assert "no token" in u.log() and "system CAs" in u.log()
    upload = make_upload("3f2a9c0d1e2b")
    worker.send(upload)
    worker.wait_acked()
    wait_for(lambda: fault_server.posts, "the post")
    [p] = fault_server.posts
    assert p.body == upload.pprof_gz
    assert p.headers["X-Profile-Id"] == upload.profile_id
    assert p.headers["Content-Type"] == "application/octet-stream"
    assert p.headers["User-Agent"].startswith("ebpfprofiler/")
    assert "Authorization" not in p.headers
    assert p.query == {"source": ["ebpf"], "type": ["cpu"], "service": ["3f2a9c0d1e2b"],
                       "host": ["web-1"], "start": [str(START_NS)], "end": [str(END_NS)]}
    wait_for(lambda: not u.spooled(), "the spool to be emptied after the 2xx")
    assert u.stop() == 0
    assert "1 delivered, 0 dead-lettered, 0 dropped; 0 profile(s) (0.0 MB) left in the spool" in u.log()


def test_http_mode_to_the_reference_receiver(workdir: Path, start_uploader, worker: TestWorker,
                                             receiver: tuple[str, Path]) -> None:
    url, store = receiver
    u = start_uploader(http_config(workdir, url))
    uploads = [make_upload(f"/usr/bin/svc{i}") for i in range(5)]
    worker.send(*uploads)
    worker.wait_acked()
    wait_for(lambda: store.exists() and len(list_profiles(str(store))) == 5, "five profiles at the receiver")
    got = {m["id"]: m for m in list_profiles(str(store))}
    for up in uploads:
        assert Path(got[up.profile_id]["path"]).read_bytes() == up.pprof_gz
        assert got[up.profile_id]["service"] == up.service
    assert u.stop() == 0


@pytest.mark.parametrize("script", [
    [(500, {}), (500, {})],
    [(429, {"Retry-After": "0"}), (503, {})],
    [(408, {}), (502, {})],
], ids=["500-twice", "429-then-503", "408-then-502"])
def test_transient_failures_are_retried_until_the_profile_arrives(workdir: Path, start_uploader,
                                                                  worker: TestWorker,
                                                                  fault_server: FaultServer, script) -> None:
    # given a backend that fails twice, then answers 200
    fault_server.script = list(script)
    u = start_uploader(http_config(workdir, fault_server.url), env=FAST_BACKOFF)
    upload = make_upload()
    # when a profile arrives
    worker.send(upload)
    worker.wait_acked()
    # then the third attempt delivers it: same id, same bytes each time
    wait_for(lambda: len(fault_server.posts) >= 3 and not u.spooled(), "three attempts and an empty spool")
    assert u.stop() == 0
    assert fault_server.ids() == [upload.profile_id] * 3
    assert all(p.body == upload.pprof_gz for p in fault_server.posts)
    log = u.log()
    assert "failed (attempt 1)" in log and "failed (attempt 2)" in log
    assert "the backend accepts profiles again after 2 failed attempt(s)" in log
    assert "1 delivered, 0 dead-lettered, 0 dropped" in log


def test_retry_after_is_honoured(workdir: Path, start_uploader, worker: TestWorker,
                                 fault_server: FaultServer) -> None:
    # given a backend that answers 503 with Retry-After: 2 (the backoff alone would wait ~10 ms)
    fault_server.script = [(503, {"Retry-After": "2"})]
    u = start_uploader(http_config(workdir, fault_server.url), env=FAST_BACKOFF)
    worker.send(make_upload())
    worker.wait_acked()
    wait_for(lambda: len(fault_server.posts) >= 2, "the retry")
    # then the retry came no sooner than the server asked
    gap = fault_server.posts[1].at - fault_server.posts[0].at
    assert 1.9 <= gap < 6, gap
    assert "next attempt in 2.00 s" in u.log()
    assert u.stop() == 0


def test_a_400_is_dead_lettered_and_the_next_profile_goes_on(workdir: Path, start_uploader,
                                                             worker: TestWorker,
                                                             fault_server: FaultServer) -> None:
    # given a backend that refuses the first profile with 400
    fault_server.script = [(400, {})]
    u = start_uploader(http_config(workdir, fault_server.url), env=FAST_BACKOFF)
    refused, accepted = make_upload("/bin/refused"), make_upload("/bin/accepted")
    # when two profiles arrive, in order
    worker.send(refused, accepted)
    worker.wait_acked()
    # then each is posted once, and the refused one is in the dead-letter directory with the reason
    wait_for(lambda: len(fault_server.posts) >= 2 and not u.spooled(), "both posts and an empty spool")
    assert u.stop() == 0
    assert fault_server.ids() == [refused.profile_id, accepted.profile_id]
    [record] = list(u.dead_letter_dir.glob("*.json"))
    meta = json.loads(record.read_text())
    assert meta["id"] == refused.profile_id and meta["status"] == 400 and meta["service"] == "/bin/refused"
    assert meta["reason"] == "HTTP 400 'scripted 400'" and meta["attempts"] == 1
    assert record.with_suffix(".pb.gz").read_bytes() == refused.pprof_gz
    assert "not retried, moved to" in u.log()
    assert "1 delivered, 1 dead-lettered, 0 dropped" in u.log()


def test_malformed_messages_are_refused_by_id_when_possible(workdir: Path, start_uploader,
                                                            worker: TestWorker) -> None:
    local_dir = workdir / "profiles"
    local_dir.mkdir()
    give("uploader", local_dir)
    u = start_uploader(ProfilerConfig(endpoint="", local_dir=str(local_dir)))
    # given messages that are not valid hand-offs, three of them with a valid envelope
    batch = StackBatch(host="h", profile_type="cpu", sample_hz=19, time_ns=1, processes=(),
                       user_stacks=(), kernel_stacks=(), samples=())

    def envelope(pid: str, v: int = 1) -> bytes:
        return json.dumps({"handoff": v, "id": pid}).encode()

    for frames in ([b"not json", b"x"], [b"only one frame"],
                   [envelope("bad-wire"), b'{"v":1,"kind":"profile","body":{}}', b"x"],
                   [envelope("a-batch"), *encode(batch)],
                   [envelope("v9", 9), *encode(make_upload())]):
        worker.sock.send_multipart(frames)
    # then the ones with an id are answered "refused", with the reason
    acks: list[handoff.Ack] = []
    wait_for(lambda: acks.extend(handoff.decode_ack(f[0]) for f in _drain(worker.sock)) or len(acks) >= 3,
             "three refusals")
    assert sorted((a.profile_id, a.status) for a in acks) == [
        ("a-batch", "refused"), ("bad-wire", "refused"), ("v9", "refused")]
    assert "hand-off version 9, this build speaks 1" in {a.profile_id: a.reason for a in acks}["v9"]
    # and a valid one that follows is still written, while all five are counted
    upload = make_upload("/bin/sh")
    worker.send(upload)
    worker.wait_acked()
    assert list((local_dir / "bin_sh").glob("*.pb.gz"))
    assert u.stop() == 0
    log = u.log()
    assert "exiting: 1 written, 5 refused" in log
    assert "refused a message: envelope is not JSON" in log
    assert "a StackBatch message was sent to the uploader" in log


def _drain(sock: zmq.Socket) -> list[list[bytes]]:
    out = []
    while sock.poll(50):
        out.append(sock.recv_multipart())
    return out


def test_sigterm_spools_what_is_queued_and_makes_a_final_attempt(workdir: Path, start_uploader,
                                                                 worker: TestWorker,
                                                                 fault_server: FaultServer) -> None:
    # given an uploader busy posting the first of three profiles to a backend that holds the reply
    fault_server.hold_first = threading.Event()
    u = start_uploader(http_config(workdir, fault_server.url))
    uploads = [make_upload() for _ in range(3)]
    worker.send(*uploads)
    worker.wait_acked()
    wait_for(lambda: fault_server.posts, "the first post")
    # when it is told to stop, and the backend then answers
    u.proc.send_signal(signal.SIGTERM)
    fault_server.hold_first.set()
    # then the two spooled profiles are delivered before it exits 0 and removes its ready file
    assert u.stop() == 0
    assert fault_server.ids() == [x.profile_id for x in uploads]
    assert "3 delivered, 0 dead-lettered, 0 dropped; 0 profile(s) (0.0 MB) left in the spool" in u.log()
    assert not Path(endpoints.ready_file(str(u.run_dir), "uploader")).exists()


def test_sigterm_with_the_backend_down_exits_promptly_and_the_next_start_sends_the_spool(
        workdir: Path, start_uploader, worker: TestWorker) -> None:
    # given a backend that is down and three acknowledged profiles in the spool
    port = reserve_port()
    cfg = http_config(workdir, f"http://127.0.0.1:{port}")
    u = start_uploader(cfg, env=FAST_BACKOFF)
    uploads = [make_upload(f"/bin/s{i}") for i in range(3)]
    worker.send(*uploads)
    worker.wait_acked()
    wait_for(lambda: "failed (attempt" in u.log(), "a failed attempt")
    # when it is stopped, it does not wait for the backend
    t0 = time.monotonic()
    assert u.stop() == 0
    assert time.monotonic() - t0 < 10
    assert "3 profile(s)" in u.log().splitlines()[-1] and "left in the spool for the next start" in u.log()
    assert len(u.spooled()) == 3
    # and when the backend is up and the uploader starts again, it sends the spool oldest first
    server = make_server(f"127.0.0.1:{port}", str(workdir / "store"))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        u2 = start_uploader(cfg, env=FAST_BACKOFF)
        wait_for(lambda: len(list_profiles(str(workdir / "store"))) == 3, "the spooled profiles")
        assert [m["id"] for m in list_profiles(str(workdir / "store"))] == [x.profile_id for x in uploads]
        assert "holds 3 profile(s)" in u2.log() and "sending them first, oldest first" in u2.log()
        assert u2.stop() == 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE_S)


def test_bearer_token_is_sent_and_never_logged(workdir: Path, start_uploader, worker: TestWorker,
                                               fault_server: FaultServer) -> None:
    # given a token file and debug logging
    token = "s3cr3t-" + uuid.uuid4().hex
    token_file = workdir / "token"
    token_file.write_text(f"  {token}\n")
    token_file.chmod(0o600)
    give("uploader", token_file)
    fault_server.script = [(500, {}), (401, {})]
    u = start_uploader(http_config(workdir, fault_server.url, token_file=str(token_file)),
                       env={**FAST_BACKOFF, "EBPFPROFILER_LOG_LEVEL": "DEBUG"})
    worker.send(make_upload(), make_upload())
    worker.wait_acked()
    wait_for(lambda: len(fault_server.posts) >= 3 and not u.spooled(), "three posts")
    # then every post carries it, stripped, as a bearer token
    assert {p.headers["Authorization"] for p in fault_server.posts} == {f"Bearer {token}"}
    assert u.stop() == 0
    log = u.log()
    assert "a bearer token" in log and "plain http://" in log    # it warns about http
    # and it appears in no log line, failures and dead letters included
    assert token not in log
    for f in u.dead_letter_dir.iterdir():
        assert token.encode() not in f.read_bytes()


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"two words", "other than visible ASCII"),
    (b"x" * (17 << 10), "larger than"),
], ids=["empty", "space-inside", "too-large"])
def test_an_unusable_token_file_exits_2_without_showing_it(workdir: Path, content: bytes, message: str) -> None:
    token_file = workdir / "token"
    token_file.write_bytes(content)
    token_file.chmod(0o600)
    give("uploader", token_file)
    config = write_config(workdir / "agent.yaml", http_config(workdir, "http://127.0.0.1:1",
                                                               token_file=str(token_file)))
    result = subprocess.run(uploader_command(config, workdir / "run", workdir / "state"),
                            capture_output=True, timeout=DEADLINE_S)
    assert result.returncode == 2
    err = result.stderr.decode()
    assert "token_file" in err and message in err and "Traceback" not in err
    if content:
        assert content.decode()[:20] not in err


def make_certificate(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl): (cert, key)."""
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_is_verified_and_a_ca_file_can_be_configured(workdir: Path, start_uploader,
                                                         worker: TestWorker) -> None:
    # given an HTTPS backend with a self-signed certificate
    cert, key = make_certificate(workdir)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    state = FaultServer()
    stop_server = serve_faults(state, tls)
    try:
        # when the uploader trusts only the system CAs, verification fails and nothing is posted
        u = start_uploader(http_config(workdir, state.url), env=FAST_BACKOFF)
        upload = make_upload()
        worker.send(upload)
        worker.wait_acked()
        wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in u.log(), "a verification failure")
        assert state.posts == [] and len(u.spooled()) == 1
        assert u.stop() == 0
        # and with the certificate as its CA file, the spooled profile is delivered
        u2 = start_uploader(http_config(workdir, state.url, ca_file=str(cert)), env=FAST_BACKOFF)
        assert f"CA file {cert}" in u2.log()
        wait_for(lambda: state.posts, "the post over TLS")
        assert state.ids() == [upload.profile_id]
        assert u2.stop() == 0
    finally:
        stop_server()


# ---------------------------------------------------------------- command line

@pytest.mark.parametrize("block, key", [
    ("  sample_hz: 0\n", "modules.ebpf_profiler.sample_hz"),
    ("  endpoint: ftp://backend\n", "modules.ebpf_profiler.endpoint"),
    ("  colour: blue\n", "modules.ebpf_profiler.colour"),
    ("  spool_max_mb: 0\n", "modules.ebpf_profiler.spool_max_mb"),
    ("  ca_file: relative.pem\n", "modules.ebpf_profiler.ca_file"),
])
def test_a_bad_config_exits_2_naming_the_key(workdir: Path, block: str, key: str) -> None:
    config = workdir / "agent.yaml"
    config.write_text("modules:\n  ebpf_profiler:\n  " + block)
    config.chmod(0o644)
    result = subprocess.run(uploader_command(config, workdir / "run", workdir / "state"), capture_output=True,
                            timeout=DEADLINE_S)
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert key in stderr and "Traceback" not in stderr
    assert not (workdir / "run").exists() and not (workdir / "state").exists()


def test_help_says_what_it_does() -> None:
    result = subprocess.run([sys.executable, "-m", "ebpfprofiler.cli.main", "uploader", "--help"],
                            capture_output=True, timeout=DEADLINE_S)
    assert result.returncode == 0
    out = result.stdout.decode()
    assert "--config FILE" in out and "--run-dir DIR" in out and "--state-dir DIR" in out
    assert "/v1/profiles" in out and "spool" in out and "dead-letter" in out


@pytest.mark.parametrize("service, expected", [
    ("/usr/bin/python3.11", "usr_bin_python3.11"),
    ("3f2a9c0d1e2b", "3f2a9c0d1e2b"),
    ("[kernel]", "kernel"),
    ("..", "unknown"),
    ("/", "unknown"),
    ("", "unknown"),
    ("../../etc/passwd", "etc_passwd"),
    ("/opt/my app/bin/ünïcode", "opt_my_app_bin_n_code"),
])
def test_service_names_map_to_safe_directory_names(service: str, expected: str) -> None:
    assert safe_name(service, MAX_SERVICE_DIR_CHARS) == expected


def test_long_service_names_are_cut_and_kept_apart() -> None:
    a, b = "/x/" + "a" * 300 + "1", "/x/" + "a" * 300 + "2"
    sa, sb = safe_name(a, MAX_SERVICE_DIR_CHARS), safe_name(b, MAX_SERVICE_DIR_CHARS)
    assert len(sa) <= MAX_SERVICE_DIR_CHARS and len(sb) <= MAX_SERVICE_DIR_CHARS and sa != sb
