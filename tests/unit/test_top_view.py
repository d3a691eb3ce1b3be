"""cli/top.py's figures and screen, on profiles as the agent writes them (cpu, plain pid labels)."""

from __future__ import annotations

import pytest

from cli import top
from report.profiles import Loaded
from shared import pprof

NS = 10_000_000  # one sample at 100 Hz


def frame(name: str) -> pprof.Frame:
    return pprof.Frame(name, "", "/usr/bin/app", "", 0)


def cpu(*stacks: tuple[int, str, tuple[str, ...], int], kind: str = "cpu") -> Loaded:
    """A profile of (pid, executable, root-first functions, samples) samples."""
    samples = tuple(
        pprof.ReadSample(tuple(map(frame, fs)), (n, n * NS), {"pid": pid, "process.executable": exe})
        for pid, exe, fs, n in stacks
    )
    prof = pprof.ReadProfile((("samples", "count"), ("cpu", "nanoseconds")), ("cpu", "nanoseconds"), NS, 0, 0, samples)
    return Loaded(f"/x/{kind}-1.pb.gz", kind, "app", prof)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_own_and_total_shares_of_the_recent_seconds_and_times_since_the_start() -> None:
    # given a view fed one window of leaf 3 : other 1 under main→work
    clock = Clock()
    view = top.TopView(clock)
    view.add([cpu((1, "/usr/bin/app", ("main", "work", "leaf"), 30), (1, "/usr/bin/app", ("main", "other"), 10))])
    rows, grand = view.rows(10)
    assert grand == 40 * NS
    by = {r.name: r for r in rows}
    # then leaf leads by own, main and work by total
    assert rows[0].name == "leaf" and by["leaf"].own_share == pytest.approx(0.75)
    assert by["main"].own_share == 0 and by["main"].total_share == pytest.approx(1.0)
    assert by["work"].total_share == pytest.approx(0.75)
    # when t is pressed, then the rows go by total
    assert view.key("t")
    assert [r.name for r in view.rows(2)[0]] == ["main", "leaf"]
    # when a window older than RECENT_S is followed by one of only `other`, the rows are the new one's
    clock.now += top.RECENT_S + 1
    view.add([cpu((1, "/usr/bin/app", ("main", "other"), 5))])
    by = {r.name: r for r in view.rows(10)[0]}
    assert set(by) == {"main", "other"} and by["other"].own_share == pytest.approx(1.0)
    # but the times since the start keep both
    assert by["other"].own_ns == 15 * NS and by["main"].total_ns == 45 * NS
    assert view.own["functions"]["leaf"] == 30 * NS


def test_processes_view_and_a_hostile_name_reaches_the_screen_escaped() -> None:
    view = top.TopView(Clock())
    view.add(
        [
            cpu((7, "/tmp/evil\x1b]0;pwned\x07", ("main", "spin\x1b[2J"), 3), (8, "/usr/bin/app", ("main",), 1)),
            cpu((7, "/tmp/evil", ("main",), 100), kind="offcpu"),  # not on-CPU time: not in top
        ]
    )
    lines = top.screen_lines(view, "header\x1b[31m", 200, 20)
    assert all("\x1b" not in line and "\x07" not in line for line in lines)
    assert lines[0] == "header\\x1b[31m"
    assert lines[4].endswith("spin\\x1b[2J") and lines[4].lstrip().startswith("75.0%")
    assert view.key("p")
    lines = top.screen_lines(view, "h", 200, 20)
    assert "Process" in lines[3]
    assert [ln.split("s  ", 2)[-1] for ln in lines[4:]] == ["7 evil\\x1b]0;pwned\\x07", "8 app"]


def test_lines_fit_the_screen() -> None:
    view = top.TopView(Clock())
    view.add([cpu(*((1, "/a", ("main", f"f{i}" * 50), 1) for i in range(40)))])
    lines = top.screen_lines(view, "h" * 300, 80, 12)
    assert len(lines) == 12 and all(len(line) <= 79 for line in lines)


def test_names_past_the_cap_keep_only_their_recent_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(top, "MAX_FUNCTIONS", 3)
    view = top.TopView(Clock())
    view.add([cpu((1, "/a", ("main", "a"), 1), (1, "/a", ("main", "b"), 1))])  # main, a, b: the cap
    view.add([cpu((1, "/a", ("main", "c"), 2))])
    by = {r.name: r for r in view.rows(10)[0]}
    assert by["c"].own_share == pytest.approx(0.5) and by["c"].own_ns == 0
    assert by["main"].total_ns == 4 * NS
    assert view.not_kept == 1
    assert len(view.total["functions"]) == 3
