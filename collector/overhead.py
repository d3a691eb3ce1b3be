"""The overhead guard: what the profiler cost in each upload window, and the sampling rate it allows.

Owns: the window's figures — CPU time of every stage's process (the pids in
the run directory's ready files: utime + stime of all threads, by the
process's CPU-time clock, in ns), RSS of each (/proc/<pid>/stat), the run time and run count of each
of the collector's BPF programs as they count it (collector/bpftime.py), samples
and lost samples — the
budget decision (over overhead_budget_pct of the window's wall time: halve
the rate, floor 1 Hz; three windows in a row under half of it: double it
back, never above the configured rate), the log line of every window, and
the status file (RUN_DIR/status.json) that `ebpfprofiler status` prints.

Must not: attach, detach or drain anything (the collector changes the rate
when told to), or read anything of a process but its /proc stat and status.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from collector.bpftime import ProgTime
from shared import files
from shared.procstat import read_stat, stat_fields

log = logging.getLogger("ebpfprofiler.collector.overhead")

# Windows in a row under half the budget before the rate is doubled back (the three).
RECOVER_AFTER_WINDOWS = 3
# The lowest rate the guard goes to: below 1 Hz a cpu-clock period is over a second.
FLOOR_HZ = 1
# The decision of the first window since start: not judged (see end_window).
START_UP = "start-up"
STATUS_FILE = "status.json"
# Version of the status file's layout, for `ebpfprofiler status` and other readers.
STATUS_VERSION = 1
# The stages' ready files: "<stage>.ready" holding the pid (shared/ready.py).
READY_SUFFIX = ".ready"
# Clock ticks and page size, to turn /proc/<pid>/stat fields into nanoseconds and bytes.
_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)


def status_path(run_dir: str) -> str:
    return os.path.join(run_dir, STATUS_FILE)


@dataclass(frozen=True)
class ProcSample:
    pid: int
    start_ticks: int  # field 22 of /proc/<pid>/stat: tells a reused pid from the stage's
    cpu_ns: int  # utime + stime of every thread, since the process started
    rss_bytes: int


def _cpu_clock_ns(pid: int) -> int | None:
    """The process's CPU-time clock (clock_getcpuclockid): utime + stime in ns, not 10 ms ticks."""
    clock = ctypes.c_int()
    if _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        return None
    try:
        return time.clock_gettime_ns(clock.value)
    except OSError:
        return None


def read_proc(pid: int) -> ProcSample | None:
    """CPU time and RSS of `pid`, or None if it is gone."""
    text = read_stat(pid)
    if text is None:
        return None
    fields = stat_fields(text)  # field N is fields[N - 3]
    utime, stime, start, rss = int(fields[11]), int(fields[12]), int(fields[19]), int(fields[21])
    cpu_ns = _cpu_clock_ns(pid)
    if cpu_ns is None:
        cpu_ns = (utime + stime) * 1_000_000_000 // _TICKS
    return ProcSample(pid, start, cpu_ns, rss * _PAGE)


def stage_pids(run_dir: str) -> dict[str, int]:
    """stage name → pid, from the ready files in the run directory (unreadable or stale ones skipped)."""
    out: dict[str, int] = {}
    try:
        names = os.listdir(run_dir)
    except OSError:
        return out
    for name in names:
        if not name.endswith(READY_SUFFIX):
            continue
        try:
            with open(os.path.join(run_dir, name)) as f:
                out[name[: -len(READY_SUFFIX)]] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


class Budget:
    """The rate decision alone: levels of halving below the configured rate."""

    def __init__(self, configured_hz: int, budget_pct: float) -> None:
        self.configured_hz = configured_hz
        self.budget_pct = budget_pct
        self.level = 0  # the rate is configured_hz // 2**level
        self.under = 0  # windows in a row under half the budget

    @property
    def rate_hz(self) -> int:
        return max(FLOOR_HZ, self.configured_hz >> self.level)

    def judge(self, used_ns: int, wall_ns: int) -> str:
        """ "halve", "double", "over at floor" (over budget at 1 Hz already) or "" for a window that
        cost `used_ns` in `wall_ns`; updates the rate."""
        budget_ns = self.budget_pct / 100 * wall_ns
        if used_ns > budget_ns:
            self.under = 0
            if self.rate_hz > FLOOR_HZ:
                self.level += 1
                return "halve"
            return "over at floor"
        if used_ns < budget_ns / 2:
            self.under += 1
            if self.under >= RECOVER_AFTER_WINDOWS and self.level > 0:
                self.level -= 1
                self.under = 0
                return "double"
            return ""
        self.under = 0
        return ""


