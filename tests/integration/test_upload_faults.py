"""Uploads that lose nothing (issue 5), shown against the real receiver on 127.0.0.1.

The faults of the backend (down, 500s, hangs) and the kill -9 of the uploader are run for each
upload_format (pprof, otlp, pyroscope): the same spool and retries must lose nothing and store
nothing twice whatever the backend speaks. Each test is one fault: the receiver down for three windows, answering 500 at random, hanging past
the read timeout, refusing with 400; the uploader killed with -9 while posting; the spool on a tiny
filesystem that fills; a collector or symbolizer killed mid-run. The processes are real (the
pipeline under `ebpfprofiler run`, or an uploader fed by a test worker over its real socket); every
one is ended by pid, also when a test fails. Waiting is polling with deadlines.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared import counters, endpoints
from shared.config import UPLOAD_FORMATS, ProfilerConfig
from shared.privileges import ids as stage_ids
from shared.wire import ProfileUpload
from symbolizer.main import WINDOW_GRACE_S
from tests.harness import (
    FAST_BACKOFF,
    Pipeline,
    Receiver,
    TestWorker,
    UploaderProcess,
    http_config,
    launch_uploader,
    make_upload,
    require_root,
    reserve_port,
    wait_for,
)
from uploader.spool import decode_file

WINDOW_S = 2  # upload_interval_s of the pipeline tests
SAMPLE_HZ = 49
PIPELINE_DEADLINE_S = 60
# Resident memory each stage must stay under during the hang test. The collector carries bcc and
# LLVM (~126 MB after compiling); a worker and the uploader have budgets of tens of MB.
RSS_BOUND_MB = {"collector": 260, "symbolizer-0": 80, "uploader": 80}
# And none may grow by more than this between the first and the last sample of the hang.
RSS_GROWTH_MB = 16

PROFILE_LINE = re.compile(
    r" symbolizer-(\d+)\[(\d+)\] INFO [\w.]+: profile (\S+) (\w+) of service (.*), "
    r"window (\S+): "
)


@dataclass(frozen=True)
class Produced:
    """One profile a worker built and handed to the uploader, from its log line."""

    worker_pid: int
    profile_id: str
    profile_type: str
    service: str
    window: str


def produced(log: str) -> list[Produced]:
    """Each profile a worker handed over, from the line it logs for each (the log line is the feature:
    the audit trail an operator matches against the backend's)."""
    return [Produced(int(m[2]), m[3], m[4], m[5], m[6]) for m in PROFILE_LINE.finditer(log)]


def spool_of(pipeline: Pipeline) -> Path:
    """The pipeline uploader's spool directory, as its start-up log line names it."""
    m = re.search(r"through the spool (\S+) \(cap", pipeline.log())
    assert m, "the uploader did not say where its spool is"
    return Path(m[1])


def spooled(spool: Path) -> dict[str, tuple[str, str, int]]:
    """id → (service, type, window start) of what is in the spool now, oldest first (the spool's name order)."""
    out = {}
    for p in sorted(spool.glob("*.prof")):
        try:
            head = decode_file(p.read_bytes(), header_only=True)
        except FileNotFoundError:
            continue  # delivered while we looked
        out[head.profile_id] = (head.service, head.profile_type, head.window_start_ns)
    return out


def stage_pid(run_dir: Path, stage: str) -> int:
    try:
        return int(Path(endpoints.ready_file(str(run_dir), stage)).read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def uploader_counts(run_dir: Path) -> dict[str, int]:
    """The running uploader's counters as `ebpfprofiler status` reads them (RUN_DIR/uploader.counters.json)."""
    return counters.read_all(str(run_dir)).get("uploader", {})


def agent_id(profile_id: str) -> str:
    """A profile id as every format's receiver metadata gives it back (OTLP carries it as 16 bytes)."""
    try:
        return uuid.UUID(profile_id).hex
    except ValueError:
        return profile_id


def received_ids(receiver: Receiver) -> list[str]:
    """The agent's profile id of each stored profile, whatever its format.

    pprof: X-Profile-Id, the key. otlp: the first profile_id, the key. pyroscope: the key is
    (name, from, until); the X-Profile-Id the agent also sends tells which profile it was."""
    return [agent_id(m.get("x_profile_id") or m["id"]) for m in receiver.received()]


def assert_each_received_once(receiver: Receiver, ids: set[str]) -> None:
    """Every id in `ids` is stored, and no (service, type, window) is stored twice under two ids."""
    got = receiver.received()
    ids = {agent_id(i) for i in ids}
    missing = ids - set(received_ids(receiver))
    assert not missing, f"{len(missing)} of {len(ids)} profiles never arrived: {sorted(missing)[:5]}"
    keys = Counter((m["service"], m["type"], m["start"]) for m in got)
    assert not [k for k, n in keys.items() if n > 1], f"stored twice: {[k for k, n in keys.items() if n > 1]}"


@pytest.fixture
def workload(build: Callable[..., Path], started: list[subprocess.Popen]) -> subprocess.Popen:
    """A CPU-bound process for the whole test, so every window has a profile of its service."""
    p = subprocess.Popen([str(build("hot")), "600"], stdout=subprocess.DEVNULL)
    started.append(p)
    return p


def pipeline_config(tmp_path: Path, url: str, **changes: Any) -> ProfilerConfig:
    return ProfilerConfig(
        sample_hz=SAMPLE_HZ, upload_interval_s=WINDOW_S, endpoint=url, local_dir=str(tmp_path / "unused"), **changes
    )


# ---------------------------------------------------------------- the receiver down for three windows


@pytest.mark.parametrize("upload_format", UPLOAD_FORMATS)
def test_receiver_down_for_three_windows_then_up_every_profile_arrives_once(
    tmp_path: Path, workload: subprocess.Popen, procs: list, upload_format: str
) -> None:
    require_root()
    # given the pipeline posting to a port where no receiver listens yet
    port = reserve_port()
    pipeline = Pipeline(tmp_path, pipeline_config(tmp_path, f"http://127.0.0.1:{port}", upload_format=upload_format))
    procs.append(pipeline)
    spool = spool_of(pipeline)
    # when three windows close while it is down, their profiles wait in the spool
    windows = wait_for(
        "profiles of three windows in the spool",
        lambda: ws if len(ws := {w for _, _, w in spooled(spool).values()}) >= 3 else None,
        timeout=PIPELINE_DEADLINE_S,
    )
    during_outage = spooled(spool)
    wait_for(
        "the failed attempts, counted by cause",
        lambda: uploader_counts(pipeline.run_dir).get("unreachable", 0) >= 1,
        timeout=2 * counters.WRITE_GAP_S + 1,
    )
    # and then the receiver comes up on that port
    receiver = Receiver.start(tmp_path, port=port)
    procs.append(receiver)
    # then the spooled profiles arrive, oldest first, and the pipeline keeps going
    wait_for(
        "the spooled profiles",
        lambda: {agent_id(i) for i in during_outage} <= set(received_ids(receiver)),
        timeout=PIPELINE_DEADLINE_S,
    )
    # oldest first: in the order they came into the spool. That is not always window order: a worker may
    # hand over an older window's offcpu or python_wall profile after a newer window's cpu one.
    spool_order = [agent_id(i) for i in during_outage]
    assert [i for i in received_ids(receiver) if i in set(spool_order)] == spool_order
    assert pipeline.stop() == 0
    # and every profile any worker handed over, those of the three windows included, is stored once
    made = produced(pipeline.log())
    assert {p.profile_id for p in made} >= set(during_outage)
    assert len(windows) >= 3
    assert_each_received_once(receiver, {p.profile_id for p in made})
    assert not spooled(spool)


# ---------------------------------------------------------------- 500 to half the posts


@pytest.mark.parametrize("upload_format", UPLOAD_FORMATS)
def test_receiver_failing_half_the_posts_at_random_every_profile_arrives_once(
    tmp_path: Path, workdir: Path, procs: list, zctx: zmq.Context, upload_format: str
) -> None:
    receiver = Receiver.start(tmp_path, "--fail-ratio", "0.5")
    procs.append(receiver)
    u = launch_uploader(workdir, http_config(workdir, receiver.url, upload_format=upload_format), env=FAST_BACKOFF)
    procs.append(u)
    worker = TestWorker(u.run_dir, zctx)
    uploads = [make_upload(f"/usr/bin/svc{i % 7}", start_ns=1_700_000_000_000_000_000 + i * 10**9) for i in range(40)]
    worker.send(*uploads)
    worker.wait_acked()
    wait_for("all 40 profiles at the receiver", lambda: len(receiver.received()) == 40 and not u.spooled(), timeout=60)
    assert_each_received_once(receiver, {x.profile_id for x in uploads})
    assert sorted(received_ids(receiver)) == sorted(agent_id(x.profile_id) for x in uploads)
    assert u.stop() == 0
    counts = u.counters()
    assert counts.get("http_retry", 0) >= 5, f"only {counts} failed attempts in 40+ posts"
    assert (counts["spool_delivered"], counts["spool_dead_lettered"], counts["spool_dropped"]) == (40, 0, 0)
    worker.close()


# ---------------------------------------------------------------- a receiver that hangs


def test_receiver_hanging_past_the_read_timeout_uploader_retries_and_memory_stays_bounded(
    tmp_path: Path, workload: subprocess.Popen, procs: list
) -> None:
    """With the default format: what this adds to the lone uploader's test below (run for each
    format) is the pipeline's side, the workers producing on and every stage's memory, which no
    format changes; once per format it took a minute of CI more."""
    require_root()
    upload_format = "pprof"
    # given the pipeline with a 2 s read timeout, posting to a receiver that hangs 30 s on every post
    port = reserve_port()
    hanging = Receiver.start(tmp_path, "--hang-s", "30", port=port)
    procs.append(hanging)
    pipeline = Pipeline(
        tmp_path, pipeline_config(tmp_path, hanging.url, upload_timeout_s=2, upload_format=upload_format)
    )
    procs.append(pipeline)
    spool = spool_of(pipeline)
    pids = {s: stage_pid(pipeline.run_dir, s) for s in RSS_BOUND_MB}
    assert all(pids.values()), pids
    # when it runs for six windows after the first one closed (the stages' start-up allocations are done)
    wait_for("the first window's profiles", lambda: spooled(spool), timeout=PIPELINE_DEADLINE_S)
    samples: dict[str, list[float]] = {s: [] for s in pids}
    spool_sizes: list[int] = []
    deadline = time.monotonic() + 6 * WINDOW_S + WINDOW_GRACE_S
    while time.monotonic() < deadline:
        for stage, pid in pids.items():
            samples[stage].append(rss_mb(pid))
        spool_sizes.append(len(spooled(spool)))
        time.sleep(0.5)
    log = pipeline.log()
    # then the uploader timed out and retried, more than once
    assert uploader_counts(pipeline.run_dir).get("read_timeout", 0) >= 2, log[-3000:]
    # and the workers kept producing: the spool grew window after window, and no worker waited
    assert spool_sizes[-1] > spool_sizes[len(spool_sizes) // 2] > 0, spool_sizes
    assert len({w for _, _, w in spooled(spool).values()}) >= 4
    waits = {
        stage: c.get("uploader_waits") for stage, c in pipeline.counters().items() if stage.startswith("symbolizer-")
    }
    assert waits and not any(waits.values()), waits
    # and no stage's memory went past its bound or kept growing
    for stage, mb in samples.items():
        assert max(mb) < RSS_BOUND_MB[stage], f"{stage}: RSS up to {max(mb):.0f} MB, bound {RSS_BOUND_MB[stage]}"
        assert mb[-1] - mb[0] < RSS_GROWTH_MB, f"{stage}: RSS grew from {mb[0]:.0f} to {mb[-1]:.0f} MB"
    # and once the receiver answers again, everything arrives once
    hanging.stop()
    receiver = Receiver.start(tmp_path, port=port)
    procs.append(receiver)
    wait_for("the spool to drain", lambda: not spooled(spool), timeout=PIPELINE_DEADLINE_S)
    assert pipeline.stop() == 0
    assert_each_received_once(receiver, {p.profile_id for p in produced(pipeline.log())})


@pytest.mark.parametrize("upload_format", UPLOAD_FORMATS)
def test_a_lone_uploader_retries_a_hanging_receiver_and_delivers_each_profile_once(
    tmp_path: Path, workdir: Path, procs: list, zctx: zmq.Context, upload_format: str
) -> None:
    """The hang of the test above without the pipeline: only the uploader's part, for each format."""
    # given an uploader with a 2 s read timeout posting to a receiver that holds every post 30 s
    port = reserve_port()
    hanging = Receiver.start(tmp_path, "--hang-s", "30", port=port)
    procs.append(hanging)
    u = launch_uploader(
        workdir, http_config(workdir, hanging.url, upload_timeout_s=2, upload_format=upload_format), env=FAST_BACKOFF
    )
    procs.append(u)
    worker = TestWorker(u.run_dir, zctx)
    uploads = [make_upload(f"/usr/bin/svc{i}", start_ns=1_700_000_000_000_000_000 + i * 10**9) for i in range(20)]
    worker.send(*uploads)
    worker.wait_acked()
    # when the posts time out, again and again, every profile stays in the spool
    wait_for("two read timeouts", lambda: uploader_counts(u.run_dir).get("read_timeout", 0) >= 2, timeout=60)
    assert len(u.spooled()) == 20
    # and when the receiver answers again, each arrives once
    hanging.stop()
    receiver = Receiver.start(tmp_path, port=port)
    procs.append(receiver)
    wait_for("the spool to drain", lambda: not u.spooled(), timeout=60)
    assert_each_received_once(receiver, {x.profile_id for x in uploads})
    assert sorted(received_ids(receiver)) == sorted(agent_id(x.profile_id) for x in uploads)
    assert u.stop() == 0
    counts = u.counters()
    assert counts["read_timeout"] >= 2
    assert (counts["spool_delivered"], counts["spool_dead_lettered"], counts["spool_dropped"]) == (20, 0, 0)
    worker.close()


# ---------------------------------------------------------------- kill -9 while posting


@pytest.mark.parametrize("upload_format", UPLOAD_FORMATS)
def test_uploader_killed_while_posting_loses_nothing(
    tmp_path: Path, workdir: Path, procs: list, zctx: zmq.Context, upload_format: str
) -> None:
    # given an uploader in the middle of a post to a receiver that holds its answer
    port = reserve_port()
    hanging = Receiver.start(tmp_path, "--hang-s", "60", port=port)
    procs.append(hanging)
    cfg = http_config(workdir, hanging.url, upload_format=upload_format)
    u = launch_uploader(workdir, cfg, env=FAST_BACKOFF)
    procs.append(u)
    worker = TestWorker(u.run_dir, zctx)
    first = [make_upload(f"/bin/a{i}") for i in range(10)]
    worker.send(*first)
    worker.wait_acked()
    wait_for("a post in progress", lambda: "hanging 60 s before answering profile" in hanging.log())
    # when it is killed with -9, and more profiles are produced while it is gone
    u.kill()
    assert len(u.spooled()) == 10
    later = [make_upload(f"/bin/b{i}") for i in range(5)]
    worker.send(*later)
    worker.sender.poll(200)
    assert worker.sender.pending_profiles == 5  # the worker keeps what nobody acknowledged
    # and it starts again, with the receiver answering
    hanging.stop()
    receiver = Receiver.start(tmp_path, port=port)
    procs.append(receiver)
    u2 = launch_uploader(workdir, cfg, env=FAST_BACKOFF)
    procs.append(u2)
    # then the spooled ones and the later ones all arrive, once each
    worker.wait_acked()
    wait_for("15 profiles at the receiver", lambda: len(receiver.received()) == 15 and not u2.spooled())
    assert sorted(received_ids(receiver)) == sorted(agent_id(x.profile_id) for x in first + later)
    assert_each_received_once(receiver, {x.profile_id for x in first + later})
    assert [n for n in os.listdir(u2.spool_dir)] == []  # no partial file left either
    assert u2.stop() == 0
    assert u2.counters()["spool_delivered"] == 15  # the 10 it found spooled, and the 5 it was handed
    worker.close()


# ---------------------------------------------------------------- a spool on a tiny filesystem


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int) -> None:
    """Grow the file `path` until its filesystem has about `leave` bytes free (all of it: leave=0)."""
    with open(path, "ab") as f:
        while True:
            room = free_bytes(path.parent) - leave
            if room <= 0:
                return
            try:
                f.write(b"\0" * min(room, 64 << 10))
                f.flush()
            except OSError:
                return


@contextlib.contextmanager
def tiny_filesystem(path: Path) -> Iterator[None]:
    """A 1 MiB tmpfs on `path` (a new directory), the uploader's own (it runs as its own user), until
    the end of the with."""
    path.mkdir()
    uid, gid = stage_ids("uploader")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size=1m,mode=0700,uid={uid},gid={gid}", "tmpfs", str(path)], check=True
    )
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False)


