"""The upload formats (issue 22): OTLP profiles and Pyroscope's /ingest, from the uploader to the reference receiver.

Real uploader processes fed over their real socket post to the reference
receiver on 127.0.0.1; what it stored is decoded with opentelemetry-proto's
classes (OTLP) or read by `go tool pprof` (Pyroscope) and compared with the
pprof the worker handed over, value for value. The pipeline on a real workload
is tests/integration/test_upload_formats_pipeline.py's.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import threading
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
import zmq
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as service_pb

from receiver import otlp as receiver_otlp
from receiver.pyroscope import parse_name
from receiver.server import Faults, make_server
from receiver.store import list_profiles
from shared import pprof, remote_config
from shared.config import ConfigError, ProfilerConfig, from_mapping
from shared.pprof import ProfileBuilder
from shared.wire import ProfileUpload
from tests.harness import (
    DEADLINE_S,
    FAST_BACKOFF,
    START_NS,
    Receiver,
    TestWorker,
    UploaderProcess,
    http_config,
    wait_for,
)
from tests.otlp_check import otlp_samples, pprof_samples
from uploader import format_otlp, formats

CONTAINER = "3f2a9c0d1e2b" * 5 + "abcd"
POD = "0b7d2f8e-1c3a-4e5f-9a6b-7c8d9e0f1a2b"


def window_profile(*, plain_pid: bool, profile_type: str = "cpu") -> ProfileUpload:
    """A profile shaped like the symbolizer's: two processes of one container, build ids, an unsymbolized frame."""
    b = ProfileBuilder(
        [("samples", "count"), ("cpu", "nanoseconds")],
        ("cpu", "nanoseconds"),
        period=10_101_010,
        time_ns=START_NS,
        duration_ns=5_000_000_000,
    )
    app = b.mapping(("/srv/app", "aa11"), "/srv/app", "aa11bb22cc33", memory_limit=1 << 48, has_functions=True)
    libc = b.mapping(("/usr/lib/libc.so.6", "dd44"), "/usr/lib/libc.so.6", "dd44ee55", memory_limit=1 << 48)
    kernel = b.mapping("[kernel]", "[kernel]")
    main = b.location("main", app, 0x1130, [b.function("main")])
    work = b.location("work", app, 0x1180, [b.function("work")])
    memcpy = b.location("memcpy", libc, 0x9A0C0, [b.function("__memcpy_avx")])
    anon = b.location("anon", libc, 0x12345)  # no symbol: address and build id only
    sched = b.location("k", kernel, 0xFFFFFFFF81000000, [b.function("schedule")])
    for pid, rows in ((101, [((memcpy, work, main), 7), ((anon, main), 2)]), (202, [((sched, work, main), 3)])):
        labels = {
            "host": "web-1",
            "container": CONTAINER,
            "k8s.pod": POD,
            "process.executable": "/srv/app",
            "pid": str(pid) if plain_pid else f"{pid:016x}",
        }
        if pid == 202:
            labels["process.command_line"] = "/srv/app --serve"
        for locs, n in rows:
            b.sample(list(locs), [n, n * 10_101_010], labels)
    return ProfileUpload(
        profile_id=str(uuid.uuid4()),
        host="web-1",
        service=CONTAINER,
        profile_type=profile_type,
        window_start_ns=START_NS,
        window_end_ns=START_NS + 5_000_000_000,
        samples=3,
        pprof_gz=b.gzipped(),
    )


@pytest.fixture
def worker(workdir: Path, zctx: zmq.Context) -> Iterator[TestWorker]:
    w = TestWorker(workdir / "run", zctx)
    try:
        yield w
    finally:
        w.close()


def serve(directory: Path, faults: Faults | None = None) -> Iterator[tuple[str, Path]]:
    server = make_server("127.0.0.1:0", str(directory), faults or Faults())
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.url, directory
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE_S)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    yield from serve(tmp_path / "store")


# ---------------------------------------------------------------- config


