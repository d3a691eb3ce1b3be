"""The uploader stage, run as `ebpfprofiler uploader`: fed by a test worker (a real DEALER socket
and shared.handoff.ProfileSender) over a real ipc:// socket, delivering to a local directory, to the
reference receiver, or to a scripted HTTP(S) server on 127.0.0.1.
"""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import zmq

from receiver.server import make_server
from receiver.store import list_profiles
from shared import counters, endpoints, handoff
from shared.config import UPLOAD_FORMATS, ProfilerConfig
from shared.wire import StackBatch, encode
from tests.harness import (
    DEADLINE_S,
    END_NS,
    FAST_BACKOFF,
    START_NS,
    TestWorker,
    UploaderProcess,
    give,
    http_config,
    make_upload,
    reserve_port,
    uploader_command,
    wait_for,
    write_config,
)
from uploader.local import MAX_SERVICE_DIR_CHARS, safe_name

# ---------------------------------------------------------------- fixtures


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
    hold_first: threading.Event | None = None  # when set, the first POST waits for it
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ids(self) -> list[str]:
        with self.lock:
            return [p.headers["X-Profile-Id"] for p in self.posts]


def serve_faults(state: FaultServer, tls: ssl.SSLContext | None = None) -> Callable[[], None]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with state.lock:
                state.posts.append(
                    Post(parse_qs(urlsplit(self.path).query), dict(self.headers), body, time.monotonic())
                )
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


def test_local_mode_writes_the_exact_bytes_and_then_acks(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker
) -> None:
    # given an uploader with endpoint "" writing to local_dir
    local_dir = workdir / "profiles"
    local_dir.mkdir()
    give("uploader", local_dir)
    u = start_uploader(ProfilerConfig(endpoint="", local_dir=str(local_dir)))
    # the log line is the feature: the start line tells the operator where profiles go
    assert f"profiles go to the local directory {local_dir}" in u.log()
    # when a profile is handed to it
    upload = make_upload("/usr/bin/python3.11")
    worker.send(upload)
    worker.wait_acked()
    # then by the time it is acknowledged it is written, byte for byte, under a readable service dir
    path = local_dir / "usr_bin_python3.11" / f"cpu-20231114T221320Z-{upload.profile_id}.pb.gz"
    assert path.read_bytes() == upload.pprof_gz
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left
    assert worker.sender.counts["acked"] == 1
    assert u.stop() == 0
    assert u.counters() == {"messages_stored": 1, "messages_refused": 0, "messages_retry": 0}
    assert not u.spool_dir.exists()  # local mode has no spool


def test_local_mode_that_cannot_write_says_retry_and_the_worker_keeps_the_profile(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker
) -> None:
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
    def nacked() -> int:
        worker.sender.poll(20)
        return worker.sender.counts["nacked"]

    wait_for("a retry answer", nacked)
    assert worker.sender.pending_profiles == 1
    # the log line is the feature: it tells the operator why the worker holds profiles (the uploader's reason)
    assert "the uploader cannot take profiles now (cannot write under local_dir" in worker.logs.text()
    # and when the obstacle is gone, the next offer is written and acknowledged
    blocker.unlink()
    worker.wait_acked()
    assert (local_dir / "usr_bin_python3.11" / f"cpu-20231114T221320Z-{upload.profile_id}.pb.gz").exists()
    assert worker.sender.counts["retry_ended"] == 1
    assert u.stop() == 0


# ---------------------------------------------------------------- HTTP mode


