""".NET JIT frame names end to end: real .NET processes, the whole pipeline, cpu profiles at the receiver.

With runtime_stacks: [dotnet], the runtime reader asks each .NET process once,
over its diagnostics socket, for a perf map. The runtimes come from PyPI
(bench/assets/dotnet_runtimes.py), hosted in Python processes by pythonnet
(tests/workloads/dotnet_hot.py), all started at once before the pipeline, so
the collector's first sight of each already maps libcoreclr.so:

- .NET 8.0.4, run as nobody (the reader connects as its user), runs a
  DynamicMethod the JIT compiled, HotLoopEbpfTest, hot: in every window of its
  cpu profiles from the second on, its JIT frames are named (at most 10%
  unnamed) and the hot method is among them, and over those windows it holds
  most of the process's samples (on a loaded host a window may hold only a
  few: each is judged by its JIT frames); after the agent
  stops (DisablePerfMap), the methods it compiles are no longer written to its
  map. The map stays where the runtime wrote it, as the runtime leaves it.
- .NET Core 3.1.23, run as root (the reader connects as uid 0 without
  capabilities): EnablePerfMap is answered "unknown command"; refused with the
  reason and the advice DOTNET_PerfMapEnabled=1, and no map is left.
- .NET 8 with DOTNET_EnableDiagnostics=0 (no socket) and with TMPDIR
  elsewhere than /tmp: refused with the reason, no map.

Every answer is logged once. While the pipeline runs, the runtime stage holds
CAP_SYS_PTRACE only and its connector, its one child, CAP_SETUID and
CAP_SETGID besides.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.assets import dotnet_runtimes
from receiver.store import list_profiles
from shared import endpoints, pprof, privileges
from shared.config import ProfilerConfig
from tests.harness import WORKLOADS, Pipeline, Receiver, children, open_dir, require_root, wait_for

SCRIPT = WORKLOADS / "dotnet_hot.py"
HOT = "HotLoopEbpfTest"
NOBODY = 65534
# The workloads' own deadline: they end by themselves even if the test cannot end them.
WORKLOAD_SECONDS = 240
# Seconds per window: a busy thread's 57 samples at 19 Hz.
WINDOW_S = 3
# Windows of the .NET 8 process's cpu profiles the test waits for.
WANT_WINDOWS = 3
# Share of the hot process's samples from the second window on that must be in the hot method (its JIT
# code is where it spends its time; the rest is pythonnet's call into it and the fresh methods' compiles).
# On a loaded host a window may hold only a few samples of it: each window is judged by its JIT frames.
MIN_NAMED_SHARE = 0.6
# Share of a window's samples in JIT code that may be unnamed (code the runtime made but does not name,
# such as its stubs).
MAX_UNNAMED_JIT_SHARE = 0.1


class Workload:
    """One .NET process, its output lines collected as they come."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], started: list[subprocess.Popen]) -> None:
        self.name = name
        # SIGKILL at the module's end (conftest.py): the runtime's SIGTERM handler makes pythonnet print errors
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True)
        started.append(self.proc)
        self.pid = self.proc.pid
        self.fresh = 0
        self._ready = threading.Event()
        self._first = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def wait_ready(self) -> None:
        """Until its runtime runs the method (the workloads start at once: each takes seconds)."""
        if not self._ready.wait(60) or not self._first.startswith("ready "):
            raise AssertionError(f"{self.name}: printed {self._first!r} (exit {self.proc.poll()})")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        self._first = self.proc.stdout.readline()
        self._ready.set()
        for line in self.proc.stdout:
            if line.startswith("fresh "):
                self.fresh = int(line.split()[1])

    def remove_leftovers(self) -> None:
        """The test's own clean-up: a killed runtime leaves its diagnostics socket and its debugger
        pipes (clr-debug-pipe-PID-*-in/out), and every runtime its map."""
        for left in (
            *Path("/tmp").glob(f"dotnet-diagnostic-{self.pid}-*-socket"),
            *Path("/tmp").glob(f"clr-debug-pipe-{self.pid}-*"),
        ):
            left.unlink(missing_ok=True)
        self.perf_map.unlink(missing_ok=True)

    @property
    def perf_map(self) -> Path:
        return Path(f"/tmp/perf-{self.pid}.map")


