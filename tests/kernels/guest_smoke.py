"""The kernel matrix's smoke suite, run inside each guest by tests/kernels/guest_init.sh.

Owns: the guest's facts (uname -r, perf_event_paranoid, RLIMIT_MEMLOCK, BTF,
python3), four C workloads built with the guest's gcc (main→alpha→beta with
frame pointers, without them, blocking in beta in a syscall of its own, and
blocking in beta in libc's nanosleep), and the steps run
against them: preflight; `ebpfprofiler record` (FP, DWARF and off-CPU
figures, and its start-up time); `ebpfprofiler run` with python_legacy on
the guest's own python3 (python_wall names alpha/beta, and so does its cpu
profile: mixed stacks; cpu profiles are written, `ebpfprofiler status` works, SIGINT stops it cleanly with none of
its BPF programs, links or perf events left). Each step has a deadline; a
step that fails records why and the next one runs. Each result is one JSON
line marked RESULT_MARK on the results port (the host reads it).

Must not: change any sysctl or rlimit, patch the agent, or import anything
but the standard library at module level (the host imports it for its
constants; the project is imported inside the steps, from the guest's venv).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

RESULT_MARK = "KTEST-RESULT "
# The host's choices for this run (tests/kernels/guestroot.py writes it into the root).
GUEST_PLAN = "/etc/ktest/plan.json"
WORK = Path("/tmp/ktest")
PROJECT = Path(__file__).resolve().parents[2]
VENV_BIN = PROJECT / ".venv" / "bin"

# The three C programs: main→alpha→beta in a loop; beta spins, or blocks in libc's nanosleep.
C_SOURCE = r"""
#include <time.h>
volatile unsigned long sink;
__attribute__((noipa)) void beta(void) {
#if defined(BLOCK_RAW)
    /* 20 ms off-CPU in an inline syscall: beta's own frame is the top user frame, so a frame-pointer
       walk sees every caller (as tests/workloads/offcpu.c; Debian's libc has no frame pointers) */
    struct timespec ts = {0, 20 * 1000 * 1000};
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(35L), "D"(&ts), "S"(0L) : "rcx", "r11", "memory");
#elif defined(BLOCK_LIBC)
    struct timespec ts = {0, 20 * 1000 * 1000};   /* 20 ms off-CPU in libc: its callers need DWARF */
    nanosleep(&ts, 0);
#else
    unsigned long x = sink;
    for (long i = 0; i < 2000000; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    sink = x;
#endif
}
__attribute__((noipa)) void alpha(void) { beta(); sink++; }
int main(void) { for (;;) { alpha(); sink++; } }
"""
PY_SOURCE = """\
def beta():
    x = 0
    for i in range(100000):
        x += i * i
    return x


def alpha():
    return beta() + 1


def main():
    while True:
        alpha()


