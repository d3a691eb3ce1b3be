"""The runtime reader's CPU pace (runtimes/main.py CpuPace), on a simulated clock and CPU clock.

Given a budget of 2% of a CPU and ticks every 1/19 s, when each tick that runs costs far more than
the budget allows (a host of many threads: 5 ms a tick, 9.5% of a CPU at every tick), then over a
simulated 10 minutes the ticks that ran used 2% of the wall time (±5% of it, after the saved-up
burst), and the weights of the ticks that ran add up to every tick: no wall time is lost. A tick as
cheap as the budget allows always runs, weight 1.
"""

from __future__ import annotations

from runtimes.main import PACE_BURST_S, SAMPLE_HZ, CpuPace


class Clocks:
    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0


def run(budget_pct: float, cost_s: float, seconds: float) -> tuple[int, int, float]:
    """(ticks, the sum of the weights of those that ran, CPU seconds spent) over `seconds` of ticks."""
    c = Clocks()
    pace = CpuPace(budget_pct, clock=lambda: c.wall, cpu=lambda: c.cpu)
    ticks = weights = 0
    while c.wall < seconds:
        ticks += 1
        w = pace.start()
        if w is not None:
            weights += w
            c.cpu += cost_s
            pace.end()
        c.wall += 1 / SAMPLE_HZ
    return ticks, weights, c.cpu


def test_a_reader_over_its_budget_keeps_to_it_and_loses_no_wall_time() -> None:
    ticks, weights, cpu = run(2.0, 0.005, 600.0)
    spent_pct = 100 * (cpu - 0.02 * PACE_BURST_S) / 600.0
    assert 1.9 <= spent_pct <= 2.1, spent_pct
    # every tick is stood for, but the ones still owed by the last that ran
    assert ticks - weights < 1 / (0.02 / 0.005 / SAMPLE_HZ) + 1, (ticks, weights)


def test_a_reader_within_its_budget_runs_every_tick_at_weight_one() -> None:
    ticks, weights, _ = run(2.0, 0.0009, 600.0)  # 1.7% of a CPU at 19 Hz
    assert weights == ticks