@dataclass
class Run:
    log: str
    samples: dict[int, dict[int, list[pprof.ReadSample]]]  # pid → window start → cpu samples
    net8: Workload
    refused: dict[str, Workload]
    maps_left: dict[str, bool] = field(default_factory=dict)  # refused process → its map existed after stop
    written_while_on: str = ""  # a fresh method's name found in the map while the agent ran
    size_at_stop: int = 0
    size_later: int = 0
    not_written: str = ""  # a fresh method compiled after the stop, and whether it was written
    written_after_stop: bool = True
    reader_status: dict[str, str] = field(default_factory=dict)  # the runtime stage's /proc status
    connector_status: list[dict[str, str]] = field(default_factory=list)  # its children's
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # each stage's at its exit


def status(pid: int) -> dict[str, str]:
    return {
        k: v.strip() for k, _, v in (ln.partition(":") for ln in Path(f"/proc/{pid}/status").read_text().splitlines())
    }


def cpu_samples(directory: Path) -> dict[int, dict[int, list[pprof.ReadSample]]]:
    out: dict[int, dict[int, list[pprof.ReadSample]]] = {}
    for meta in list_profiles(str(directory)):
        if meta["type"] != "cpu":
            continue
        for s in pprof.read(Path(meta["path"]).read_bytes()).samples:
            out.setdefault(int(s.labels["pid"]), {}).setdefault(int(meta["start"]), []).append(s)
    return out


def launch(
    started: list[subprocess.Popen],
    name: str,
    script: Path,
    root: Path,
    version: str,
    mode: str,
    *,
    user: int | None = None,
    **env: str,
) -> Workload:
    base = {k: v for k, v in os.environ.items() if k not in ("TMPDIR",) and not k.startswith(("DOTNET_", "COMPlus_"))}
    base.update(DOTNET_SYSTEM_GLOBALIZATION_INVARIANT="1", **env)
    argv = [str(dotnet_runtimes.venv() / "bin/python"), str(script), str(root), version, mode, str(WORKLOAD_SECONDS)]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    return Workload(name, argv, base, started)


def answers(log: str, pid: int) -> list[str]:
    return [ln for ln in log.splitlines() if re.search(rf"\bpid {pid} \(.*(: \.NET: |refused: \.NET: )", ln)]


def launch_workloads(
    started: list[subprocess.Popen], venv: Path, script: Path, other_tmp: Path, workloads: list[Workload]
) -> tuple[Workload, dict[str, Workload]]:
    """The .NET 8 process (as nobody) and the three to refuse, ready, each in `workloads` once launched."""
    net8_root, net31_root = dotnet_runtimes.dotnet8_root(venv), dotnet_runtimes.dotnet31_root(venv)
    net8 = launch(started, "net8", script, net8_root, "8.0.4", "hot", user=NOBODY)
    workloads.append(net8)
    refused = {
        "net31": launch(started, "net31", script, net31_root, "3.1.23", "fresh"),
        "no_diagnostics": launch(
            started, "no_diagnostics", script, net8_root, "8.0.4", "fresh", DOTNET_EnableDiagnostics="0"
        ),
        "other_tmpdir": launch(started, "other_tmpdir", script, net8_root, "8.0.4", "fresh", TMPDIR=str(other_tmp)),
    }
    workloads.extend(refused.values())
    for w in workloads:
        w.wait_ready()
    return net8, refused


