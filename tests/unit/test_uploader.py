"""The uploader stage, run as `ebpfprofiler uploader`: fed over a real ipc:// socket, delivering
to a local directory, to the reference receiver, or to a scripted HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
from ebpfprofiler.shared import endpoints
from ebpfprofiler.shared.config import ProfilerConfig, dump
from ebpfprofiler.shared.pprof import ProfileBuilder
from ebpfprofiler.shared.wire import ProfileUpload, StackBatch, encode
from ebpfprofiler.uploader.local import MAX_SERVICE_DIR_CHARS, safe_name

DEADLINE_S = 15
START_NS = 1_700_000_000_000_000_000      # 2023-11-14T22:13:20Z
END_NS = START_NS + 60_000_000_000
# Retries in tests wait milliseconds, not seconds.
FAST_BACKOFF = {"EBPFPROFILER_UPLOAD_BACKOFF_S": "0.01"}


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


def make_upload(service: str = "/usr/bin/python3.11", n_samples: int = 2) -> ProfileUpload:
    b = ProfileBuilder([("samples", "count"), ("cpu", "nanoseconds")], ("cpu", "nanoseconds"),
                       period=52_631_578, time_ns=START_NS, duration_ns=END_NS - START_NS)
    m = b.mapping("main", service, "abcdef")
    for i in range(n_samples):
        b.sample([b.location(i, m, 0x1000 + i, [b.function(f"fn{i}")])], [1, 52_631_578], {"pid": 7})
    return ProfileUpload(profile_id=uuid.uuid4().hex, host="web-1", service=service, profile_type="cpu",
                         window_start_ns=START_NS, window_end_ns=END_NS, samples=n_samples,
                         pprof_gz=b.gzipped())


# ---------------------------------------------------------------- the uploader process

@dataclass
class Uploader:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    stderr: Path
    push_socket: zmq.Socket

    def push(self, frames: list[bytes]) -> None:
        self.push_socket.send_multipart(frames)

    def push_upload(self, upload: ProfileUpload) -> None:
        self.push(encode(upload))

    def log(self) -> str:
        return self.stderr.read_text()

    def stop(self) -> int:
        """SIGTERM, then the exit code (killed after a deadline if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"uploader ignored SIGTERM; log:\n{self.log()}")
        return self.proc.returncode


def write_config(tmp_path: Path, cfg: ProfilerConfig) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(dump(cfg))
    return path


def uploader_command(config: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "ebpfprofiler.cli.main", "uploader", "--config", str(config),
            "--run-dir", str(run_dir)]


@pytest.fixture
def start_uploader(tmp_path: Path) -> Iterator[Callable[..., Uploader]]:
    ctx = zmq.Context()
    started: list[Uploader] = []

    def start(cfg: ProfilerConfig, env: dict[str, str] | None = None) -> Uploader:
        run_dir = tmp_path / "run"
        stderr = tmp_path / "uploader.err"
        with open(stderr, "wb") as err:
            proc = subprocess.Popen(uploader_command(write_config(tmp_path, cfg), run_dir),
                                    stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})})
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        u = Uploader(proc, run_dir, stderr, push)
        started.append(u)
        ready = Path(endpoints.ready_file(str(run_dir), "uploader"))
        wait_for(lambda: ready.exists() or proc.poll() is not None, "the uploader's ready file")
        assert proc.poll() is None, f"uploader exited with {proc.returncode}:\n{u.log()}"
        push.connect(endpoints.uploader(str(run_dir)))
        return u

    try:
        yield start
    finally:
        for u in started:
            u.push_socket.close()
            if u.proc.poll() is None:
                u.proc.kill()
                u.proc.wait()
        ctx.term()


# ---------------------------------------------------------------- HTTP servers the uploader posts to

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