def test_http_mode_spools_acks_and_delivers_with_the_right_params(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, fault_server: FaultServer
) -> None:
    u = start_uploader(http_config(workdir, fault_server.url))
    # the log line is the feature: the start line tells the operator where profiles go, how
    assert f"profiles go to the endpoint {fault_server.url}/v1/profiles" in u.log()
    # the log line is the feature: ... and with what credentials and trust
    assert "no token" in u.log() and "system CAs" in u.log()
    upload = make_upload("3f2a9c0d1e2b")
    worker.send(upload)
    worker.wait_acked()
    wait_for("the post", lambda: fault_server.posts)
    [p] = fault_server.posts
    assert p.body == upload.pprof_gz
    assert p.headers["X-Profile-Id"] == upload.profile_id
    assert p.headers["Content-Type"] == "application/octet-stream"
    assert p.headers["User-Agent"].startswith("ebpfprofiler/")
    assert "Authorization" not in p.headers
    assert p.query == {
        "source": ["ebpf"],
        "type": ["cpu"],
        "service": ["3f2a9c0d1e2b"],
        "host": ["web-1"],
        "start": [str(START_NS)],
        "end": [str(END_NS)],
    }
    wait_for("the spool to be emptied after the 2xx", lambda: not u.spooled())
    # and `ebpfprofiler status` shows the totals while the uploader runs, not only at its exit
    wait_for(
        "the running totals in the counters status reads",
        lambda: counters.read_all(str(u.run_dir)).get("uploader", {}).get("spool_delivered") == 1,
    )
    assert u.stop() == 0
    counts = u.counters()
    assert (counts["messages_stored"], counts["messages_refused"], counts["messages_retry"]) == (1, 0, 0)
    assert (counts["spool_spooled"], counts["spool_delivered"], counts["rejected_in_2xx"]) == (1, 1, 0)
    assert not {
        k: n for k, n in counts.items() if n and k not in {"messages_stored", "spool_spooled", "spool_delivered"}
    }
    assert not u.spooled()


def test_http_mode_to_the_reference_receiver(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, receiver: tuple[str, Path]
) -> None:
    url, store = receiver
    u = start_uploader(http_config(workdir, url))
    uploads = [make_upload(f"/usr/bin/svc{i}") for i in range(5)]
    worker.send(*uploads)
    worker.wait_acked()
    wait_for("five profiles at the receiver", lambda: store.exists() and len(list_profiles(str(store))) == 5)
    got = {m["id"]: m for m in list_profiles(str(store))}
    for up in uploads:
        assert Path(got[up.profile_id]["path"]).read_bytes() == up.pprof_gz
        assert got[up.profile_id]["service"] == up.service
    assert u.stop() == 0


@pytest.mark.parametrize(
    "script",
    [
        [(500, {}), (500, {})],
        [(429, {"Retry-After": "0"}), (503, {})],
        [(408, {}), (502, {})],
    ],
    ids=["500-twice", "429-then-503", "408-then-502"],
)
def test_transient_failures_are_retried_until_the_profile_arrives(
    workdir: Path,
    start_uploader: Callable[..., UploaderProcess],
    worker: TestWorker,
    fault_server: FaultServer,
    script: list[tuple[int, dict[str, str]]],
) -> None:
    # given a backend that fails twice, then answers 200
    fault_server.script = list(script)
    u = start_uploader(http_config(workdir, fault_server.url), env=FAST_BACKOFF)
    upload = make_upload()
    # when a profile arrives
    worker.send(upload)
    worker.wait_acked()
    # then the third attempt delivers it: same id, same bytes each time
    wait_for("three attempts and an empty spool", lambda: len(fault_server.posts) >= 3 and not u.spooled())
    assert u.stop() == 0
    assert fault_server.ids() == [upload.profile_id] * 3
    assert all(p.body == upload.pprof_gz for p in fault_server.posts)
    counts = u.counters()
    assert counts["http_retry"] == 2  # the two failed attempts, by their cause
    assert (counts["spool_delivered"], counts["spool_dead_lettered"], counts["spool_dropped"]) == (1, 0, 0)


def test_retry_after_is_honoured(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, fault_server: FaultServer
) -> None:
    # given a backend that answers 503 with Retry-After: 2 (the backoff alone would wait ~10 ms)
    fault_server.script = [(503, {"Retry-After": "2"})]
    u = start_uploader(http_config(workdir, fault_server.url), env=FAST_BACKOFF)
    worker.send(make_upload())
    worker.wait_acked()
    wait_for("the retry", lambda: len(fault_server.posts) >= 2)
    # then the retry came no sooner than the server asked
    gap = fault_server.posts[1].at - fault_server.posts[0].at
    assert 1.9 <= gap < 6, gap
    assert u.stop() == 0
    assert u.counters()["http_retry"] == 1


