"""`make bench` suite `budget`: what the agent costs at the shipped defaults, measured from outside.

The agent is `ebpfprofiler run` with deploy/agent.yaml as shipped (only local_dir moved to a scratch
directory), as a user runs it. Its cost is what the host sees: the CPU of every process under `run`
(its CPU-time clock, ns) plus the kernel's run time of the BPF programs the collector holds (BPF_ENABLE_STATS,
which this suite turns on for those measurements: the agent leaves the kernel's statistics off and
counts its programs' cost itself, collector/bpftime.py), over MEASURE_S seconds after WARM_S seconds, with

- idle:      nothing else started;
- busy:      two CPU-bound loops, a CPython loop and a shell starting short processes
             (`while :; do /bin/true; sleep 0.001; done`, ~250-500 a second);
- spawner:   the shell alone (the cost per new process, against idle);
- pingpong:  bench/workloads/pingpong.c on one CPU, its round trips a second under the agent (median
             of PINGPONG_RUNS runs, the kernel's statistics off, as the agent leaves them) against the
             same runs alone, before and after (median of all) (blocks far shorter than
             offcpu_min_ms: the cost of a short block); then PINGPONG_RUNS more with the statistics
             on, for the BPF ns per switch.

Alongside, on the busy load, profile-bpfcc and `perf record -a -g` at the same 19 Hz: their CPU over
their whole life, including what they spend after the run to symbolize (profile-bpfcc on SIGINT,
`perf report` on the data), per second of the run.

Figures: total % of one CPU, stage by stage, BPF program by program (ns per run, runs a second), RSS
per stage, and the terms of the cost model (README "Overhead"): fixed cost a second (idle), cost per
new process (spawner - idle, per process started), cost per sample (on_cpu_sample ns per run), cost
per context switch with a short block (pingpong: the off-CPU programs' ns per switch) and with a long
one (idle: off-CPU BPF ns per interval charged), the overhead guard's decisions and the % of one
CPU each judged window cost by the agent's own counting (status.json), and the host's steal time
over each measurement (a round the hypervisor slowed shows there). Writes bench/results/budget.json.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench import bpf, procs
from bench.offcpu import build as build_pingpong
from bench.overhead import BpfccProfiler, PerfProfiler, bpf_totals, kernel_stats
from bench.procs import BenchError
from collector.overhead import START_UP, read_proc

ROOT = Path(__file__).resolve().parent.parent
# Seconds after start before measuring: past the first window boundary (at most upload_interval_s,
# 60, after start) and its hand-over. The first window holds the start-up work (BPF compile, the
# first unwind tables, the first symbols of every process on the host), which the overhead guard
# does not judge either.
WARM_S = 70.0
# Seconds measured: one whole window (upload_interval_s), so that the work done once a window (the
# boundary's drain, the profiles built, written and uploaded) is counted once, not 0 or 1 times by
# where a shorter stretch falls.
MEASURE_S = 60.0
# After the measurement, at most this long for the overhead guard's first judged window (it ends at
# the first drain 60 s after the start-up window's end: on a quiet host, just after a window boundary).
GUARD_WAIT_S = 75.0
# Round trips of one ping-pong run; about 2-4 s on these machines.
PINGPONG_TRIPS = 200_000
# Ping-pong runs per side (alone: this many before the agent and as many after; under the agent).
PINGPONG_RUNS = 3
SPAWNER = "while :; do /bin/true; sleep 0.001; done"
STAGES = ("run", "collector", "symbolizer", "runtime", "uploader")


def _tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        x = todo.pop()
        out.append(x)
        todo.extend(kids.get(x, []))
    return out


def _stage_of(pid: int) -> str | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    text = b" ".join(cmd).decode(errors="replace")
    for s in STAGES[1:]:
        if f"ebpfprofiler.{'runtimes' if s == 'runtime' else s}.main" in text:
            return s
    return "run" if " run " in f" {text} " else None


def _cpu_rss(pid: int) -> tuple[float, int]:
    """(CPU seconds since it started, RSS bytes) of a stage: its CPU-time clock, the kernel's own
    sum in ns (the figure /proc/PID/stat gives as utime + stime in 10-ms ticks, which at ~50 ms a
    minute a stage is too coarse for), read as the collector's guard reads it (collector/overhead.py)."""
    got = read_proc(pid)
    return (got.cpu_ns / 1e9, got.rss_bytes) if got is not None else (0.0, 0)


