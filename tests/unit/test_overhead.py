"""The overhead guard's rate decision, its figures, the budget key, and `ebpfprofiler status` (no BPF)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cli import status as status_cli
from collector.bpftime import ProgTime
from collector.overhead import (
    Budget,
    OverheadGuard,
    read_proc,
    write_status,
)
from shared import config as config_mod
from tests.harness import PY, wait_for

WALL_NS = 1_000_000_000


def test_over_budget_halves_down_to_1_hz_and_three_windows_under_half_double_back_to_the_configured_rate() -> None:
    # given a 1% budget at 99 Hz
    b = Budget(99, 1.0)
    over, under_half, between = 20_000_000, 1_000_000, 7_000_000  # 2%, 0.1%, 0.7% of one second
    # when windows go over it, the rate halves each time, down to 1 Hz and no further
    rates = []
    for _ in range(8):
        b.judge(over, WALL_NS)
        rates.append(b.rate_hz)
    assert rates == [49, 24, 12, 6, 3, 1, 1, 1]
    assert b.judge(over, WALL_NS) == "over at floor"
    # when windows are under half the budget, the rate doubles after every third one in a row
    assert [b.judge(under_half, WALL_NS) for _ in range(3)] == ["", "", "double"] and b.rate_hz == 3
    # and a window between half and all of the budget restarts the count
    b.judge(under_half, WALL_NS)
    b.judge(under_half, WALL_NS)
    assert b.judge(between, WALL_NS) == "" and b.rate_hz == 3
    # then it comes back to exactly the configured rate, never above it
    for _ in range(30):
        b.judge(under_half, WALL_NS)
    assert b.rate_hz == 99


def test_a_window_counts_stage_cpu_and_bpf_run_time_and_decides_on_their_sum(tmp_path: Path) -> None:
    # given a guard over a run directory naming this test process as a stage, and the programs' own
    # counters (bpf/common.h: every run counted, some timed)
    (tmp_path / "uploader.ready").write_text(f"{os.getppid()}\n")
    (tmp_path / "gone.ready").write_text("999999999\n")  # a stale ready file: skipped
    counters = {"on_cpu_sample": ProgTime(runs=10, timed=1, timed_ns=100)}
    clock = [0]
    guard = OverheadGuard(str(tmp_path), 99, 1.0, "test", lambda: counters, clock=lambda: clock[0])
    # when the start-up window ends, whatever it cost, it is reported and not judged
    clock[0] = WALL_NS
    first = guard.end_window({}, {})
    assert first.decision == "start-up" and first.next_rate_hz == 99
    # when the BPF program then runs 100 times in a 1 s window, 4 of them timed at 2 ms together
    counters["on_cpu_sample"] = ProgTime(runs=110, timed=5, timed_ns=2_000_100)
    clock[0] = 2 * WALL_NS
    w = guard.end_window({"cpu": 500}, {"cpu.counts_map_full": 2})
    # then the window shows it, per program, the timed runs' mean scaled to all of them: 50 ms, and
    # with the totals read and 5% used: over 1%, halved
    assert w.bpf == {"on_cpu_sample": {"run_time_ns": 50_000_000, "run_cnt": 100}}
    assert w.bpf_totals["on_cpu_sample"] == {"run_cnt": 110, "timed": 5, "timed_ns": 2_000_100}
    assert set(w.stage_cpu_ns) == {"collector", "uploader"}
    assert w.used_pct >= 5.0 and w.decision == "halve" and (w.rate_hz, w.next_rate_hz) == (99, 49)
    assert w.samples == {"cpu": 500} and w.lost == {"cpu.counts_map_full": 2}
    # and the status file holds it whole, for `ebpfprofiler status`
    write_status(str(tmp_path), w)
    doc = json.loads((tmp_path / "status.json").read_text())
    assert doc["next_rate_hz"] == 49 and doc["bpf_ns"] == 50_000_000
    shown = status_cli.table(doc)
    assert "on_cpu_sample" in shown
    # with the cost model's terms this window gives: 50 ms over 100 samples is 500,000 ns a sample
    assert "per sample: 500000 ns of BPF (100 samples)" in shown, shown


def test_read_proc_reads_cpu_and_rss_of_a_process_whose_name_has_spaces_and_parentheses(
    tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    # given a process named "a) (b c"
    exe = tmp_path / "a) (b c"
    exe.symlink_to("/bin/sleep")
    p = subprocess.Popen([str(exe), "30"])
    started.append(p)
    wait_for(
        "the process to run under that name", lambda: Path(f"/proc/{p.pid}/comm").read_text().strip() == exe.name, 10
    )
    # when its stat is read (once exec has mapped and touched its pages: just after the name
    # changes, the new image can have no resident pages yet), then the fields after the name
    # are found
    got = wait_for(
        "its stat to show resident pages",
        lambda: g if (g := read_proc(p.pid)) is not None and g.rss_bytes > 0 else None,
        10,
    )
    assert got.pid == p.pid and got.cpu_ns >= 0
    p.kill()
    p.wait()
    assert read_proc(p.pid) is None  # reaped: nothing to read


@pytest.mark.parametrize("value", [0, -1, 0.0001, 101, "1%", True])
def test_a_bad_overhead_budget_is_a_clear_error(value: object) -> None:
    with pytest.raises(
        config_mod.ConfigError,
        match=r"overhead_budget_pct = .* is not allowed; expected a number "
        r"from 0.001 to 100",
    ):
        config_mod.from_mapping({"overhead_budget_pct": value}, source="agent.yaml")


def test_overhead_budget_default_is_one_percent_and_integers_are_taken() -> None:
    assert config_mod.ProfilerConfig().overhead_budget_pct == 1.0
    assert config_mod.from_mapping({"overhead_budget_pct": 5}).overhead_budget_pct == 5.0


def test_status_says_clearly_when_nothing_runs(tmp_path: Path) -> None:
    # given a run directory with no collector (and a ready file of a dead one)
    (tmp_path / "collector.ready").write_text("999999999\n")
    # when `ebpfprofiler status` is asked
    out = subprocess.run(
        [PY, "-m", "cli.main", "status", "--run-dir", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # then it exits 1 and says that no collector runs there, not a traceback
    assert out.returncode == 1
    assert "no collector is running with run directory" in out.stderr and "Traceback" not in out.stderr
