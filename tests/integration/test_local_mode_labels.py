"""With no backend: profiles land in local_dir; plain_pid and strip_process_args: false show through."""

from __future__ import annotations

import pwd
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from shared import pprof
from shared.config import ProfilerConfig
from tests.harness import Pipeline, open_dir, require_root


def test_local_dir_plain_pid_and_command_line(build: Callable[..., Path], tmp_path: Path) -> None:
    # given the pipeline with no endpoint, plain pids and command lines on
    require_root()
    hot = build("hot")
    open_tmp = open_dir("local")
    local = open_tmp / "profiles"
    pipeline = Pipeline(
        tmp_path,
        ProfilerConfig(
            sample_hz=49,
            upload_interval_s=2,
            endpoint="",
            local_dir=str(local),
            plain_pid=True,
            strip_process_args=False,
        ),
    )
    try:
        # when a workload runs with arguments
        w = subprocess.Popen([str(hot), "1.5"], stdout=subprocess.DEVNULL)
        assert w.wait(timeout=60) == 0
    finally:
        assert pipeline.stop() == 0, pipeline.log()
    # then its profiles are files under local_dir, one directory per service
    files = sorted(local.rglob("cpu-*.pb.gz"))
    assert files, f"nothing written under {local}: {pipeline.log()}"
    samples = [
        s
        for f in files
        for s in pprof.read(f.read_bytes()).samples
        if s.labels.get("process.executable") == str(hot.resolve())
    ]
    assert samples
    # and the pid label is the plain pid, the command line is sent
    pids = {s.labels["pid"] for s in samples}
    cmdlines = {s.labels.get("process.command_line") for s in samples}
    assert pids == {str(w.pid)}
    assert cmdlines == {f"{hot} 1.5"}
    assert all(str(f.relative_to(local)).count("/") == 1 for f in files)
    # written by the uploader's user, readable by the agent's group
    assert {f.stat().st_uid for f in files} == {pwd.getpwnam("ebpfprofiler-uploader").pw_uid}
    shutil.rmtree(open_tmp)
