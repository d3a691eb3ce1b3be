"""The hand-off between a worker and the uploader (shared/handoff.py): the envelope and ack frames,
and ProfileSender against a real uploader process — acks only after the spool has the profile,
resends after the uploader restarts, blocks (and says so) when the uploader stops acknowledging,
and reports at close what it could not hand off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from shared import endpoints, handoff
from shared.config import ProfilerConfig
from shared.wire import Process, Sample, StackBatch, encode
from tests.harness import (
    DEADLINE_S,
    Receiver,
    TestWorker,
    give,
    http_config,
    launch_uploader,
    make_upload,
    reserve_port,
    wait_for,
    write_config,
)

# ---------------------------------------------------------------- frames


def test_a_profile_round_trips_through_envelope_and_wire() -> None:
    u = make_upload()
    frames = handoff.encode_profile(u)
    assert json.loads(frames[0]) == {"handoff": 1, "id": u.profile_id}
    assert frames[1:] == encode(u)
    assert handoff.decode_profile(frames) == u


@pytest.mark.parametrize(
    "frames, message, has_id",
    [
        ([b"x"], "expected an envelope and a wire message", False),
        ([b"{", b"h", b"b"], "envelope is not JSON", False),
        ([b'{"handoff":1,"id":"../x"}', b"h", b"b"], "no valid profile id", False),
        ([b'{"handoff":1,"id":"' + b"a" * 600 + b'"}', b"h", b"b"], "over the cap", False),
        ([b'{"handoff":2,"id":"p1"}', b"h", b"b"], "hand-off version 2", True),
        ([b'{"handoff":1,"id":"p1"}', b"not json", b"b"], "wire: header is not JSON", True),
    ],
    ids=["one-frame", "not-json", "unsafe-id", "huge-envelope", "other-version", "bad-wire"],
)
def test_bad_profile_messages_are_refused_with_the_id_when_known(
    frames: list[bytes], message: str, has_id: bool
) -> None:
    with pytest.raises(handoff.HandoffError) as e:
        handoff.decode_profile(frames)
    assert message in str(e.value)
    assert (e.value.profile_id == "p1") is has_id


def test_an_envelope_must_name_its_own_profile() -> None:
    u = make_upload()
    frames = handoff.encode_profile(u)
    frames[0] = b'{"handoff":1,"id":"someone-else"}'
    with pytest.raises(handoff.HandoffError, match="differs"):
        handoff.decode_profile(frames)


def test_acks_round_trip_and_bad_ones_are_rejected() -> None:
    ack = handoff.decode_ack(handoff.encode_ack("p-1", handoff.RETRY, "disk full " * 100))
    assert ack.profile_id == "p-1" and ack.status == "retry" and len(ack.reason) <= handoff.MAX_REASON_CHARS
    for bad in (
        b"{}",
        b"[]",
        b"x" * (handoff.MAX_ACK_BYTES + 1),
        b'{"handoff":1,"id":"p","status":"maybe"}',
        b'{"handoff":1,"id":"a/b","status":"stored"}',
    ):
        with pytest.raises(handoff.HandoffError):
            handoff.decode_ack(bad)
    with pytest.raises(ValueError):
        handoff.encode_ack("p", "maybe")


# ---------------------------------------------------------------- with a real uploader


def test_an_ack_means_the_profile_is_in_the_spool(workdir: Path, procs: list, zctx: zmq.Context) -> None:
    # given an uploader whose backend is down
    u = launch_uploader(workdir, http_config(workdir, f"http://127.0.0.1:{reserve_port()}"))
    procs.append(u)
    w = TestWorker(workdir / "run", zctx)
    uploads = [make_upload(f"/bin/s{i}") for i in range(10)]
    # when profiles are handed over and acknowledged
    w.send(*uploads)
    w.wait_acked()
    # then each acknowledged one is already a file in the spool
    assert w.sender.counts["acked"] == 10
    assert {n.split("-", 1)[1].removesuffix(".prof") for n in u.spooled()} == {x.profile_id for x in uploads}
    w.close()


def test_unacked_profiles_are_offered_again_after_the_uploader_is_killed(
    workdir: Path, procs: list, zctx: zmq.Context
) -> None:
    # given a receiver, and an uploader that is frozen (it takes nothing off its socket)
    receiver = Receiver.start(workdir)
    try:
        cfg = http_config(workdir, receiver.url)
        u = launch_uploader(workdir, cfg)
        procs.append(u)
        w = TestWorker(workdir / "run", zctx)
        first = make_upload("/bin/first")
        w.send(first)
        w.wait_acked()  # connected, and acknowledging
        os.kill(u.proc.pid, signal.SIGSTOP)
        uploads = [make_upload(f"/bin/s{i}") for i in range(4)]
        w.send(*uploads)
        w.sender.poll(300)
        assert w.sender.pending_profiles == 4
        # when it is killed with what was queued in its socket, and a new one starts
        u.kill()
        u2 = launch_uploader(workdir, cfg)
        procs.append(u2)
        # then the worker offers the profiles again and each arrives once
        w.wait_acked()
        assert w.sender.counts["resent"] >= 4
        wait_for("five profiles at the receiver", lambda: len(receiver.received()) == 5)
        assert sorted(receiver.received_ids()) == sorted(x.profile_id for x in [first, *uploads])
        assert u2.stop() == 0
        w.close()
    finally:
        receiver.stop()


def test_a_full_queue_blocks_the_worker_and_says_so_until_acks_make_room(
    workdir: Path, procs: list, zctx: zmq.Context
) -> None:
    # given a worker with room for 3 unacknowledged profiles, and an uploader that stopped answering
    (workdir / "profiles").mkdir()
    give("uploader", workdir / "profiles")
    u = launch_uploader(workdir, ProfilerConfig(endpoint="", local_dir=str(workdir / "profiles")))
    procs.append(u)
    os.kill(u.proc.pid, signal.SIGSTOP)
    uploads = [make_upload(f"/bin/s{i}") for i in range(5)]
    done = threading.Event()
    peak: list[int] = []
    worker: list[TestWorker] = []

    def produce() -> None:  # the worker's thread: its socket is used from here only
        w = TestWorker(workdir / "run", zctx, max_profiles=3)
        worker.append(w)
        for x in uploads:
            w.send(x)
            peak.append(w.sender.pending_profiles)
        w.wait_acked()
        done.set()

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    try:
        # when it has handed over three, the fourth send blocks and the worker says why, with figures
        wait_for("the worker to wait", lambda: worker and worker[0].sender.counts["waits"] >= 1)
        assert not done.wait(1.0) and len(peak) == 3
        line = next(x for x in worker[0].logs.lines if "waiting on the uploader" in x)
        # the log line is the feature: it tells the operator why the worker stopped reading, with the figures
        assert "3 profiles" in line and "caps 3 profiles" in line and "service '/bin/s0'" in line
        # then, once the uploader answers again, the worker goes on, and never held more than its cap
        os.kill(u.proc.pid, signal.SIGCONT)
        assert done.wait(DEADLINE_S)
        assert max(peak) <= 3
        assert worker[0].sender.counts["caught_up"] >= 1
        assert worker[0].sender.counts["waits"] <= 2  # once per episode
        assert len(list((workdir / "profiles").rglob("*.pb.gz"))) == 5
    finally:
        os.kill(u.proc.pid, signal.SIGCONT)
        t.join(DEADLINE_S)
        if worker:
            worker[0].close()


def test_a_stop_request_ends_the_wait(workdir: Path, zctx: zmq.Context) -> None:
    # given no uploader at all and a full queue
    stop = threading.Event()
    w = TestWorker(workdir / "run", zctx, max_profiles=1, should_stop=stop.is_set)
    w.send(make_upload())
    t = threading.Timer(0.5, stop.set)
    t.start()
    # when the worker is told to stop while blocked
    started = time.monotonic()
    w.send(make_upload())
    # then the send returns (the profile kept over the cap for close) within a poll or two
    assert time.monotonic() - started < 3
    assert w.sender.pending_profiles == 2
    assert w.sender.counts["stopped_waiting"] == 1
    t.join()
    w.close()


def test_close_reports_what_it_could_not_hand_off(workdir: Path, zctx: zmq.Context) -> None:
    # given no uploader, and two profiles of two services
    w = TestWorker(workdir / "run", zctx)
    a, b = make_upload("/bin/a"), make_upload("/bin/b")
    w.send(a, b)
    # when the worker closes with a bounded wait
    started = time.monotonic()
    left = w.sender.close(0.5)
    # then it returns within its bound and names count, services and windows
    assert time.monotonic() - started < 2
    assert [x.profile_id for x in left] == [a.profile_id, b.profile_id]
    assert w.sender.counts["lost_at_close"] == 2
    [line] = [x for x in w.logs.lines if "could not hand" in x]
    # the log line is the feature: the profiles lost at close are named only there (services, windows)
    assert "could not hand 2 profile(s)" in line and "'/bin/a', '/bin/b'" in line
    assert "2023-11-14T22:13:20Z+60s" in line
    w.close()


def start_a_worker(workdir: Path, started: list[subprocess.Popen]) -> tuple[subprocess.Popen, Path, Path]:
    """A real symbolizer worker 0 with no uploader, ready (or exited): it, its run dir and its log."""
    config = write_config(workdir / "agent.yaml", ProfilerConfig(upload_interval_s=1, plain_pid=True))
    run_dir = workdir / "run"
    run_dir.mkdir()
    give("symbolizer", run_dir)
    err = workdir / "worker.err"
    with open(err, "wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-P",  # the checkout must not shadow the code view the worker reads once it drops root
                "-m",
                "symbolizer.main",
                "--config",
                str(config),
                "--worker",
                "0",
                "--run-dir",
                str(run_dir),
                "--state-dir",
                str(workdir / "state"),
            ],
            stderr=f,
        )
    started.append(proc)
    wait_for(
        "the worker's ready file",
        lambda: Path(endpoints.ready_file(str(run_dir), "symbolizer-0")).exists() or proc.poll() is not None,
    )
    return proc, run_dir, err


def one_batch_of_svc() -> StackBatch:
    """One batch of one sample of one service, from 5 s ago."""
    return StackBatch(
        host="h",
        profile_type="cpu",
        sample_hz=19,
        time_ns=time.time_ns() - 5_000_000_000,
        processes=(
            Process(
                pid=4242,
                start_ticks=1,
                uid=0,
                nspid=4242,
                comm="svc",
                executable="/usr/bin/svc",
                service="/usr/bin/svc",
            ),
        ),
        user_stacks=(),
        kernel_stacks=(),
        samples=(Sample(4242, 4242, -1, -1, 3, 3),),
    )


def test_a_symbolizer_worker_that_cannot_hand_off_says_what_it_lost(
    workdir: Path, zctx: zmq.Context, started: list[subprocess.Popen]
) -> None:
    """A real worker with no uploader: its stop waits a bounded time, then names what it could not hand off."""
    proc, run_dir, err = start_a_worker(workdir, started)
    # given one batch of one service
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoints.symbolizer(str(run_dir), 0))
    push.send_multipart(encode(one_batch_of_svc()))
    # when its window has closed (the batch is from 5 s ago, windows are 1 s) and the profile was built
    wait_for(
        "the worker to build the profile",
        lambda: b"of service /usr/bin/svc" in err.read_bytes() or proc.poll() is not None,
    )
    # and it is stopped with no uploader to take the profile
    stop_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=handoff.CLOSE_TIMEOUT_S + DEADLINE_S)
    # then it exits within its bound and its log names the profile it could not hand off
    assert proc.returncode == 0
    assert time.monotonic() - stop_at < handoff.CLOSE_TIMEOUT_S + 5
    log = err.read_text()
    # the log line is the feature: the profiles lost at exit are named only there, for the operator
    assert "could not hand 1 profile(s)" in log and "'/usr/bin/svc'" in log, log
    push.close()