@dataclass
class FaultServer:
    """Answers POSTs with scripted (status, headers) in turn, then 200; records every POST."""
    url: str = ""
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    posts: list[Post] = field(default_factory=list)
    hold_first: threading.Event | None = None     # when set, the first POST waits for it
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def fault_server() -> Iterator[FaultServer]:
    state = FaultServer()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with state.lock:
                state.posts.append(Post(parse_qs(urlsplit(self.path).query), dict(self.headers), body))
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
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        if state.hold_first is not None:
            state.hold_first.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE_S)


def http_config(tmp_path: Path, url: str) -> ProfilerConfig:
    return ProfilerConfig(endpoint=url, local_dir=str(tmp_path / "unused"))


# ---------------------------------------------------------------- tests

def test_local_mode_writes_the_exact_bytes_under_the_service_dir(tmp_path: Path, start_uploader) -> None:
    # given an uploader with endpoint "" writing to local_dir
    local_dir = tmp_path / "profiles"
    u = start_uploader(ProfilerConfig(endpoint="", local_dir=str(local_dir)))
    assert f"profiles go to the local directory {local_dir}" in u.log()
    # when a profile arrives
    upload = make_upload("/usr/bin/python3.11")
    u.push_upload(upload)
    # then it is written, byte for byte, under a readable service dir
    path = local_dir / "usr_bin_python3.11" / f"cpu-20231114T221320Z-{upload.profile_id}.pb.gz"
    wait_for(path.exists, f"{path}")
    assert path.read_bytes() == upload.pprof_gz
    assert [p.name for p in path.parent.iterdir()] == [path.name]    # no temporary files left
    assert u.stop() == 0
    assert "1 delivered, 0 failed, 0 dropped" in u.log()


def test_http_mode_arrives_at_the_receiver_with_the_right_params(tmp_path: Path, start_uploader,
                                                                 receiver: tuple[str, Path]) -> None:
    url, store = receiver
    u = start_uploader(http_config(tmp_path, url))
    assert f"profiles go to the endpoint {url}/v1/profiles" in u.log()
    upload = make_upload("3f2a9c0d1e2b")
    u.push_upload(upload)
    [meta] = wait_for(lambda: store.exists() and list_profiles(str(store)), "the profile at the receiver")
    assert {k: meta[k] for k in ("id", "source", "type", "service", "host", "start", "end", "samples")} == {
        "id": upload.profile_id, "source": "ebpf", "type": "cpu", "service": "3f2a9c0d1e2b",
        "host": "web-1", "start": START_NS, "end": END_NS, "samples": 2,
    }
    assert Path(meta["path"]).read_bytes() == upload.pprof_gz
    assert u.stop() == 0


@pytest.mark.parametrize("script", [
    [(500, {}), (500, {})],
    [(429, {"Retry-After": "0"}), (503, {})],
], ids=["500-twice", "429-then-503"])
def test_transient_failures_are_retried_until_the_profile_arrives(tmp_path: Path, start_uploader,
                                                                  fault_server: FaultServer, script) -> None:
    # given a backend that fails twice, then answers 200
    fault_server.script = list(script)
    u = start_uploader(http_config(tmp_path, fault_server.url), env=FAST_BACKOFF)
    upload = make_upload()
    # when a profile arrives
    u.push_upload(upload)
    # then the third attempt delivers it: same id, same bytes, the same request each time
    wait_for(lambda: len(fault_server.posts) >= 3, "three attempts")
    assert u.stop() == 0
    assert len(fault_server.posts) == 3
    for p in fault_server.posts:
        assert p.body == upload.pprof_gz
        assert p.headers["X-Profile-Id"] == upload.profile_id
        assert p.headers["Content-Type"] == "application/octet-stream"
        assert p.headers["User-Agent"].startswith("ebpfprofiler/")
        assert p.query == {"source": ["ebpf"], "type": ["cpu"], "service": ["/usr/bin/python3.11"],
                           "host": ["web-1"], "start": [str(START_NS)], "end": [str(END_NS)]}
    assert "1 delivered, 0 failed, 0 dropped" in u.log()