def test_upload_format_is_validated_with_a_clear_error() -> None:
    assert ProfilerConfig().upload_format == "pprof"
    with pytest.raises(ConfigError) as e:
        from_mapping({"upload_format": "zipkin"}, source="agent.yaml")
    assert str(e.value) == (
        "agent.yaml: modules.ebpf_profiler.upload_format = 'zipkin' is not allowed; expected one "
        "of ['pprof', 'otlp', 'pyroscope'] (pprof: our POST /v1/profiles; otlp: OTLP/HTTP profiles "
        "to an OpenTelemetry Collector; pyroscope: Pyroscope's POST /ingest)"
    )
    with pytest.raises(ConfigError, match="remote_config_url = 'ftp://x' is not allowed"):
        from_mapping({"remote_config_url": "ftp://x"})


def test_remote_config_is_ours_and_off_for_other_backends_unless_a_url_is_set() -> None:
    base = ProfilerConfig(endpoint="https://collector:4318/")
    assert base.agent_config_url == "https://collector:4318/v1/agent-config"
    assert base.replace(upload_format="otlp").agent_config_url == ""
    assert base.replace(upload_format="pyroscope").agent_config_url == ""
    ours = "https://profiles.example/v1/agent-config"
    assert base.replace(upload_format="otlp", remote_config_url=ours).agent_config_url == ours
    assert ProfilerConfig(remote_config_url=ours).agent_config_url == ""  # local_dir: no backend at all


# ---------------------------------------------------------------- OTLP conversion


@pytest.mark.parametrize("plain_pid", [False, True], ids=["hashed-pid", "plain-pid"])
def test_otlp_conversion_keeps_every_sample_stack_and_attribute(plain_pid: bool) -> None:
    upload = window_profile(plain_pid=plain_pid)
    req = format_otlp.convert(upload, plain_pid=plain_pid)
    # it decodes with the package's classes and passes the receiver's index checks
    decoded = receiver_otlp.decode(req.SerializeToString())
    rows, types, resources = otlp_samples(decoded)
    assert rows == pprof_samples(pprof.read(upload.pprof_gz))
    assert types == [("samples", "count"), ("cpu", "nanoseconds")]
    assert len(resources) == 2  # one per process
    for res in resources:
        assert res["service.name"] == CONTAINER and res["host.name"] == "web-1"
        assert res["container.id"] == CONTAINER and res["k8s.pod.uid"] == POD
        assert res["process.executable.name"] == "app" and res["process.executable.path"] == "/srv/app"
        if plain_pid:
            assert isinstance(res["process.pid"], int) and "ebpfprofiler.pid_hash" not in res
        else:
            assert "process.pid" not in res and len(res["ebpfprofiler.pid_hash"]) == 16
    assert {r.get("process.command_line") for r in resources} == {None, "/srv/app --serve"}
    # ids: the first is ours; all are distinct, 16 bytes
    ids = [p.profile_id for rp in decoded.resource_profiles for sp in rp.scope_profiles for p in sp.profiles]
    assert ids[0] == uuid.UUID(upload.profile_id).bytes and len(set(ids)) == len(ids) == 4
    p0 = decoded.resource_profiles[0].scope_profiles[0].profiles[0]
    assert (p0.time_unix_nano, p0.duration_nano, p0.period) == (START_NS, 5_000_000_000, 10_101_010)
    # a retry is the same request, byte for byte
    fmt = format_otlp.OtlpFormat(plain_pid)
    assert fmt.request(upload).body == fmt.request(upload).body


def test_a_profile_that_is_not_pprof_is_a_format_error_not_a_retry() -> None:
    bad = ProfileUpload("x1", "h", "s", "cpu", 0, 1, 0, gzip.compress(b"not a profile"))
    for name in ("otlp", "pyroscope"):
        with pytest.raises(formats.FormatError, match="not a valid gzip pprof"):
            formats.for_config(ProfilerConfig(upload_format=name)).request(bad)


# ---------------------------------------------------------------- uploader → receiver


