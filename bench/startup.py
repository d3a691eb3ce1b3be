"""`make bench` suite `startup`: how long the agent takes to start, cold and warm.

Two commands, as a user runs them:
- `ebpfprofiler run` with deploy/agent.yaml as shipped (only local_dir, the run and the state
  directories moved to a scratch directory);
- `ebpfprofiler record -d RECORD_S --offcpu` (record's own defaults, with off-CPU as the shipped
  config has it).
Each round starts each command COLD (the page cache dropped first, `sync; echo 3 >
/proc/sys/vm/drop_caches`: LLVM, the kernel headers and Python's modules are read from disk again)
and then WARM (again at once), each after waiting for a quiet host (bench/host.py); a host that stays
busy past --quiet-wait after at least one whole round ends the suite with the rounds it has (noted).

Figures, seconds from the moment bench starts the command, median (min–max) over the rounds:
- collector ready: its ready file (RUN/collector.ready) appears, polled every POLL_S;
- first sample drained: the time stamp of the collector's first drain that took a key (its DEBUG log
  line "drained (...): N keys", N > 0: the agent runs with EBPFPROFILER_LOG_LEVEL=DEBUG, which adds a
  few lines a second). A CPU loop is started when the collector is ready, so that there is a sample to
  take: on an idle host the first one may wait for any process to run;
- where the time to ready goes, from the agent's log (stamped to the ms): `run`'s own start and the
  collector's preflight (until the first stage is started), the other stages (until the collector is
  started), the collector before its compile (imports, privilege drop, checks, kernel probes), compiling
  and loading the BPF programs (the collector's "...: done in S s" line, shared/ready.py), and the rest
  until its ready file (connecting to the workers, attaching).
Where the compile-and-load step's own time goes (bcc's compile against the kernel's verifier) is not
visible from outside; docs/architecture.md "Start-up" has that split, measured once.

Writes bench/results/startup.json.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from bench import bpf, host, procs
from bench.procs import BenchError
from bench.report import _mmm
from bench.stats import summary
from shared import endpoints

ROOT = Path(__file__).resolve().parent.parent
EBPFPROFILER = str(ROOT / ".venv" / "bin" / "ebpfprofiler")
# How often bench looks for the ready file and the log lines: the figures' resolution.
POLL_S = 0.02
# The longest a start may take before bench gives up on it: minutes, for a slow host (this one: ~10 s).
START_DEADLINE_S = 600.0
# After the collector is ready, the longest wait for its first drained sample (drains are 1 s apart
# while processes start; a CPU loop runs).
FIRST_SAMPLE_DEADLINE_S = 60.0
# record's length: past its start and its first drain, short enough to cost little.
RECORD_S = 10.0
# How long a command may take to stop (run drains once more and writes its windows).
STOP_DEADLINE_S = 90.0
BUSY = ["sh", "-c", "while :; do :; done"]
COMMANDS = ("run", "record")
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+?)\[(\d+)\] (\w+) (\S+): (.*)$")
DRAINED = re.compile(r"^drained \(\w+\): (\d+) keys")
STEP_DONE = re.compile(r"^compiling and loading BPF programs: done in ([\d.]+) s$")


def parse_log(text: str, t0: float) -> dict[str, float]:
    """The moments (seconds after wall-clock time t0) the agent's log names: first_stage_started,
    collector_started, step_started, step_done (and step_s), first_sample; those not yet there are absent."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        stamp, who, _pid, _level, _logger, msg = m.groups()
        at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() - t0
        if who == "run" and msg.startswith("started ") and "first_stage_started" not in out:
            out["first_stage_started"] = at
        if who == "run" and msg.startswith("started collector "):
            out["collector_started"] = at
        if who == "collector" and (done := STEP_DONE.match(msg)):
            out["step_s"] = float(done.group(1))
            out["step_done"] = at
            out["step_started"] = at - out["step_s"]
        if who == "collector" and (drained := DRAINED.match(msg)) and int(drained.group(1)) > 0:
            out.setdefault("first_sample", at)
    return out


