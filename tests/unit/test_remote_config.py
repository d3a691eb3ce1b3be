"""Remote config (issue 4): the backend may set only `enabled` and `upload_interval_s`.

parse() keeps those two (when their values pass the config's rules) and refuses everything else;
the overrides file is read as untrusted input (a bad one means the local config, logged); the
uploader's fetcher, against the reference receiver over real HTTP on 127.0.0.1, logs each refusal
once, each change once, a failed fetch once per episode, and writes the file only on a change; a
worker's windows change length at once.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from shared import remote_config as rc
from shared import stopping
from shared.config import ProfilerConfig
from shared.window import Windows
from tests.harness import DEADLINE_S, ListHandler, Receiver, give, http_config, reserve_port, stage_ids, wait_for
from uploader.http import MAX_AGENT_CONFIG_BYTES, HttpClient
from uploader.remote import RemoteConfigFetcher

S = 1_000_000_000
LOCAL = ProfilerConfig(sample_hz=19, upload_interval_s=60)


def doc(**block: Any) -> dict[str, Any]:
    return {"modules": {"ebpf_profiler": block}}


# ------------------------------------------------------------ parse


def test_enabled_and_upload_interval_are_accepted() -> None:
    overrides, refused = rc.parse(doc(enabled=False, upload_interval_s=10))
    assert overrides == {"enabled": False, "upload_interval_s": 10} and refused == []
    cfg = rc.effective(LOCAL, overrides)
    assert (cfg.enabled, cfg.upload_interval_s, cfg.sample_hz) == (False, 10, 19)


def test_sample_hz_is_refused_and_the_local_value_stays() -> None:
    overrides, refused = rc.parse(doc(sample_hz=99, upload_interval_s=4))
    assert overrides == {"upload_interval_s": 4}
    assert [(r.key, r.value) for r in refused] == [("sample_hz", 99)]
    assert refused[0].describe(LOCAL) == (
        "remote config: refused modules.ebpf_profiler.sample_hz = 99: remote config may set only enabled, "
        "upload_interval_s; the local value 19 stays"
    )
    assert rc.effective(LOCAL, overrides).sample_hz == 19


def test_remote_enabled_cannot_turn_on_a_locally_disabled_agent() -> None:
    off = ProfilerConfig(enabled=False)
    overrides, _ = rc.parse(doc(enabled=True, upload_interval_s=5))
    cfg = rc.effective(off, overrides)
    assert (cfg.enabled, cfg.upload_interval_s) == (False, 5)
    assert rc.without_effect(off, overrides) and not rc.without_effect(LOCAL, overrides)
    assert rc.effective(LOCAL, {"enabled": False}).enabled is False


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("endpoint", "http://evil.example", "remote config may set only enabled, upload_interval_s"),
        ("strip_process_args", False, "remote config may set only"),
        ("colour", "red", "not a config key"),
        ("upload_interval_s", 0, "expected an integer from 1 to 3600"),
        ("upload_interval_s", "4", "expected an integer from 1 to 3600"),
        ("upload_interval_s", 4.0, "expected an integer"),
        ("upload_interval_s", True, "expected an integer"),
        ("enabled", "no", "expected true or false"),
        ("enabled", 0, "expected true or false"),
    ],
)
def test_other_keys_and_bad_values_are_refused(key: str, value: Any, words: str) -> None:
    overrides, refused = rc.parse(doc(**{key: value}))
    assert overrides == {}
    assert len(refused) == 1 and refused[0].key == key and words in refused[0].describe(LOCAL)
    assert rc.effective(LOCAL, overrides) == LOCAL


@pytest.mark.parametrize(
    "document",
    [
        None,
        {},
        {"modules": {}},
        {"modules": {"ebpf_profiler": None}},
        doc(),
        {"modules": {"other_agent": {"sample_hz": 5}}},
    ],
)
def test_no_block_means_no_overrides(document: Any) -> None:
    assert rc.parse(document) == ({}, [])


@pytest.mark.parametrize(
    "document",
    [
        [],
        "enabled",
        {"modules": []},
        {"modules": {"ebpf_profiler": [1]}},
        doc(**{f"k{i}": i for i in range(rc.MAX_BLOCK_KEYS + 1)}),
    ],
)
def test_a_document_of_the_wrong_shape_is_not_an_agent_config(document: Any) -> None:
    with pytest.raises(rc.AgentConfigError):
        rc.parse(document)


def test_a_long_refused_value_is_cut_in_the_log_line() -> None:
    _, refused = rc.parse(doc(endpoint="x" * 10_000))
    assert len(refused[0].describe(LOCAL)) < 400


# ------------------------------------------------------------ the overrides file


@pytest.fixture
def logs() -> Iterator[tuple[logging.Logger, ListHandler]]:
    handler = ListHandler()
    logger = logging.getLogger(f"test-remote-config-{id(handler)}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, handler
    logger.removeHandler(handler)


def test_overrides_round_trip_group_readable_and_empty_removes(tmp_path: Path) -> None:
    rc.write_overrides(str(tmp_path), {"upload_interval_s": 4, "enabled": True})
    f = tmp_path / rc.FILE_NAME
    assert stat.S_IMODE(f.stat().st_mode) == rc.FILE_MODE
    assert json.loads(f.read_text()) == {"enabled": True, "upload_interval_s": 4}
    assert rc.read_overrides(str(tmp_path)) == {"enabled": True, "upload_interval_s": 4}
    assert sorted(os.listdir(tmp_path)) == [rc.FILE_NAME]  # no temporary file left
    rc.write_overrides(str(tmp_path), {})
    assert not f.exists() and rc.read_overrides(str(tmp_path)) == {}


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("not JSON", b"{enabled: false", "not JSON"),
        ("oversized", b'{"enabled": false' + b" " * rc.MAX_OVERRIDES_BYTES + b"}", "larger than"),
        ("a list", b"[1, 2]", "not a JSON object"),
        ("a refused key", b'{"sample_hz": 99}', "sample_hz = 99"),
        ("a bad value", b'{"upload_interval_s": -1}', "upload_interval_s = -1"),
        ("binary", b"\xff\xfe\x00", "not JSON"),
    ],
)
def test_a_bad_overrides_file_means_the_local_config_and_is_logged(
    tmp_path: Path, logs: tuple[logging.Logger, ListHandler], name: str, content: bytes, words: str
) -> None:
    logger, handler = logs
    (tmp_path / rc.FILE_NAME).write_bytes(content)
    assert rc.read_overrides(str(tmp_path), logger) == {}, name
    # the log line is the feature: an ignored overrides file changes nothing else; the line says why
    assert "ignoring the overrides file" in handler.text() and words in handler.text(), handler.text()


def test_a_symlink_a_fifo_and_a_stranger_s_file_are_not_followed(
    tmp_path: Path, logs: tuple[logging.Logger, ListHandler]
) -> None:
    logger, handler = logs
    real = tmp_path / "elsewhere.json"
    real.write_text('{"enabled": false}')
    target = tmp_path / rc.FILE_NAME
    target.symlink_to(real)
    # the log line is the feature: each refusal below leaves the local config; only the line says which file and why
    assert rc.read_overrides(str(tmp_path), logger) == {} and "a symlink" in handler.text()
    target.unlink()
    os.mkfifo(target)
    # a FIFO with no writer would block a plain open(); the reader must not hang on it
    result: list[dict] = []
    t = threading.Thread(target=lambda: result.append(rc.read_overrides(str(tmp_path), logger)), daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert result == [{}] and "not a regular file" in handler.text()
    target.unlink()
    target.write_text('{"enabled": false}')
    assert rc.read_overrides(str(tmp_path), logger, writers={os.geteuid() + 12345}) == {}
    assert "not to the uploader's user" in handler.text()


def test_the_watcher_rereads_only_on_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: tuple[logging.Logger, ListHandler]
) -> None:
    reads: list[str] = []
    real = rc.read_overrides

    def counted(*a: Any, **k: Any) -> dict[str, Any]:
        reads.append("r")
        return real(*a, **k)

    monkeypatch.setattr(rc, "read_overrides", counted)
    w = rc.Watcher(str(tmp_path), logs[0])
    assert not w.check() and w.overrides == {} and reads == []  # no file: nothing to read
    rc.write_overrides(str(tmp_path), {"enabled": False})
    assert w.check() and w.overrides == {"enabled": False}
    assert not w.check() and not w.check() and len(reads) == 1  # unchanged: one stat each, no read
    rc.write_overrides(str(tmp_path), {"enabled": False})  # rewritten, same content
    assert not w.check() and len(reads) == 2
    (tmp_path / rc.FILE_NAME).write_text("garbage")
    assert w.check() and w.overrides == {}  # bad file: the local config
    rc.write_overrides(str(tmp_path), {})
    assert not w.check() and w.overrides == {}


def test_without_remote_config_the_watcher_reads_nothing_and_lets_the_stage_sleep(tmp_path: Path) -> None:
    # local_dir (the shipped default) or a backend that serves no agent config: nothing writes the
    # file, and one an earlier run left behind is not followed
    assert ProfilerConfig().agent_config_url == ""
    rc.write_overrides(str(tmp_path), {"enabled": False})
    w = rc.Watcher.for_config(str(tmp_path), ProfilerConfig())
    assert not w.check() and w.overrides == {}
    assert w.wake_s == stopping.QUIET_WAKE_S
    # with a backend that serves agent config, the stages follow the file and check it every 5 s
    w = rc.Watcher.for_config(str(tmp_path), ProfilerConfig(endpoint="http://127.0.0.1:9"))
    assert w.check() and w.overrides == {"enabled": False} and w.wake_s == stopping.IDLE_WAKE_S


# ------------------------------------------------------------ windows change length


def test_a_new_window_length_hands_out_the_window_in_progress_and_continues() -> None:
    w = Windows(interval_s=2)
    w.service("cpu", 100 * S, "a").add(("l",), ("f",), 1, 1)  # window 100..102, ended
    w.service("cpu", 103 * S, "a").add(("l",), ("f",), 2, 2)  # window 102..104, in progress
    closed = w.set_interval(4, now_ns=int(103.5 * S))
    assert [(c.start_ns, c.end_ns, c.data.rows[(("l",), ("f",))][0]) for c in closed] == [
        (100 * S, 102 * S, 1),
        (102 * S, int(103.5 * S), 2),
    ]
    assert w.set_interval(4, now_ns=int(103.6 * S)) == []  # the same length: nothing happens
    w.service("cpu", 103 * S, "a").add(("l",), ("f",), 4, 4)  # late: drained before the change
    w.service("cpu", int(103.8 * S), "a").add(("l",), ("f",), 8, 8)  # 103.5..104: up to the 4 s boundary
    w.service("cpu", 105 * S, "a").add(("l",), ("f",), 16, 16)  # 104..108
    w.service("cpu", 109 * S, "a").add(("l",), ("f",), 32, 32)  # 108..112
    assert w.late_batches == 1
    closed = list(w.close_due(now_ns=111 * S, grace_ns=int(2.5 * S)))
    assert [(c.start_ns, c.end_ns, c.data.rows[(("l",), ("f",))][0]) for c in closed] == [
        (int(103.5 * S), 104 * S, 12),
        (104 * S, 108 * S, 16),
    ]
    rest = list(w.close_all())
    assert [(c.start_ns, c.end_ns) for c in rest] == [(108 * S, 112 * S)]


# ------------------------------------------------------------ the uploader's fetcher, real HTTP


@pytest.fixture
def agent_config(workdir: Path, procs: list) -> Iterator[tuple[Path, Receiver]]:
    """The reference receiver serving workdir/agent-config.json (absent at first: 404)."""
    path = workdir / "agent-config.json"
    r = Receiver.start(workdir, "--agent-config", str(path))
    procs.append(r)
    yield path, r


def test_the_receiver_serves_the_file_as_it_is_and_404_without_it(
    workdir: Path, agent_config: tuple[Path, Receiver], procs: list
) -> None:
    path, receiver = agent_config
    url = receiver.url + "/v1/agent-config"
    assert requests.get(url, params={"host": "h"}, timeout=DEADLINE_S).status_code == 404  # no file yet
    path.write_bytes(b'{"modules": {"ebpf_profiler": {"enabled": false}}}')
    r = requests.get(url, params={"host": "h"}, timeout=DEADLINE_S)
    assert (r.status_code, r.content, r.headers["Content-Type"]) == (200, path.read_bytes(), "application/json")
    path.write_bytes(b"not checked here")  # read again on each request, served as it is
    assert requests.get(url, timeout=DEADLINE_S).content == b"not checked here"
    r = requests.post(url, data=b"{}", timeout=DEADLINE_S)
    assert (r.status_code, r.headers["Allow"]) == (405, "GET")
    plain = Receiver.start(workdir, name="plain")
    procs.append(plain)
    r = requests.get(plain.url + "/v1/agent-config", timeout=DEADLINE_S)
    assert r.status_code == 404 and "without --agent-config" in r.json()["error"]


def fetcher_for(url: str, run_dir: Path, logger: logging.Logger, **changes: Any) -> RemoteConfigFetcher:
    cfg = http_config(run_dir, url, sample_hz=19, upload_interval_s=2, upload_timeout_s=5, **changes)
    return RemoteConfigFetcher(HttpClient(url, read_timeout_s=5), cfg, str(run_dir), "web-1", logger)


def test_the_fetcher_refuses_once_logs_changes_once_and_writes_only_on_change(
    tmp_path: Path, agent_config: tuple[Path, Receiver], logs: tuple[logging.Logger, ListHandler]
) -> None:
    path, receiver = agent_config
    logger, handler = logs
    f = fetcher_for(receiver.url, tmp_path, logger)
    target = tmp_path / rc.FILE_NAME

    f.fetch_once()  # 404: no remote settings
    assert f.failures == 0 and not target.exists()
    assert f.answered  # a 404 is an answer (the backend sets none), not a failed fetch

    path.write_text(json.dumps(doc(sample_hz=99, upload_interval_s=4)))
    for _ in range(3):
        f.fetch_once()
    assert json.loads(target.read_text()) == {"upload_interval_s": 4}
    refusal = (
        "remote config: refused modules.ebpf_profiler.sample_hz = 99: remote config may set only "
        "enabled, upload_interval_s; the local value 19 stays"
    )
    # the log line is the feature: a refusal is logged once, a change once; they tell the user what the backend did
    assert handler.lines.count(refusal) == 1, handler.text()
    assert handler.lines.count("remote config: upload_interval_s 2 -> 4") == 1, handler.text()
    written = target.stat().st_mtime_ns, target.stat().st_ino
    f.fetch_once()
    assert (target.stat().st_mtime_ns, target.stat().st_ino) == written  # unchanged: not rewritten
    assert f.fetches == 5 and f.failures == 0  # the 404 and four answers, none failed

    path.write_text(json.dumps(doc(sample_hz=99)))  # the backend stops setting the interval
    f.fetch_once()
    assert not target.exists()
    assert handler.lines.count(refusal) == 1
    assert (
        "remote config: upload_interval_s 4 -> 2 (the local value: the backend no longer sets it)" in handler.lines
    ), handler.text()


@pytest.mark.parametrize(
    "reply, words",
    [
        (b"{not json", "not JSON"),
        (b'{"modules": []}', "not an agent config"),
        (b" " * (MAX_AGENT_CONFIG_BYTES + 1), "larger than"),
    ],
)
def test_a_bad_reply_keeps_the_last_accepted_overrides(
    tmp_path: Path,
    agent_config: tuple[Path, Receiver],
    logs: tuple[logging.Logger, ListHandler],
    reply: bytes,
    words: str,
) -> None:
    path, receiver = agent_config
    logger, handler = logs
    f = fetcher_for(receiver.url, tmp_path, logger)
    path.write_text(json.dumps(doc(enabled=False)))
    f.fetch_once()
    path.write_bytes(reply)
    f.fetch_once()
    f.fetch_once()
    assert rc.read_overrides(str(tmp_path)) == {"enabled": False}
    # the log line is the feature: logged once per episode, it says why the fetch failed and what stays in force
    assert sum("remote config: cannot fetch" in line for line in handler.lines) == 1, handler.text()
    assert words in handler.text() and "in force: enabled=False" in handler.text()


def test_fetch_failures_are_logged_once_per_episode_and_change_nothing(
    tmp_path: Path, workdir: Path, logs: tuple[logging.Logger, ListHandler], procs: list
) -> None:
    logger, handler = logs
    path = workdir / "agent-config.json"
    path.write_text(json.dumps(doc(enabled=False, upload_interval_s=10)))
    port = reserve_port()
    r = Receiver.start(workdir, "--agent-config", str(path), port=port)
    procs.append(r)
    f = fetcher_for(r.url, tmp_path, logger)
    f.fetch_once()
    assert rc.read_overrides(str(tmp_path)) == {"enabled": False, "upload_interval_s": 10}
    r.stop()
    for _ in range(3):
        f.fetch_once()
    assert f.failures == 3
    # the log line is the feature: the failure is logged once per episode, not once per attempt
    assert sum("remote config: cannot fetch" in line for line in handler.lines) == 1, handler.text()
    assert rc.read_overrides(str(tmp_path)) == {"enabled": False, "upload_interval_s": 10}
    # a new uploader (same runtime directory) starts from what was accepted before
    again = fetcher_for(r.url, tmp_path, logger)
    assert again.overrides == {"enabled": False, "upload_interval_s": 10}
    r2 = Receiver.start(workdir, "--agent-config", str(path), port=port)
    procs.append(r2)
    f.fetch_once()
    assert f.failures == 0  # the episode of three failures ended
    f.fetch_once()
    r2.stop()
    f.fetch_once()
    assert f.failures == 1
    assert sum("remote config: cannot fetch" in line for line in handler.lines) == 2  # a second episode


def test_the_uploader_writes_the_file_for_the_agent_group_and_local_mode_removes_it(
    workdir: Path, agent_config: tuple[Path, Receiver], start_uploader: Any
) -> None:
    path, receiver = agent_config
    path.write_text(json.dumps(doc(enabled=False, sample_hz=99)))
    u = start_uploader(http_config(workdir, receiver.url, remote_config_interval_s=5))
    target = u.run_dir / rc.FILE_NAME
    wait_for("the overrides file", target.exists, DEADLINE_S)
    st = target.stat()
    assert stat.S_IMODE(st.st_mode) == rc.FILE_MODE
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == stage_ids("uploader")
    assert json.loads(target.read_text()) == {"enabled": False}
    wait_for("the refusal in the uploader's log", lambda: "refused modules.ebpf_profiler.sample_hz = 99" in u.log())
    assert u.stop() == 0
    # with no endpoint there is no backend: a file left by an earlier run goes
    local = workdir / "local"
    local.mkdir()
    give("uploader", local)
    u2 = start_uploader(ProfilerConfig(local_dir=str(local)))
    assert not target.exists(), u2.log()
    assert u2.stop() == 0