def big(name: str) -> ProfileUpload:  # ~200 KB gzip: random bytes do not compress
    return make_upload(name, padding=os.urandom(100_000))


def refused_until_space_returns(u: UploaderProcess, worker: TestWorker, filler: Path) -> ProfileUpload:
    """When something else fills the filesystem, a profile cannot be spooled even with nothing to drop;
    when some space returns, it is spooled. The profile."""
    fill(filler, 0)
    refused = big("/bin/refused-first")
    worker.send(refused)

    def nacked() -> int:
        worker.sender.poll(20)
        return worker.sender.counts["nacked"]

    wait_for("a retry answer", nacked)
    assert worker.sender.pending_profiles == 1  # the worker keeps it
    log = u.log()
    # the log line is the feature: one line per episode says the disk is full and what happens
    assert "no space left for the spool" in log and "No space left on device" in log
    assert "nothing left to drop" in log and "the worker keeps it and offers it again" in log
    filler.unlink()
    fill(filler, 450 << 10)
    worker.wait_acked()
    assert refused.profile_id in spooled(u.spool_dir)
    return refused


def oldest_dropped(u: UploaderProcess, worker: TestWorker, refused: ProfileUpload) -> tuple[list[str], list[str]]:
    """When more profiles come than fit, the oldest are dropped, each counted and logged: (the ids
    dropped, the ids kept)."""
    rest = [big(f"/bin/p{i}") for i in range(4)]
    worker.send(*rest)
    worker.wait_acked()
    sent = [refused, *rest]
    drops = re.findall(
        r"dropped the oldest spooled profile id=(\w+) service='([^']+)' type=cpu "
        r"window=(\S+): no space left on the spool's filesystem \((\d+) dropped so far\)",
        u.log(),
    )
    assert drops, u.log()[-3000:]
    dropped = [d[0] for d in drops]
    order = [x.profile_id for x in sent]
    # oldest first, but for the one the sender may hold in flight (it is not dropped while sent)
    assert dropped == sorted(dropped, key=order.index)
    assert sum(1 for k in order[: order.index(dropped[-1])] if k not in dropped) <= 1
    assert [int(d[3]) for d in drops] == list(range(1, len(drops) + 1))
    assert all(d[2] == "2023-11-14T22:13:20Z+60s" for d in drops)
    kept = [k for k in order if k not in dropped]
    assert sorted(spooled(u.spool_dir)) == sorted(kept)
    return dropped, kept