# Every BPF program id an agent of this suite held (bench/run.py checks none is left behind).
OUR_PROG_IDS: set[int] = set()


def _bpf_of(pid: int) -> dict[str, tuple[int, int]]:
    OUR_PROG_IDS.update(bpf.held_by(pid)[0])
    return bpf_totals([pid])


class Agent:
    """`ebpfprofiler run` at the shipped defaults, local_dir in `work`."""

    def __init__(self, work: Path) -> None:
        cfg = yaml.safe_load((ROOT / "deploy" / "agent.yaml").read_text())
        m = cfg["modules"]["ebpf_profiler"]
        m["local_dir"] = str(work / "profiles")
        (work / "profiles").mkdir()
        os.chmod(work / "profiles", 0o777)
        self.config = work / "agent.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.config.chmod(0o644)
        self.run_dir = work / "run"
        self.log = work / "agent.log"
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = procs.start(
                [
                    str(ROOT / ".venv" / "bin" / "ebpfprofiler"),
                    "run",
                    "--config",
                    str(self.config),
                    "--run-dir",
                    str(self.run_dir),
                ],
                stdout=log,
                stderr=log,
            )

    def stages(self) -> dict[str, int]:
        assert self.proc is not None
        out = {}
        for pid in _tree(self.proc.pid):
            s = _stage_of(pid)
            if s is not None and s not in out:
                out[s] = pid
        return out

    def status(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, timeout=60)
            self.proc = None

    def note_window(self, seen: dict[int, tuple[str, float]]) -> None:
        """Note the overhead guard's last window (RUN_DIR/status.json, as `ebpfprofiler status` and
        tests/integration/test_overhead_guard.py read it) in `seen`: its end time -> its decision and
        the % of one CPU it judged. The file holds one window and they are 60 s apart: note it more
        often than that."""
        s = self.status()
        if "time_ns" in s:
            seen[s["time_ns"]] = (s.get("decision", ""), float(s.get("used_pct", 0.0)))


def decisions(seen: dict[int, tuple[str, float]]) -> dict[str, int]:
    """Of the windows noted (Agent.note_window): how many were judged (all but the start-up one), and
    how many of those halved the rate, doubled it, or were over the budget at 1 Hz already."""
    judged = [d for d, _ in seen.values() if d != START_UP]
    return {"judged": len(judged), **{k: judged.count(k) for k in ("halve", "double", "over at floor")}}


def judged_pcts(seen: dict[int, tuple[str, float]]) -> list[float]:
    """The % of one CPU of each judged window noted, in time order: what the guard saw, by the agent's
    own counting (its programs time themselves, collector/bpftime.py)."""
    return [pct for _, (d, pct) in sorted(seen.items()) if d != START_UP]


def guard_text(d: dict[str, int]) -> str:
    """What the guard did over a run, in a few words: "3 window(s) judged, none halved"."""
    did = ", ".join(
        f"{n} {what}"
        for what, n in (("halved", d["halve"]), ("doubled", d["double"]), ("over at 1 Hz", d["over at floor"]))
        if n
    )
    return f"{d['judged']} window(s) judged, " + (did or "none halved")


def measure_agent(work: Path, load: list[list[str]], warm_s: float, measure_s: float) -> dict[str, Any]:
    """Start the agent, then the load; after warm_s, the agent's cost over measure_s (the kernel's BPF
    statistics on throughout)."""
    agent = Agent(work)
    loads: list[subprocess.Popen[Any]] = []
    stats = kernel_stats()
    try:
        agent.start()
        loads = [procs.start(argv) for argv in load]
        time.sleep(warm_s)
        stages = agent.stages()
        if "collector" not in stages:
            raise BenchError(f"the collector is not running; see {agent.log}")
        c0 = {s: _cpu_rss(p)[0] for s, p in stages.items()}
        b0 = _bpf_of(stages["collector"])
        # steal: the hypervisor ran something else while this VM's CPUs wanted to run (a round the
        # host slowed shows here)
        steal0 = procs.host_cpu()["steal_s"]
        t0 = time.monotonic()
        time.sleep(measure_s)
        wall = time.monotonic() - t0
        steal = procs.host_cpu()["steal_s"] - steal0
        now = {s: _cpu_rss(p) for s, p in stages.items()}
        b1 = _bpf_of(stages["collector"])
        seen = guard_windows(agent)
        status = agent.status()
    finally:
        for p in loads:
            procs.stop(p, sig=signal.SIGKILL, timeout=10)
        agent.stop()
        stats.close()
    stage_ms = {s: 1000 * (now[s][0] - c0[s]) / wall for s in stages}
    progs = program_rates(b0, b1, wall)
    bpf_ms = sum(p["ms_per_s"] for p in progs.values())
    total_pct = (sum(stage_ms.values()) + bpf_ms) / 10
    return {
        "total_pct": total_pct,
        "stage_ms_per_s": stage_ms,
        "bpf_ms_per_s": bpf_ms,
        "programs": progs,
        "rss_mb": {s: now[s][1] / 1e6 for s in stages},
        "rss_total_mb": sum(v[1] for v in now.values()) / 1e6,
        "sample_hz": status.get("rate_hz"),
        "guard": status.get("decision"),
        "decisions": decisions(seen),
        "judged_pct": judged_pcts(seen),
        "host_steal_pct": 100 * steal / wall / (os.cpu_count() or 1),
        "seconds": wall,
    }


