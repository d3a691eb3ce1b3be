"""The CPU-bound workload (workloads/cpu_loop.c): build it, size it, run it.

The workload does a fixed amount of work (UNITS × 10^6 iterations of a
multiply-add chain) on N threads and reports its own wall time and CPU time.
Throughput is work / elapsed; a slowdown ratio is elapsed_with / elapsed_without.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import procs
from bench.procs import BenchError

SOURCE = Path(__file__).resolve().parent / "workloads" / "cpu_loop.c"
CFLAGS = ["-O2", "-fno-omit-frame-pointer", "-pthread"]
# The calibration run does this many units per thread (~0.6 s here).
CALIBRATION_UNITS_PER_THREAD = 400


@dataclass(frozen=True)
class Result:
    elapsed_s: float          # wall time of the work, measured by the workload
    cpu_s: float              # its user + system CPU time
    host: dict[str, float]    # host-wide CPU seconds during the run (procs.host_cpu_delta)


def build(tmpdir: str) -> str:
    out = os.path.join(tmpdir, "cpu_loop")
    cmd = ["gcc", *CFLAGS, "-o", out, str(SOURCE)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BenchError(f"cannot build the workload ({' '.join(cmd)}):\n{r.stderr}")
    return out


def run(binary: str, units: int, threads: int, timeout: float, kernel_ms: int = 0) -> Result:
    """Run the workload to the end; BenchError if it fails or takes longer than `timeout`.

    kernel_ms > 0 (warm-up runs): each thread then spends that long in read(2) of /dev/zero.
    """
    before = procs.host_cpu()
    p = procs.start([binary, str(units), str(threads), str(kernel_ms)], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs.stop(p, timeout=5)
        raise BenchError(f"the workload ran longer than {timeout:.0f} s") from None
    finally:
        procs.stop(p)
    host = procs.host_cpu_delta(before, procs.host_cpu())
    if p.returncode != 0:
        raise BenchError(f"the workload exited with {p.returncode}: {err.strip()}")
    fields = dict(kv.split("=", 1) for kv in out.split())
    try:
        return Result(float(fields["elapsed_s"]), float(fields["cpu_s"]), host)
    except (KeyError, ValueError):
        raise BenchError(f"unexpected workload output: {out!r}") from None


def calibrate(binary: str, threads: int, target_s: float, disturbed_share: float,
              before_each: Callable[[], object] = lambda: None, max_tries: int = 10) -> tuple[int, dict]:
    """UNITS that take about `target_s` wall seconds with nothing else running, and the evidence.

    Two undisturbed calibration runs (the first also warms caches and CPU
    clocks), each after `before_each()` (bench waits for a quiet host there); a
    run during which other processes used more than `disturbed_share` of the
    workload's CPU time does not count.
    """
    units = CALIBRATION_UNITS_PER_THREAD * threads
    elapsed: list[float] = []
    tries = 0
    while len(elapsed) < 2:
        tries += 1
        before_each()
        r = run(binary, units, threads, timeout=120)
        other = r.host["busy_s"] - r.cpu_s
        if other <= disturbed_share * r.cpu_s:
            elapsed.append(r.elapsed_s)
        elif tries >= max_tries:
            raise BenchError(f"cannot calibrate the workload: other processes kept using CPU "
                             f"({other:.2f} s during a {r.elapsed_s:.2f} s run, {tries} tries)")
    rate = units / min(elapsed)
    sized = max(threads, round(rate * target_s))
    return sized, {"calibration_units": units, "calibration_elapsed_s": elapsed, "calibration_tries": tries,
                   "units_per_s": round(rate, 1), "target_s": target_s, "units": sized}