def watch_while_on(pipeline: Pipeline, receiver: Receiver, workloads: list[Workload], r: Run) -> None:
    """While the agent runs: every process answered, the windows wanted, the reader's and its
    connectors' status, and the latest fresh method in the map (into `r`)."""
    net8 = r.net8
    ready = Path(endpoints.ready_file(str(pipeline.run_dir), "runtime"))
    wait_for("the runtime reader", ready.exists, timeout=30)
    wait_for(
        "an answer for every .NET process",
        lambda: all(answers(pipeline.log(), w.pid) for w in workloads),
        timeout=60,
        interval=0.5,
    )

    def windows() -> bool:
        return len(cpu_samples(receiver.dir).get(net8.pid, {})) >= WANT_WINDOWS

    wait_for(f"{WANT_WINDOWS} windows of the .NET 8 process's cpu profiles", windows, timeout=90, interval=1.0)
    reader = int(Path(endpoints.ready_file(str(pipeline.run_dir), "runtime")).read_text())
    r.reader_status = status(reader)
    r.connector_status = [status(c) for c in children(reader)]
    # The map is written as the runtime compiles: the latest fresh method is in it.
    r.written_while_on = f"FreshEbpfTest_{net8.fresh}("
    wait_for(
        f"{r.written_while_on} in {net8.perf_map}",
        lambda: net8.perf_map.exists() and r.written_while_on in net8.perf_map.read_text(errors="replace"),
        timeout=10,
    )


@pytest.fixture(scope="module")
def run(module_started: list[subprocess.Popen]) -> Iterator[Run]:
    require_root()
    venv = dotnet_runtimes.venv()
    work = open_dir("dotnet")
    script = work / SCRIPT.name
    shutil.copy(SCRIPT, script)
    other_tmp = work / "tmpdir"
    other_tmp.mkdir()
    receiver = Receiver(work / "received")
    workloads: list[Workload] = []
    try:
        net8, refused = launch_workloads(module_started, venv, script, other_tmp, workloads)
        pipeline = Pipeline(
            work,
            ProfilerConfig(
                upload_interval_s=WINDOW_S,
                endpoint=receiver.url,
                local_dir=str(work / "unused"),
                plain_pid=True,
                python_stacks=False,
                runtime_stacks=("dotnet",),
                dwarf_unwind=False,
                offcpu=True,
            ),
        )
        r = Run("", {}, net8, refused)
        try:
            watch_while_on(pipeline, receiver, workloads, r)
        except AssertionError as e:
            said = [ln for ln in pipeline.log().splitlines() if " runtime[" in ln or "perf map" in ln]
            raise AssertionError(f"{e}; the runtime reader said:\n" + "\n".join(said[-30:])) from None
        finally:
            code = pipeline.stop()
        assert code == 0, pipeline.log()
        r.log, r.samples, r.counters = pipeline.log(), cpu_samples(receiver.dir), pipeline.counters()
        # After the stop: the methods it compiles are no longer written.
        r.size_at_stop = net8.perf_map.stat().st_size
        last = net8.fresh
        wait_for("two more fresh methods compiled by the .NET 8 process", lambda: net8.fresh >= last + 2, timeout=10)
        r.not_written = f"FreshEbpfTest_{net8.fresh}("
        r.written_after_stop = r.not_written in net8.perf_map.read_text(errors="replace")
        r.size_later = net8.perf_map.stat().st_size
        r.maps_left = {name: w.perf_map.exists() for name, w in refused.items()}
        yield r
    finally:
        for w in workloads:  # still running (killed at the module's end): a runtime remakes neither
            w.remove_leftovers()
        receiver.stop()
        shutil.rmtree(work, ignore_errors=True)


def user_leaf(s: pprof.ReadSample) -> pprof.Frame | None:
    user = [f for f in s.frames if f.module != "[kernel.kallsyms]"]
    return user[-1] if user else None


