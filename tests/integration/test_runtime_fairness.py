"""The runtime reader is fair and bounded with hostile processes beside ordinary ones (issue 40, cases 6 and 7).

The reader is the stage's own Reader (runtimes/main.py) driven tick by tick in
the test process (tests/runtime_harness.py's DrivenReader),
reading real processes:

- Case 7: a CPython process whose stacks take more than a tick's read budget
  (hundreds of threads, each deep in a recursion), announced before an
  ordinary spinner: the spinner is read at every tick, the big one's
  overruns are counted per reason, and the round-robin start moves on.
- Case 6: ten fake .NET processes (tests/workloads/fake_runtime.c: they map a
  file named libcoreclr.so and listen on the diagnostics socket the reader
  connects to, and never answer), a fake .NET process that answers like the
  runtime, and an ordinary CPython spinner: the spinner's stacks and the
  answering process's answer arrive in time, the stalled ones are counted and
  retried, and stopping the reader stays within its budget.
- Fake JVMs: processes mapping a libjvm.so whose one 1,000,000-symbol .symtab
  its section headers list 2,000 times (tests/elf_builder.py), a copy each,
  beside an ordinary spinner: each file's symbols are read once and bounded,
  detection pauses after each slow one, and the spinner, read already, keeps
  most of its stacks; one whose header claims a table of 2^40 bytes is refused with the
  cap counted.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runtimes import dotnet
from runtimes.dotnet import ipc
from shared import counters
from tests.elf_builder import symbol_table_elf
from tests.runtime_harness import PYTHON311, DrivenReader, go, spinner, start

# A process's own deadline: it ends by itself even if the test cannot end it.
WORKLOAD_SECONDS = 120
# Threads of the big process, each this deep: 500 x 125 frames take over a tick's 4 MiB.
BIG_THREADS = 500
BIG_DEPTH = 125
# Ticks the fairness test watches.
TICKS = 30
# Fake .NET processes that never answer (each cost the reader ENABLE_ANSWER_TIMEOUT_S, 3 s, before the fix).
SILENT_DOTNET = 10
# Seconds within which the answering .NET process's answer must arrive, and the spinner's stacks.
SERVED_WITHIN_S = 3.0
# Fake libjvm.so files with a huge .symtab (a copy each: the reader caches a file's symbols by its identity).
FAKE_JVMS = 3
FAKE_JVM_SYMBOLS = 1_000_000
FAKE_JVM_TABLES = 2000
# Seconds the fake-JVM test ticks, and the share of its ticks' stacks the spinner must keep.
FAKE_JVM_RUN_S = 8.0
FAKE_JVM_KEEP = 0.5
# The longest a tick may take with the silent processes about (a tick is 53 ms; a loaded host is slow).
MAX_TICK_S = 1.0

BIG = """\
import sys, threading, time

def deep(n, ev):
    if n:
        return deep(n - 1, ev)
    ev.wait()

def main():
    threads, depth, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    ev = threading.Event()
    for _ in range(threads):
        threading.Thread(target=deep, args=(depth, ev), daemon=True).start()
    print("ready", flush=True)
    time.sleep(seconds)

main()
"""


def test_a_process_over_the_read_budget_never_starves_the_next_one(
    tmp_path: Path, started: list[subprocess.Popen], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ebpfprofiler.runtime")
    d = DrivenReader(tmp_path)
    try:
        # Given a process whose stacks take more than a tick's bytes, announced first, and an ordinary spinner
        big_py = tmp_path / "big.py"
        big_py.write_text(BIG)
        big, _ = start(started, [PYTHON311, str(big_py), str(BIG_THREADS), str(BIG_DEPTH), str(WORKLOAD_SECONDS)])
        spin, _ = start(started, [PYTHON311, str(spinner(tmp_path)), str(WORKLOAD_SECONDS), "return"])
        go(spin)
        d.announce(big.pid)
        d.announce(spin.pid)
        for _ in range(3):  # detection (DETECTS_PER_TICK a tick)
            d.tick()
        assert [d.reader.targets.entries[p.pid].state for p in (big, spin)] == ["reading", "reading"]
        # When the reader ticks
        served = []
        for _ in range(TICKS):
            before = d.reader.stats["stacks"]
            spin_before = _stacks_of(d, "spin")
            d.tick()
            served.append(_stacks_of(d, "spin") > spin_before)
            assert d.reader.stats["stacks"] >= before
        # Then the spinner got its stacks at every tick, and the big process's overruns are counted by reason
        assert all(served), f"the spinner was read at {sum(served)} of {TICKS} ticks"
        over = {k: v for k, v in d.reader.stats.items() if k.startswith("process_over_")}
        assert sum(over.values()) >= TICKS // 2, d.reader.stats
        # logged once for the process and reason (bytes, or time under load), not at every tick
        lines = [
            r.getMessage()
            for r in caplog.records
            if f"pid {big.pid} " in r.getMessage() and "share of a tick" in r.getMessage()
        ]
        # the log line is the feature: a process over its share is logged once per reason (the counters are
        # asserted below)
        reasons = [line.partition(": over in ")[2].split(";")[0] for line in lines]
        assert lines and sorted(reasons) == sorted(set(reasons)) and set(reasons) <= {"bytes", "time"}, lines
        # and in the stage's counters, which `ebpfprofiler status` prints
        status = _status(d, tmp_path)
        assert status["process_over_time"] + status["process_over_bytes"] == sum(over.values()), status
    finally:
        d.close()


def _stacks_of(d: DrivenReader, function: str) -> int:
    """Stacks holding `function` in the reader's open windows so far."""
    n = 0
    for by_service in d.reader.windows._open.values():  # the test reads the open windows
        for w in by_service.values():
            for (_, frames), row in w.rows.items():
                if any(getattr(f, "function", "") == function for f in frames):
                    n += row[0]
    return n


