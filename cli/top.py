"""`ebpfprofiler top`: a live terminal view of the hottest functions, host-wide or of -p PID…, like
`py-spy top` and `perf top`, over every process and runtime the agent reads.

Owns: top's command line, its figures (TopView: each function's own and total share of the last
RECENT_S seconds, and its own and total CPU time since the start; or the same by process), the
screen's lines (screen_lines, with every name made safe by safestr.printable), and the curses loop
(redrawn each REFRESH_S; keys sort and switch views). The agent is record's: cli/record.py's
Recording runs `run` in a private workspace with TOP_WINDOW_S windows, and top reads each window's
files as they are written, then removes them (the disk stays bounded however long top runs).

Must not: do any stage's work itself, draw a byte of a process's names that printable() did not
make safe, or keep more than MAX_FUNCTIONS names (a host of JIT code names new functions forever).
"""

from __future__ import annotations

import argparse
import contextlib
import curses
import locale
import math
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cli import record, record_command
from report import profiles as profiles_mod
from shared import log as log_mod
from shared.safestr import printable

# The agent's windows: the shortest the config allows, so the view is at most a second or two old.
TOP_WINDOW_S = 1
# The screen is redrawn (and new windows read) this often.
REFRESH_S = 1.0
# The shares are of this many seconds of samples: one window arrives late as often as not, so one
# window alone flickers between full and empty.
RECENT_S = 3.0
# Distinct names kept for the totals since the start; beyond, a new name has only its recent share.
MAX_FUNCTIONS = 50_000
# The figure the first key switches between, and the views.
SORTS = ("own", "total")
VIEWS = ("functions", "processes")
KEYS_HELP = "o: sort by own  t: by total  p: functions/processes  q: quit"

DESCRIPTION = (
    "A live view of the hottest functions on this host (or of -p PID...), refreshed each second: "
    "each function's own and total share of the last few seconds of on-CPU samples and its CPU "
    "time since top started, or the same by process. Every process's native, kernel and (with "
    "--runtime) interpreter and JIT frames. Keys: o sorts by own, t by total, p switches between "
    "functions and processes, q (or Ctrl-C) quits. Run as root, on a terminal; the agent starts "
    "first (a few seconds), and stops with top, leaving nothing behind."
)


@dataclass(frozen=True)
class Row:
    name: str  # as the process gave it: made safe when drawn
    own_share: float  # of the last RECENT_S seconds' samples, 0..1
    total_share: float
    own_ns: int  # since the start
    total_ns: int


class TopView:
    """Each function's (or process's) figures, from the cpu profiles as they arrive."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.sort, self.view = SORTS[0], VIEWS[0]
        # (when read, own by name, total by name, grand) per view, for the last RECENT_S seconds
        self.recent: dict[str, deque[tuple[float, Counter[str], Counter[str], int]]] = {v: deque() for v in VIEWS}
        self.own: dict[str, Counter[str]] = {v: Counter() for v in VIEWS}
        self.total: dict[str, Counter[str]] = {v: Counter() for v in VIEWS}
        self.not_kept = 0  # names past MAX_FUNCTIONS: recent shares only

    def add(self, loaded: Sequence[profiles_mod.Loaded]) -> None:
        """The cpu samples of newly written profiles."""
        cpu = [x for x in loaded if x.profile_type == "cpu"]
        now = self.clock()
        self._add("functions", now, *profiles_mod.function_values(profiles_mod.stacks(cpu)))
        by_process: Counter[str] = Counter()
        for item in cpu:
            i = profiles_mod.value_index(item.profile)
            for s in item.profile.samples:
                by_process[process_name(s.labels)] += s.values[i]
        self._add("processes", now, by_process, by_process, sum(by_process.values()))

    def _add(self, view: str, now: float, own: Counter[str], total: Counter[str], grand: int) -> None:
        recent = self.recent[view]
        recent.append((now, own, total, grand))
        while recent and recent[0][0] < now - RECENT_S:
            recent.popleft()
        for name, v in total.items():
            if name in self.total[view] or len(self.total[view]) < MAX_FUNCTIONS:
                self.total[view][name] += v
                self.own[view][name] += own.get(name, 0)
            else:
                self.not_kept += 1

    def key(self, ch: str) -> bool:
        """Act on a key: whether it was top's (q is the caller's)."""
        if ch in ("o", "t"):
            self.sort = "own" if ch == "o" else "total"
        elif ch == "p":
            self.view = VIEWS[(VIEWS.index(self.view) + 1) % len(VIEWS)]
        else:
            return False
        return True

    def rows(self, n: int) -> tuple[list[Row], int]:
        """The `n` rows of the view, by the sort chosen, and the recent samples' grand total (ns)."""
        own, total, grand = Counter[str](), Counter[str](), 0
        for _, o, t, g in self.recent[self.view]:
            own.update(o)
            total.update(t)
            grand += g
        key = own if self.sort == "own" else total
        names = sorted(total, key=lambda f: (-key[f], -total[f], f))[:n]
        base = grand or 1
        return [
            Row(f, own[f] / base, total[f] / base, self.own[self.view][f], self.total[self.view][f]) for f in names
        ], grand