def guard_windows(agent: Agent) -> dict[int, tuple[str, float]]:
    """The guard's windows once it has judged one, or at GUARD_WAIT_S.

    Its first judged window (60 s after the start-up one, which ends at the first drain 60 s after
    start) ends about when the measurement does: waited for under the same load, so that what the
    guard decided is part of the figures."""
    seen: dict[int, tuple[str, float]] = {}
    deadline = time.monotonic() + GUARD_WAIT_S
    while True:
        agent.note_window(seen)
        if decisions(seen)["judged"] >= 1 or time.monotonic() >= deadline:
            return seen
        time.sleep(1.0)


def program_rates(
    b0: dict[str, tuple[int, int]], b1: dict[str, tuple[int, int]], wall: float
) -> dict[str, dict[str, float]]:
    """Per BPF program, from the kernel's run time and count before and after: ms per second, runs per
    second, ns per run."""
    progs = {}
    for name, (t, c) in b1.items():
        t0, c0 = b0.get(name, (0, 0))
        runs = c - c0
        progs[name] = {
            "ms_per_s": (t - t0) / 1e6 / wall,
            "runs_per_s": runs / wall,
            "ns_per_run": (t - t0) / runs if runs else 0.0,
        }
    return progs


def measure_peer(work: Path, peer: str, load: list[list[str]], seconds: float) -> dict[str, Any]:
    """A peer at 19 Hz on the load: its CPU over its life (post-processing included) per second of the run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    prof = BpfccProfiler(work / peer, 19) if peer == "profile-bpfcc" else PerfProfiler(work / peer, 19, dwarf=False)
    loads: list[subprocess.Popen[Any]] = []
    try:
        loads = [procs.start(argv) for argv in load]
        prof.start()
        time.sleep(seconds)
        prof.stop()
        if isinstance(prof, PerfProfiler):  # perf's symbolizing happens here, after the run
            subprocess.run(
                ["perf", "report", "--stdio", "-i", str(prof.data)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=600,
                check=False,
            )
    finally:
        after_peer = resource.getrusage(resource.RUSAGE_CHILDREN)
        for p in loads:
            procs.stop(p, sig=signal.SIGKILL, timeout=10)
    cpu = (after_peer.ru_utime - before.ru_utime) + (after_peer.ru_stime - before.ru_stime)
    return {
        "total_pct": 100 * cpu / seconds,
        "cpu_s": cpu,
        "seconds": seconds,
        "note": "process CPU only (its BPF run time is not counted)",
    }


def pingpong_rate(binary: str) -> float:
    out = subprocess.run(
        ["taskset", "-c", "0", binary, str(PINGPONG_TRIPS), "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    f = dict(kv.split("=") for kv in out.split())
    return int(f["round_trips"]) / float(f["seconds"])


class BudgetBench:
    def __init__(
        self, rounds: int, warm_s: float = WARM_S, measure_s: float = MEASURE_S, log: Callable[[str], None] = print
    ) -> None:
        self.rounds, self.warm_s, self.measure_s, self.log = rounds, warm_s, measure_s, log
        self.our_prog_ids = OUR_PROG_IDS

    def run(self) -> dict[str, Any]:
        tmp = Path(tempfile.mkdtemp(prefix="ebpfprofiler-budget-", dir="/tmp"))
        tmp.chmod(0o755)
        try:
            pingpong = build_pingpong(str(tmp))
            busy = [
                ["sh", "-c", "while :; do :; done"],
                ["sh", "-c", "while :; do :; done"],
                ["python3", "-c", "while True: pass"],
                ["sh", "-c", SPAWNER],
            ]
            runs: dict[str, list[dict[str, Any]]] = {
                "idle": [],
                "busy": [],
                "spawner": [],
                "pingpong": [],
                "profile-bpfcc": [],
                "perf -g": [],
            }
            for r in range(self.rounds):
                for name, load in (("idle", []), ("busy", busy), ("spawner", [["sh", "-c", SPAWNER]])):
                    d = tmp / f"{name}-{r}"
                    d.mkdir()
                    d.chmod(0o755)
                    if name == "spawner":
                        n0 = _forks()
                    res = measure_agent(d, load, self.warm_s, self.measure_s)
                    if name == "spawner":
                        res["processes_per_s"] = (_forks() - n0) / (self.warm_s + self.measure_s)
                    runs[name].append(res)
                    self.log(
                        f"budget round {r + 1}: {name}: {res['total_pct']:.3f}% of one CPU "
                        f"(stages {sum(res['stage_ms_per_s'].values()):.2f} ms/s, BPF {res['bpf_ms_per_s']:.3f} ms/s), "
                        f"RSS {res['rss_total_mb']:.0f} MB, rate {res['sample_hz']} Hz, guard: {guard_text(res['decisions'])} "
                        f"(judged {', '.join(f'{p:.3f}%' for p in res['judged_pct'])}), "
                        f"host steal {res['host_steal_pct']:.2f}%"
                    )
                for peer in ("profile-bpfcc", "perf -g"):
                    d = tmp / f"{peer.replace(' ', '')}-{r}"
                    d.mkdir()
                    res = measure_peer(d, peer, busy, self.measure_s)
                    runs[peer].append(res)
                    self.log(f"budget round {r + 1}: {peer} on the busy load: {res['total_pct']:.3f}% of one CPU")
                # Alone before and after the agent's runs, the median of each side: one run of a few
                # seconds on a shared 2-CPU VM varies by ±10%, more than the cost being measured.
                alone_runs = [pingpong_rate(pingpong) for _ in range(PINGPONG_RUNS)]
                d = tmp / f"pingpong-{r}"
                d.mkdir()
                d.chmod(0o755)
                res = self._pingpong_under_agent(d, pingpong)
                alone_runs += [pingpong_rate(pingpong) for _ in range(PINGPONG_RUNS)]
                alone = _median(alone_runs)
                res["ratio"] = res["rate"] / alone
                res["alone"] = alone
                res["alone_runs"] = alone_runs
                runs["pingpong"].append(res)
                self.log(f"budget round {r + 1}: pingpong keeps {res['ratio']:.3f} of its round trips")
            return {"runs": runs, "model": model(runs), "warm_s": self.warm_s, "measure_s": self.measure_s}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _pingpong_under_agent(self, d: Path, binary: str) -> dict[str, Any]:
        agent = Agent(d)
        try:
            agent.start()
            procs.wait_for(
                "the collector",
                lambda: ("collector" in agent.stages() and (agent.run_dir / "collector.ready").exists()) or None,
                120,
            )
            time.sleep(5)
            col = agent.stages()["collector"]
            rates = [pingpong_rate(binary) for _ in range(PINGPONG_RUNS)]
            stats = kernel_stats()
            try:
                b0 = _bpf_of(col)
                for _ in range(PINGPONG_RUNS):
                    pingpong_rate(binary)
                b1 = _bpf_of(col)
            finally:
                stats.close()
        finally:
            agent.stop()
        progs = {n: {"runs": c - b0.get(n, (0, 0))[1], "ns": t - b0.get(n, (0, 0))[0]} for n, (t, c) in b1.items()}
        return {"rate": _median(rates), "runs": rates, "programs": progs}


def _forks() -> int:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("processes "):
            return int(line.split()[1])
    return 0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def model(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """The cost-model terms, medians over rounds."""
    idle = _median([r["total_pct"] for r in runs["idle"]]) * 10  # ms per s
    spawn = [
        (r["total_pct"] * 10 - idle) / r["processes_per_s"] * 1000 for r in runs["spawner"] if r.get("processes_per_s")
    ]
    sample = _median([r["programs"].get("on_cpu_sample", {}).get("ns_per_run", 0.0) for r in runs["busy"]])
    short = []
    for r in runs["pingpong"]:
        p = r["programs"]
        switches = p.get("offcpu_switch", {}).get("runs", 0)
        ns = sum(p.get(n, {}).get("ns", 0) for n in ("offcpu_switch", "offcpu_wakeup", "offcpu_resume"))
        if switches:
            short.append(ns / switches)
    long_ = []
    for r in runs["idle"]:
        p = r["programs"]
        ns = (
            sum(
                p.get(n, {}).get("ms_per_s", 0)
                for n in ("offcpu_switch", "offcpu_wakeup", "offcpu_resume", "offcpu_unwind_s", "offcpu_unwind_f")
            )
            * 1e6
        )
        sw = p.get("offcpu_switch", {}).get("runs_per_s", 0)
        if sw:
            long_.append(ns / sw)
    return {
        "fixed_ms_per_s": idle,
        "per_new_process_us": _median(spawn),
        "per_sample_ns": sample,
        "per_switch_short_block_ns": _median(short),
        "per_switch_idle_host_ns": _median(long_),
    }


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    runs = result["runs"]
    head = ["configuration", "% of one CPU", "stages ms/s", "BPF ms/s", "RSS MB", "rate Hz", "guard"]
    rows = [_agent_row(name, runs[name]) for name in ("idle", "busy", "spawner")]
    for peer in ("profile-bpfcc", "perf -g"):
        rows.append(
            [
                f"{peer} (busy, CPU incl. symbolizing)",
                f"{_median([r['total_pct'] for r in runs[peer]]):.3f}",
                "",
                "",
                "",
                "19",
                "",
            ]
        )
    rows.append(
        [
            "pingpong (ratio of round trips)",
            f"{_median([r['ratio'] for r in runs['pingpong']]):.3f}",
            "",
            "",
            "",
            "",
            "",
        ]
    )
    caption = (
        f"Median of {len(runs['idle'])} round(s), {result['measure_s']:.0f} s measured after "
        f"{result['warm_s']:.0f} s at deploy/agent.yaml's defaults"
    )
    return caption, head, rows, _notes(runs, result["model"])


def _agent_row(name: str, rs: list[dict[str, Any]]) -> list[str]:
    """The table's row of the agent under one load, over its rounds."""
    return [
        name,
        f"{_median([r['total_pct'] for r in rs]):.3f}",
        f"{_median([sum(r['stage_ms_per_s'].values()) for r in rs]):.2f}",
        f"{_median([r['bpf_ms_per_s'] for r in rs]):.3f}",
        f"{_median([r['rss_total_mb'] for r in rs]):.0f}",
        str(rs[-1]["sample_hz"]),
        guard_text({k: sum(r["decisions"][k] for r in rs) for k in rs[0]["decisions"]})
        if all("decisions" in r for r in rs)
        else str(rs[-1]["guard"]),
    ]


