"""The reference receiver, run as `ebpfprofiler receiver` and driven over real HTTP on 127.0.0.1."""

from __future__ import annotations

import gzip
import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from receiver.server import MAX_BODY_BYTES
from receiver.store import list_profiles
from shared.pprof import ProfileBuilder
from tests.harness import END_NS, START_NS, Receiver

HTTP_TIMEOUT_S = 10


def start_receiver(tmp_path: Path, *options: str) -> Receiver:
    r = Receiver(tmp_path / "store", *options, stderr=tmp_path / "receiver.err")
    text = r.announcement
    prefix = "receiver listening on http://127.0.0.1:"
    if not text.startswith(prefix) or text.count("\n") != 1:
        r.stop()
        raise AssertionError(
            f"receiver did not announce itself: {text!r}; stderr: {(tmp_path / 'receiver.err').read_text()}"
        )
    return r


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = start_receiver(tmp_path)
    try:
        yield r
    finally:
        r.stop()


def profile_bytes(n_samples: int = 2) -> bytes:
    b = ProfileBuilder(
        [("samples", "count"), ("cpu", "nanoseconds")],
        ("cpu", "nanoseconds"),
        period=52_631_578,
        time_ns=START_NS,
        duration_ns=END_NS - START_NS,
    )
    m = b.mapping("main", "/usr/bin/python3.11", "abcdef")
    for i in range(n_samples):
        loc = b.location(i, m, 0x1000 + i, [b.function(f"fn{i}")])
        b.sample([loc], [1, 52_631_578], {"pid": 42})
    return b.gzipped()


Param = str | int | None  # a query parameter's value; None leaves it out


def params(**changes: Param) -> dict[str, str | int]:
    p: dict[str, Param] = {
        "source": "ebpf",
        "type": "cpu",
        "service": "/usr/bin/python3.11",
        "host": "web-1",
        "start": START_NS,
        "end": END_NS,
    }
    p.update(changes)
    return {k: v for k, v in p.items() if v is not None}


def post(r: Receiver, body: bytes, profile_id: str | None = "p-1", **changes: Param) -> requests.Response:
    headers = {"Content-Type": "application/octet-stream"}
    if profile_id is not None:
        headers["X-Profile-Id"] = profile_id
    return requests.post(
        f"{r.url}/v1/profiles", params=params(**changes), data=body, headers=headers, timeout=HTTP_TIMEOUT_S
    )


def test_a_valid_profile_is_stored_with_its_metadata(receiver: Receiver) -> None:
    # given a valid gzip pprof with 3 samples
    body = profile_bytes(3)
    # when it is posted with an id
    resp = post(receiver, body, "prof-0001.a_b")
    # then the receiver stores body and metadata under that id
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"id": "prof-0001.a_b", "stored": True}
    assert (receiver.dir / "prof-0001.a_b.pb.gz").read_bytes() == body
    [meta] = list_profiles(str(receiver.dir))
    received_at = meta.pop("received_at")
    assert abs(received_at - time.time_ns()) < 60e9
    assert meta == {
        "id": "prof-0001.a_b",
        "source": "ebpf",
        "type": "cpu",
        "service": "/usr/bin/python3.11",
        "host": "web-1",
        "start": START_NS,
        "end": END_NS,
        "bytes": len(body),
        "samples": 3,
        "path": str(receiver.dir / "prof-0001.a_b.pb.gz"),
        "file": "prof-0001.a_b.pb.gz",
        "format": "pprof",
    }
    assert json.loads((receiver.dir / "prof-0001.a_b.json").read_text())["samples"] == 3


def test_without_an_id_the_receiver_assigns_one_and_host_is_optional(receiver: Receiver) -> None:
    # given a profile posted without X-Profile-Id and without host
    resp = post(receiver, profile_bytes(), profile_id=None, host=None)
    # then it is stored under a fresh id
    assert resp.status_code == 200, resp.text
    [meta] = list_profiles(str(receiver.dir))
    assert meta["id"] == resp.json()["id"] and len(meta["id"]) == 32
    assert meta["host"] == ""