@dataclass
class WindowFigures:
    time_ns: int
    window_s: float
    rate_hz: int
    configured_hz: int
    budget_pct: float
    used_pct: float  # (stage CPU + BPF run time) / wall time, percent of one CPU
    stage_cpu_ns: dict[str, int]  # stage → CPU time in the window
    stage_rss_bytes: dict[str, int]
    stage_pids: dict[str, int]
    bpf: dict[str, dict[str, int]]  # program → {"run_time_ns", "run_cnt"} in the window
    samples: dict[str, int]  # profile type → samples in the window
    lost: dict[str, int]  # reason → lost in the window
    bpf_stats: str  # how the BPF figures are measured (collector/bpftime.py)
    # The programs' own counters as read at the window's end ({"run_cnt", "timed", "timed_ns"} per
    # program, since it was loaded), and the wall-clock interval of that read: the kernel's run count
    # of a program (`bpftool prog show`, while its statistics are on) before that interval is <=
    # run_cnt, after it >=.
    bpf_totals: dict[str, dict[str, int]] = field(default_factory=dict)
    bpf_read_ns: tuple[int, int] = (0, 0)
    decision: str = ""
    next_rate_hz: int = 0
    new_processes: int = 0  # processes the collector read from /proc for the first time
    pid: int = field(default_factory=os.getpid)

    @property
    def stage_ns(self) -> int:
        return sum(self.stage_cpu_ns.values())

    @property
    def bpf_ns(self) -> int:
        return sum(p["run_time_ns"] for p in self.bpf.values())


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def describe(w: WindowFigures) -> str:
    """The figures of a window in one line."""
    stages = ", ".join(f"{s} {_ms(ns)}" for s, ns in sorted(w.stage_cpu_ns.items()))
    progs = ", ".join(
        f"{name} {_ms(p['run_time_ns'])}/{p['run_cnt']} runs"
        + (f" = {p['run_time_ns'] // p['run_cnt']} ns each" if p["run_cnt"] else "")
        for name, p in sorted(w.bpf.items())
    )
    lost = sum(w.lost.values())
    return (
        f"{w.used_pct:.3f}% of one CPU in {w.window_s:.1f} s (budget {w.budget_pct:g}%): "
        f"stages {_ms(w.stage_ns)} ({stages or 'none'}), BPF {_ms(w.bpf_ns)} ({progs or 'no statistics'}); "
        f"samples {dict(sorted(w.samples.items()))}, lost {lost}{' ' + str(w.lost) if lost else ''}; "
        f"rate {w.rate_hz} Hz (configured {w.configured_hz} Hz)"
    )


