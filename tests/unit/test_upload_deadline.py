"""Uploads have an overall deadline per request (issue 40, case 10), shown against slow backends on 127.0.0.1.

A backend that answers a 200's headers and then one byte of its body every TRICKLE_S, forever, never
trips the read timeout (it bounds each recv); nor does one that reads the request body 8 KiB at a
time. Each post must give up at the client's deadline as a retryable failure whose cause is
"deadline". The backends are real sockets served from a thread; each post runs in a thread of its
own joined with a time limit, so that the test fails, not hangs, on a client without a deadline.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import make_upload
from uploader import http
from uploader.http import HttpClient

# A byte (or a read) this often: under the 1-s read timeout, so that no single recv or send times out.
TRICKLE_S = 0.3
READ_TIMEOUT_S = 1.0
DEADLINE_S = 2.0
# How long past the deadline a post may take to give up (thread start, a recv returning).
SLACK_S = 3.0


class SlowBackend:
    """An HTTP backend on 127.0.0.1, slow on purpose: "reply" reads the request's head, answers the
    headers of a 200 with a 100,000-byte body, then sends it a byte every TRICKLE_S; "read" reads the
    request 8 KiB every TRICKLE_S and never answers. Until stop(), which closes every socket."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.mode == "read":
                while not self._stop.wait(TRICKLE_S) and conn.recv(8192):
                    pass
                return
            head = b""
            while b"\r\n\r\n" not in head:
                got = conn.recv(65536)
                if not got:
                    return
                head += got
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            while not self._stop.wait(TRICKLE_S):
                conn.sendall(b" ")
        except OSError:
            pass  # the client gave up

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        for t in self._threads:
            t.join(5)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Any:
    b = SlowBackend(request.param)
    try:
        yield b
    finally:
        b.stop()


def timed(call: Callable[[], Any], limit_s: float) -> tuple[Any, float]:
    """call()'s result and its seconds, run in a thread joined for at most limit_s (fails past it)."""
    out: list[Any] = []
    start = time.monotonic()
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still running after {limit_s:g} s: no deadline"
    return out[0], time.monotonic() - start


@pytest.mark.parametrize(
    "backend, body_bytes",
    [("reply", 0), ("read", 8 << 20)],
    indirect=["backend"],
    ids=["trickled-reply", "slowly-read-body"],
)
def test_a_slow_backend_fails_the_post_at_the_deadline_as_a_retryable_error(
    backend: SlowBackend, body_bytes: int
) -> None:
    # given a client with a 1-s read timeout and a 2-s deadline, and a backend slow on purpose
    client = HttpClient(backend.url, read_timeout_s=READ_TIMEOUT_S, deadline_s=DEADLINE_S)
    upload = make_upload(padding=os.urandom(body_bytes))
    try:
        # when a profile is posted
        outcome, took = timed(lambda: client.post(upload), DEADLINE_S + SLACK_S)
    finally:
        client.close()
    # then the post gives up at the deadline, as a failure to retry, counted as "deadline"
    assert DEADLINE_S - 0.1 <= took <= DEADLINE_S + SLACK_S
    assert not outcome.ok and outcome.retry and outcome.cause == "deadline", outcome
    assert "over the request deadline of 2s" in outcome.reason


@pytest.mark.parametrize("backend", ["reply"], indirect=True)
def test_a_trickled_agent_config_reply_ends_at_the_deadline(backend: SlowBackend) -> None:
    client = HttpClient(backend.url, read_timeout_s=READ_TIMEOUT_S, deadline_s=DEADLINE_S)
    try:
        reply, took = timed(lambda: client.get_agent_config("h"), DEADLINE_S + SLACK_S)
    finally:
        client.close()
    assert not reply.ok and "over the request deadline" in reply.reason and took >= DEADLINE_S - 0.1


def test_the_deadline_follows_the_read_timeout() -> None:
    assert http.request_deadline_s(30) == http.CONNECT_TIMEOUT_S + 4 * 30
    assert HttpClient("http://127.0.0.1:1", read_timeout_s=1).deadline_s == http.CONNECT_TIMEOUT_S + 4
