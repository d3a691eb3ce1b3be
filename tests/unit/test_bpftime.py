"""collector/bpftime.py and bpf/common.h's self-timing: the slots C and Python share, and every
program timing itself from its first line to each of its returns and tail calls."""

from __future__ import annotations

import re
from pathlib import Path

from collector import bpftime
from collector.bpftime import ProgTime
from tests.harness import ROOT

BPF = Path(ROOT) / "bpf"
# An entry point of a BPF program: a non-static int function, or bcc's TRACEPOINT_PROBE.
ENTRY = re.compile(r"^(?:int (\w+)\([^)]*\)|TRACEPOINT_PROBE\(\w+, (\w+)\)) \{\n(.*?)^\}\n", re.MULTILINE | re.DOTALL)


def programs() -> dict[str, str]:
    """C name of each program (a TRACEPOINT_PROBE by its event) → its body."""
    out = {}
    for path in sorted(BPF.glob("*.c")):
        for m in ENTRY.finditer(path.read_text()):
            out[m.group(1) or m.group(2)] = m.group(3)
    return out


def test_every_program_is_timed_in_its_own_slot_from_its_first_line_to_every_exit() -> None:
    defines = bpftime.bpf_defines()
    bodies = programs()
    # every slot names a program there is, and every program has a slot
    assert {f"TIMED_{name}" for name in bodies} == {k for k in defines if k not in ("TIMED_SLOTS", "TIMING_PERIOD")}
    assert sorted(v for k, v in defines.items() if k.startswith("TIMED_") and k != "TIMED_SLOTS") == list(
        range(defines["TIMED_SLOTS"])
    )
    for name, body in bodies.items():
        first = body.strip().splitlines()[0]
        assert first == f"struct prog_time *timing = timing_begin(TIMED_{name});", (name, first)
        # no bare return: each ends the timing first
        code = re.sub(r"//.*", "", body).replace("TIMED_RETURN", "")
        assert not re.search(r"(?<!\w)return\b", code), name
        # and each tail call comes after a timing_end (a step program times itself)
        lines = body.splitlines()
        for i, line in enumerate(lines):
            if re.search(r"\w+\.call\(", line):
                assert any("timing_end(timing);" in ln for ln in lines[:i]), (name, line)


def test_the_timed_runs_mean_is_scaled_to_every_run() -> None:
    # given 1,000 runs of which 60 were timed, at 9,000 ns together
    t = ProgTime(runs=1_000, timed=60, timed_ns=9_000)
    # then the runs took 150 ns each: 150,000 ns
    assert t.run_time_ns == 150_000
    # and a window is the change since the last read
    assert t.since(ProgTime(runs=400, timed=30, timed_ns=3_000)) == ProgTime(600, 30, 6_000)
    assert t.since(ProgTime(runs=400, timed=30, timed_ns=3_000)).run_time_ns == 120_000
    # and runs with none timed are counted, their time unknown: 0
    assert ProgTime(runs=5).run_time_ns == 0