def test_a_400_is_dead_lettered_and_the_next_profile_goes_on(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, fault_server: FaultServer
) -> None:
    # given a backend that refuses the first profile with 400
    fault_server.script = [(400, {})]
    u = start_uploader(http_config(workdir, fault_server.url), env=FAST_BACKOFF)
    refused, accepted = make_upload("/bin/refused"), make_upload("/bin/accepted")
    # when two profiles arrive, in order
    worker.send(refused, accepted)
    worker.wait_acked()
    # then each is posted once, and the refused one is in the dead-letter directory with the reason
    wait_for("both posts and an empty spool", lambda: len(fault_server.posts) >= 2 and not u.spooled())
    assert u.stop() == 0
    assert fault_server.ids() == [refused.profile_id, accepted.profile_id]
    [record] = list(u.dead_letter_dir.glob("*.json"))
    meta = json.loads(record.read_text())
    assert meta["id"] == refused.profile_id and meta["status"] == 400 and meta["service"] == "/bin/refused"
    assert meta["reason"] == "HTTP 400 'scripted 400'" and meta["attempts"] == 1
    assert record.with_suffix(".pb.gz").read_bytes() == refused.pprof_gz
    counts = u.counters()
    assert counts["refused"] == 1  # the failed attempt, by its cause
    assert (counts["spool_delivered"], counts["spool_dead_lettered"], counts["spool_dropped"]) == (1, 1, 0)


def test_malformed_messages_are_refused_by_id_when_possible(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker
) -> None:
    local_dir = workdir / "profiles"
    local_dir.mkdir()
    give("uploader", local_dir)
    u = start_uploader(ProfilerConfig(endpoint="", local_dir=str(local_dir)))
    # given messages that are not valid hand-offs, three of them with a valid envelope
    batch = StackBatch(
        host="h",
        profile_type="cpu",
        sample_hz=19,
        time_ns=1,
        processes=(),
        user_stacks=(),
        kernel_stacks=(),
        samples=(),
    )

    def envelope(pid: str, v: int = 1) -> bytes:
        return json.dumps({"handoff": v, "id": pid}).encode()

    for frames in (
        [b"not json", b"x"],
        [b"only one frame"],
        [envelope("bad-wire"), b'{"v":1,"kind":"profile","body":{}}', b"x"],
        [envelope("a-batch"), *encode(batch)],
        [envelope("v9", 9), *encode(make_upload())],
    ):
        worker.sock.send_multipart(frames)
    # then the ones with an id are answered "refused", with the reason
    acks: list[handoff.Ack] = []

    def three_refused() -> bool:
        acks.extend(handoff.decode_ack(f[0]) for f in _drain(worker.sock))
        return len(acks) >= 3

    wait_for("three refusals", three_refused)
    assert sorted((a.profile_id, a.status) for a in acks) == [
        ("a-batch", "refused"),
        ("bad-wire", "refused"),
        ("v9", "refused"),
    ]
    assert "hand-off version 9, this build speaks 1" in {a.profile_id: a.reason for a in acks}["v9"]
    # and a valid one that follows is still written, while all five are counted
    upload = make_upload("/bin/sh")
    worker.send(upload)
    worker.wait_acked()
    assert list((local_dir / "bin_sh").glob("*.pb.gz"))
    assert u.stop() == 0
    assert u.counters()["messages_stored"] == 1 and u.counters()["messages_refused"] == 5
    log = u.log()
    # the log line is the feature: each reason for refusing a message is said once
    assert "refused a message: envelope is not JSON" in log
    assert "a StackBatch message was sent to the uploader" in log


def _drain(sock: zmq.Socket) -> list[list[bytes]]:
    out = []
    while sock.poll(50):
        out.append(sock.recv_multipart())
    return out


def test_sigterm_spools_what_is_queued_and_makes_a_final_attempt(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, fault_server: FaultServer
) -> None:
    # given an uploader busy posting the first of three profiles to a backend that holds the reply
    fault_server.hold_first = threading.Event()
    u = start_uploader(http_config(workdir, fault_server.url))
    uploads = [make_upload() for _ in range(3)]
    worker.send(*uploads)
    worker.wait_acked()
    wait_for("the first post", lambda: fault_server.posts)
    # when it is told to stop, and the backend then answers
    u.proc.send_signal(signal.SIGTERM)
    fault_server.hold_first.set()
    # then the two spooled profiles are delivered before it exits 0 and removes its ready file
    assert u.stop() == 0
    assert fault_server.ids() == [x.profile_id for x in uploads]
    counts = u.counters()
    assert (counts["spool_delivered"], counts["spool_dead_lettered"], counts["spool_dropped"]) == (3, 0, 0)
    assert not u.spooled()
    assert not Path(endpoints.ready_file(str(u.run_dir), "uploader")).exists()


