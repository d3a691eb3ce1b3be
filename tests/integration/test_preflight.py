"""collector --preflight, run with and without capabilities (setpriv drops them from the bounding set)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness import PY, open_dir, require_root

COLLECTOR = [PY, "-m", "collector.main"]


def run(argv: list[str], drop: str | None = None) -> subprocess.CompletedProcess:
    prefix = ["setpriv", f"--bounding-set=-{drop}", "--inh-caps=-all"] if drop else []
    return subprocess.run(prefix + argv, capture_output=True, text=True, timeout=120)


def test_preflight_passes_as_root() -> None:
    require_root()
    out = run([*COLLECTOR, "--preflight"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("preflight: ready")
    for name in ("kernel version", "BTF", "CAP_BPF", "CAP_PERFMON", "tracefs", "kernel headers", "bcc"):
        assert name in out.stdout


@pytest.mark.parametrize(
    "drop, named",
    [
        ("syslog", "CAP_SYSLOG"),
        ("sys_ptrace", "CAP_SYS_PTRACE"),
        ("bpf,-sys_admin", "CAP_BPF"),  # CAP_SYS_ADMIN stands in for CAP_BPF: drop both
    ],
)
def test_preflight_names_a_missing_capability_and_its_fix(drop: str, named: str) -> None:
    require_root()
    out = run([*COLLECTOR, "--preflight"], drop=drop)
    assert out.returncode == 1
    failing = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert [ln for ln in failing if named in ln], out.stdout
    assert f"grant {named}" in out.stdout and "Traceback" not in out.stderr


def test_collector_refuses_to_start_without_a_capability(tmp_path: Path) -> None:
    require_root()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("modules:\n  ebpf_profiler: {}\n")
    out = run([*COLLECTOR, "--config", str(cfg), "--run-dir", str(tmp_path / "run")], drop="syslog")
    assert out.returncode == 1
    assert "cannot run the collector" in out.stderr and "CAP_SYSLOG" in out.stderr
    assert "Traceback" not in out.stderr


def test_run_names_the_cause_before_it_starts_any_stage() -> None:
    # given a host where the collector would lack a capability (dropped from the bounding set)
    require_root()
    work = open_dir("preflight")  # reachable by the stages' users, as `run` checks first
    cfg = work / "agent.yaml"
    cfg.write_text("modules:\n  ebpf_profiler: {}\n")
    # when `ebpfprofiler run` starts
    try:
        out = run(
            [
                PY,
                "-m",
                "cli.main",
                "run",
                "--config",
                str(cfg),
                "--run-dir",
                str(work / "run"),
                "--state-dir",
                str(work / "state"),
            ],
            drop="syslog",
        )
        ready = (work / "run" / "uploader.ready").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # then it refuses with the collector's preflight, naming the cause and its fix, and started nothing
    assert out.returncode == 1, out.stdout + out.stderr
    assert "cannot run the collector" in out.stderr and "grant CAP_SYSLOG" in out.stderr
    assert "started uploader" not in out.stdout + out.stderr
    assert not ready
    assert "Traceback" not in out.stderr
