"""Remote config end to end (issue 4): real BPF, the whole pipeline, the reference receiver on 127.0.0.1.

The receiver serves an agent config document the test changes while the pipeline runs
(`--agent-config FILE`, read on every GET). The uploader fetches it every 5 s. The backend may
set only `enabled` and `upload_interval_s`: a remote sample_hz is refused, logged once however
often it is fetched, and the local rate stays; a remote upload_interval_s changes the windows'
length; a remote `enabled: false` stops sampling until `enabled: true` brings it back (and a
collector that starts remotely disabled loads nothing until then).
Every process is ended by pid, also when a test fails; waiting is polling with deadlines.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shared import endpoints, pprof
from shared.config import ProfilerConfig
from tests.harness import Pipeline, Receiver, bpf_holdings, require_root, wait_for

LOCAL_HZ = 19
LOCAL_WINDOW_S = 2
REMOTE_WINDOW_S = 4
FETCH_EVERY_S = 5  # remote_config_interval_s: its minimum
S = 1_000_000_000
# From a changed document to its effect: the next fetch, then a window of the new length and the
# worker's grace before it is handed out, with room for a loaded host.
APPLY_DEADLINE_S = 40
SERVED = "served the agent config to host="


@dataclass
class Window:
    meta: dict
    profile: pprof.ReadProfile

    @property
    def start(self) -> int:
        return self.meta["start"]

    @property
    def end(self) -> int:
        return self.meta["end"]

    @property
    def samples(self) -> int:
        return sum(s.values[0] for s in self.profile.samples)


@dataclass
class Setup:
    receiver: Receiver
    pipeline: Pipeline
    agent_config: Path
    hot_exe: str

    def serve(self, **block: Any) -> None:
        """What the backend answers from now on."""
        tmp = self.agent_config.with_suffix(".new")
        tmp.write_text(json.dumps({"modules": {"ebpf_profiler": block}}))
        tmp.replace(self.agent_config)

    def fetches(self) -> int:
        return self.receiver.log().count(SERVED)

    def windows(self, profile_type: str = "cpu", service: str | None = None) -> list[Window]:
        service = self.hot_exe if service is None else service
        out = [
            Window(m, pprof.read(Path(m["path"]).read_bytes()))
            for m in self.receiver.received()
            if m["type"] == profile_type and (service == "*" or m["service"] == service)
        ]
        return sorted(out, key=lambda w: w.start)


@pytest.fixture
def start(
    build: Callable[..., Path], tmp_path: Path, started: list[subprocess.Popen], procs: list
) -> Callable[..., Setup]:
    """start(**block): a busy workload, the receiver serving `block` as the agent config, and the
    pipeline posting to it; all ended by pid at the end (the conftest fixtures)."""
    require_root()
    hot = build("hot")
    agent_config = tmp_path / "agent-config.json"

    def _start(**block: Any) -> Setup:
        agent_config.write_text(json.dumps({"modules": {"ebpf_profiler": block}}))
        started.append(subprocess.Popen([str(hot), "600"], stdout=subprocess.DEVNULL))
        receiver = Receiver.start(tmp_path, "--agent-config", str(agent_config))
        procs.append(receiver)
        pipeline = Pipeline(
            tmp_path,
            ProfilerConfig(
                sample_hz=LOCAL_HZ,
                upload_interval_s=LOCAL_WINDOW_S,
                endpoint=receiver.url,
                remote_config_interval_s=FETCH_EVERY_S,
                local_dir=str(tmp_path / "unused"),
            ),
        )
        procs.append(pipeline)
        return Setup(receiver, pipeline, agent_config, str(hot.resolve()))

    return _start


@pytest.fixture
def setup(start: Callable[..., Setup]) -> Setup:
    """The pipeline with no remote settings at first."""
    return start()


def test_remote_sample_hz_is_refused_once_and_upload_interval_applies(setup: Setup) -> None:
    # given the pipeline at 19 Hz with 2 s windows, profiling a busy process
    wait_for(
        "two 2 s windows of the busy process",
        lambda: len([w for w in setup.windows() if w.end - w.start == LOCAL_WINDOW_S * S]) >= 2,
        APPLY_DEADLINE_S,
    )
    # when the backend asks for 99 Hz and 4 s windows
    setup.serve(sample_hz=99, upload_interval_s=REMOTE_WINDOW_S)
    fetches_before = setup.fetches()
    # then windows become 4 s long ...
    wait_for(
        "two 4 s windows of the busy process",
        lambda: len([w for w in setup.windows() if w.end - w.start == REMOTE_WINDOW_S * S]) >= 2,
        APPLY_DEADLINE_S + REMOTE_WINDOW_S,
    )
    # ... and however often the document is fetched again, the refusal is logged once
    wait_for(
        "three more fetches of the agent config", lambda: setup.fetches() >= fetches_before + 3, 4 * FETCH_EVERY_S + 10
    )
    log = setup.pipeline.log()
    assert setup.pipeline.stop() == 0
    refusal = (
        "remote config: refused modules.ebpf_profiler.sample_hz = 99: remote config may set only "
        "enabled, upload_interval_s; the local value 19 stays"
    )
    # the log line is the feature: a refusal and a change are each logged once; they tell the user what the backend did
    assert log.count(refusal) == 1, log
    assert log.count("remote config: upload_interval_s 2 -> 4") == 1, log

    windows = setup.windows()
    # the local sample_hz stays: every profile's period, and the rate the kernel sampled at
    assert {w.profile.period for w in setup.windows(service="*")} == {S // LOCAL_HZ}
    four = [w for w in windows if w.end - w.start == REMOTE_WINDOW_S * S]
    rates = [w.samples / REMOTE_WINDOW_S for w in four[:-1]]  # the last one was cut short by the stop
    assert rates and all(0.75 * LOCAL_HZ <= r <= 1.25 * LOCAL_HZ for r in rates), (
        f"samples per second of one busy thread in 4 s windows: {rates}, expected about {LOCAL_HZ}"
    )
    # 2 s windows; at the change, the 2 s window in progress ends early and the first new window runs
    # to the next 4 s boundary (each at most one, either may be missing); then 4 s windows; none overlap
    lengths = [(w.end - w.start) / S for w in windows]
    first_four = lengths.index(REMOTE_WINDOW_S)
    full_two = len(list(itertools.takewhile(lambda n: n == LOCAL_WINDOW_S, lengths)))
    partial = lengths[full_two:first_four]
    assert full_two >= 2, lengths
    assert len(partial) <= 2 and all(n < REMOTE_WINDOW_S for n in partial), lengths
    if len(partial) == 2:
        assert partial[0] < LOCAL_WINDOW_S, lengths
    assert set(lengths[first_four:]) == {REMOTE_WINDOW_S}, lengths
    assert all(b.start >= a.end for a, b in zip(windows, windows[1:])), [(w.start, w.end) for w in windows]  # noqa: RUF007


def test_remote_enabled_false_stops_sampling_and_true_brings_it_back(setup: Setup) -> None:
    # given samples of the busy process arriving
    wait_for("a cpu profile of the busy process", lambda: any(w.samples for w in setup.windows()), APPLY_DEADLINE_S)
    # when the backend says enabled: false
    setup.serve(enabled=False)
    wait_for(
        "the collector to stop sampling",
        lambda: "remote config: profiling disabled" in setup.pipeline.log(),
        APPLY_DEADLINE_S,
    )
    off = time.time_ns()
    # the fetcher is the clock: stay off for three more fetches (about 15 s: several windows)
    fetches = setup.fetches()
    wait_for("three more fetches while disabled", lambda: setup.fetches() >= fetches + 3, 4 * FETCH_EVERY_S + 10)
    # and then enabled: true
    on = time.time_ns()
    setup.serve(enabled=True)
    wait_for(
        "the collector to sample again",
        lambda: "remote config: profiling enabled again" in setup.pipeline.log(),
        APPLY_DEADLINE_S,
    )
    wait_for(
        "cpu samples of the busy process after re-enabling",
        lambda: any(w.samples and w.start >= on for w in setup.windows()),
        APPLY_DEADLINE_S,
    )
    # and off-CPU profiling is attached again: blocked time of the host's processes after it
    wait_for(
        "off-CPU samples after re-enabling",
        lambda: any(w.samples and w.start >= on for w in setup.windows("offcpu", service="*")),
        APPLY_DEADLINE_S,
    )
    log = setup.pipeline.log()
    assert setup.pipeline.stop() == 0

    # then: samples before, none in the windows entirely within the disabled stretch, samples after
    # (the drain after the detach may still carry the last second before it: one drain interval)
    quiet_from = off + 1 * S
    everything = setup.windows(service="*") + setup.windows("offcpu", service="*")
    during = [w for w in everything if w.start >= quiet_from and w.end <= on]
    quiet_windows = (on - quiet_from) // (LOCAL_WINDOW_S * S) - 1
    assert quiet_windows >= 3, "the disabled stretch was too short to show anything"
    assert during == [], [(w.meta["type"], w.meta["service"], w.start, w.samples) for w in during]
    assert any(w.samples for w in setup.windows() if w.end <= off)
    after = [w for w in setup.windows() if w.start >= on]
    assert after and all(w.profile.period == S // LOCAL_HZ for w in after)
    # the log line is the feature: each change of enabled is logged once, telling the user profiling stopped or resumed
    assert log.count("remote config: enabled True -> False") == 1, log
    assert log.count("remote config: enabled False -> True") == 1, log
    assert log.count("remote config: profiling disabled") == 1, log
    assert log.count("remote config: profiling enabled again") == 1, log


def test_a_collector_started_remotely_disabled_loads_nothing_until_enabled(start: Callable[..., Setup]) -> None:
    # given the backend says enabled: false before the agent starts (the uploader fetches first)
    setup = start(enabled=False)
    log = setup.pipeline.log()
    # the log line is the feature: the only sign that an idle agent is idle on purpose, and why
    assert "profiling is disabled by remote config (enabled: false)" in log, log
    collector = int(Path(endpoints.ready_file(str(setup.pipeline.run_dir), "collector")).read_text())
    # then the collector holds no BPF program and no perf event, and no profile arrives
    fetches = setup.fetches()
    wait_for("two more fetches while disabled", lambda: setup.fetches() >= fetches + 2, 3 * FETCH_EVERY_S + 10)
    assert bpf_holdings(collector) == (set(), 0)
    assert setup.windows(service="*") == []
    # when it says enabled: true, the collector loads its programs and samples at the local rate
    setup.serve(enabled=True)
    wait_for("cpu samples of the busy process", lambda: any(w.samples for w in setup.windows()), APPLY_DEADLINE_S + 15)
    progs, perf = bpf_holdings(collector)
    assert progs and perf, "the collector samples without holding programs and perf events?"
    assert setup.pipeline.stop() == 0
    assert {w.profile.period for w in setup.windows(service="*")} == {S // LOCAL_HZ}