class OverheadGuard:
    """Measures each window and keeps the rate within the budget; the collector applies the rate."""

    def __init__(
        self,
        run_dir: str,
        configured_hz: int,
        budget_pct: float,
        bpf_stats: str,
        read_bpf: Callable[[], Mapping[str, ProgTime]],
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.run_dir = run_dir
        self.budget = Budget(configured_hz, budget_pct)
        self.bpf_stats = bpf_stats
        self._read_bpf_now = read_bpf
        self._clock = clock
        self._start_ns = clock()
        self._cpu: dict[str, ProcSample] = {}
        self._bpf: dict[str, ProgTime] = {}
        self._samples: dict[str, int] = {}
        self._lost: dict[str, int] = {}
        self._new_processes = 0
        self.last: WindowFigures | None = None
        self._baseline({}, {})

    def _read_bpf(self) -> dict[str, ProgTime]:
        try:
            return dict(self._read_bpf_now())
        except (OSError, KeyError) as e:  # bcc raises KeyError for a lookup that failed
            log.warning("BPF run times: cannot read them (%s)", e)
            return {}

    def _read_stages(self) -> dict[str, ProcSample]:
        pids = stage_pids(self.run_dir)
        pids["collector"] = os.getpid()  # before its ready file exists, too
        return {s: got for s, pid in pids.items() if (got := read_proc(pid)) is not None}

    def _baseline(self, samples: Mapping[str, int], lost: Mapping[str, int]) -> None:
        self._cpu = self._read_stages()
        self._bpf = self._read_bpf()
        self._samples = dict(samples)
        self._lost = dict(lost)

    def set_budget(self, budget_pct: float) -> None:
        self.budget.budget_pct = budget_pct

    def window_due(self, interval_s: int, slack_s: float = 0.0) -> bool:
        """An upload window has passed since the last one ended; `slack_s` early counts (the caller
        checks once per drain, and a window a drain's jitter short must not wait a whole drain more)."""
        return self._clock() - self._start_ns >= (interval_s - slack_s) * 1_000_000_000

    def end_window(self, samples: Mapping[str, int], lost: Mapping[str, int], new_processes: int = 0) -> WindowFigures:
        """Close the window: its figures, with the decision taken on them (budget.rate_hz is the new rate)."""
        now = self._clock()
        wall_ns = max(1, now - self._start_ns)
        cpu = self._read_stages()
        stage_cpu: dict[str, int] = {}
        for stage, s in cpu.items():
            before = self._cpu.get(stage)
            if before is not None and (before.pid, before.start_ticks) == (s.pid, s.start_ticks):
                stage_cpu[stage] = s.cpu_ns - before.cpu_ns
            else:
                # A stage that (re)started in this window: all its CPU so far is this window's.
                stage_cpu[stage] = s.cpu_ns if self.last is not None or before is not None else 0
        read_start = time.time_ns()
        bpf_now = self._read_bpf()
        read_end = time.time_ns()
        bpf: dict[str, dict[str, int]] = {}
        for name, p in bpf_now.items():
            change = p.since(self._bpf.get(name, ProgTime()))
            bpf[name] = {"run_time_ns": change.run_time_ns, "run_cnt": change.runs}
        used = sum(stage_cpu.values()) + sum(p["run_time_ns"] for p in bpf.values())
        rate = self.budget.rate_hz
        w = WindowFigures(
            time_ns=time.time_ns(),
            window_s=wall_ns / 1e9,
            rate_hz=rate,
            configured_hz=self.budget.configured_hz,
            budget_pct=self.budget.budget_pct,
            used_pct=100.0 * used / wall_ns,
            stage_cpu_ns=stage_cpu,
            stage_rss_bytes={s: p.rss_bytes for s, p in cpu.items()},
            stage_pids={s: p.pid for s, p in cpu.items()},
            bpf=bpf,
            samples={k: v - self._samples.get(k, 0) for k, v in samples.items()},
            lost={k: d for k, v in lost.items() if (d := v - self._lost.get(k, 0))},
            bpf_stats=self.bpf_stats,
            bpf_read_ns=(read_start, read_end),
            new_processes=new_processes - self._new_processes,
            bpf_totals={n: {"run_cnt": p.runs, "timed": p.timed, "timed_ns": p.timed_ns} for n, p in bpf_now.items()},
        )
        # The first window since start holds one-off costs (compiling BPF, building the unwind
        # tables of every running process's modules) that no sampling rate would lower: it is
        # measured and reported, not judged.
        w.decision = START_UP if self.last is None else self.budget.judge(used, wall_ns)
        w.next_rate_hz = self.budget.rate_hz
        self._start_ns = now
        self._cpu, self._bpf = cpu, bpf_now
        self._samples, self._lost = dict(samples), dict(lost)
        self._new_processes = new_processes
        self.last = w
        return w


def write_status(run_dir: str, w: WindowFigures) -> None:
    """RUN_DIR/status.json, whole or absent (shared/files.write_atomic), readable by the agent's group."""
    doc = {"version": STATUS_VERSION, **asdict(w), "stage_ns": w.stage_ns, "bpf_ns": w.bpf_ns}
    files.write_atomic(status_path(run_dir), json.dumps(doc, sort_keys=True).encode() + b"\n", mode=0o644)


def remove_status(run_dir: str) -> None:
    Path(status_path(run_dir)).unlink(missing_ok=True)


def log_window(w: WindowFigures, out: logging.Logger) -> None:
    """The log line of a window: its figures, and what the guard decided from them."""
    budget_ms = w.budget_pct / 100 * w.window_s * 1e3
    if w.decision == "halve":
        out.warning(
            "overhead over budget: %.1f ms used > %.1f ms allowed (%g%% of one CPU); halving "
            "sample_hz %d -> %d Hz. Window: %s",
            w.used_pct / 100 * w.window_s * 1e3,
            budget_ms,
            w.budget_pct,
            w.rate_hz,
            w.next_rate_hz,
            describe(w),
        )
    elif w.decision == "over at floor":
        out.warning(
            "overhead over budget at %d Hz already: %.1f ms used > %.1f ms allowed; the rest is not the "
            "sampling rate's (stage CPU, off-CPU tracepoints): raise overhead_budget_pct, or turn off "
            "what costs. Window: %s",
            w.rate_hz,
            w.used_pct / 100 * w.window_s * 1e3,
            budget_ms,
            describe(w),
        )
    elif w.decision == START_UP:
        out.info(
            "overhead of the start-up window (one-off costs: compiling BPF, building unwind tables; "
            "reported, not judged against the budget): %s",
            describe(w),
        )
    elif w.decision == "double":
        out.info(
            "overhead under half the budget for %d windows: doubling sample_hz %d -> %d Hz. Window: %s",
            RECOVER_AFTER_WINDOWS,
            w.rate_hz,
            w.next_rate_hz,
            describe(w),
        )
    else:
        out.info("overhead: %s", describe(w))