@pytest.mark.parametrize(
    "body, reason",
    [
        (b"this is not gzip", "body is not gzip data"),
        (gzip.compress(b"\xff\xfe garbage that is not a protobuf " * 10), "not a pprof protobuf"),
        (gzip.compress(b""), "string_table must start with the empty string"),
    ],
    ids=["not-gzip", "gzip-of-garbage", "gzip-of-nothing"],
)
def test_an_invalid_body_is_refused_with_the_reason(receiver: Receiver, body: bytes, reason: str) -> None:
    # when a body that is not a valid gzip pprof is posted
    resp = post(receiver, body)
    # then 400 says why, and nothing is stored
    assert resp.status_code == 400
    assert resp.headers["Content-Type"] == "application/json"
    assert resp.json()["error"].startswith(reason), resp.json()
    assert list_profiles(str(receiver.dir)) == []


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"source": None}, "missing query parameter 'source'"),
        ({"type": None}, "missing query parameter 'type'"),
        ({"service": None}, "missing query parameter 'service'"),
        ({"start": None}, "missing query parameter 'start'"),
        ({"end": None}, "missing query parameter 'end'"),
        ({"service": ""}, "query parameter 'service' is empty"),
        ({"start": "yesterday"}, "query parameter 'start' = 'yesterday' is not unix nanoseconds"),
        ({"end": START_NS - 1}, f"end {START_NS - 1} is before start {START_NS}"),
    ],
)
def test_missing_or_bad_params_are_refused(receiver: Receiver, changes: dict[str, Param], reason: str) -> None:
    resp = post(receiver, profile_bytes(), "p-1", **changes)
    assert resp.status_code == 400
    assert resp.json() == {"error": reason}
    assert list_profiles(str(receiver.dir)) == []


def test_an_unsafe_id_is_refused(receiver: Receiver) -> None:
    resp = post(receiver, profile_bytes(), profile_id="../escape")
    assert resp.status_code == 400
    assert "X-Profile-Id" in resp.json()["error"]
    assert list_profiles(str(receiver.dir)) == []
    assert not (receiver.dir.parent / "escape.pb.gz").exists()


def test_the_same_id_twice_is_stored_once(receiver: Receiver) -> None:
    # given a profile already stored
    first_body = profile_bytes(1)
    assert post(receiver, first_body, "dup-1").json() == {"id": "dup-1", "stored": True}
    # when the same id is posted again (a retry after a lost reply)
    resp = post(receiver, profile_bytes(2), "dup-1")
    # then it succeeds but is not stored again
    assert resp.status_code == 200
    assert resp.json() == {"id": "dup-1", "stored": False, "duplicate": True}
    [meta] = list_profiles(str(receiver.dir))
    assert meta["samples"] == 1
    assert (receiver.dir / "dup-1.pb.gz").read_bytes() == first_body


def test_an_oversized_or_missing_content_length_is_refused(receiver: Receiver) -> None:
    query = "/v1/profiles?source=ebpf&type=cpu&service=s&start=1&end=2"
    for length, status in ((str(MAX_BODY_BYTES + 1), 413), (None, 411)):
        # given only the headers of a request, no body
        conn = http.client.HTTPConnection(receiver.host, receiver.port, timeout=HTTP_TIMEOUT_S)
        try:
            conn.putrequest("POST", query)
            if length is not None:
                conn.putheader("Content-Length", length)
            conn.endheaders()
            # then the receiver refuses before reading any body
            resp = conn.getresponse()
            assert resp.status == status
            assert "error" in json.loads(resp.read())
        finally:
            conn.close()


def test_paths_methods_and_health(receiver: Receiver) -> None:
    health = requests.get(f"{receiver.url}/healthz", timeout=HTTP_TIMEOUT_S)
    assert (health.status_code, health.text) == (200, "ok")
    unknown = requests.post(f"{receiver.url}/v2/profiles", data=b"x", timeout=HTTP_TIMEOUT_S)
    assert unknown.status_code == 404 and "error" in unknown.json()
    for method in ("GET", "PUT", "DELETE"):
        resp = requests.request(method, f"{receiver.url}/v1/profiles", timeout=HTTP_TIMEOUT_S)
        assert resp.status_code == 405 and resp.headers["Allow"] == "POST" and "error" in resp.json()


def test_sigterm_stops_the_receiver_cleanly(tmp_path: Path) -> None:
    r = start_receiver(tmp_path)
    try:
        assert post(r, profile_bytes()).status_code == 200
    finally:
        code = r.stop()
    assert code == 0
    assert "Traceback" not in (tmp_path / "receiver.err").read_text()  # a guard on the log, not an outcome: no crash