main()
"""
# name → gcc flags. kfp: frame pointers, as the test (the host's tests/harness.py
# FRAME_POINTER_FLAGS reach it through GUEST_PLAN); knofp: -O2 without them (.eh_frame kept: DWARF
# unwinding needed); kblock: blocks in beta in a syscall of its own, built with frame pointers (the
# off-CPU figure); kblocklibc: blocks in libc's nanosleep (off-CPU through libc: informational, as its
# callers need DWARF off-CPU, which kernels before 5.15 lack by design).
DEFAULT_FP_FLAGS = ["-O1", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]
NOFP_FLAGS = ["-O2", "-fomit-frame-pointer", "-fasynchronous-unwind-tables"]
CHAIN = ("main", "alpha", "beta")

# gcc under TCG: a few seconds a program.
BUILD_TIMEOUT_S = 180
# preflight imports the collector's checks (no compile): seconds, more under TCG.
PREFLIGHT_TIMEOUT_S = 240
# How long `record` records.
RECORD_SECONDS = 30
# bcc's compile takes 70-136 s under TCG: `record` and `run` get 300 s to become ready.
READY_TIMEOUT_S = 300
# record: ready + recording + its own stop (90 s) + writing the outputs.
RECORD_TIMEOUT_S = READY_TIMEOUT_S + RECORD_SECONDS + 180
# run: upload windows of this length, so profiles arrive quickly.
RUN_WINDOW_S = 10
# Windows `run` writes before its steady-state figures are read (its last whole window, the 6th):
# under TCG a process's unwind tables arrive up to ~30 s after `run` is ready (seen on 6.12: the 4th
# window still had none).
STEADY_WINDOWS = 7
# After `run` is ready: cpu profiles of the workloads and python_wall of python3 within a few windows.
PROFILES_TIMEOUT_S = 6 * RUN_WINDOW_S
# `ebpfprofiler status` reads a file: seconds, more under TCG (Python start-up).
STATUS_TIMEOUT_S = 60
# `run` stops every stage in order (each gets 20 s before a kill): it must exit within this.
STOP_TIMEOUT_S = 120
# bpftool, pgrep: one short command.
TOOL_TIMEOUT_S = 60
# Passing figures: the share of a program's samples whose stack holds main→alpha→beta. The issue's
# working runs read 92-100%; samples in main or alpha themselves, or in the kernel's entry, are the rest.
MIN_CHAIN_PCT = 80.0
# Fewer samples than this is no figure (30 s at 99 Hz of a spinning program gives ~1500 at TCG speed or less).
MIN_SAMPLES = 20
# The agent's processes (`ebpfprofiler run` and its stages), by command line.
AGENT_PROCESS_RE = r"bin/ebpfprofiler |-m (cli|collector|symbolizer|uploader|runtimes)\.main"
# Log lines that say something was refused, degraded or failed.
NOTABLE_RE = re.compile(
    r"refus|cannot|can't|WARNING|ERROR|verifier|Traceback|failed|denied|not permitted|"
    r"invalid|error:|did not|degrad|unavailable",
    re.IGNORECASE,
)
# A log line's time stamp (shared/log.py's format), left out of a reason.
STAMP_RE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ ")
# Notable words in lines that say nothing went wrong (the uploader's "0 refused" at exit).
IGNORED_RE = re.compile(r"\b0 refused|0 failed|failed 0\b")
# Notable lines and output tails kept per step (the whole outputs go to the console log).
MAX_NOTABLE = 40
TAIL_LINES = 30
# Lines of a step's whole output echoed to the console log.
CONSOLE_ECHO_LINES = 600
# The whole suite's worst case, for the host's deadline (boot and power-off are the host's margin).
SUITE_BUDGET_S = (
    BUILD_TIMEOUT_S
    + PREFLIGHT_TIMEOUT_S
    + RECORD_TIMEOUT_S
    + READY_TIMEOUT_S
    + 4 * PROFILES_TIMEOUT_S
    + STEADY_WINDOWS * RUN_WINDOW_S
    + STATUS_TIMEOUT_S
    + STOP_TIMEOUT_S
    + 6 * TOOL_TIMEOUT_S
)


class Reporter:
    """Result lines to the results port, and a copy on the console."""

    def __init__(self, path: str) -> None:
        self.out: TextIO = open(path, "w", buffering=1)  # noqa: SIM115 - open for the guest's whole run

    def __call__(self, step: str, **fields: Any) -> None:
        doc = {"step": step, **fields}
        self.out.write(RESULT_MARK + json.dumps(doc, default=str) + "\n")
        self.out.flush()
        short = {k: v for k, v in doc.items() if k not in ("output", "notable", "tail", "tree")}
        print(f"ktest: {json.dumps(short, default=str)[:2000]}", flush=True)

    def progress(self, message: str) -> None:
        self("progress", message=message)


def echo(title: str, text: str) -> None:
    """A step's whole output into the console log (the serial log kept on the host)."""
    lines = text.splitlines()
    cut = len(lines) - CONSOLE_ECHO_LINES
    print(f"----- ktest: {title} ({len(lines)} lines{f', first {cut} cut' if cut > 0 else ''}) -----")
    print("\n".join(lines[max(0, cut) :]))
    print(f"----- ktest: end of {title} -----", flush=True)