def test_a_jit_compiled_hot_method_is_named_from_the_second_window_on(run: Run) -> None:
    by_window = run.samples.get(run.net8.pid, {})
    starts = sorted(by_window)
    assert len(starts) >= WANT_WINDOWS, starts
    rows, hot_total, all_total = [], 0, 0
    for i, start in enumerate(starts):
        jit: Counter[str] = Counter()  # samples whose user leaf is JIT code, by its name ("" unnamed)
        total = 0
        for s in by_window[start]:
            total += s.values[0]
            leaf = user_leaf(s)
            if leaf is not None and leaf.module == "[jit]":
                jit[leaf.function] += s.values[0]
        hot = sum(n for name, n in jit.items() if HOT in name)
        rows.append((total, sum(jit.values()), jit[""], hot))
        for name in jit:  # the runtime's own name for it
            assert HOT not in name or name.endswith(f"dynamicClass::{HOT}(int64)[Optimized]"), name
        if i == 0:
            continue
        hot_total, all_total = hot_total + hot, all_total + total
        # From the second window on: JIT code is named, and the hot method is among it. Code the JIT
        # writes later (the [Optimized] tier) waits up to a re-check of the map (PERF_MAP_RECHECK_S, 1 s,
        # a third of a window): the share left unnamed is judged from the third window on.
        if sum(jit.values()):
            assert hot, (i, jit.most_common(5))
            if i >= 2:
                assert jit[""] <= MAX_UNNAMED_JIT_SHARE * sum(jit.values()), (i, jit.most_common(5))
    print(".NET 8 windows (samples, in JIT code, unnamed, in the hot method):", rows)
    # The process spends its time there: most of its samples from the second window on.
    assert hot_total >= MIN_NAMED_SHARE * all_total, rows


def test_each_answer_is_logged_once(run: Run) -> None:
    for w in [run.net8, *run.refused.values()]:
        # the log line is the feature: each process's answer is logged once, saying what the runtime did
        assert len(answers(run.log, w.pid)) == 1, (w.name, answers(run.log, w.pid))
    (enabled,) = answers(run.log, run.net8.pid)
    assert "(.NET 8.0.4): EnablePerfMap answered OK" in enabled, enabled


def test_dotnet_3_1_is_refused_with_the_reason_and_left_without_a_map(run: Run) -> None:
    (line,) = answers(run.log, run.refused["net31"].pid)
    # the log line is the feature: the refusal says why and what to do (start with DOTNET_PerfMapEnabled=1)
    assert (
        "refused: .NET: " in line
        and "(.NET 3.1.23): EnablePerfMap answered error HRESULT 0x80131385 (unknown command)" in line
    ), line
    assert "start the process with DOTNET_PerfMapEnabled=1" in line, line
    assert not run.maps_left["net31"]


def test_no_diagnostics_socket_and_another_tmpdir_are_refused_with_the_reason(run: Run) -> None:
    (line,) = answers(run.log, run.refused["no_diagnostics"].pid)
    # the log line is the feature: each refusal says why the process is not named
    assert "refused: .NET: " in line and "DOTNET_EnableDiagnostics=0: the runtime opened no diagnostics socket" in line
    (line,) = answers(run.log, run.refused["other_tmpdir"].pid)
    assert "refused: .NET: " in line and "TMPDIR is '/tmp/ebpfprofiler-dotnet-" in line, line
    assert not run.maps_left["no_diagnostics"] and not run.maps_left["other_tmpdir"]


def test_after_the_agent_stops_the_process_stops_writing_its_map(run: Run) -> None:
    # the one perf map the agent asked for (the .NET 8 process's) is asked back, and it answered OK
    runtime = run.counters["runtime"]
    assert (runtime["dotnet_perf_maps_disabled"], runtime["dotnet_disable_failed"]) == (1, 0), runtime
    assert run.written_while_on  # it was written while the agent ran
    assert not run.written_after_stop, f"{run.not_written} was written after the stop"
    assert run.size_later == run.size_at_stop


def test_only_the_connector_keeps_setuid_and_setgid(run: Run) -> None:
    runtime_user = privileges.STAGES["runtime"].user
    uid = str(pwd.getpwnam(runtime_user).pw_uid)
    base = privileges.mask(privileges.STAGES["runtime"].caps)
    extra = privileges.mask(privileges.OPTIONAL_CAPS["runtime"])
    st = run.reader_status
    assert st["Uid"].split() == [uid] * 4 and st["NoNewPrivs"] == "1"
    assert int(st["CapEff"], 16) == int(st["CapPrm"], 16) == base, st
    (conn,) = run.connector_status
    assert conn["Uid"].split() == [uid] * 4 and conn["NoNewPrivs"] == "1"
    assert int(conn["CapEff"], 16) == int(conn["CapPrm"], 16) == base | extra, conn
