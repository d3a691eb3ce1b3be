"""BPF programs on the host, as `bpftool prog show` lists them, and who holds them.

Bench uses this to wait until no other profiler samples the host before it
measures, to know when a profiler it started has attached, and to check at the
end that it left no BPF program behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench.procs import BenchError

# Programs of profilers that would disturb a measurement: ebpfprofiler's
# collector, and any perf_event program (profile-bpfcc's is do_perf_event).
PROFILER_PROGRAM_NAMES = ("on_cpu_sample", "do_perf_event")


def programs() -> list[dict[str, Any]]:
    """Every loaded BPF program: dicts with at least id, type and name."""
    try:
        out = subprocess.run(
            ["bpftool", "-j", "prog", "show"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BenchError(f"bpftool prog show failed: {e}") from None
    return json.loads(out or "[]")


def held_by(pid: int) -> tuple[set[int], int]:
    """(ids of BPF programs, number of perf event fds) among the open files of `pid`."""
    prog_ids: set[int] = set()
    perf_fds = 0
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except (FileNotFoundError, PermissionError):
        return prog_ids, perf_fds
    for fd in fds:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target == "anon_inode:[perf_event]":
            perf_fds += 1
        elif target == "anon_inode:bpf-prog":
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    for line in f:
                        if line.startswith("prog_id:"):
                            prog_ids.add(int(line.split()[1]))
            except OSError:
                continue
    return prog_ids, perf_fds


def owners(prog_ids: set[int]) -> dict[int, list[str]]:
    """prog id → ["pid (comm)", ...] of the processes holding it (a scan of /proc)."""
    found: dict[int, list[str]] = {i: [] for i in prog_ids}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        held, _ = held_by(int(name))
        for i in held & prog_ids:
            try:
                with open(f"/proc/{name}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                comm = "?"
            found[i].append(f"{name} ({comm})")
    return found


def foreign_profilers(ours: set[int]) -> list[dict[str, Any]]:
    """Profiler programs (PROFILER_PROGRAM_NAMES or type perf_event) that bench did not load."""
    return [
        p
        for p in programs()
        if p["id"] not in ours and (p.get("name") in PROFILER_PROGRAM_NAMES or p.get("type") == "perf_event")
    ]


def wait_until_no_foreign_profiler(ours: set[int], timeout: float, log: Callable[[str], None]) -> float:
    """Wait (polling, with a deadline) until no other profiler's program is loaded; seconds waited."""
    t0 = time.monotonic()
    progs = foreign_profilers(ours)
    if not progs:
        return 0.0
    who = owners({p["id"] for p in progs})
    log(
        "waiting for another profiler to finish before measuring: "
        + ", ".join(
            f"{p.get('name', '?')} (prog {p['id']}, held by {', '.join(who[p['id']]) or 'no process'})" for p in progs
        )
    )
    deadline = t0 + timeout
    while progs:
        if time.monotonic() > deadline:
            raise BenchError(
                f"another profiler kept BPF programs loaded for {timeout:.0f} s: "
                + ", ".join(f"{p.get('name')} (prog {p['id']})" for p in progs)
            )
        time.sleep(1.0)
        progs = foreign_profilers(ours)
    waited = time.monotonic() - t0
    log(f"other profiler gone after {waited:.0f} s")
    return waited
