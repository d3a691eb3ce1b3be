"""The overhead guard with real BPF and the real pipeline: the rate follows the budget, and the
BPF time our programs count themselves agrees with the kernel's own statistics of them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from collector.bpfstats import RunTimeStats
from collector.bpftime import ProgTime
from shared import config as config_mod
from shared import pprof
from shared.config import ProfilerConfig
from tests.harness import (
    PY,
    ROOT,
    Pipeline,
    bpf_holdings,
    bpf_prog_id,
    bpftool,
    open_dir,
    require_root,
    wait_for,
    write_config,
)

CONFIGURED_HZ = 999
# Far below what the collector alone spends on a drain a second: every window is over it.
TINY_BUDGET_PCT = 0.001
# A whole CPU: no window of this pipeline comes near half of it.
LARGE_BUDGET_PCT = 100.0
WINDOW_S = 1
STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


def fd_targets(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:  # noqa: SIM105
            out.add(os.readlink(fd))
        except FileNotFoundError:  # closed meanwhile
            pass
    return out


def status(p: Pipeline) -> dict | None:
    try:
        return json.loads((p.run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def next_status(p: Pipeline, after_ns: int, timeout: float = 30) -> dict:
    """The first status written for a window that ended after `after_ns`."""
    return wait_for(
        "the collector's next window status",
        lambda: (s := status(p)) is not None and s["time_ns"] > after_ns and s,
        timeout,
    )


@pytest.fixture
def pipeline(tmp_path: Path) -> Iterator[tuple[Pipeline, Path]]:
    require_root()
    out = open_dir("overhead")
    cfg = ProfilerConfig(
        sample_hz=CONFIGURED_HZ,
        upload_interval_s=WINDOW_S,
        overhead_budget_pct=TINY_BUDGET_PCT,
        local_dir=str(out / "profiles"),
        python_stacks=False,
    )
    stats_before = STATS_SYSCTL.read_text()
    p = Pipeline(tmp_path, cfg)
    try:
        yield p, out
    finally:
        p.stop()
        shutil.rmtree(out, ignore_errors=True)
    # and the kernel's statistics setting is as it was: the collector does not touch it
    assert STATS_SYSCTL.read_text() == stats_before


def test_tiny_budget_halves_the_rate_and_a_raised_budget_brings_it_back(pipeline: tuple[Pipeline, Path]) -> None:
    # given the pipeline at 999 Hz with a budget of 0.001% of one CPU
    p, out = pipeline
    # when its start-up window ends, it is reported and not judged (one-off costs)
    start_up = next_status(p, 0)
    assert start_up["decision"] == "start-up" and start_up["next_rate_hz"] == CONFIGURED_HZ
    # when the next upload window ends
    first = next_status(p, start_up["time_ns"])
    # then that window was sampled at the configured rate, went over the budget, and the rate is halved
    assert first["rate_hz"] == CONFIGURED_HZ and first["configured_hz"] == CONFIGURED_HZ
    assert first["decision"] == "halve" and first["next_rate_hz"] == CONFIGURED_HZ // 2
    assert first["used_pct"] > TINY_BUDGET_PCT
    assert first["stage_cpu_ns"]["collector"] > 0 and {"uploader", "symbolizer-0"} <= set(first["stage_cpu_ns"])
    # and the warning says why, with the figures: used against allowed, stages, BPF, the rates (the log
    # line is the feature: what an operator reads when the rate falls)
    log = wait_for(
        "the over-budget warning",
        lambda: re.search(
            r"WARNING .*overhead over budget: ([\d.]+) ms used > ([\d.]+) ms allowed \(0.001% of one CPU\); "
            rf"halving sample_hz {CONFIGURED_HZ} -> {CONFIGURED_HZ // 2} Hz\. Window: .*stages .*collector .*"
            r"BPF .*on_cpu_sample .* runs",
            p.log(),
        ),
        10,
    )
    assert float(log.group(1)) > float(log.group(2))
    # and the perf event now fires at the lower rate: a cpu profile written after the change says so
    lower_periods = {1_000_000_000 // max(1, CONFIGURED_HZ >> k) for k in range(1, 11)}

    def lower_rate_profile() -> bool:
        return any(pprof.read(f.read_bytes()).period in lower_periods for f in (out / "profiles").glob("*/cpu-*.pb.gz"))

    wait_for("a cpu profile at a halved rate's period", lower_rate_profile, 30)
    # when the budget is raised in the config file and `ebpfprofiler run` gets SIGHUP
    write_config(p.config_path, p.cfg.replace(overhead_budget_pct=LARGE_BUDGET_PCT))
    p.proc.send_signal(signal.SIGHUP)
    wait_for(
        "the collector to take the new budget",
        lambda: (s := status(p)) is not None and s["budget_pct"] == LARGE_BUDGET_PCT,
        15,
    )
    # then the rate doubles back, window by window, up to the configured rate and not beyond
    decisions: list[str] = []  # of each window's status as it is written (a window is 1 s, a poll 50 ms)

    def back_at_configured() -> dict | None:
        s = status(p)
        if s is None:
            return None
        decisions.append(s["decision"])
        return s if s["budget_pct"] == LARGE_BUDGET_PCT and s["next_rate_hz"] == CONFIGURED_HZ else None

    back = wait_for("the rate back at the configured rate", back_at_configured, 90)
    assert "double" in decisions, decisions
    later = next_status(p, back["time_ns"])
    assert later["rate_hz"] == later["next_rate_hz"] == CONFIGURED_HZ
    # and `ebpfprofiler status` prints the figures as a table
    check_status_table(p)


def check_status_table(p: Pipeline) -> None:
    """`ebpfprofiler status` prints the rate, the programs' and stages' figures, and the cost model's terms."""
    shown = subprocess.run(
        [PY, "-m", "cli.main", "status", "--run-dir", str(p.run_dir)],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"sampling rate: {CONFIGURED_HZ} Hz (configured {CONFIGURED_HZ} Hz" in shown.stdout
    assert re.search(r"^on_cpu_sample\s+\d+\s+[\d.]+ ms", shown.stdout, re.MULTILINE)
    assert re.search(r"^collector\s+\d+\s+[\d.]+ ms", shown.stdout, re.MULTILINE)
    # with the cost model's terms for this host
    assert re.search(r"^  per sample: \d+ ns of BPF \(\d+ samples\)$", shown.stdout, re.MULTILINE), shown.stdout
    assert re.search(r"^  per context switch: \d+ ns of BPF", shown.stdout, re.MULTILINE), shown.stdout
    assert re.search(r"^  new processes: \d+ in the window", shown.stdout, re.MULTILINE), shown.stdout


# Families of programs as the kernel's statistics see them: a tail-called step program's time is its
# caller's there, and each counts itself here (collector/bpftime.py).
FAMILIES = {
    "on_cpu_sample": ("on_cpu_sample", "oncpu_unwind_step"),
    "offcpu_switch": ("offcpu_switch",),
    "offcpu_resume": ("offcpu_resume", "offcpu_unwind_step", "offcpu_unwind_finish"),
}
# Seconds of windows compared: enough timed runs (one in ~16) for the programs' estimate.
COMPARE_S = 12
# The tracepoint of each off-CPU family's entry program. The kernel's statistics add their own clock
# reads to every run of it (40-70 ns a run on this VM), which its body may not much exceed
# (offcpu_resume's fast path is ~10 ns); an empty program beside it on the same tracepoint measures
# that overhead in the same seconds. (on_cpu_sample's runs are 10 us: the overhead is lost in them.)
TRACEPOINTS = {"offcpu_switch": "sched_switch", "offcpu_resume": "rseq_update"}


@contextlib.contextmanager
def empty_programs(tracepoints: Iterable[str]) -> Iterator[dict[str, int]]:
    """An empty tp_btf program attached to each of `tracepoints`: their program ids by tracepoint."""
    from bcc import BPF

    from collector.btfprog import BtfProgram

    module = BPF(text=b"int stats_probe(void *ctx) { return 0; }")
    progs: list[BtfProgram] = []
    try:
        for tp in tracepoints:
            progs.append(prog := BtfProgram(module, "stats_probe", tp))
            prog.attach()
        yield {prog.tracepoint: bpf_prog_id(os.getpid(), prog.fd) or 0 for prog in progs}
    finally:
        for prog in progs:
            prog.close()
        module.cleanup()


Poll = tuple[int, int, dict[str, dict]]  # bpftool's programs by name, and the ns before and after reading them


def poll_through_windows(p: Pipeline, first: dict, empty: dict[str, int]) -> tuple[list[Poll], dict]:
    """bpftool polled until a window COMPARE_S seconds after `first` ends: the polls, and that window's status."""
    ids = bpf_holdings(first["pid"])[0]
    polls: list[Poll] = []

    def poll() -> None:
        t0 = time.time_ns()
        shown = {q["id"]: q for q in bpftool("prog", "show")}
        progs = {q["name"]: q for q in shown.values() if q["id"] in ids}
        progs |= {f"empty on {tp}": shown[i] for tp, i in empty.items()}
        polls.append((t0, time.time_ns(), progs))

    deadline = time.monotonic() + 60
    last = first
    while time.monotonic() < deadline and last["time_ns"] < first["time_ns"] + COMPARE_S * 10**9:
        poll()
        last = status(p) or last
    poll()
    assert last["time_ns"] >= first["time_ns"] + COMPARE_S * 10**9, "no window ended late enough"
    return polls, last


def check_family_agrees(
    name: str, members: tuple[str, ...], totals: dict, around: tuple[dict, dict], polls: list[Poll]
) -> None:
    """A family's runs and time as the programs count them agree with the kernel's, polled `around` the read."""
    before, after = around
    # then every run the kernel counted, the program counted: a run is counted here when it
    # begins and there when it ends (at most one run a CPU in between)
    assert (
        int(before[name]["run_cnt"]) <= totals[name]["run_cnt"] <= int(after[name]["run_cnt"]) + (os.cpu_count() or 1)
    ), (name, before[name], totals[name], after[name])
    # and the time it estimates from the runs it timed is the kernel's: at most 1.25 times it, and
    # at least 0.6 times what is left of it without the statistics' own cost a run, which the
    # empty program on the same tracepoint measured over the same seconds
    ours = sum(ProgTime(t["run_cnt"], t["timed"], t["timed_ns"]).run_time_ns for m in members if (t := totals.get(m)))
    theirs = int(after[name]["run_time_ns"])
    overhead_ns = 0.0
    if name in TRACEPOINTS:
        probe = f"empty on {TRACEPOINTS[name]}"
        runs = int(polls[-1][2][probe]["run_cnt"]) - int(polls[0][2][probe]["run_cnt"])
        assert runs > 0, (probe, polls[0][2][probe], polls[-1][2][probe])
        overhead_ns = (int(polls[-1][2][probe]["run_time_ns"]) - int(polls[0][2][probe]["run_time_ns"])) / runs
    body = theirs - overhead_ns * int(after[name]["run_cnt"])
    print(
        f"{name}: ours {ours} ns, kernel {theirs} ns ({overhead_ns:.1f} ns a run of it the statistics'), "
        f"ratio {ours / max(1, theirs):.3f}, to the body {ours / max(1.0, body):.3f}"
    )
    assert ours > 0 and 0.6 * body <= ours <= 1.25 * theirs, (name, ours, theirs, overhead_ns)


def test_the_bpf_time_the_programs_count_agrees_with_the_kernels_statistics(tmp_path: Path) -> None:
    require_root()
    # given the kernel's statistics switched on (by the test: the collector leaves them off) before
    # the pipeline loads its programs, so that both count every run from the start
    with contextlib.ExitStack() as held:
        kernel = RunTimeStats(allow_sysctl=False)
        held.callback(kernel.close)
        assert kernel.on, kernel.problem
        out = open_dir("overhead-kernel")
        held.callback(shutil.rmtree, out, ignore_errors=True)
        # and an empty program on each off-CPU tracepoint, which measures what the statistics add a run
        empty = held.enter_context(empty_programs(TRACEPOINTS.values()))
        p = Pipeline(
            tmp_path,
            ProfilerConfig(
                sample_hz=CONFIGURED_HZ,
                upload_interval_s=WINDOW_S,
                overhead_budget_pct=LARGE_BUDGET_PCT,
                local_dir=str(out / "profiles"),
                python_stacks=False,
            ),
        )
        held.callback(p.stop)
        first = next_status(p, 0)
        # (the collector holds no statistics descriptor, and says how it counts)
        assert "anon_inode:bpf-stats" not in fd_targets(first["pid"])
        assert first["bpf_stats"].startswith("counted by the programs"), first["bpf_stats"]
        # when windows end for COMPARE_S seconds, bpftool polled all along
        polls, last = poll_through_windows(p, first, empty)
    read_start, read_end = last["bpf_read_ns"]
    before = [progs for _, t1, progs in polls if t1 < read_start][-1]
    after = next(progs for t0, _, progs in polls if t0 > read_end)
    totals = last["bpf_totals"]
    assert set(FAMILIES) <= set(totals), totals
    for name, members in FAMILIES.items():
        check_family_agrees(name, members, totals, (before, after), polls)
    # and a window's figure is the change of the counters over it, the timed runs' mean times its runs
    assert last["bpf_ns"] == sum(v["run_time_ns"] for v in last["bpf"].values())


# Windows of the idle test: the shipped 60 s would make three windows three minutes; the budget is
# per window, so a shorter one is the stricter judge of the fixed cost (drains, wake-ups, uploads).
# With 10 s, the start-up's table building spilled into the first judged window (3.5%: halved).
IDLE_WINDOW_S = 20


def test_the_shipped_defaults_run_three_windows_on_an_idle_host_without_a_halving(tmp_path: Path) -> None:
    require_root()
    # given deploy/agent.yaml as shipped, its profiles into a scratch directory and 20 s windows
    shipped = config_mod.load(str(ROOT / "deploy" / "agent.yaml"))
    out = open_dir("idle-defaults")
    cfg = dataclasses.replace(shipped, local_dir=str(out / "profiles"), upload_interval_s=IDLE_WINDOW_S)
    p = Pipeline(tmp_path, cfg, shipped_budget=True)
    windows: list[dict] = []
    try:
        # when the start-up window and three more end on this otherwise idle host
        def three_after_start_up() -> bool:
            s = status(p)
            if s is not None and (not windows or s["time_ns"] != windows[-1]["time_ns"]):
                windows.append(s)
            return len(windows) >= 4

        wait_for("the start-up window and three more", three_after_start_up, timeout=IDLE_WINDOW_S * 7, interval=0.5)
    finally:
        p.stop()
        shutil.rmtree(out, ignore_errors=True)
    # then none of them halved the rate: 19 Hz throughout, each window within its budget
    summary = [(w["decision"], w["rate_hz"], w["next_rate_hz"], round(float(w["used_pct"]), 3)) for w in windows]
    print(f"windows (decision, rate, next rate, % of one CPU): {summary}")
    for w in windows[-3:]:
        assert w["decision"] not in ("halve", "over at floor"), summary
        assert w["rate_hz"] == w["next_rate_hz"] == shipped.sample_hz == 19, summary
        assert float(w["used_pct"]) <= float(w["budget_pct"]) == shipped.overhead_budget_pct, summary
