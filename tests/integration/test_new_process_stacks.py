"""Whole stacks from a new process's first second, at the shipped defaults (issue 14).

Given the pipeline running deploy/agent.yaml as shipped (19 Hz, DWARF unwinding), with 10 s
windows so that "the first window" is the process's first ten seconds, when a program built with
-O2 -fomit-frame-pointer (a frame-pointer walk loses its callers; only its .eh_frame gives whole
stacks) starts just after a window boundary and burns 25 s of CPU, then its first window has at
least 95% whole stacks and its whole life at least 97%: its modules' tables are in the kernel
before most of its stacks have gone by.
"""

from __future__ import annotations

import dataclasses
import datetime
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from receiver.store import list_profiles
from shared import config as config_mod
from shared import pprof
from tests.harness import ROOT, Pipeline, Receiver, require_root, wait_for

NOFP_FLAGS = ["-O2", "-fomit-frame-pointer"]
WINDOW_S = 10
CPU_SECONDS = 25.0
START = ("__libc_start_call_main", "main")  # root side of every whole stack (frames root first)
FIRST_WINDOW_WHOLE = 0.95
LIFE_WHOLE = 0.97


def whole(s: pprof.ReadSample) -> bool:
    n = [f.function for f in s.frames]
    return any(tuple(n[i : i + 2]) == START for i in range(len(n) - 1))


def test_a_new_no_frame_pointer_process_has_whole_stacks_from_its_first_window(
    build: Callable[..., Path], tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    require_root()
    exe = build("nofp", NOFP_FLAGS)
    receiver = Receiver(tmp_path / "received")
    try:
        shipped = config_mod.load(str(ROOT / "deploy" / "agent.yaml"))
        cfg = dataclasses.replace(
            shipped, upload_interval_s=WINDOW_S, endpoint=receiver.url, local_dir=str(tmp_path / "unused")
        )
        pipeline = Pipeline(tmp_path, cfg, shipped_budget=True)
        try:
            # Given a pipeline past its start-up (the first window's table builds for the host's processes)
            wait_for(
                "the pipeline's first window",
                (pipeline.run_dir / "status.json").exists,
                timeout=4 * WINDOW_S,
            )
            # When the process starts just after a window boundary and runs its course
            first_start, last_end_ns, started_at = run_from_a_window_start(exe, started)
            wait_for(
                "the process's last window",
                lambda: any(t + WINDOW_S * 10**9 >= last_end_ns for t in windows_of(receiver.dir, exe)),
                timeout=6 * WINDOW_S,
            )
        finally:
            code = pipeline.stop()
        assert code == 0, pipeline.log()
        tables_after = table_latency(pipeline.log(), exe, started_at)
        by_window = windows_of(receiver.dir, exe)
    finally:
        receiver.stop()
    # Then the first window's stacks, and all of its life's, are whole
    check_whole(by_window, first_start, cfg.sample_hz, f"its table loaded {tables_after} after its start")


def table_latency(log: str, exe: Path, started_at: float) -> str:
    """How long after `started_at` (time.time()) the collector logged `exe`'s unwind table as loaded."""
    for line in log.splitlines():
        if f"unwind table loaded for {exe.resolve()}" in line:
            when = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            return f"{when - started_at:.2f} s"
    return "never"


def run_from_a_window_start(exe: Path, started: list[subprocess.Popen]) -> tuple[int, int, float]:
    """`exe` started just after a window boundary, to its end: the ns its window starts and its last ends,
    and the time it was started."""
    wait_for(
        "the start of an upload window",
        lambda: 0.1 <= time.time() % WINDOW_S < 0.6,
        timeout=WINDOW_S + 1,
        interval=0.02,
    )
    first_start = int(time.time() // WINDOW_S * WINDOW_S) * 10**9
    started_at = time.time()
    proc = subprocess.Popen([str(exe), "cpu", str(CPU_SECONDS)], stdout=subprocess.PIPE, text=True)
    started.append(proc)
    out = proc.communicate(timeout=CPU_SECONDS * 4)[0]
    assert proc.returncode == 0, out
    # (its last window is handed in a grace period after it ends)
    return first_start, (int(time.time() // WINDOW_S) + 1) * WINDOW_S * 10**9, started_at


def windows_of(received: Path, exe: Path) -> dict[int, list[pprof.ReadSample]]:
    """The cpu samples of `exe` received, by the start of their window."""
    got: dict[int, list[pprof.ReadSample]] = {}
    for meta in list_profiles(str(received)):
        if meta["type"] != "cpu":
            continue
        profile = pprof.read(Path(meta["path"]).read_bytes())
        for s in profile.samples:
            if s.labels.get("process.executable") == str(exe.resolve()):
                got.setdefault(profile.time_ns, []).append(s)
    return got


def check_whole(by_window: dict[int, list[pprof.ReadSample]], first_start: int, sample_hz: int, why: str) -> None:
    """The samples of the first window, and of the whole life, are whole stacks in their shares (`why`:
    what the pipeline's log says of its table, printed with the figures)."""

    def share(samples: list[pprof.ReadSample]) -> tuple[int, int]:
        return sum(s.values[0] for s in samples if whole(s)), sum(s.values[0] for s in samples)

    assert first_start in by_window, f"no samples in the window it started in: {sorted(by_window)} vs {first_start}"
    # (a drain's samples go to the window holding most of the time since the drain before: the very
    # first ones may land in the window before the one it started in)
    first = [s for t, samples in by_window.items() if t <= first_start for s in samples]
    life = [s for samples in by_window.values() for s in samples]
    (fw, ft), (lw, lt) = share(first), share(life)
    broken = Counter(" > ".join(f.function for f in s.frames) for s in first if not whole(s))
    print(
        f"first window: {fw}/{ft} = {fw / ft:.3f} whole ({why}); life: {lw}/{lt} = {lw / lt:.3f}; "
        f"broken: {broken.most_common(3)}; by window: "
        f"{[(t // 10**9 % 1000, sum(s.values[0] for s in v)) for t, v in sorted(by_window.items())]}"
    )
    assert ft >= 0.5 * WINDOW_S * sample_hz, f"only {ft} samples in the first window"
    assert fw / ft >= FIRST_WINDOW_WHOLE, f"first window {fw}/{ft} whole ({why}); broken: {broken.most_common(5)}"
    assert lw / lt >= LIFE_WHOLE, f"its life {lw}/{lt} whole"
