"""Is the host quiet enough to measure on? No other profiler loaded, little else running.

This machine is shared: other people's tests run workloads and load BPF
programs. Before every measured run bench waits, polling with a deadline,
until neither is the case; a run that was disturbed anyway is detected after
the fact from /proc/stat (see oncpu.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from bench import bpf, procs
from bench.procs import BenchError

# The host is quiet when, over QUIET_WINDOW_S, at most this share of its CPU
# time was busy (bench's own profilers are stopped by then).
QUIET_SHARE = 0.10
QUIET_WINDOW_S = 0.5


def _process_times() -> dict[int, tuple[str, float]]:
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            out[int(name)] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / procs.CLK_TCK)
        except (OSError, IndexError, ValueError):
            continue
    return out


def busy_over(window_s: float) -> tuple[float, str]:
    """(share of all CPUs busy over the next `window_s`, the busiest process that lived through it)."""
    ncpu = os.sysconf("SC_NPROCESSORS_ONLN")
    p0, h0, t0 = _process_times(), procs.host_cpu(), time.monotonic()
    time.sleep(window_s)  # the measurement window itself
    p1, h1, t1 = _process_times(), procs.host_cpu(), time.monotonic()
    share = (h1["busy_s"] - h0["busy_s"]) / (ncpu * (t1 - t0))
    deltas = [(p1[pid][1] - p0[pid][1], pid, p1[pid][0]) for pid in p1 if pid in p0]
    top = max(deltas, default=(0.0, 0, "?"))
    return share, f"{top[2]} (pid {top[1]}, {top[0] / (t1 - t0):.0%} of a CPU)"


def wait_until_quiet(ours: set[int], timeout: float, log: Callable[[str], None]) -> float:
    """Wait until no other profiler is loaded and the host is nearly idle; seconds waited."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    said = False
    while True:
        left = deadline - time.monotonic()
        bpf.wait_until_no_foreign_profiler(ours, max(left, 1.0), log)
        share, top = busy_over(QUIET_WINDOW_S)
        if share <= QUIET_SHARE:
            break
        if time.monotonic() > deadline:
            raise BenchError(
                f"the host stayed busy for {timeout:.0f} s ({share:.0%} of its CPUs; busiest: {top}); nothing measured"
            )
        if not said:
            log(
                f"waiting for the host to quieten: {share:.0%} of its CPUs busy; busiest process that "
                f"lived through the check: {top}"
            )
            said = True
    waited = time.monotonic() - t0
    if said:
        log(f"host quiet after {waited:.0f} s")
    return waited
