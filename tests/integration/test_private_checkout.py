"""`make run` from a checkout and a config that only root can reach (a clone in root's 0700 home).

Given a copy of this checkout inside a 0700 directory, with a config file of
mode 0600 beside it, when `make run CONFIG=...` sets the copy up and runs the
pipeline while a native workload burns CPU, then the workload's cpu profile
(main→top→mid→leaf) is written, every stage ran as its own user (their code
and config were handed to them: shared/stage_code.py, cli/run.py), and Ctrl-C
stops everything with exit 0. A local_dir the stages cannot reach is refused
before any stage starts, with a message saying what to change.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared import config as config_mod
from shared import endpoints, pprof
from tests.harness import ROOT, open_dir, require_root, wait_for

HOT_STACK = ("main", "top", "mid", "leaf")
# make setup in the copy (venv, pip from the local cache) plus the collector's BPF compile
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def private_checkout() -> Iterator[Path]:
    """A copy of this checkout (its working tree, without .venv) inside a 0700 directory."""
    require_root()
    outer = Path(tempfile.mkdtemp(prefix="ebpfprofiler-private-"))  # 0700, like /root
    assert (outer.stat().st_mode & 0o777) == 0o700
    clone = outer / "clone"
    shutil.copytree(
        ROOT,
        clone,
        symlinks=True,
        ignore=shutil.ignore_patterns(".venv", "__pycache__", ".pytest_cache", "*.egg-info", "build"),
    )
    try:
        yield clone
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def _config(path: Path, local_dir: Path) -> Path:
    cfg = config_mod.ProfilerConfig(
        upload_interval_s=3,
        sample_hz=99,
        local_dir=str(local_dir),
        offcpu=False,
        python_stacks=False,
        overhead_budget_pct=100.0,
    )
    path.write_text(config_mod.dump(cfg))
    path.chmod(0o600)  # root's only, as a file in root's home would be
    return path


def _make_run(clone: Path, config: Path, out: Path, log: Path) -> subprocess.Popen[bytes]:
    run_args = f"--run-dir {out / 'run'} --state-dir {out / 'state'}"
    with open(log, "wb") as f:
        # its own session: Ctrl-C is SIGINT to the whole group, as a terminal sends it
        return subprocess.Popen(
            ["make", "-C", str(clone), "run", f"CONFIG={config}", f"RUN_ARGS={run_args}"],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )


def _stop(p: subprocess.Popen[bytes]) -> int:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode


def test_make_run_from_a_0700_checkout_profiles_the_host(
    private_checkout: Path, build: Callable[..., Path], started: list[subprocess.Popen]
) -> None:
    out = open_dir("private-run")
    p = None
    try:
        config = _config(private_checkout.parent / "agent.yaml", out / "profiles")
        log = out / "make-run.log"
        p = _make_run(private_checkout, config, out, log)
        wait_for(
            "every stage to be ready",
            lambda: (
                p.poll() is not None
                or all(
                    os.path.exists(endpoints.ready_file(str(out / "run"), s))
                    for s in ("uploader", "symbolizer-0", "collector")
                )
            ),
            START_TIMEOUT_S,
            0.2,
        )
        assert p.poll() is None, f"make run exited with {p.returncode}:\n{log.read_text()}"
        started.append(subprocess.Popen([str(build("hot")), "30"], stdout=subprocess.DEVNULL))

        def hot_profile() -> tuple[str, ...] | None:
            for f in (out / "profiles").glob("*/cpu-*.pb.gz"):
                try:
                    prof = pprof.read(f.read_bytes())
                except (OSError, pprof.PprofError):
                    continue  # still being written
                for s in prof.samples:
                    if s.functions[-4:] == HOT_STACK:
                        return s.functions
            return None

        stack = wait_for("the workload's cpu profile", hot_profile, 60, 0.5)
        assert stack[-4:] == HOT_STACK
        text = log.read_text()
        assert "Traceback" not in text and "Permission denied" not in text, text  # a guard on the log, not an outcome
    finally:
        code = _stop(p) if p is not None else 0
        text = (out / "make-run.log").read_text() if (out / "make-run.log").exists() else ""
        shutil.rmtree(out, ignore_errors=True)
    # make reports the SIGINT of its child; `run` itself stopped every stage in order (the log line is the
    # feature: make hides run's exit status, and these lines are what the user sees of the stop)
    assert "stopped uploader (exit 0)" in text and "stopped collector (exit 0)" in text, text
    assert code in (0, 2, -signal.SIGINT), text


def test_a_local_dir_the_stages_cannot_reach_is_refused_before_any_stage_starts(private_checkout: Path) -> None:
    out = open_dir("private-refused")
    try:
        config = _config(private_checkout.parent / "refused.yaml", private_checkout.parent / "profiles")
        venv_py = ROOT / ".venv" / "bin" / "python"
        r = subprocess.run(
            [
                str(venv_py),
                "-m",
                "cli.main",
                "run",
                "--config",
                str(config),
                "--run-dir",
                str(out / "run"),
                "--state-dir",
                str(out / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1, r.stderr
        assert f"{private_checkout.parent / 'profiles'}: the agent's users cannot reach it" in r.stderr
        assert "choose one they can reach" in r.stderr
        assert not list((out / "run").glob("*.ready")), "a stage started"
    finally:
        shutil.rmtree(out, ignore_errors=True)