def notable(text: str) -> list[str]:
    return [line.strip()[:400] for line in text.splitlines() if NOTABLE_RE.search(line)][:MAX_NOTABLE]


def cause(text: str) -> str:
    """The line of an output that best says why it failed: its first ERROR (a stage's before the
    supervisor's), else a traceback's exception, else its first notable line, else its last line;
    without the log line's time stamp."""
    lines = [STAMP_RE.sub("", line).strip() for line in text.splitlines() if line.strip()]
    errors = [x for x in lines if re.search(r"\b(ERROR|CRITICAL)\b", x)]
    # a stage's own error says more than the supervisor's "did not become ready" that follows it
    own = [x for x in errors if not x.startswith("run[")]
    if own or errors:
        return (own or errors)[0][:400]
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            return next(
                (
                    x
                    for x in lines[i + 1 :]
                    if not x.startswith(("File ", "^", "~")) and re.match(r"^[\w.]+(Error|Exception)\b", x)
                ),
                line,
            )[:400]
    return next((x for x in lines if NOTABLE_RE.search(x) and not IGNORED_RE.search(x)), lines[-1] if lines else "")[
        :400
    ]


def tail(text: str, n: int = TAIL_LINES) -> list[str]:
    return [line[:400] for line in text.splitlines()[-n:]]


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        return f"unreadable: {e.strerror}"