def test_fault_injection_options_are_documented_and_checked(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "cli.main", "receiver"]
    help_text = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=HTTP_TIMEOUT_S).stdout
    for option in ("--fail-ratio R", "--hang-s S", "--reject-status N", "--reject-reason TEXT", "test aids"):
        assert option in help_text
    for bad, message in (
        (["--fail-ratio", "1.5"], "not a ratio from 0 to 1"),
        (["--hang-s", "-1"], "not seconds from 0 to 3600"),
        (["--reject-status", "200"], "not an HTTP error status from 400 to 599"),
    ):
        result = subprocess.run(
            [*cmd, "--dir", str(tmp_path / "d"), *bad], capture_output=True, text=True, timeout=HTTP_TIMEOUT_S
        )
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_fault_injection_answers_without_storing(tmp_path: Path) -> None:
    # given a receiver that rejects every post with 429
    r = start_receiver(tmp_path, "--reject-status", "429", "--reject-reason", "slow down")
    try:
        # when a valid profile is posted, then it is answered as asked and nothing is stored
        resp = post(r, profile_bytes(), "p-429")
        assert resp.status_code == 429 and resp.json() == {"error": "slow down"}
        assert list_profiles(str(r.dir)) == []
    finally:
        r.stop()
    log = (tmp_path / "receiver.err").read_text()
    # the log line is the feature: a receiver that rejects on purpose says so at start, lest it pass for a broken one
    assert "fault injection on: 429 to every post" in log


# --- hostile clients (issue 15, item 8) ---


def vm_hwm_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_gzip_bomb_is_refused_without_the_memory(receiver: Receiver) -> None:
    # given 16 KB of gzip that inflates to 16 MB of one-value samples (4 bytes each: ~4M samples)
    bomb = gzip.compress(b"\x32\x00" + b"\x12\x02\x10\x01" * (4 << 20), 9)
    assert len(bomb) < 20_000
    before = vm_hwm_kb(receiver.proc.pid)
    resp = post(receiver, bomb)
    # then it is refused for its inflated size, and the receiver's peak memory barely moved
    assert resp.status_code == 400 and "larger than" in resp.json()["error"]
    assert vm_hwm_kb(receiver.proc.pid) - before < 64 << 10, "the receiver grew by 64 MB or more"
    assert post(receiver, profile_bytes(), profile_id="after-bomb").status_code == 200


@pytest.mark.parametrize("length", ["²", "¹²", "0x10", "9" * 40, "-1"])
def test_a_content_length_that_is_not_ascii_digits_is_a_400(receiver: Receiver, length: str) -> None:
    conn = http.client.HTTPConnection(receiver.host, receiver.port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.putrequest("POST", "/v1/profiles?source=ebpf&type=cpu&service=s&start=1&end=2")
        conn.putheader("Content-Length", length.encode("latin-1"))  # headers are read as latin-1
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and "Content-Length" in json.loads(resp.read())["error"]
    finally:
        conn.close()
    # a guard on the log, not an outcome: a 400 can also come after a handler crashed and logged it
    assert "Traceback" not in (receiver.log() or "")


def test_a_trickling_sender_is_cut_at_the_deadline_and_requests_past_the_cap_get_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    import threading

    from receiver import server as srv

    monkeypatch.setattr(srv, "REQUEST_DEADLINE_S", 2)
    monkeypatch.setattr(srv, "MAX_CONCURRENT_REQUESTS", 2)
    s = srv.make_server("127.0.0.1:0", str(tmp_path / "store"))
    t = threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True)
    t.start()
    host, port = s.server_address[:2]
    assert isinstance(host, str)
    try:
        # given two senders that trickle their headers, a byte every 0.2 s (within every read timeout)
        slow = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
        for c in slow:
            c.sendall(b"POST /v1/profiles?source=ebpf HTTP/1.1\r\n")
        # when a third request comes, then it is answered 503 at once
        with socket.create_connection((host, port), timeout=10) as third:
            third.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
            assert third.recv(100).startswith(b"HTTP/1.1 503")
        # and the trickling ones are cut at the deadline, not held for ever
        started = time.monotonic()
        closed: set[int] = set()
        while len(closed) < 2 and time.monotonic() - started < 10:
            for i, c in enumerate(slow):
                try:
                    c.sendall(b"X")
                    c.settimeout(0.2)
                    if c.recv(100) == b"":
                        closed.add(i)
                except TimeoutError:
                    pass
                except OSError:
                    closed.add(i)
        assert len(closed) == 2 and time.monotonic() - started < 6
        for c in slow:
            c.close()
        # and then the receiver serves again
        resp = requests.get(f"http://{host}:{port}/healthz", timeout=HTTP_TIMEOUT_S)
        assert resp.status_code == 200
    finally:
        s.shutdown()
        s.server_close()
        t.join(10)
