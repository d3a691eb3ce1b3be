"""A kernel that lacks a feature costs the agent that feature alone, named; perf_event_paranoid > 2 costs nothing.

Given the whole pipeline, when the collector is told the kernel lacks a feature
(EBPFPROFILER_DISABLE_FEATURES, collector/features.py: the same fallbacks a kernel without it
takes), then the rest of the agent profiles as before, and the log and `ebpfprofiler status`
name what is missing and what was refused. When kernel.perf_event_paranoid is 3 (Debian's
default), the collector holds CAP_SYS_ADMIN only while it opens its perf events, and samples
without it afterwards. (Debian's own kernels, where paranoid=3 refuses perf_event_open to a
process without CAP_SYS_ADMIN, and where features really are missing, are booted by
`make test-kernels`: tests/kernels/.)
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from collector.preflight import PARANOID_MAX_WITHOUT_SYS_ADMIN
from receiver.store import list_profiles
from shared import endpoints, pprof, privileges
from shared.config import ProfilerConfig
from tests.harness import PY, Pipeline, Receiver, require_root

PARANOID = Path("/proc/sys/kernel/perf_event_paranoid")


def samples_of(receiver: Receiver, kind: str, exe: Path) -> int:
    """How many samples of `kind` profiles the receiver holds for `exe`."""
    n = 0
    for meta in list_profiles(str(receiver.dir)):
        if meta["type"] == kind:
            n += sum(
                s.values[0]
                for s in pprof.read(Path(meta["path"]).read_bytes()).samples
                if s.labels.get("process.executable") == str(exe.resolve())
            )
    return n


def status(p: Pipeline) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "cli.main", "status", "--run-dir", str(p.run_dir)], capture_output=True, text=True, timeout=30
    )


def collector_pid(p: Pipeline) -> int:
    return int(Path(endpoints.ready_file(str(p.run_dir), "collector")).read_text().split()[0])


def test_a_kernel_without_btf_profiles_on_cpu_and_names_the_off_cpu_refusal(
    build: Callable[..., Path], tmp_path: Path
) -> None:
    # given a pipeline with off-CPU profiling asked for, on a kernel without BTF (its programs need it)
    require_root()
    hot, offcpu = build("hot"), build("offcpu")
    receiver = Receiver(tmp_path / "received")
    try:
        p = Pipeline(
            tmp_path,
            ProfilerConfig(
                sample_hz=49,
                upload_interval_s=2,
                offcpu=True,
                dwarf_unwind=False,
                python_stacks=False,
                endpoint=receiver.url,
            ),
            env={"EBPFPROFILER_DISABLE_FEATURES": "btf"},
        )
        try:
            # when a CPU-bound and a blocking workload run
            shown = status(p)
            w = [
                subprocess.Popen([str(hot), "2"], stdout=subprocess.DEVNULL),
                subprocess.Popen([str(offcpu), "ratio", "2"], stdout=subprocess.DEVNULL),
            ]
            assert [x.wait(timeout=60) for x in w] == [0, 0]
        finally:
            assert p.stop() == 0, p.log()
        # then on-CPU profiles come as always, and no off-CPU one
        assert samples_of(receiver, "cpu", hot) > 40  # 2 s at 49 Hz
        assert {m["type"] for m in list_profiles(str(receiver.dir))} == {"cpu"}
    finally:
        receiver.stop()
    # and the log and status name the missing feature and the refusal, with the version that has it
    # the log line is the feature: a refusal the operator must see, with what it needs
    assert "off-CPU profiles (offcpu) refused: needs the kernel's type information" in p.log()
    assert "missing btf (turned off by EBPFPROFILER_DISABLE_FEATURES" in shown.stdout, shown.stdout + shown.stderr
    assert "refused: off-CPU profiles (offcpu)" in shown.stdout


@pytest.fixture
def paranoid_3() -> Iterator[None]:
    """kernel.perf_event_paranoid at 3 for the test, then as it was."""
    require_root()
    before = PARANOID.read_text()
    PARANOID.write_text("3")
    try:
        yield
    finally:
        PARANOID.write_text(before)


def test_under_paranoid_3_cap_sys_admin_is_held_at_start_only(
    build: Callable[..., Path], tmp_path: Path, paranoid_3: None
) -> None:
    # given kernel.perf_event_paranoid=3, under which Debian's kernels let only CAP_SYS_ADMIN open perf events
    hot = build("hot")
    receiver = Receiver(tmp_path / "received")
    try:
        p = Pipeline(
            tmp_path,
            ProfilerConfig(
                sample_hz=49,
                upload_interval_s=2,
                offcpu=True,
                dwarf_unwind=False,
                python_stacks=False,
                endpoint=receiver.url,
            ),
        )
        try:
            # when the collector is ready
            pid = collector_pid(p)
            held = privileges.held(f"/proc/{pid}/status")
            kernel = json.loads((p.run_dir / "kernel.json").read_text())
            shown = status(p)
            w = subprocess.Popen([str(hot), "2"], stdout=subprocess.DEVNULL)
            assert w.wait(timeout=60) == 0
        finally:
            assert p.stop() == 0, p.log()
        # then it holds its table's capabilities and not CAP_SYS_ADMIN (effective or permitted: it cannot be
        # had again; the bounding set keeps it, but no_new_privs bars every way back through it)
        assert held["CapEff"] == held["CapPrm"] == privileges.mask(privileges.STAGES["collector"].caps)
        assert held["NoNewPrivs"] == 1
        # and it says why it held it, and that it dropped it
        assert kernel["cap_sys_admin"].startswith("held at start only")
        # the log line is the feature: the start says why it took CAP_SYS_ADMIN
        assert f"kernel.perf_event_paranoid > {PARANOID_MAX_WITHOUT_SYS_ADMIN}: CAP_SYS_ADMIN was held" in p.log()
        assert "CAP_SYS_ADMIN: held at start only" in shown.stdout
        # and it samples with the perf events it opened before
        assert samples_of(receiver, "cpu", hot) > 40  # 2 s at 49 Hz
    finally:
        receiver.stop()