def process_name(labels: dict[str, str | int]) -> str:
    """`PID executable` of a sample (record's profiles carry plain pid labels)."""
    exe = str(labels.get("process.executable", "") or "?")
    return f"{labels.get('pid', '?')} {os.path.basename(exe) or exe}"


def screen_lines(view: TopView, header: str, width: int, height: int) -> list[str]:
    """Every line of the screen, each at most `width - 1` characters (curses cannot write the last
    column of the last line), names made safe."""
    rows, grand = view.rows(max(0, height - 4))
    first = "Function" if view.view == "functions" else "Process (pid executable)"
    lines = [
        printable(header),
        f"sorted by {view.sort}, shares of the last {RECENT_S:g} s ({grand / 1e9:.2f} CPU s)   {KEYS_HELP}",
        "",
        f"{'%Own':>6} {'%Total':>7} {'OwnTime':>9} {'TotalTime':>10}  {first}",
    ]
    for r in rows:
        lines.append(
            f"{100 * r.own_share:5.1f}% {100 * r.total_share:6.1f}% {r.own_ns / 1e9:8.2f}s {r.total_ns / 1e9:9.2f}s  "
            f"{printable(r.name)}"
        )
    return [line[: max(0, width - 1)] for line in lines[:height]]


class TopRecording(record.Recording):
    """record's agent with one-second windows and no end of its own."""

    window_s = TOP_WINDOW_S

    def started_line(self, took: str) -> str:
        return f"{self.prog}: {took}; the view follows"


def parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    record.add_pid_option(p, "only these processes (default: every process of the host)")
    record.add_sampling_options(p, offcpu=False)  # top shows on-CPU time
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        args.runtimes = record_command.parse_runtimes(args.runtime + (["python"] if args.python else []))
    except ValueError as e:
        p.error(str(e))
    # what record.Recording reads of a recording's options
    args.command, args.duration, args.output = None, math.inf, ""
    return args


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler top") -> int:
    args = parse_args(argv, prog)
    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        print(f"{prog}: needs a terminal (to a file or a pipe: ebpfprofiler record)", file=sys.stderr)
        return 2
    log_mod.setup("top", "ERROR")  # a log line would tear the screen
    refused = record.agent_refusal(args, prog)
    if refused is not None:
        return refused
    rec = record.open_recording(args, prog, "stopping top", TopRecording)
    if isinstance(rec, int):
        return rec
    try:
        rec.start_agent()
        failed = rec.wait_started()
        if failed is not None:
            return failed
        locale.setlocale(locale.LC_ALL, "")  # curses draws in the terminal's encoding
        ended = curses.wrapper(live, rec)
        if ended:
            print(f"{prog}: {ended}; its log:\n{record.tail(rec.run_log)}", file=sys.stderr)
            return 1
        return 0
    finally:
        rec.close()


def live(scr: curses.window, rec: record.Recording) -> str:
    """Draw until q, a stop, or `run` ending: "" or why the agent ended."""
    assert rec.child is not None
    going = True
    with contextlib.suppress(curses.error):  # a terminal without an invisible cursor
        curses.curs_set(0)
    scr.timeout(int(REFRESH_S * 1000))
    progress = record.Progress(rec.local_dir, rec.run_dir, set(rec.args.pid), consume=True)
    view = TopView()
    began = time.monotonic()
    next_draw = 0.0
    while going and not rec.stop.is_set():
        if rec.child.poll() is not None:
            return f"the profiler stopped (exit {rec.child.returncode})"
        now = time.monotonic()
        if now >= next_draw:
            view.add(progress.update())
            height, width = scr.getmaxyx()
            header = (
                f"ebpfprofiler top: {rec.target} at {rec.args.hz} Hz, {now - began:.0f} s, "
                f"{progress.samples} cpu samples, {len(progress.processes)} processes, {progress.lost} lost"
            )
            draw(scr, screen_lines(view, header, width, height))
            next_draw = now + REFRESH_S
        ch = scr.getch()
        if 0 <= ch < 256:
            going = chr(ch) not in ("q", "Q")
            if view.key(chr(ch)):
                next_draw = 0.0  # at once
    return ""


def draw(scr: curses.window, lines: Sequence[str]) -> None:
    """The screen: `lines` in the terminal's encoding (a name it cannot show is a ?)."""
    scr.erase()
    for y, line in enumerate(lines):
        with contextlib.suppress(curses.error):  # wide characters past the last column
            enc = scr.encoding or "ascii"
            scr.addstr(y, 0, line.encode(enc, "replace").decode(enc))
    scr.refresh()