def facts() -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def lim(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"

    py = subprocess.run(["/usr/bin/python3", "--version"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    release = platform.release()
    build = Path(f"/lib/modules/{release}/build")
    bcc_version = subprocess.run(
        [str(VENV_BIN / "python"), "-c", "import bcc; print(bcc.__version__)"],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
    ).stdout.strip()
    return {
        "uname_r": release,
        "kernel_version": read("/proc/version"),
        "perf_event_paranoid": read("/proc/sys/kernel/perf_event_paranoid"),
        "unprivileged_bpf_disabled": read("/proc/sys/kernel/unprivileged_bpf_disabled"),
        "memlock": f"{lim(soft)} (hard {lim(hard)})",
        "btf": os.path.exists("/sys/kernel/btf/vmlinux"),
        "python3": py.stdout.strip() or py.stderr.strip(),
        "bcc": bcc_version,
        "headers": os.path.realpath(build) if build.exists() else "missing",
        "cmdline": read("/proc/cmdline"),
        "cpus": os.cpu_count(),
    }


class Output:
    """A process's merged stdout/stderr, read by a thread, each line with its time since start."""

    def __init__(self, p: subprocess.Popen[str], name: str) -> None:
        self.p, self.started, self.name = p, time.monotonic(), name
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self._lock:
                self.lines.append((time.monotonic() - self.started, line.rstrip("\n")))
            # live into the console log: a guest that hangs or panics mid-step still shows how far it got
            print(f"[{self.name} {time.monotonic() - self.started:5.1f}] {line.rstrip()}", flush=True)

    def first(self, pattern: str) -> float | None:
        """Seconds from start to the first line matching `pattern`, None if none yet."""
        with self._lock:
            return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def snapshot(self) -> str:
        """What the process wrote so far."""
        with self._lock:
            return "\n".join(line for _, line in self.lines)

    def text(self) -> str:
        """All it wrote (call once it has ended)."""
        self.thread.join(TOOL_TIMEOUT_S)
        return self.snapshot()


def start(name: str, argv: list[str]) -> tuple[subprocess.Popen[str], Output]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return p, Output(p, name)


def kill_group(p: subprocess.Popen[Any]) -> None:
    """End a process this suite started, and its group, by its id; reap it."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def wait_until(
    cond: Callable[[], bool], timeout: float, step_s: float = 1.0, alive: Callable[[], bool] = lambda: True
) -> bool:
    """Poll `cond` until it holds (True) or the deadline passes or `alive` stops holding (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if not alive():
            return cond()
        time.sleep(step_s)  # polling interval under a deadline, not a synchronisation
    return cond()


def ebpfprofiler() -> str:
    return str(VENV_BIN / "ebpfprofiler")


def bpf_objects() -> dict[str, set[str]]:
    """Ids of every BPF program and link, and every perf event BPF is attached to ("pid/fd"), via bpftool."""
    out: dict[str, set[str]] = {}
    for kind in ("prog", "link", "perf"):
        p = subprocess.run(["bpftool", "-j", kind, "show"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
        try:
            items = json.loads(p.stdout or "[]")
        except ValueError:
            items = []
        if kind == "perf":
            out[kind] = {f"{i.get('pid')}/{i.get('fd')}:{i.get('prog_id')}" for i in items}
        else:
            out[kind] = {f"{i.get('id')}:{i.get('name', i.get('type', ''))}" for i in items}
    return out


# ---------------------------------------------------------------- figures


def chain_share(items: list[Any], pid: int) -> tuple[float | None, int, list[str]]:
    """(% of pid's value whose stack holds main→alpha→beta in a row, its samples (off-CPU: blocks
    counted), its 3 heaviest stacks)."""
    from report import profiles as pm

    total = chained = samples = 0
    stacks: dict[str, int] = {}
    for item in items:
        vi = pm.value_index(item.profile)
        for s in item.profile.samples:
            if str(s.labels.get("pid")) != str(pid):
                continue
            names = [pm.frame_name(f).split(".")[0] for f in s.frames]
            v = s.values[vi]
            total += v
            # a row's values are (count, value, …) (symbolizer/profile.py): the count is its samples
            samples += s.values[0] if len(item.profile.sample_types) > 1 else 1
            if any(tuple(names[i : i + 3]) == CHAIN for i in range(len(names) - 2)):
                chained += v
            key = ";".join(pm.frame_name(f) for f in s.frames)[-300:]
            stacks[key] = stacks.get(key, 0) + v
    heaviest = [f"{v} {k}" for k, v in sorted(stacks.items(), key=lambda kv: -kv[1])[:3]]
    return (round(100.0 * chained / total, 1) if total else None), samples, heaviest


def figure(name: str, pct: float | None, samples: int, heaviest: list[str], **extra: Any) -> dict[str, Any]:
    if pct is None or samples < MIN_SAMPLES:
        return {
            "status": "failed",
            "reason": f"too few samples: {samples} (fewer than {MIN_SAMPLES})",
            "pct": pct,
            "samples": samples,
            "stacks": heaviest,
            **extra,
        }
    ok = pct >= MIN_CHAIN_PCT
    return {
        "status": "ok" if ok else "failed",
        "pct": pct,
        "samples": samples,
        "stacks": heaviest,
        "reason": "" if ok else f"{pct}% of {name} stacks hold main→alpha→beta (< {MIN_CHAIN_PCT}%)",
        **extra,
    }


# ---------------------------------------------------------------- steps


def build(report: Reporter, fp_flags: list[str]) -> dict[str, Path]:
    src = WORK / "abc.c"
    src.write_text(C_SOURCE)
    progs = {
        "kfp": fp_flags,
        "knofp": NOFP_FLAGS,
        "kblock": [*fp_flags, "-DBLOCK_RAW"],
        "kblocklibc": [*fp_flags, "-DBLOCK_LIBC"],
    }
    built: dict[str, Path] = {}
    for name, flags in progs.items():
        out = WORK / name
        p = subprocess.run(
            ["gcc", "-g", *flags, "-o", str(out), str(src)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if p.returncode != 0:
            report("build", program=name, status="failed", reason=f"gcc exit {p.returncode}", tail=tail(p.stderr))
            continue
        built[name] = out
    report(
        "build",
        status="ok" if len(built) == len(progs) else "failed",
        programs=sorted(built),
        flags={k: v for k, v in progs.items()},
    )
    return built


def preflight(report: Reporter) -> None:
    helptext = subprocess.run(
        [ebpfprofiler(), "--help"], capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S
    ).stdout
    # The tree the checks read, recorded (collector/preflight.py record): the unit tests replay it
    # (tests/fixtures/kernels/). Written by the collector's user, after its privilege drop.
    tree = WORK / "preflight-tree"
    tree.mkdir(mode=0o1777, exist_ok=True)
    tree.chmod(0o1777)
    argv = (
        [ebpfprofiler(), "preflight"]
        if re.search(r"^\s+preflight\s", helptext, re.M)
        else [str(VENV_BIN / "ebpfprofiler-collector"), "--preflight", "--record", str(tree)]
    )
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        report("preflight", status="failed", reason=f"timeout {PREFLIGHT_TIMEOUT_S} s", command=argv)
        return
    text = p.stdout + p.stderr
    echo("preflight", text)
    last = cause(text)
    recorded = {
        str(f.relative_to(tree)): (f.read_text(errors="replace") if f.is_file() else None)
        for f in sorted(tree.rglob("*"))
        if f.is_file() or not any(f.iterdir())
    }
    report(
        "preflight",
        status="ok" if p.returncode == 0 else "failed",
        exit=p.returncode,
        command=" ".join(argv),
        reason="" if p.returncode == 0 else last[:300],
        output=text[-4000:],
        tree=recorded,
    )


def record(report: Reporter, pids: dict[str, int]) -> None:
    from report import profiles as pm

    out = WORK / "rec.pb.gz"
    argv = [
        ebpfprofiler(),
        "record",
        "-d",
        str(RECORD_SECONDS),
        "--offcpu",
        "-o",
        str(out),
        "-p",
        *[str(p) for p in pids.values()],
    ]
    report.progress(f"record: {' '.join(argv[1:])}")
    p, output = start("record", argv)
    try:
        p.wait(RECORD_TIMEOUT_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        kill_group(p)
    text = output.text()
    ready_s = output.first(r"^[^:]*: recording ")
    base = {
        "command": " ".join(argv[1:]),
        "exit": p.returncode,
        "ready_s": round(ready_s, 1) if ready_s else None,
        "notable": notable(text),
        "tail": tail(text),
    }
    if timed_out or p.returncode != 0:
        why = f"timeout {RECORD_TIMEOUT_S} s" if timed_out else f"exit {p.returncode}"
        report("record", status="failed", reason=f"{why}: {cause(text)}"[:300], **base)
        for cell in ("fp", "dwarf", "offcpu", "offcpu_libc"):
            report(cell, status="failed", reason="record failed")
        return
    report("record", status="ok", **base)
    loaded = pm.load([str(out)])
    off_path = WORK / "rec.offcpu.pb.gz"
    offcpu = pm.load([str(off_path)]) if off_path.exists() else []
    report("fp", **figure("kfp", *chain_share(loaded, pids["kfp"])))
    report("dwarf", **figure("knofp", *chain_share(loaded, pids["knofp"])))
    if not offcpu:
        for cell in ("offcpu", "offcpu_libc"):
            report(
                cell,
                status="failed",
                reason="record wrote no offcpu profile",
                written=sorted(x.name for x in WORK.glob("rec*")),
            )
    else:
        report(
            "offcpu",
            **figure("kblock off-CPU", *chain_share(offcpu, pids["kblock"]), unit=offcpu[0].profile.sample_types[-1]),
        )
        report("offcpu_libc", **figure("kblocklibc off-CPU", *chain_share(offcpu, pids["kblocklibc"])))


def windows_of(local: Path, kind: str, pid: int) -> dict[str, list[str]]:
    """Window → the `kind` profile files (local_dir/SERVICE/KIND-WINDOW-ID.pb.gz) holding samples of pid."""
    from report import profiles as pm

    out: dict[str, list[str]] = {}
    for f in pm.profile_files([str(local)]):
        name = os.path.basename(f)
        if name.startswith(kind + "-") and any(
            str(s.labels.get("pid")) == str(pid) for x in pm.load([f]) for s in x.profile.samples
        ):
            out.setdefault(name[len(kind) + 1 :].split("-")[0], []).append(f)
    return out


class Polled(Protocol):
    """What steady_figures needs of `run`'s process: whether it still runs (a Popen, or a test's stand-in)."""

    def poll(self) -> int | None: ...


def steady_figures(local: Path, pids: dict[str, int], p: Polled) -> dict[str, Any]:
    """The FP, DWARF and off-CPU shares in `run`'s last whole window, once STEADY_WINDOWS windows have
    been written: apart from `record`'s figures, which include its first seconds (unwind tables are
    built after a process is first seen), they say whether the unwinding works once it has them."""
    from report import profiles as pm

    wait_until(
        lambda: len(windows_of(local, "cpu", pids["knofp"])) >= STEADY_WINDOWS,
        STEADY_WINDOWS * RUN_WINDOW_S + PROFILES_TIMEOUT_S,
        step_s=3.0,
        alive=lambda: p.poll() is None,
    )
    out: dict[str, Any] = {}
    for cell, kind, prog in (
        ("fp", "cpu", "kfp"),
        ("dwarf", "cpu", "knofp"),
        ("offcpu", "offcpu", "kblock"),
        ("offcpu_libc", "offcpu", "kblocklibc"),
    ):
        wins = windows_of(local, kind, pids[prog])
        if len(wins) < 2:
            out[cell] = {"pct": None, "windows": len(wins)}
            continue
        last = sorted(wins)[-2]  # the newest may still be in progress at another service's worker
        pct, samples, heaviest = chain_share(pm.load(wins[last]), pids[prog])
        out[cell] = {"pct": pct, "samples": samples, "window": last, "windows": len(wins), "stacks": heaviest}
    return out


def run_config(local: Path) -> Path:
    """The agent.yaml of the run step."""
    config = WORK / "agent.yaml"
    # overhead_budget_pct 100, as `record` sets it: under TCG every stage costs ~50x its real CPU, and the
    # guard would halve the rate each window (19 → 1 Hz by the 5th), leaving run's figures a few samples
    config.write_text(
        "modules:\n  ebpf_profiler:\n"
        f"    upload_interval_s: {RUN_WINDOW_S}\n    local_dir: {local}\n"
        "    runtime_stacks: [python_legacy]\n    plain_pid: true\n    offcpu: true\n"
        "    overhead_budget_pct: 100\n"
    )
    return config


def _frame_names(files: list[str], kind: str | None, pid: int) -> set[str]:
    """The frame names of `pid`'s samples in the profiles of `files` (of one type, if `kind`)."""
    from report import profiles as pm

    return {
        pm.frame_name(f)
        for x in pm.load(files)
        if kind is None or x.profile_type == kind
        for s in x.profile.samples
        if str(s.labels.get("pid")) == str(pid)
        for f in s.frames
    }


def _short(names: set[str]) -> set[str]:
    return {n.split(" ")[0].split("(")[0].rsplit(".", 1)[-1] for n in names}


def profile_cells(local: Path, pids: dict[str, int], py_pid: int, p: subprocess.Popen[str]) -> dict[str, Any]:
    """The run cell (a cpu profile of kfp) and the python cell (python_wall names alpha and beta)."""
    from report import profiles as pm

    def written(kind: str, pid: int) -> bool:
        files = [f for f in pm.profile_files([str(local)]) if os.path.basename(f).startswith(kind + "-")]
        return any(str(s.labels.get("pid")) == str(pid) for x in pm.load(files) for s in x.profile.samples)

    got_cpu = wait_until(
        lambda: written("cpu", pids["kfp"]), PROFILES_TIMEOUT_S, step_s=3.0, alive=lambda: p.poll() is None
    )
    cpu_files = [f for f in pm.profile_files([str(local)]) if os.path.basename(f).startswith("cpu-")]
    run = (
        {"status": "ok", "cpu_profiles": len(cpu_files)}
        if got_cpu
        else {
            "status": "failed",
            "reason": f"no cpu profile of kfp within {PROFILES_TIMEOUT_S} s "
            f"of ready ({len(cpu_files)} cpu files; exit {p.poll()})",
        }
    )
    got_py = wait_until(
        lambda: written("python_wall", py_pid), PROFILES_TIMEOUT_S, step_s=3.0, alive=lambda: p.poll() is None
    )
    all_files = pm.profile_files([str(local)])
    wall = [x for x in pm.load(all_files) if x.profile_type == "python_wall"]
    names = _frame_names(all_files, "python_wall", py_pid)
    has = {"alpha", "beta"} <= _short(names)

    def mixed_now() -> bool:
        files = [f for f in pm.profile_files([str(local)]) if os.path.basename(f).startswith("cpu-")]
        return {"alpha", "beta"} <= _short(_frame_names(files, None, py_pid))

    # mixed stacks (issue 42): the walk in BPF puts python3's frames in its cpu profile too, once the
    # runtime reader has answered for it and its names have come (a window or two)
    mixed = wait_until(mixed_now, PROFILES_TIMEOUT_S, step_s=3.0, alive=lambda: p.poll() is None)
    python = {
        "status": "ok" if has and mixed else "failed",
        "python_wall_files": len(wall),
        "cpu_names_alpha_beta": mixed,
        "names": sorted(names)[:20],
        "reason": ""
        if has and mixed
        else (
            f"python_wall of python3 names {sorted(names)[:8]}"
            if got_py and not has
            else "python3's cpu profile names no alpha and beta (no mixed stacks)"
            if got_py
            else f"no python_wall profile of python3 within {PROFILES_TIMEOUT_S} s"
        ),
    }
    return {"run": run, "python": python}


def status_cell(p: subprocess.Popen[str]) -> dict[str, Any]:
    """`ebpfprofiler status` while run runs, once the collector's first window has ended (before it,
    status says there are no figures yet, and exits 2): exit 0."""
    from collector.overhead import status_path
    from shared.endpoints import DEFAULT_RUN_DIR

    # The collector's windows start when it is ready, not on the symbolizers' wall-clock boundaries:
    # the profiles waited for before this may come first.
    if not wait_until(
        lambda: os.path.exists(status_path(DEFAULT_RUN_DIR)), 2 * RUN_WINDOW_S, alive=lambda: p.poll() is None
    ):
        return {"status": "failed", "reason": f"no {status_path(DEFAULT_RUN_DIR)} within {2 * RUN_WINDOW_S} s"}
    try:
        st = subprocess.run([ebpfprofiler(), "status"], capture_output=True, text=True, timeout=STATUS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timeout {STATUS_TIMEOUT_S} s"}
    echo("status", st.stdout + st.stderr)
    return {
        "status": "ok" if st.returncode == 0 else "failed",
        "exit": st.returncode,
        "reason": "" if st.returncode == 0 else tail(st.stdout + st.stderr, 1)[0][:300],
        "output": (st.stdout + st.stderr)[-2000:],
    }


def stop_cell(rc: int | None, exited_before: int | None, stop_s: float, before: dict[str, set[str]]) -> dict[str, Any]:
    """The stop: run ended by itself after SIGINT, exit 0, and left no process or BPF object."""
    leftover = subprocess.run(
        ["pgrep", "-a", "-f", AGENT_PROCESS_RE], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S
    ).stdout.strip()
    after = bpf_objects()
    left = {k: sorted(after[k] - before[k]) for k in after if after[k] - before[k]}
    clean = rc == 0 and exited_before is None and not left and not leftover
    problems: list[str] = []
    if exited_before is not None:
        problems.append(
            f"not stopped: run had exited ({exited_before}) before the SIGINT"
            + ("" if left or leftover else "; it left nothing")
        )
    elif rc is None:
        problems.append(f"did not exit within {STOP_TIMEOUT_S} s")
    elif rc != 0:
        problems.append(f"exit {rc}")
    if left:
        problems.append(f"left {left}")
    if leftover:
        problems.append(f"processes left: {leftover[:200]}")
    return {
        "status": "ok" if clean else "failed",
        "exit": rc,
        "stop_s": stop_s,
        "left": left,
        "reason": "; ".join(problems)[:300],
    }


def run_step(report: Reporter, pids: dict[str, int], py_pid: int) -> None:
    local = WORK / "profiles"
    config = run_config(local)
    before = bpf_objects()
    argv = [ebpfprofiler(), "run", "--config", str(config)]
    report.progress(f"run: {' '.join(argv[1:])} (runtime_stacks: [python_legacy], window {RUN_WINDOW_S} s)")
    p, output = start("run", argv)
    cells: dict[str, dict[str, Any]] = {}
    try:
        ready = wait_until(
            lambda: output.first(r"all stages ready") is not None, READY_TIMEOUT_S, alive=lambda: p.poll() is None
        )
        ready_s = output.first(r"all stages ready")
        if not ready:
            why = f"exited {p.poll()} before ready" if p.poll() is not None else f"not ready in {READY_TIMEOUT_S} s"
            cells["run"] = {"status": "failed", "reason": f"{why}: {cause(output.snapshot())}"[:300]}
        else:
            cells.update(profile_cells(local, pids, py_pid, p))
            cells["status"] = status_cell(p)
            try:
                cells["run"]["steady"] = steady_figures(local, pids, p)
            except Exception as e:  # informational figures: their failure must not cost the stop's check
                cells["run"]["steady"] = {"error": repr(e)[:300]}
        # the stop: SIGINT, as Ctrl-C; it must end by itself within the deadline, exit 0, leave nothing
        stop_started = time.monotonic()
        exited_before = p.poll()
        if exited_before is None:
            p.send_signal(signal.SIGINT)
        try:
            rc: int | None = p.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        stop_s = round(time.monotonic() - stop_started, 1)
    finally:
        kill_group(p)
    cells["stop"] = stop_cell(rc, exited_before, stop_s, before)
    text = output.text()
    run_cell = cells["run"]
    for name in ("python", "status"):
        cells.setdefault(name, {"status": "failed", "reason": "run did not become ready"})
    report("run", ready_s=round(ready_s, 1) if ready_s else None, notable=notable(text), tail=tail(text), **run_cell)
    for name in ("python", "status", "stop"):
        report(name, **cells[name])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", required=True, help="where result lines go (the guest's ttyS1)")
    p.add_argument("--fp-flags", default=" ".join(DEFAULT_FP_FLAGS), help="gcc flags of the frame-pointer programs")
    args = p.parse_args()
    report = Reporter(args.results)
    started = time.monotonic()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(mode=0o755)
    WORK.chmod(0o755)  # the agent's users write profiles below it
    workloads: list[subprocess.Popen[Any]] = []
    try:
        try:
            report("env", status="ok", **facts())
        except Exception as e:  # a fact unreadable is recorded, the suite goes on
            report("env", status="failed", reason=repr(e)[:300])
        plan_flags = args.fp_flags.split()
        plan = Path(GUEST_PLAN)
        if plan.exists():
            plan_flags = json.loads(plan.read_text()).get("fp_flags", plan_flags)
        built = build(report, plan_flags)
        pids: dict[str, int] = {}
        for name, path in built.items():
            w = subprocess.Popen(
                [str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
            workloads.append(w)
            pids[name] = w.pid
        (WORK / "pyabc.py").write_text(PY_SOURCE)
        py = subprocess.Popen(
            ["/usr/bin/python3", str(WORK / "pyabc.py")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        workloads.append(py)
        report.progress(f"workloads running: {pids}, python3 {py.pid}")
        steps: list[tuple[str, Callable[[], None]]] = [("preflight", lambda: preflight(report))]
        if len(pids) == len(built) == 4:
            steps.append(("record", lambda: record(report, pids)))
            steps.append(("run", lambda: run_step(report, pids, py.pid)))
        else:
            for cell in ("record", "fp", "dwarf", "offcpu", "offcpu_libc", "run", "python", "status", "stop"):
                report(cell, status="failed", reason="the workloads did not build")
        for name, fn in steps:
            report.progress(f"{name} …")
            try:
                fn()
            except Exception as e:  # the step failed in the suite itself: recorded, the next one runs
                report(
                    name,
                    status="failed",
                    reason=f"suite error: {e!r}"[:300],
                    tail=traceback.format_exc().splitlines()[-TAIL_LINES:],
                )
    finally:
        for w in workloads:
            kill_group(w)
        report("done", seconds=round(time.monotonic() - started, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