def test_otlp_upload_is_stored_once_and_decodes_to_the_same_profile(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, receiver: tuple[str, Path]
) -> None:
    url, store = receiver
    u = start_uploader(http_config(workdir, url, upload_format="otlp"), env=FAST_BACKOFF)
    wait_for(
        "the start-up line",
        lambda: f"profiles go to the endpoint {url}/v1development/profiles (upload_format otlp)" in u.log(),
    )
    # the log line is the feature: the start says that remote config is off, and why
    assert "remote config: off (upload_format otlp" in u.log()
    upload = window_profile(plain_pid=False)
    worker.send(upload, upload)  # the same profile twice (a worker's resend): stored once
    worker.wait_acked()
    wait_for("the OTLP profile", lambda: list_profiles(str(store)) and not u.spooled())
    [meta] = list_profiles(str(store))
    assert meta["id"] == uuid.UUID(upload.profile_id).hex and meta["format"] == "otlp"
    assert (meta["service"], meta["host"], meta["type"]) == (CONTAINER, "web-1", "cpu")
    assert (meta["start"], meta["end"], meta["samples"]) == (START_NS, START_NS + 5_000_000_000, 3)
    req = service_pb.ExportProfilesServiceRequest.FromString(Path(meta["path"]).read_bytes())
    assert otlp_samples(req)[0] == pprof_samples(pprof.read(upload.pprof_gz))
    assert u.stop() == 0


def test_otlp_partial_success_is_logged_and_counted_not_retried(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, tmp_path: Path
) -> None:
    for url, store in serve(tmp_path / "store", Faults(partial_reject="profiles signal disabled by test")):
        u = start_uploader(http_config(workdir, url, upload_format="otlp"), env=FAST_BACKOFF)
        worker.send(window_profile(plain_pid=False))
        worker.wait_acked()
        wait_for("the spool to empty", lambda: not u.spooled())
        assert u.stop() == 0
        # the log line is the feature: the backend's reason for the rejection, which nothing else keeps
        assert "rejected 4 profile(s) of it: 'profiles signal disabled by test' (not retried" in u.log()
        counts = u.counters()
        assert (counts["spool_delivered"], counts["spool_dead_lettered"], counts["spool_dropped"]) == (1, 0, 0)
        assert counts["rejected_in_2xx"] == 4
        assert list_profiles(str(store)) == []


