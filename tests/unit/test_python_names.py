"""symbolizer/pynames.py: asking the runtime reader for Python frames' names, with a real ROUTER in its place.

Given a PythonNameClient connected to a ZeroMQ ROUTER the test binds at endpoints.python_names (the
runtime reader's socket) in a temporary run directory, when the client asks for frames and the test
answers (or does not, or answers what nobody asked), then it keeps only the names it asked for, asks
again what timed out a bounded number of times, and counts every drop; nothing blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shared import endpoints
from shared.wire import MAX_PYTHON_NAMES, PythonNameRequest, PythonNames, decode, encode
from symbolizer import pynames
from symbolizer.pynames import PythonNameClient
from symbolizer.pystacks import PythonFrame

PID, START = 4242, 987654
KEYFN, RUN, MODULE = (0x7F3A11C2B0, 24), (0x7F3A11C1F0, 58), (0x7F3A11E030, -1)
# How long the test waits for a message on a local socket before it fails.
WAIT_MS = 5000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[zmq.Socket]:
    """The ROUTER the runtime reader binds, played by the test."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoints.python_names(str(tmp_path)))
    yield sock
    sock.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def client(tmp_path: Path, reader: zmq.Socket, clock: Clock) -> Iterator[PythonNameClient]:
    c = PythonNameClient(str(tmp_path), clock=clock)
    yield c
    c.close()