def _notes(runs: dict[str, list[dict[str, Any]]], m: dict[str, float]) -> list[str]:
    """The table's notes: the cost model, the last rounds by stage and program, each load by round."""
    notes = [
        f"cost model: fixed {m['fixed_ms_per_s']:.2f} ms/s; per new process {m['per_new_process_us']:.0f} us; "
        f"per sample {m['per_sample_ns']:.0f} ns; per context switch with a short block "
        f"{m['per_switch_short_block_ns']:.0f} ns; per context switch on the idle host (mostly long blocks) "
        f"{m['per_switch_idle_host_ns']:.0f} ns",
        "by stage (idle): " + ", ".join(f"{s} {v:.2f} ms/s" for s, v in runs["idle"][-1]["stage_ms_per_s"].items()),
        "by program (busy): "
        + ", ".join(
            f"{n} {p['ns_per_run']:.0f} ns x {p['runs_per_s']:.0f}/s" for n, p in runs["busy"][-1]["programs"].items()
        ),
        "RSS by stage (busy): " + ", ".join(f"{s} {v:.0f} MB" for s, v in runs["busy"][-1]["rss_mb"].items()),
    ]
    for name in ("idle", "busy", "spawner"):
        if all("judged_pct" in r for r in runs[name]):
            notes.append(
                f"{name}, by round: % of one CPU measured from outside / the windows the guard judged "
                f"(its own counting) / the host's steal time: "
                + "; ".join(
                    f"{r['total_pct']:.3f} / {', '.join(f'{p:.3f}' for p in r['judged_pct'])} / "
                    f"{r['host_steal_pct']:.2f}%"
                    for r in runs[name]
                )
            )
    return notes
