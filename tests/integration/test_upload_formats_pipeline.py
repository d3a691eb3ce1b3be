"""The pipeline on a real workload, exporting to the other backends (issue 22): OTLP profiles and Pyroscope.

Given `ebpfprofiler run` with upload_format otlp posting to a port where the
reference receiver is not up yet, the worker's gzip pprof of each window waits
in the uploader's spool: the test reads it there, then starts the receiver.
What the receiver stored is decoded with opentelemetry-proto's classes and
must match that pprof value for value (samples, stacks with function names and
build ids, attributes), the build id being the one `readelf -n` reads from the
workload. With upload_format pyroscope, `go tool pprof` reads the stored body
and the series name parses back to the service and our labels.
"""

from __future__ import annotations

import re
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as service_pb

from receiver.pyroscope import parse_name
from shared import pprof
from shared.config import ProfilerConfig
from shared.wire import ProfileUpload
from tests.harness import Pipeline, Receiver, require_root, reserve_port, wait_for
from tests.otlp_check import otlp_samples, pprof_samples
from uploader.spool import SpoolFormatError, decode_file

WINDOW_S = 2
SAMPLE_HZ = 49
DEADLINE_S = 90
HOT_STACK = ("main", "top", "mid", "leaf")


@pytest.fixture
def hot(build: Callable[..., Path], started: list[subprocess.Popen]) -> subprocess.Popen:
    """A CPU-bound process (main → top → mid → leaf) for the whole test."""
    p = subprocess.Popen([str(build("hot")), "600"], stdout=subprocess.DEVNULL)
    started.append(p)
    return p


def gnu_build_id(path: str) -> str:
    out = subprocess.run(["readelf", "-n", path], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert m, f"{path} has no GNU build id"
    return m[1]


def spool_dir(pipeline: Pipeline) -> Path:
    m = re.search(r"through the spool (\S+) \(cap", pipeline.log())
    assert m, "the uploader did not say where its spool is"
    return Path(m[1])


def spooled(spool: Path) -> dict[str, ProfileUpload]:
    out = {}
    for p in spool.glob("*.prof"):
        try:
            u = decode_file(p.read_bytes())
        except (FileNotFoundError, SpoolFormatError):
            continue
        out[u.profile_id] = u
    return out


def config(tmp_path: Path, url: str, upload_format: str) -> ProfilerConfig:
    return ProfilerConfig(
        sample_hz=SAMPLE_HZ,
        upload_interval_s=WINDOW_S,
        endpoint=url,
        plain_pid=True,
        local_dir=str(tmp_path / "unused"),
        python_stacks=False,
        upload_format=upload_format,
    )


def test_an_otlp_export_of_a_real_window_matches_its_pprof_value_for_value(
    tmp_path: Path, hot: subprocess.Popen, procs: list
) -> None:
    require_root()
    assert isinstance(hot.args, list)
    exe = str(Path(hot.args[0]).resolve())
    build_id = gnu_build_id(exe)
    # given the pipeline exporting OTLP to a port where nobody listens yet
    port = reserve_port()
    pipeline = Pipeline(tmp_path, config(tmp_path, f"http://127.0.0.1:{port}", "otlp"))
    procs.append(pipeline)
    spool = spool_dir(pipeline)
    # when two cpu windows of the workload wait in the spool, the pprof of each is read there
    windows = wait_for(
        "two cpu windows of the workload in the spool",
        lambda: (
            w
            if len(w := [u for u in spooled(spool).values() if u.service == exe and u.profile_type == "cpu"]) >= 2
            else None
        ),
        timeout=DEADLINE_S,
    )
    # and the receiver comes up
    receiver = Receiver.start(tmp_path, port=port)
    procs.append(receiver)
    want = {uuid.UUID(u.profile_id).hex: u for u in windows}
    wait_for(
        "those windows at the receiver", lambda: set(want) <= {m["id"] for m in receiver.received()}, timeout=DEADLINE_S
    )
    assert pipeline.stop() == 0
    hostname = socket.gethostname()
    for meta in receiver.received():
        if meta["id"] not in want:
            continue
        upload = want[meta["id"]]
        assert meta["format"] == "otlp" and meta["path"].endswith(".otlp.pb")
        # then the stored body decodes with opentelemetry-proto's classes
        req = service_pb.ExportProfilesServiceRequest.FromString(Path(meta["path"]).read_bytes())
        rows, types, resources = otlp_samples(req)
        profile = pprof.read(upload.pprof_gz)
        # and its samples, stacks and attributes are the pprof's, value for value
        assert rows == pprof_samples(profile)
        assert types == list(profile.sample_types) == [("samples", "count"), ("cpu", "nanoseconds")]
        assert sum(r[2][0] for r in rows) == profile.total("samples") > 0
        # with the semantic conventions' resource attributes of the workload's process
        [res] = resources  # one process in this service
        assert res["service.name"] == exe and res["host.name"] == hostname == upload.host
        assert res["process.executable.path"] == exe and res["process.executable.name"] == Path(exe).name
        assert res["process.pid"] == hot.pid
        # and the hot stack with its function names and the binary's build id
        stacks = [r[1] for r in rows]
        hot_frames = [f for s in stacks for f in s if tuple(x[0] for x in s[-4:]) == HOT_STACK]
        assert hot_frames, f"no {'→'.join(HOT_STACK)} stack in {[[x[0] for x in s] for s in stacks][:5]}"
        assert {f[3] for f in hot_frames if f[2] == exe} == {build_id}
        ps = [p for rp in req.resource_profiles for sp in rp.scope_profiles for p in sp.profiles]
        assert {(p.time_unix_nano, p.duration_nano) for p in ps} == {(profile.time_ns, profile.duration_ns)}


def test_a_pyroscope_push_of_a_real_window_reads_back_with_its_name_and_labels(
    tmp_path: Path, hot: subprocess.Popen, procs: list
) -> None:
    require_root()
    assert isinstance(hot.args, list)
    exe = str(Path(hot.args[0]).resolve())
    receiver = Receiver.start(tmp_path)
    procs.append(receiver)
    pipeline = Pipeline(tmp_path, config(tmp_path, receiver.url, "pyroscope"))
    procs.append(pipeline)
    [meta] = wait_for(
        "a cpu window of the workload",
        lambda: [m for m in receiver.received() if m["service"] == exe and m["type"] == "cpu"][:1],
        timeout=DEADLINE_S,
    )
    assert pipeline.stop() == 0
    # the series name parses back to the service and our labels
    app, labels = parse_name(meta["name"])
    assert app == exe
    assert labels == {"profile_type": "cpu", "host": socket.gethostname(), "process_executable": exe}
    assert meta["end"] - meta["start"] == WINDOW_S * 10**9
    # and go tool pprof reads the body: the hot stack, and the per-process labels in the samples
    out = subprocess.run(
        ["go", "tool", "pprof", "-traces", meta["path"]], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert re.search(r"leaf\n\s+mid\n\s+top\n\s+main", out), out[:2000]
    assert re.search(rf"pid:\s*\[?{hot.pid}\]?\n", out), out[:2000]