def connected(c: PythonNameClient, reader: zmq.Socket) -> bytes:
    """Wait until the client's connection is up (IMMEDIATE refuses sends before) with a throwaway request,
    answered; the client's peer id at the reader."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while c.counts["python_name_requests"] == 0:
        assert time.monotonic() < deadline, "the client never connected"
        c.ask(1, 1, [(0x1000, 0)])
        time.sleep(0.01)
    peer, req = take(reader)
    answer(reader, peer, PythonNames(req.request_id, 1, 1, ()), c)
    c.counts = dict.fromkeys(c.counts, 0)
    return peer


def take(reader: zmq.Socket) -> tuple[bytes, PythonNameRequest]:
    """The next request the reader gets: (its peer's id, the request)."""
    assert reader.poll(WAIT_MS), "no request came"
    peer, *frames = reader.recv_multipart()
    req = decode(frames)
    assert isinstance(req, PythonNameRequest)
    return peer, req


def answer(reader: zmq.Socket, peer: bytes, msg: PythonNames, client: PythonNameClient) -> None:
    """Send `msg` to the client and let it take it."""
    reader.send_multipart([peer, *encode(msg)])
    assert client.sock.poll(WAIT_MS), "the answer did not arrive"
    client.poll()


def frame(key: tuple[int, int]) -> PythonFrame:
    return PythonFrame(PID, START, *key)


def test_a_request_is_answered_and_the_names_kept(client: PythonNameClient, reader: zmq.Socket) -> None:
    # Given a connected client
    connected(client, reader)
    # When it asks for three frames of a process and the reader names two of them
    client.ask(PID, START, [KEYFN, RUN, MODULE, KEYFN])
    peer, req = take(reader)
    assert (req.pid, req.start_ticks, sorted(req.frames)) == (PID, START, sorted([KEYFN, RUN, MODULE]))
    named = ((*KEYFN, "Work.keyfn", "/srv/app.py", 7), (*MODULE, "<module>", "/srv/app.py", 1))
    answer(reader, peer, PythonNames(req.request_id, PID, START, named), client)
    # Then those two have their names, the third was refused and is not asked again
    assert client.name(frame(KEYFN)) == ("Work.keyfn", "/srv/app.py", 7)
    assert client.name(frame(MODULE)) == ("<module>", "/srv/app.py", 1)
    assert client.name(frame(RUN)) is None
    assert client.counts["python_names"] == 2 and client.counts["python_names_refused"] == 1
    assert client.counts["python_unnamed"] == 1
    client.ask(PID, START, [KEYFN, RUN, MODULE])
    assert not reader.poll(100)
    assert client.counts["python_name_requests"] == 1


def test_an_unsolicited_answer_is_ignored_and_counted(client: PythonNameClient, reader: zmq.Socket) -> None:
    # Given a request outstanding for keyfn
    connected(client, reader)
    client.ask(PID, START, [KEYFN])
    peer, req = take(reader)
    # When the reader sends an answer to no request, one with the request's id for another process,
    # and one with names of frames the request did not ask for
    answer(reader, peer, PythonNames(req.request_id + 1, PID, START, ((*KEYFN, "evil", "x.py", 1),)), client)
    answer(reader, peer, PythonNames(req.request_id, PID + 1, START, ((*KEYFN, "evil", "x.py", 1),)), client)
    answer(reader, peer, PythonNames(req.request_id, PID, START + 1, ((*KEYFN, "evil", "x.py", 1),)), client)
    # Then none is taken, each counted, and the request is still outstanding
    assert client.counts["python_names_unsolicited"] == 3
    assert client.name(frame(KEYFN)) is None
    # When its real answer comes with an extra frame it did not ask for
    extra = ((*KEYFN, "keyfn", "/srv/app.py", 7), (*RUN, "run", "/srv/app.py", 12))
    answer(reader, peer, PythonNames(req.request_id, PID, START, extra), client)
    # Then the asked frame is named and the other dropped, counted; a second copy is unsolicited
    assert client.name(frame(KEYFN)) == ("keyfn", "/srv/app.py", 7)
    assert client.name(frame(RUN)) is None
    assert client.counts["python_names_unasked"] == 1
    answer(reader, peer, PythonNames(req.request_id, PID, START, extra), client)
    assert client.counts["python_names_unsolicited"] == 4


def test_a_malformed_answer_is_dropped_and_counted(client: PythonNameClient, reader: zmq.Socket) -> None:
    peer = connected(client, reader)
    # When the reader sends something that is not a python_names answer
    reader.send_multipart([peer, b'{"v": 1, "kind": "nonsense", "body": {}}'])
    reader.send_multipart([peer, *encode(PythonNameRequest(1, PID, START, (KEYFN,)))])
    assert client.sock.poll(WAIT_MS)
    time.sleep(0.05)
    client.poll()
    # Then both are dropped, counted
    assert client.counts["python_names_bad"] == 2


def test_an_unanswered_request_is_asked_again_then_given_up(
    client: PythonNameClient, reader: zmq.Socket, clock: Clock
) -> None:
    connected(client, reader)
    # Given a request the reader never answers
    client.ask(PID, START, [KEYFN])
    take(reader)
    assert client.next_due() == clock.now + pynames.ANSWER_TIMEOUT_S
    # When its timeout passes, again and again
    for _ in range(pynames.MAX_ASKS - 1):
        clock.now += pynames.ANSWER_TIMEOUT_S
        client.poll()
        _, again = take(reader)
        assert again.frames == (KEYFN,)
    clock.now += pynames.ANSWER_TIMEOUT_S
    client.poll()
    # Then it was asked MAX_ASKS times in all, then given up: not asked again, counted
    assert client.counts["python_name_reasks"] == pynames.MAX_ASKS - 1
    assert client.counts["python_names_timed_out"] == 1
    assert client.next_due() is None
    client.ask(PID, START, [KEYFN])
    assert not reader.poll(100)


def test_a_late_answer_to_a_request_asked_again_is_unsolicited(
    client: PythonNameClient, reader: zmq.Socket, clock: Clock
) -> None:
    connected(client, reader)
    client.ask(PID, START, [KEYFN])
    peer, first = take(reader)
    clock.now += pynames.ANSWER_TIMEOUT_S
    client.poll()
    _, second = take(reader)
    # When the first request's answer comes after it was asked again
    answer(reader, peer, PythonNames(first.request_id, PID, START, ((*KEYFN, "keyfn", "a.py", 1),)), client)
    # Then it is dropped, and the second's answer is taken
    assert client.counts["python_names_unsolicited"] == 1
    answer(reader, peer, PythonNames(second.request_id, PID, START, ((*KEYFN, "keyfn", "a.py", 1),)), client)
    assert client.name(frame(KEYFN)) == ("keyfn", "a.py", 1)


def test_without_a_reader_nothing_blocks_and_the_drop_is_counted(tmp_path: Path) -> None:
    # Given no reader bound at the endpoint
    c = PythonNameClient(str(tmp_path / "nobody"))
    try:
        # When asked, twice
        t = time.monotonic()
        c.ask(PID, START, [KEYFN, RUN])
        c.ask(PID, START, [KEYFN, RUN])
        # Then neither send waits, each is counted as dropped, and the frames are asked again each time
        assert time.monotonic() - t < 0.5
        assert c.counts["python_name_requests_dropped"] == 2
        assert c.counts["python_name_requests"] == 0
        assert c.name(frame(KEYFN)) is None and c.counts["python_unnamed"] == 1
    finally:
        c.close()


def test_a_large_ask_is_split_at_the_wire_cap(client: PythonNameClient, reader: zmq.Socket) -> None:
    connected(client, reader)
    # When more frames than one request may carry are asked
    keys = [(0x7F0000000000 + 16 * i, 2 * i) for i in range(MAX_PYTHON_NAMES + 10)]
    client.ask(PID, START, keys)
    # Then they go in two requests, within the cap
    _, a = take(reader)
    _, b = take(reader)
    assert (len(a.frames), len(b.frames)) == (MAX_PYTHON_NAMES, 10)
    assert client.counts["python_name_requests"] == 2


def test_names_are_escaped_and_capped(client: PythonNameClient, reader: zmq.Socket) -> None:
    connected(client, reader)
    client.ask(PID, START, [KEYFN])
    peer, req = take(reader)
    # When the answer holds a control character and an overlong file
    hostile = ((*KEYFN, "evil\x1b[2J\nname", "/" + "a" * 3000, 7),)
    answer(reader, peer, PythonNames(req.request_id, PID, START, hostile), client)
    # Then the kept name has no control character and the file is capped
    got = client.name(frame(KEYFN))
    assert got is not None
    assert got[0] == "evil\\x1b[2J\\x0aname"
    assert len(got[1]) <= pynames.MAX_NAME_CHARS


def test_a_reused_pid_forgets_the_old_process_names(client: PythonNameClient, reader: zmq.Socket) -> None:
    connected(client, reader)
    client.ask(PID, START, [KEYFN])
    peer, req = take(reader)
    answer(reader, peer, PythonNames(req.request_id, PID, START, ((*KEYFN, "keyfn", "a.py", 1),)), client)
    # When the pid shows up with another start time
    client.ask(PID, START + 1, [KEYFN])
    # Then the old process's names are gone, and the new one's frame is asked for
    assert client.name(frame(KEYFN)) is None
    _, again = take(reader)
    assert (again.pid, again.start_ticks, again.frames) == (PID, START + 1, (KEYFN,))