def test_spool_on_a_tiny_filesystem_that_fills(tmp_path: Path, workdir: Path, procs: list, zctx: zmq.Context) -> None:
    require_root()
    state = workdir / "state"
    with tiny_filesystem(state):
        try:
            # given an uploader whose spool is on a 1 MiB tmpfs, with the backend down
            port = reserve_port()
            u = launch_uploader(
                workdir,
                http_config(workdir, f"http://127.0.0.1:{port}", spool_max_mb=64),
                state_dir=state,
                env=FAST_BACKOFF,
            )
            procs.append(u)
            worker = TestWorker(u.run_dir, zctx)
            filler = state / "filler"
            refused = refused_until_space_returns(u, worker, filler)
            dropped, kept = oldest_dropped(u, worker, refused)
            assert u.proc.poll() is None  # no crash
            # then, when space returns and the backend is up, uploads resume: the kept ones and new ones arrive
            filler.unlink()
            receiver = Receiver.start(tmp_path, port=port)
            procs.append(receiver)
            after = big("/bin/after")
            worker.send(after)
            worker.wait_acked()
            wait_for("the kept profiles and the new one", lambda: len(receiver.received()) == len(kept) + 1)
            assert sorted(receiver.received_ids()) == sorted([*kept, after.profile_id])
            assert u.stop() == 0
            counts = u.counters()
            assert counts["spool_dropped"] == len(dropped) and counts["spool_refused_no_space"] >= 1
            worker.close()
        finally:
            for p in procs:
                if isinstance(p, UploaderProcess):
                    p.kill()