def test_sigterm_with_the_backend_down_exits_promptly_and_the_next_start_sends_the_spool(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker
) -> None:
    # given a backend that is down and three acknowledged profiles in the spool
    port = reserve_port()
    cfg = http_config(workdir, f"http://127.0.0.1:{port}")
    u = start_uploader(cfg, env=FAST_BACKOFF)
    uploads = [make_upload(f"/bin/s{i}") for i in range(3)]
    worker.send(*uploads)
    worker.wait_acked()
    wait_for("a failed attempt", lambda: "failed (attempt" in u.log())
    # when it is stopped, it does not wait for the backend
    t0 = time.monotonic()
    assert u.stop() == 0
    assert time.monotonic() - t0 < 10
    assert len(u.spooled()) == 3
    counts = u.counters()
    assert counts["unreachable"] >= 1 and counts["spool_delivered"] == 0 and counts["spool_dropped"] == 0
    # and when the backend is up and the uploader starts again, it sends the spool oldest first
    server = make_server(f"127.0.0.1:{port}", str(workdir / "store"))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        u2 = start_uploader(cfg, env=FAST_BACKOFF)
        wait_for("the spooled profiles", lambda: len(list_profiles(str(workdir / "store"))) == 3)
        assert [m["id"] for m in list_profiles(str(workdir / "store"))] == [x.profile_id for x in uploads]
        assert u2.stop() == 0
        assert u2.counters()["spool_delivered"] == 3 and u2.counters()["messages_stored"] == 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE_S)


@pytest.mark.parametrize("upload_format", UPLOAD_FORMATS)
def test_bearer_token_is_sent_and_never_logged(
    workdir: Path,
    start_uploader: Callable[..., UploaderProcess],
    worker: TestWorker,
    fault_server: FaultServer,
    upload_format: str,
) -> None:
    # given a token file and debug logging
    token = "s3cr3t-" + uuid.uuid4().hex
    token_file = workdir / "token"
    token_file.write_text(f"  {token}\n")
    token_file.chmod(0o600)
    give("uploader", token_file)
    fault_server.script = [(500, {}), (401, {})]
    u = start_uploader(
        http_config(workdir, fault_server.url, token_file=str(token_file), upload_format=upload_format),
        env={**FAST_BACKOFF, "EBPFPROFILER_LOG_LEVEL": "DEBUG"},
    )
    worker.send(make_upload(), make_upload())
    worker.wait_acked()
    wait_for("three posts", lambda: len(fault_server.posts) >= 3 and not u.spooled())
    # then every post carries it, stripped, as a bearer token
    assert {p.headers["Authorization"] for p in fault_server.posts} == {f"Bearer {token}"}
    assert u.stop() == 0
    log = u.log()
    # the log line is the feature: the warning that a bearer token goes over plain http:// is for the user
    assert "a bearer token" in log and "plain http://" in log
    # and it appears in no log line, failures and dead letters included
    assert token not in log  # a guard on the log, not an outcome: the secret must never reach a log
    for f in u.dead_letter_dir.iterdir():
        assert token.encode() not in f.read_bytes()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty"),
        (b"two words", "other than visible ASCII"),
        (b"x" * (17 << 10), "larger than"),
    ],
    ids=["empty", "space-inside", "too-large"],
)
def test_an_unusable_token_file_exits_2_without_showing_it(workdir: Path, content: bytes, message: str) -> None:
    token_file = workdir / "token"
    token_file.write_bytes(content)
    token_file.chmod(0o600)
    give("uploader", token_file)
    config = write_config(
        workdir / "agent.yaml", http_config(workdir, "http://127.0.0.1:1", token_file=str(token_file))
    )
    result = subprocess.run(
        uploader_command(config, workdir / "run", workdir / "state"), capture_output=True, timeout=DEADLINE_S
    )
    assert result.returncode == 2
    err = result.stderr.decode()
    assert "token_file" in err and message in err and "Traceback" not in err
    if content:
        assert content.decode()[:20] not in err


