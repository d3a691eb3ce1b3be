"""Two symbolizer workers, three services, and one worker killed with SIGKILL.

Given the pipeline with two workers and three CPU-bound services spread over
both, when one worker is killed, then the supervisor restarts it, its
services move to the other worker and back, and every service's profiles
keep arriving: none misses more than one window.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from collector.routing import worker_for
from receiver.store import list_profiles
from shared import endpoints, pprof
from shared.config import ProfilerConfig
from tests.harness import Pipeline, Receiver, require_root, wait_for

WINDOW_S = 2
RUN_CPU_S = 7.0


def pick_services(directory: Path) -> list[Path]:
    """Three executable paths that rendezvous hashing spreads over both workers."""
    names = [directory / f"svc_{c}" for c in "abcdefghij"]
    for i in range(len(names) - 2):
        trio = names[i : i + 3]
        if len({worker_for(str(p), [0, 1]) for p in trio}) == 2:
            return trio
    raise AssertionError("no spread trio among the candidate names")


def read_pid(run_dir: Path, stage: str) -> int | None:
    try:
        return int(Path(endpoints.ready_file(str(run_dir), stage)).read_text())
    except (FileNotFoundError, ValueError):
        return None


def test_killing_a_worker_moves_its_services_and_loses_at_most_one_window(
    build: Callable[..., Path], tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    require_root()
    services = pick_services(tmp_path)
    for exe in services:
        shutil.copy(build("hot"), exe)
    owners = {str(p): worker_for(str(p), [0, 1]) for p in services}
    victim = max((0, 1), key=lambda w: list(owners.values()).count(w))

    receiver = Receiver(tmp_path / "received")
    try:
        pipeline = Pipeline(
            tmp_path,
            ProfilerConfig(
                sample_hz=49, upload_interval_s=WINDOW_S, symbolizer_workers=2, offcpu=False, endpoint=receiver.url
            ),
        )
        try:
            run_dir = pipeline.run_dir
            procs = [subprocess.Popen([str(p), str(RUN_CPU_S)], stdout=subprocess.DEVNULL) for p in services]
            started.extend(procs)

            def arrived() -> set[str]:
                return {m["service"] for m in list_profiles(str(receiver.dir))}

            # given profiles of all three services arriving
            wait_for("a profile of every service", lambda: set(owners) <= arrived(), timeout=30)
            old_pid = read_pid(run_dir, f"symbolizer-{victim}")
            assert old_pid
            # when the worker that owns most of them is killed
            os.kill(old_pid, signal.SIGKILL)
            # then the supervisor starts it again
            new_pid = wait_for(
                "the worker to be restarted",
                lambda: (p := read_pid(run_dir, f"symbolizer-{victim}")) and p != old_pid and p,
                timeout=30,
            )
            assert new_pid != old_pid
            for p in procs:
                assert p.wait(timeout=60) == 0
        finally:
            assert pipeline.stop() == 0, pipeline.log()
        assert pipeline.exits() == {f"symbolizer-{victim}": 1}, pipeline.log()  # restarted by `run`, once
    finally:
        receiver.stop()

    # and every service has samples in every window but at most one, from start to end
    windows: dict[str, set[int]] = defaultdict(set)
    for m in list_profiles(str(receiver.dir)):
        if m["service"] in owners and pprof.read(Path(m["path"]).read_bytes()).total("samples") > 0:
            windows[m["service"]].add(int(m["start"]))
    step = WINDOW_S * 1_000_000_000
    for service, starts in windows.items():
        expected = set(range(min(starts), max(starts) + step, step))
        missing = expected - starts
        assert len(missing) <= 1, f"{service} (worker {owners[service]}) misses windows {sorted(missing)}"
    assert set(windows) == set(owners)