# ---------------------------------------------------------------- a 400


def test_a_400_lands_in_the_dead_letter_directory_and_is_not_retried(
    tmp_path: Path, workdir: Path, procs: list, zctx: zmq.Context
) -> None:
    receiver = Receiver.start(tmp_path, "--reject-status", "400", "--reject-reason", "profile refused by test")
    procs.append(receiver)
    u = launch_uploader(workdir, http_config(workdir, receiver.url), env=FAST_BACKOFF)
    procs.append(u)
    worker = TestWorker(u.run_dir, zctx)
    upload = make_upload("/bin/refused")
    worker.send(upload)
    worker.wait_acked()
    record = wait_for("the dead letter", lambda: list(u.dead_letter_dir.glob("*.json")))[0]
    meta = json.loads(record.read_text())
    assert meta["id"] == upload.profile_id and meta["status"] == 400
    assert meta["reason"] == "HTTP 400 'profile refused by test'" and meta["attempts"] == 1
    assert record.with_suffix(".pb.gz").read_bytes() == upload.pprof_gz
    assert not u.spooled()
    # a stop makes a final attempt at what is spooled: nothing is, so the receiver saw one post only
    assert u.stop() == 0
    counts = u.counters()
    assert counts["refused"] == 1  # one attempt, refused: not retried, not even by the final attempt
    assert receiver.received() == []
    assert (counts["spool_delivered"], counts["spool_dead_lettered"], counts["spool_dropped"]) == (0, 1, 0)
    worker.close()