def make_certificate(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl): (cert, key)."""
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@pytest.mark.parametrize("upload_format", UPLOAD_FORMATS)
def test_tls_is_verified_and_a_ca_file_can_be_configured(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, upload_format: str
) -> None:
    # given an HTTPS backend with a self-signed certificate
    cert, key = make_certificate(workdir)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    state = FaultServer()
    stop_server = serve_faults(state, tls)
    try:
        # when the uploader trusts only the system CAs, verification fails and nothing is posted
        u = start_uploader(http_config(workdir, state.url, upload_format=upload_format), env=FAST_BACKOFF)
        upload = make_upload()
        worker.send(upload)
        worker.wait_acked()
        wait_for("a verification failure", lambda: "CERTIFICATE_VERIFY_FAILED" in u.log())
        assert state.posts == [] and len(u.spooled()) == 1
        assert u.stop() == 0
        # and with the certificate as its CA file, the spooled profile is delivered
        u2 = start_uploader(
            http_config(workdir, state.url, ca_file=str(cert), upload_format=upload_format), env=FAST_BACKOFF
        )
        # the log line is the feature: the start line tells the operator which CAs are trusted
        assert f"CA file {cert}" in u2.log()
        wait_for("the post over TLS", lambda: state.posts)
        wait_for("the spool to be emptied", lambda: not u2.spooled())
        assert len(state.posts) == 1
        if upload_format != "otlp":  # OTLP's key is in the body (test_upload_formats.py)
            assert state.ids() == [upload.profile_id]
        assert u2.stop() == 0
    finally:
        stop_server()


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize(
    "block, key",
    [
        ("  sample_hz: 0\n", "modules.ebpf_profiler.sample_hz"),
        ("  endpoint: ftp://backend\n", "modules.ebpf_profiler.endpoint"),
        ("  colour: blue\n", "modules.ebpf_profiler.colour"),
        ("  spool_max_mb: 0\n", "modules.ebpf_profiler.spool_max_mb"),
        ("  ca_file: relative.pem\n", "modules.ebpf_profiler.ca_file"),
    ],
)
def test_a_bad_config_exits_2_naming_the_key(workdir: Path, block: str, key: str) -> None:
    config = workdir / "agent.yaml"
    config.write_text("modules:\n  ebpf_profiler:\n  " + block)
    config.chmod(0o644)
    result = subprocess.run(
        uploader_command(config, workdir / "run", workdir / "state"), capture_output=True, timeout=DEADLINE_S
    )
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert key in stderr and "Traceback" not in stderr
    assert not (workdir / "run").exists() and not (workdir / "state").exists()


def test_help_says_what_it_does() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "uploader", "--help"], capture_output=True, timeout=DEADLINE_S
    )
    assert result.returncode == 0
    out = result.stdout.decode()
    assert "--config FILE" in out and "--run-dir DIR" in out and "--state-dir DIR" in out
    assert "/v1/profiles" in out and "spool" in out and "dead-letter" in out


@pytest.mark.parametrize(
    "service, expected",
    [
        ("/usr/bin/python3.11", "usr_bin_python3.11"),
        ("3f2a9c0d1e2b", "3f2a9c0d1e2b"),
        ("[kernel]", "kernel"),
        ("..", "unknown"),
        ("/", "unknown"),
        ("", "unknown"),
        ("../../etc/passwd", "etc_passwd"),
        ("/opt/my app/bin/ünïcode", "opt_my_app_bin_n_code"),
    ],
)
def test_service_names_map_to_safe_directory_names(service: str, expected: str) -> None:
    assert safe_name(service, MAX_SERVICE_DIR_CHARS) == expected


def test_long_service_names_are_cut_and_kept_apart() -> None:
    a, b = "/x/" + "a" * 300 + "1", "/x/" + "a" * 300 + "2"
    sa, sb = safe_name(a, MAX_SERVICE_DIR_CHARS), safe_name(b, MAX_SERVICE_DIR_CHARS)
    assert len(sa) <= MAX_SERVICE_DIR_CHARS and len(sb) <= MAX_SERVICE_DIR_CHARS and sa != sb