def test_a_400_is_not_retried(tmp_path: Path, start_uploader, fault_server: FaultServer) -> None:
    # given a backend that refuses the first profile with 400
    fault_server.script = [(400, {})]
    u = start_uploader(http_config(tmp_path, fault_server.url), env=FAST_BACKOFF)
    refused, accepted = make_upload(), make_upload()
    # when two profiles arrive, in order
    u.push_upload(refused)
    u.push_upload(accepted)
    # then the second one is posted right after the single attempt at the first
    wait_for(lambda: len(fault_server.posts) >= 2, "both posts")
    assert [p.headers["X-Profile-Id"] for p in fault_server.posts] == [refused.profile_id, accepted.profile_id]
    assert u.stop() == 0
    log = u.log()
    assert "upload failed after 1 attempt(s)" in log and "HTTP 400 'scripted 400'" in log
    assert "1 delivered, 1 failed, 0 dropped" in log


def test_malformed_messages_are_dropped_and_the_uploader_keeps_going(tmp_path: Path, start_uploader) -> None:
    local_dir = tmp_path / "profiles"
    u = start_uploader(ProfilerConfig(endpoint="", local_dir=str(local_dir)))
    # given four messages that are not profile uploads
    batch = StackBatch(host="h", profile_type="cpu", sample_hz=19, time_ns=1, processes=(),
                       user_stacks=(), kernel_stacks=(), samples=())
    for frames in ([b"not json"], [b'{"v":1,"kind":"profile","body":{}}', b"x"], [b"a", b"b", b"c"],
                   encode(batch)):
        u.push(frames)
    # when a valid one follows
    upload = make_upload("/bin/sh")
    u.push_upload(upload)
    # then it is still delivered, and the four are counted as dropped
    wait_for(lambda: list((local_dir / "bin_sh").glob("*.pb.gz")), "the valid profile")
    assert u.stop() == 0
    log = u.log()
    assert "1 delivered, 0 failed, 4 dropped" in log
    assert "dropped a message: header is not JSON" in log
    assert "a StackBatch message was sent to the uploader" in log


def test_sigterm_delivers_what_is_queued_and_exits_0(tmp_path: Path, start_uploader,
                                                     fault_server: FaultServer) -> None:
    # given an uploader busy posting the first of three profiles to a backend that holds the reply
    fault_server.hold_first = threading.Event()
    u = start_uploader(http_config(tmp_path, fault_server.url))
    uploads = [make_upload() for _ in range(3)]
    for upload in uploads:
        u.push_upload(upload)
    wait_for(lambda: fault_server.posts, "the first post")
    # when it is told to stop, and the backend then answers
    u.proc.send_signal(signal.SIGTERM)
    fault_server.hold_first.set()
    # then the two queued profiles are delivered before it exits 0 and removes its ready file
    assert u.stop() == 0
    assert [p.headers["X-Profile-Id"] for p in fault_server.posts] == [x.profile_id for x in uploads]
    assert "3 delivered, 0 failed, 0 dropped" in u.log()
    assert not Path(endpoints.ready_file(str(u.run_dir), "uploader")).exists()


@pytest.mark.parametrize("block, key", [
    ("  sample_hz: 0\n", "modules.ebpf_profiler.sample_hz"),
    ("  endpoint: ftp://backend\n", "modules.ebpf_profiler.endpoint"),
    ("  colour: blue\n", "modules.ebpf_profiler.colour"),
])
def test_a_bad_config_exits_2_naming_the_key(tmp_path: Path, block: str, key: str) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("modules:\n  ebpf_profiler:\n  " + block)
    result = subprocess.run(uploader_command(config, tmp_path / "run"), capture_output=True,
                            timeout=DEADLINE_S)
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert key in stderr and "Traceback" not in stderr
    assert not (tmp_path / "run").exists()


def test_help_says_what_it_does() -> None:
    result = subprocess.run([sys.executable, "-m", "ebpfprofiler.cli.main", "uploader", "--help"],
                            capture_output=True, timeout=DEADLINE_S)
    assert result.returncode == 0
    out = result.stdout.decode()
    assert "--config FILE" in out and "--run-dir DIR" in out and "/v1/profiles" in out


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