def start_dotnet_and_spinner(
    d: DrivenReader, started: list[subprocess.Popen], fake: Path, directory: Path
) -> tuple[list[subprocess.Popen], subprocess.Popen]:
    """SILENT_DOTNET fake .NET processes that listen on their diagnostics socket and never answer,
    announced first, then one that answers like .NET 8, and an ordinary CPython spinner (going), all
    announced to `d`; (the silent ones, the answering one)."""
    coreclr = directory / "dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so"
    coreclr.parent.mkdir(parents=True)
    coreclr.write_bytes(b"\0" * 4096)
    silent = [
        start(started, [str(fake), "silent", str(coreclr), str(WORKLOAD_SECONDS)])[0] for _ in range(SILENT_DOTNET)
    ]
    answering, _ = start(started, [str(fake), "answer", str(coreclr), str(WORKLOAD_SECONDS)])
    spin, _ = start(started, [PYTHON311, str(spinner(directory)), str(WORKLOAD_SECONDS), "return"])
    go(spin)
    d.announce(*(p.pid for p in silent))
    d.announce(answering.pid)
    d.announce(spin.pid)
    return silent, answering


def tick_until_served(d: DrivenReader, answering: subprocess.Popen) -> tuple[float, float | None, float | None]:
    """Ticks at the reader's own pace until the answering process is served and every silent one is
    stalled (or long enough for both); (the longest tick, when it was served, when the spinner's
    stacks were read), in seconds."""
    began = time.monotonic()
    served_at = stacks_at = None
    longest = 0.0
    while time.monotonic() - began < ipc.ENABLE_ANSWER_TIMEOUT_S + 2 * SERVED_WITHIN_S:
        t = time.monotonic()
        d.tick()
        longest = max(longest, time.monotonic() - t)
        if served_at is None and d.reader.targets.entries[answering.pid].state == "served":
            served_at = time.monotonic() - began
        if stacks_at is None and _stacks_of(d, "spin"):
            stacks_at = time.monotonic() - began
        if (
            served_at is not None
            and d.reader.targets.stats.get("pending", 0)
            and _plugin(d).stats["stalled"] >= SILENT_DOTNET
        ):
            break
        time.sleep(max(0.0, t + 1 / 19 - time.monotonic()))  # the reader's own pace
    return longest, served_at, stacks_at