# ---------------------------------------------------------------- collector and symbolizer restarts


def window_start_ns(text: str) -> int:
    """ "2026-11-29T16:53:20Z+2s" → unix ns of the start."""
    return (
        int(datetime.strptime(text.split("Z", maxsplit=1)[0], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp())
        * 1_000_000_000
    )


def kill_and_wait_restart(pipeline: Pipeline, stage: str) -> tuple[int, int]:
    """kill -9 `stage`; (time of the kill, time it is ready again), unix ns."""
    old = stage_pid(pipeline.run_dir, stage)
    assert old
    killed_at = time.time_ns()
    os.kill(old, signal.SIGKILL)
    wait_for(
        f"{stage} to be restarted",
        lambda: stage_pid(pipeline.run_dir, stage) not in (0, old),
        timeout=PIPELINE_DEADLINE_S,
    )
    return killed_at, time.time_ns()


def test_collector_or_symbolizer_restart_loses_at_most_the_window_in_progress(
    tmp_path: Path, workload: subprocess.Popen, procs: list
) -> None:
    require_root()
    receiver = Receiver.start(tmp_path)
    procs.append(receiver)
    pipeline = Pipeline(tmp_path, pipeline_config(tmp_path, receiver.url))
    procs.append(pipeline)
    assert isinstance(workload.args, list)
    hot = str(Path(workload.args[0]).resolve())
    w = WINDOW_S * 1_000_000_000
    grace = int(WINDOW_GRACE_S * 1e9)

    def hot_windows() -> set[int]:
        return {m["start"] for m in receiver.received() if m["service"] == hot and m["type"] == "cpu"}

    # given three windows of the workload received
    wait_for("three windows of the workload", lambda: len(hot_windows()) >= 3, timeout=PIPELINE_DEADLINE_S)
    # when the symbolizer worker is killed with -9, and later the collector
    worker_kill = kill_and_wait_restart(pipeline, "symbolizer-0")
    seen = len(hot_windows())
    wait_for("two more windows", lambda: len(hot_windows()) >= seen + 2, timeout=PIPELINE_DEADLINE_S)
    collector_kill = kill_and_wait_restart(pipeline, "collector")
    seen = len(hot_windows())
    wait_for("two more windows", lambda: len(hot_windows()) >= seen + 2, timeout=PIPELINE_DEADLINE_S)
    assert pipeline.stop() == 0
    log = pipeline.log()
    assert pipeline.exits() == {"symbolizer-0": 1, "collector": 1}  # each restarted by `run`, once
    # then every profile a worker handed over arrived once, but what the killed worker had not yet
    # had acknowledged, which must be of a window open when it died
    made = produced(log)
    got = set(receiver.received_ids())
    lost = [p for p in made if p.profile_id not in got]
    for p in lost:
        start = window_start_ns(p.window)
        assert start <= worker_kill[0] < start + w + grace, f"lost a profile of a closed window: {p}"
    assert_each_received_once(receiver, {p.profile_id for p in made} - {p.profile_id for p in lost})
    # and the workload's windows are all there, but those open at a kill or while a stage was down
    have = hot_windows()
    first, last = min(have), max(have)
    allowed = set()
    for killed_at, ready_at, held_before in ((*worker_kill, grace), (*collector_kill, 1_500_000_000)):
        # the worker holds windows until end + grace; the collector holds at most one drain (1 s)
        allowed |= {s for s in range(first, last + w, w) if s + w + held_before > killed_at and s <= ready_at}
    missing = set(range(first, last + w, w)) - have
    assert missing <= allowed, f"windows missing beyond those in progress: {sorted(missing - allowed)}"
    assert len(missing) <= len(allowed)


# ---------------------------------------------------------------- a backend that trickles its reply


def test_a_backend_trickling_its_reply_is_given_up_at_the_deadline_and_the_profile_stays_spooled(
    tmp_path: Path, workdir: Path, procs: list, zctx: zmq.Context
) -> None:
    """Issue 40, case 10: a 200's headers, then a byte every 0.3 s forever, never trip the 1-s read timeout."""
    from shared import counters
    from tests.unit.test_upload_deadline import SlowBackend
    from uploader.http import request_deadline_s

    backend = SlowBackend("reply")
    try:
        # given an uploader with a 1-s read timeout (deadline 9 s) posting to that backend
        u = launch_uploader(workdir, http_config(workdir, backend.url, upload_timeout_s=1), env=FAST_BACKOFF)
        procs.append(u)
        worker = TestWorker(u.run_dir, zctx)
        upload = make_upload("/usr/bin/slow")
        worker.send(upload)
        worker.wait_acked()
        start = time.monotonic()
        # when it posts, then the attempt is given up at the deadline, logged with its cause
        deadline_s = request_deadline_s(1)
        wait_for("the deadline", lambda: "over the request deadline" in u.log(), timeout=deadline_s + 20)
        assert time.monotonic() - start <= deadline_s + 10
        # and the profile stays in the spool, and the uploader's counters say why
        assert len(u.spooled()) == 1
        wait_for(
            "the counter",
            lambda: counters.read_all(str(u.run_dir)).get("uploader", {}).get("deadline", 0) >= 1,
            timeout=10,
        )
        assert u.stop() == 0
        assert len(u.spooled()) == 1
        worker.close()
    finally:
        backend.stop()