def test_pyroscope_upload_names_the_series_and_go_tool_pprof_reads_it(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], worker: TestWorker, receiver: tuple[str, Path]
) -> None:
    url, store = receiver
    u = start_uploader(http_config(workdir, url, upload_format="pyroscope"), env=FAST_BACKOFF)
    wait_for("the start-up line", lambda: f"{url}/ingest (upload_format pyroscope)" in u.log())
    cpu, off = window_profile(plain_pid=False), window_profile(plain_pid=False, profile_type="offcpu")
    worker.send(cpu, off, cpu)
    worker.wait_acked()
    wait_for("two profiles", lambda: len(list_profiles(str(store))) == 2 and not u.spooled())
    got = {m["type"]: m for m in list_profiles(str(store))}
    for upload in (cpu, off):
        meta = got[upload.profile_type]
        app, labels = parse_name(meta["name"])
        assert app == CONTAINER
        # per-process labels (pid) differ between the samples: they stay in the body, not the series name
        assert labels == {
            "profile_type": upload.profile_type,
            "host": "web-1",
            "container": CONTAINER,
            "k8s_pod": POD,
            "process_executable": "/srv/app",
        }
        assert (meta["start"], meta["end"]) == (START_NS, START_NS + 5_000_000_000)
        assert Path(meta["path"]).read_bytes() == upload.pprof_gz
        out = subprocess.run(
            ["go", "tool", "pprof", "-raw", meta["path"]], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        assert "samples/count cpu/nanoseconds" in out and "__memcpy_avx" in out and "schedule" in out
        tags = subprocess.run(
            ["go", "tool", "pprof", "-tags", meta["path"]], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        assert f"{POD}" in tags and "/srv/app" in tags
    assert u.stop() == 0


# ---------------------------------------------------------------- the receiver refuses what does not decode


def test_the_receiver_refuses_otlp_and_pyroscope_bodies_that_do_not_decode(receiver: tuple[str, Path]) -> None:
    url, store = receiver
    otlp = url + format_otlp.PATH
    good = format_otlp.convert(window_profile(plain_pid=False), plain_pid=False)
    proto = {"Content-Type": "application/x-protobuf"}

    def post(target: str, body: bytes, headers: dict[str, str], **params: str) -> tuple[int, str]:
        r = requests.post(target, data=body, headers=headers, params=params, timeout=DEADLINE_S)
        return r.status_code, r.text

    assert post(otlp, b"\xff\xff\xff", proto)[0] == 400
    assert post(otlp, good.SerializeToString(), {"Content-Type": "application/json"})[0] == 415
    bad_index = service_pb.ExportProfilesServiceRequest()
    bad_index.CopyFrom(good)
    bad_index.resource_profiles[0].scope_profiles[0].profiles[0].samples[0].stack_index = 999
    status, text = post(otlp, bad_index.SerializeToString(), proto)
    assert status == 400 and "sample stack index 999 outside its table" in text
    no_id = service_pb.ExportProfilesServiceRequest()
    no_id.CopyFrom(good)
    no_id.resource_profiles[0].scope_profiles[0].profiles[0].profile_id = b""
    assert post(otlp, no_id.SerializeToString(), proto)[0] == 400
    z, chunk = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), b"\0" * (1 << 20)
    bomb = b"".join(z.compress(chunk) for _ in range((pprof.MAX_DECOMPRESSED_BYTES >> 20) + 1)) + z.flush()
    status, text = post(otlp, bomb, {**proto, "Content-Encoding": "gzip"})
    assert status == 400 and "larger than" in text
    ingest = url + "/ingest"
    upload = window_profile(plain_pid=False)
    octet = {"Content-Type": "application/octet-stream"}
    assert post(ingest, b"not gzip", octet, name="app{a=b}", **{"from": "1", "until": "2"}, format="pprof")[0] == 400
    assert post(ingest, upload.pprof_gz, octet, name="app{a=b}", **{"from": "1", "until": "2"}, format="jfr")[0] == 415
    assert post(ingest, upload.pprof_gz, octet, name="app{a}", **{"from": "1", "until": "2"}, format="pprof")[0] == 400
    assert post(ingest, upload.pprof_gz, octet, name="app", **{"from": "2", "until": "1"}, format="pprof")[0] == 400
    assert list_profiles(str(store)) == []
    # and the good ones are stored, each once
    assert post(otlp, good.SerializeToString(), proto)[0] == 200
    assert post(otlp, good.SerializeToString(), proto)[0] == 200
    assert (
        post(ingest, upload.pprof_gz, octet, name="app{a=b}", **{"from": "1", "until": "2"}, format="pprof")[0] == 200
    )
    assert (
        post(ingest, upload.pprof_gz, octet, name="app{a=b}", **{"from": "1", "until": "2"}, format="pprof")[0] == 200
    )
    assert sorted(m["format"] for m in list_profiles(str(store))) == ["otlp", "pyroscope"]


def test_with_otlp_remote_config_comes_only_from_remote_config_url(
    workdir: Path, start_uploader: Callable[..., UploaderProcess], procs: list, tmp_path: Path
) -> None:
    # given our receiver serving an agent config that pauses profiling, and a collector elsewhere
    document = workdir / "agent-config.json"
    document.write_text(json.dumps({"modules": {"ebpf_profiler": {"enabled": False}}}))
    ours = Receiver.start(workdir, "--agent-config", str(document), name="ours")
    procs.append(ours)
    for collector_url, _ in serve(tmp_path / "collector"):
        target = workdir / "run" / remote_config.FILE_NAME
        # when the uploader exports OTLP with remote_config_url set, the overrides come from it
        u = start_uploader(
            http_config(workdir, collector_url, upload_format="otlp", remote_config_url=ours.url + "/v1/agent-config")
        )
        wait_for("the overrides file", target.exists, DEADLINE_S)
        assert json.loads(target.read_text()) == {"enabled": False}
        assert u.stop() == 0
        # and without it remote config is off: the overrides of the earlier run are removed
        u2 = start_uploader(http_config(workdir, collector_url, upload_format="otlp"), name="uploader-2")
        wait_for("remote config off", lambda: "remote config: off (upload_format otlp" in u2.log())
        assert not target.exists()
        assert u2.stop() == 0
