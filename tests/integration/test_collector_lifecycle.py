"""The collector alone: it attaches to every CPU, and a stop leaves nothing of ours behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from shared import endpoints
from shared.config import ProfilerConfig, dump
from tests.harness import PY, Pipeline, bpf_holdings, bpftool, children, open_dir, require_root, stop_process, wait_for

# How long the kernel may take to free programs a closed tail-call array held (a workqueue, then RCU).
KERNEL_FREE_TIMEOUT_S = 10.0


@pytest.mark.parametrize(
    "sig, offcpu, dwarf",
    [(signal.SIGTERM, True, True), (signal.SIGINT, False, False)],
    ids=["SIGTERM-offcpu-dwarf", "SIGINT-oncpu-only-frame-pointers"],
)
def test_stop_detaches_every_program_and_perf_event(
    tmp_path: Path, sig: signal.Signals, offcpu: bool, dwarf: bool, started: list[subprocess.Popen]
) -> None:
    # given a running collector, with and without off-CPU profiling and DWARF unwinding
    require_root()
    work = open_dir("collector")
    cfg = work / "agent.yaml"
    cfg.write_text(dump(ProfilerConfig(sample_hz=49, offcpu=offcpu, dwarf_unwind=dwarf, offcpu_dwarf=dwarf)))
    run_dir = work / "run"
    run_dir.mkdir()
    shutil.chown(run_dir, group="ebpfprofiler")
    run_dir.chmod(0o3770)
    p = subprocess.Popen(
        [PY, "-m", "collector.main", "--config", str(cfg), "--run-dir", str(run_dir)], stderr=subprocess.PIPE, text=True
    )
    started.append(p)  # killed at the end if a check fails before the stop under test
    try:
        wait_for(
            "the collector to be ready",
            lambda: p.poll() is not None or os.path.exists(endpoints.ready_file(str(run_dir), "collector")),
            timeout=90,
        )
        assert p.poll() is None, p.stderr.read() if p.stderr else ""
        progs, perf_fds = bpf_holdings(p.pid)
        # then it holds its sampling program, one perf event per CPU, the
        # sched_switch and rseq_update programs (tp_btf, each on a
        # link) only when off-CPU profiling is on, and the DWARF unwinder's step
        # programs only when that is on (names as the kernel keeps them: 15 characters)
        loaded = {q["id"]: q for q in bpftool("prog", "show")}
        kinds = sorted((loaded[i]["type"], loaded[i]["name"]) for i in progs)
        expected = (
            [("perf_event", "on_cpu_sample")]
            + ([("tracing", "offcpu_switch"), ("tracing", "offcpu_resume")] if offcpu else [])
            + ([("perf_event", "oncpu_unwind_step")] if dwarf else [])
            + ([("tracing", "offcpu_unwind_s"), ("tracing", "offcpu_unwind_f")] if dwarf and offcpu else [])
        )
        assert kinds == sorted(expected)
        assert perf_fds == os.cpu_count()
        links = [e for e in bpftool("link", "show") if e.get("prog_id") in progs]
        assert len(links) == (2 if offcpu else 0), links
        # when it is stopped
        code = stop_process(p, sig)
        err = p.stderr.read() if p.stderr else ""
        # then it exits cleanly and none of its programs or perf links remain
        assert code == 0, err
        # (the process is gone and with it every descriptor; the kernel frees what a tail-call
        # program array held a moment later: the last user reference clears the array in a
        # workqueue, prog_array_map_clear_deferred, and the step programs go after an RCU grace
        # period; seen as 2 programs still listed right after exit, so this polls)
        wait_for(
            "the collector's programs to be freed",
            lambda: not progs & {q["id"] for q in bpftool("prog", "show")},
            KERNEL_FREE_TIMEOUT_S,
        )
        assert not [e for e in bpftool("perf") if e.get("prog_id") in progs]
        assert not [e for e in bpftool("link", "show") if e.get("prog_id") in progs]
        assert not os.path.exists(endpoints.ready_file(str(run_dir), "collector"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_bad_config_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("modules:\n  ebpf_profiler:\n    sample_hz: fast\n")
    out = subprocess.run([PY, "-m", "collector.main", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "sample_hz = 'fast' is not allowed" in out.stderr and "Traceback" not in out.stderr


def test_stages_stop_cleanly_when_run_is_killed(tmp_path: Path) -> None:
    # given `ebpfprofiler run` with every stage up (each dropped to its own user, which clears the
    # parent-death signal `run` armed: shared/privileges.py arms it again)
    require_root()
    pipeline = Pipeline(tmp_path, ProfilerConfig(sample_hz=19))
    stages: list[int] = []
    try:
        stages = children(pipeline.proc.pid)
        collector = int(Path(endpoints.ready_file(str(pipeline.run_dir), "collector")).read_text().split()[0])
        assert collector in stages and len(stages) >= 3, stages
        progs, _ = bpf_holdings(collector)
        assert progs and (pipeline.run_dir / "kernel.json").exists()
        # when `run` is killed, with no chance to stop them (SIGKILL, the OOM killer)
        pipeline.proc.kill()
        pipeline.proc.wait(timeout=10)
        # then every stage stops by itself, through its orderly stop: each withdrew its ready file, and
        # the collector closed all it held (its last step removes kernel.json); and its programs go
        wait_for("every stage to stop", lambda: not any(os.path.exists(f"/proc/{pid}") for pid in stages), 60)
        assert sorted(p.name for p in pipeline.run_dir.glob("*.ready")) == []
        assert not (pipeline.run_dir / "kernel.json").exists()
        wait_for(
            "the collector's programs to be freed",
            lambda: not progs & {q["id"] for q in bpftool("prog", "show")},
            KERNEL_FREE_TIMEOUT_S,
        )
    finally:
        for pid in stages:  # none left, unless a check above failed
            try:
                if b"--run-dir" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        pipeline.stop()