def test_fake_dotnet_processes_that_never_answer_hold_up_neither_the_others_nor_the_stop(
    tmp_path: Path, build: Callable[..., Path], started: list[subprocess.Popen], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ebpfprofiler.runtime")
    fake = build("fake_runtime", ["-O1", "-Wall", "-Werror"])
    d = DrivenReader(tmp_path, runtime_stacks=("python_legacy", "dotnet"))
    stopped = False
    try:
        # Given ten fake .NET processes that never answer, announced first, then one that answers like
        # .NET 8, and an ordinary CPython spinner
        silent, answering = start_dotnet_and_spinner(d, started, fake, tmp_path)
        # When the reader ticks
        longest, served_at, stacks_at = tick_until_served(d, answering)
        # Then no tick waited for a silent process, the answering one was served and the spinner read in time
        assert longest < MAX_TICK_S, f"a tick took {longest:.2f} s"
        assert served_at is not None and served_at < SERVED_WITHIN_S, served_at
        assert stacks_at is not None and stacks_at < SERVED_WITHIN_S, stacks_at
        assert any(
            f"pid {answering.pid} " in r.getMessage() and "EnablePerfMap answered OK" in r.getMessage()
            for r in caplog.records
        )
        # and every silent one was counted as stalled, and is waiting for its retry, not refused for good
        assert _plugin(d).stats["stalled"] == SILENT_DOTNET, _plugin(d).stats
        assert [d.reader.targets.entries[p.pid].state for p in silent] == ["pending"] * SILENT_DOTNET
        assert _status(d, tmp_path)["dotnet_stalled"] == SILENT_DOTNET
        # When the reader stops
        t = time.monotonic()
        stopped = True
        d.reader.stop_runtimes()
        took = time.monotonic() - t
        # Then the stop stays within its budget, and the answering process was told to stop its map
        assert took < dotnet.STOP_BUDGET_S / 2, f"stopping took {took:.2f} s"
        assert any(
            f"pid {answering.pid} (.NET 8.0.4): DisablePerfMap answered OK" in r.getMessage() for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
    finally:
        if not stopped:
            d.reader.stop_runtimes()  # its connector ends with it
        d.close()


def _status(d: DrivenReader, run_dir: Path) -> dict[str, int]:
    """The runtime reader's counters as `ebpfprofiler status` reads them (RUN_DIR/runtime.counters.json)."""
    d.reader.counters.update(d.reader.checks(), force=True)
    return counters.read_all(str(run_dir))["runtime"]


def _plugin(d: DrivenReader) -> dotnet.DotNet:
    (got,) = [r for r in d.reader.runtimes if isinstance(r, dotnet.DotNet)]
    return got


def test_fake_jvms_with_huge_symbol_tables_cost_a_bounded_share_of_the_reader(
    tmp_path: Path, build: Callable[..., Path], started: list[subprocess.Popen], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ebpfprofiler.runtime")
    fake = build("fake_runtime", ["-O1", "-Wall", "-Werror"])
    huge = symbol_table_elf(FAKE_JVM_SYMBOLS, tables=FAKE_JVM_TABLES)
    files = []
    for i in range(FAKE_JVMS):
        (tmp_path / f"jvm{i}").mkdir()
        files.append(tmp_path / f"jvm{i}" / "libjvm.so")
        files[-1].write_bytes(huge)
    (tmp_path / "forged").mkdir()
    forged = tmp_path / "forged" / "libjvm.so"
    forged.write_bytes(symbol_table_elf(10, claimed_bytes=1 << 40))
    d = DrivenReader(tmp_path, runtime_stacks=("python_legacy", "jvm"))
    try:
        # Given an ordinary spinner, then processes mapping a fake libjvm.so with a huge .symtab each and one
        # whose header claims a huge table
        fakes = [start(started, [str(fake), "map", str(f), str(WORKLOAD_SECONDS)])[0] for f in files]
        bad, _ = start(started, [str(fake), "map", str(forged), str(WORKLOAD_SECONDS)])
        spin, _ = start(started, [PYTHON311, str(spinner(tmp_path)), str(WORKLOAD_SECONDS), "return"])
        go(spin)
        d.announce(spin.pid)
        d.announce(*(p.pid for p in fakes), bad.pid)
        # When the reader ticks at its pace
        began = time.monotonic()
        ticks = 0
        while time.monotonic() - began < FAKE_JVM_RUN_S:
            t = time.monotonic()
            d.tick()
            ticks += 1
            time.sleep(max(0.0, t + 1 / 19 - time.monotonic()))  # the reader's own pace
        wall = time.monotonic() - began
        # Then every fake was refused, each logged once
        for p in [*fakes, bad]:
            assert d.reader.targets.entries[p.pid].state == "refused", p.pid
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"pid {p.pid} ")]
            # the log line is the feature: each refused process is logged once, not at every tick
            assert len([ln for ln in lines if "refused" in ln]) == 1, lines
        # and the spinner kept most of the stacks it would have had at 19 a second
        spun = _stacks_of(d, "spin")
        assert spun >= FAKE_JVM_KEEP * 19 * wall, f"{spun} stacks of the spinner in {wall:.1f} s ({ticks} ticks)"
        # and the checks that fired are counted by reason
        status = _status(d, tmp_path)
        assert status.get("refused_elf_symbols_over_cap") == 1, status
    finally:
        d.close()