def drop_caches() -> None:
    """Write back and drop the page cache, dentries and inodes: the next start reads from disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class StartupBench:
    def __init__(self, rounds: int, quiet_wait: float, log: Callable[[str], None] = print, keep: bool = False) -> None:
        self.rounds, self.quiet_wait, self.log, self.keep = rounds, quiet_wait, log, keep
        self.our_prog_ids: set[int] = set()

    def run(self) -> dict[str, Any]:
        tmp = Path(tempfile.mkdtemp(prefix="ebpfprofiler-startup-", dir="/tmp"))
        tmp.chmod(0o755)  # the stages run as their own users and must enter it
        runs: list[dict[str, Any]] = []
        ended_early = ""
        try:
            for r in range(self.rounds):
                for command in COMMANDS:
                    for temp in ("cold", "warm"):
                        try:
                            waited = host.wait_until_quiet(self.our_prog_ids, self.quiet_wait, self.log)
                        except BenchError as e:
                            if r == 0:
                                raise
                            # a shared host busy for good: the whole rounds measured so far stand
                            ended_early = (
                                f"ended after {r} of {self.rounds} rounds: {str(e).removesuffix('; nothing measured')}"
                            )
                            runs = [x for x in runs if x["round"] <= r]
                            self.log(ended_early)
                            raise _EndedEarly() from None
                        work = tmp / f"{r + 1}-{command}-{temp}"
                        work.mkdir()
                        work.chmod(0o755)
                        if temp == "cold":
                            drop_caches()
                        got = (self._run if command == "run" else self._record)(work)
                        got.update({"round": r + 1, "command": command, "start": temp, "quiet_wait_s": waited})
                        runs.append(got)
                        self.log(
                            f"startup round {r + 1} {command} {temp}: collector ready {got['ready']:.1f} s, "
                            f"first sample {got.get('first_sample', float('nan')):.1f} s "
                            f"(compile and load {got.get('step_s', float('nan')):.1f} s)"
                        )
        except _EndedEarly:
            pass
        finally:
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self.log(f"kept {tmp}")
        return {
            "runs": runs,
            "summary": summarize(runs),
            "record_s": RECORD_S,
            "ended_early": ended_early,
            "config": f"deploy/agent.yaml (run); record -d {RECORD_S:g} --offcpu",
        }

    def _run(self, work: Path) -> dict[str, Any]:
        cfg = yaml.safe_load((ROOT / "deploy" / "agent.yaml").read_text())
        cfg["modules"]["ebpf_profiler"]["local_dir"] = str(work / "profiles")
        config = work / "agent.yaml"
        config.write_text(yaml.safe_dump(cfg))
        config.chmod(0o644)
        run_dir = work / "run"
        log_path = work / "agent.log"
        with open(log_path, "wb") as logf:
            t0 = time.time()
            m0 = time.monotonic()
            p = procs.start(
                [
                    EBPFPROFILER,
                    "run",
                    "--config",
                    str(config),
                    "--run-dir",
                    str(run_dir),
                    "--state-dir",
                    str(work / "state"),
                ],
                stdout=logf,
                stderr=logf,
                env=_debug_env(),
            )
        try:
            return self._measure(p, t0, m0, run_dir, lambda: log_path)
        finally:
            code = procs.stop(p, timeout=STOP_DEADLINE_S)
            if code != 0:
                raise BenchError(f"`ebpfprofiler run` exited with {code} when stopped; see {log_path}")

    def _record(self, work: Path) -> dict[str, Any]:
        out_path = work / "record.out"
        with open(out_path, "wb") as out:
            t0 = time.time()
            m0 = time.monotonic()
            p = procs.start(
                [EBPFPROFILER, "record", "-d", f"{RECORD_S:g}", "--offcpu", "-o", str(work / "out.folded")],
                stdout=out,
                stderr=out,
                env=_debug_env(),
                cwd=str(work),
            )
        measured = False
        try:
            # record's agent runs in its workspace, /tmp/ebpfprofiler-record-*, whose owner file names record
            ws = procs.wait_for("record's workspace", lambda: _workspace_of(p.pid), START_DEADLINE_S, POLL_S)
            got = self._measure(p, t0, m0, str(ws / "run"), lambda: ws / "run.log", keep_log=work / "agent.log")
            measured = True
        finally:
            if measured:  # it ends by itself, and writes -o
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(RECORD_S + STOP_DEADLINE_S)
            code = procs.stop(p, sig=signal.SIGINT, timeout=STOP_DEADLINE_S)  # (as Ctrl-C does)
        if code != 0:
            raise BenchError(f"`ebpfprofiler record` exited with {code}; see {out_path}")
        said = re.search(r"the profiler started in ([\d.]+) s", out_path.read_text(errors="replace"))
        if said:
            got["record_says_started_s"] = float(said.group(1))
        return got

    def _measure(
        self,
        p: subprocess.Popen[Any],
        t0: float,
        m0: float,
        run_dir: Path | str,
        log_path: Callable[[], Path],
        keep_log: Path | None = None,
    ) -> dict[str, Any]:
        ready_file = endpoints.ready_file(str(run_dir), "collector")

        def ready() -> bool:
            if p.poll() is not None:
                raise BenchError(f"{procs.argv_of(p)[1]} exited with {p.returncode} while starting")
            return os.path.exists(ready_file)

        procs.wait_for("the collector's ready file", ready, START_DEADLINE_S, POLL_S)
        got: dict[str, Any] = {"ready": time.monotonic() - m0}
        try:
            collector = int(Path(ready_file).read_text().split()[0])
            self.our_prog_ids |= bpf.held_by(collector)[0]
        except (OSError, ValueError, IndexError):
            pass
        busy = procs.start(BUSY)
        try:

            def first_sample() -> dict[str, float] | None:
                if p.poll() is not None:
                    raise BenchError(f"{procs.argv_of(p)[1]} exited with {p.returncode} before its first sample")
                text = log_path().read_text(errors="replace")
                if keep_log is not None:
                    keep_log.write_text(text)  # record removes its workspace, log and all, when it ends
                seen = parse_log(text, t0)
                return seen if "first_sample" in seen and "step_done" in seen else None

            got.update(procs.wait_for("the first sample drained", first_sample, FIRST_SAMPLE_DEADLINE_S, 0.1))
        finally:
            procs.stop(busy, sig=signal.SIGKILL, timeout=10)
        return got


class _EndedEarly(Exception):
    """The host stayed busy after at least one whole round: the suite ends with the rounds it has."""


def _debug_env() -> dict[str, str]:
    return {**os.environ, "EBPFPROFILER_LOG_LEVEL": "DEBUG"}


def _workspace_of(pid: int) -> Path | None:
    for ws in Path("/tmp").glob("ebpfprofiler-record-*"):
        try:
            if (ws / "owner").read_text().split()[0] == str(pid) and (ws / "run.log").exists():
                return ws
        except (OSError, IndexError):
            continue
    return None


# The figures of a run, in the order of the table: (key, label).
FIGURES = (
    ("ready", "start → collector ready"),
    ("first_sample", "start → first sample drained"),
    ("first_stage_started", "run's start and the collector's preflight"),
    ("other_stages", "uploader, symbolizer, runtime reader"),
    ("collector_before_step", "collector: imports, privilege drop, checks"),
    ("step_s", "collector: compiling and loading BPF programs"),
    ("after_step", "collector: after the step, until ready"),
)


def figures(run: dict[str, Any]) -> dict[str, float | None]:
    """The table's figures of one run (the spans between the moments the log names)."""

    def span(a: str, b: str) -> float | None:
        return run[b] - run[a] if a in run and b in run else None

    return {
        "ready": run["ready"],
        "first_sample": run.get("first_sample"),
        "first_stage_started": run.get("first_stage_started"),
        "other_stages": span("first_stage_started", "collector_started"),
        "collector_before_step": span("collector_started", "step_started"),
        "step_s": run.get("step_s"),
        "after_step": span("step_done", "ready"),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for command in COMMANDS:
        for temp in ("cold", "warm"):
            these = [figures(r) for r in runs if r["command"] == command and r["start"] == temp]
            out[f"{command} {temp}"] = {k: summary([v for f in these if (v := f[k]) is not None]) for k, _ in FIGURES}
    return out


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the start-up table."""
    cols = [c for c in result["summary"] if result["summary"][c]["ready"]["n"]]
    head = ["seconds", *cols]
    rows = [[label] + [_mmm(result["summary"][c][key], "{:.1f}") for c in cols] for key, label in FIGURES]
    n = max((result["summary"][c]["ready"]["n"] for c in cols), default=0)
    caption = (
        f"from the command's start, median (min–max) of {n} round(s); run: deploy/agent.yaml as shipped; "
        f"record: -d {result['record_s']:g} --offcpu; cold: after dropping the page cache"
    )
    notes = [
        "first sample drained: the collector's first drain that took a sample (a CPU loop runs from ready)",
        "the rows below the first two split the time to ready, from the agent's log; the compile-and-load "
        "step is bcc's compile and the kernel's verifier (docs/architecture.md, Start-up)",
    ]
    if result.get("ended_early"):
        notes.append(result["ended_early"])
    return caption, head, rows, notes
