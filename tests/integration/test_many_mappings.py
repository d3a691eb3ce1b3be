"""Issue 40, case 9: processes with 15,000 long-named executable mappings each, beside an ordinary busy one.

Two processes each map one file, under a path of 960 bytes of "é", 15,000 times executable (~42 MB of
mapping table each on the wire) and spin; together they took every batch past MAX_BATCH_BYTES and the
ZeroMQ limit, and the ordinary process, routed to the same (only) worker, lost all its samples. Now
the ordinary process's samples arrive, and the cut tables are counted in the collector's counters.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from shared import counters
from shared.config import ProfilerConfig
from tests.harness import Pipeline, Receiver, open_dir, read_received, require_root, wait_for

MAPPINGS = 15_000
SPIN_S = 20
HOSTILE = r"""
import mmap, os, sys, time
path = sys.argv[1]
with open(path, "rb") as f:
    maps = [mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE)
            for _ in range(int(sys.argv[2]))]
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    pass
"""


def long_named_file(home: Path) -> Path:
    """A 4 KB file under `home`, at a path of 960 bytes of "é"."""
    d = home
    for _ in range(4):
        d = d / ("é" * 120)
    d.mkdir(parents=True)
    target = d / "file"
    target.write_bytes(b"\0" * 4096)
    return target


def start_hostile(target: Path, started: list[subprocess.Popen]) -> list[subprocess.Popen]:
    """Two processes mapping `target` MAPPINGS times and spinning SPIN_S seconds, handed to `started`;
    returned once both have mapped it."""
    hostile = [
        subprocess.Popen(
            [sys.executable, "-c", HOSTILE, str(target), str(MAPPINGS), str(SPIN_S)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    started.extend(hostile)
    for h in hostile:
        assert h.stdout is not None and h.stdout.readline().strip() == "ready"
    return hostile


def wait_cut_and_ordinary(pipeline: Pipeline, receiver: Receiver, hot: Path) -> None:
    """Until the collector counts the cut mapping tables and the ordinary process's samples arrive."""
    wait_for(
        "the mapping tables cut, counted",
        lambda: counters.read_all(str(pipeline.run_dir)).get("collector", {}).get("mappings_cut", 0) >= MAPPINGS,
        timeout=30,
    )
    wait_for(
        "the ordinary process's samples",
        lambda: any(
            s.labels.get("process.executable") == str(hot.resolve())
            for r in read_received(receiver.dir)
            if r.meta["type"] == "cpu"
            for s in r.profile.samples
        ),
        timeout=60,
    )


def test_many_long_mappings_cost_the_others_nothing(
    build: Callable[..., Path], tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    require_root()
    hot = build("hot")
    home = open_dir("mappings")
    target = long_named_file(home)
    receiver = Receiver(tmp_path / "received")
    try:
        pipeline = Pipeline(
            tmp_path,
            ProfilerConfig(
                sample_hz=49,
                upload_interval_s=2,
                symbolizer_workers=1,
                endpoint=receiver.url,
                local_dir=str(tmp_path / "unused"),
                python_stacks=False,
                offcpu=False,
                dwarf_unwind=False,
            ),
        )
        try:
            hostile = start_hostile(target, started)
            ordinary = subprocess.Popen([str(hot), "6"], stdout=subprocess.DEVNULL)
            started.append(ordinary)
            assert ordinary.wait(timeout=60) == 0
            wait_cut_and_ordinary(pipeline, receiver, hot)
        finally:
            code = pipeline.stop()
        assert code == 0
        log = pipeline.log()
        for h in hostile:  # the log line is the feature: the cut is said once per process, not per batch
            assert log.count(f"pid {h.pid} (") >= 1 and log.count("left out (those with the longest names") <= 2
    finally:
        receiver.stop()
        shutil.rmtree(home, ignore_errors=True)
