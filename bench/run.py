"""`make bench`: run the benchmarks, write bench/results/*.json and bench/RESULTS.md, print tables.

Usage: .venv/bin/python -m bench.run [--rounds N] [--seconds S] [--rates 19,99] ...
(as root, from the repository root). See bench/README.md for what is measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from bench import bpf, procs, report
from bench.alloc import AllocLockBench
from bench.alloc import section as alloc_section
from bench.budget import BudgetBench
from bench.budget import section as budget_section
from bench.dotnet import DotNetBench
from bench.dotnet import section as dotnet_section
from bench.growth import GrowthBench
from bench.growth import section as growth_section
from bench.jvm import JvmBench
from bench.jvm import section as jvm_section
from bench.offcpu import ROUND_TRIPS, PingPongBench
from bench.oncpu import OnCpuBench
from bench.overhead import OverheadBench
from bench.overhead import section as overhead_section
from bench.procs import BenchError
from bench.python import PythonBench
from bench.python import section as python_section
from bench.python_walk import PythonWalkBench
from bench.python_walk import section as python_walk_section
from bench.runtimes import RuntimesBench
from bench.runtimes import section as runtimes_section
from bench.scaling import ScalingBench
from bench.startup import StartupBench
from bench.startup import section as startup_section
from bench.tables import TablesBench
from bench.tables import section as tables_section
from bench.unwind import UnwindBench
from bench.unwind import section as unwind_section

# A suite's table: (caption, header, rows, notes).
Section = tuple[str, list[str], list[list[str]], list[str]]

SUITES = (
    "oncpu",
    "offcpu",
    "scaling",
    "tables",
    "unwind",
    "python",
    "python_walk",
    "runtimes",
    "jvm",
    "overhead",
    "alloc",
    "budget",
    "dotnet",
    "growth",
    "startup",
)


# What --help says: every suite in a sentence.
DESCRIPTION = (
    "Benchmarks of ebpfprofiler, each against the same work with nothing running "
    "and against its peers, in one run, as ratios: oncpu (a CPU-bound workload under "
    "the pipeline and profile-bpfcc; the pipeline's CPU per 10,000 samples), offcpu "
    "(pipe ping-pong under on-CPU, on+off-CPU and perf sched_switch), scaling "
    "(symbolizer throughput with 1 and 2 workers on a recorded batch stream), tables (unwind "
    "table build time and size for libc, libpython and node, pyelftools as the peer), python "
    "(a CPU-bound CPython 3.11 workload under the runtime reader and py-spy; the reader's CPU "
    "per stack), python_walk (on_cpu_sample's BPF ns per sample with and without the in-BPF walk of "
    "a CPython 3.11 stack 10, 30 and 100 frames deep; the added ns per sample and per frame), overhead (four workloads under the pipeline, profile-bpfcc, perf -g, perf "
    "--call-graph dwarf and py-spy at --rates, each paired with a run alone; throughput ratio, "
    "profiler CPU and RSS, BPF ns per sample, whole stacks without frame pointers; at "
    "--high-rates the cost per sample implied against the BPF ns counted; a full run, 11 "
    "rounds at 19,99 and 999,4999 Hz, takes hours: scale it with --rounds, --rates, "
    "--high-rates and --seconds), alloc (a malloc/free loop with nothing and with allocation profiling "
    "at the defaults, at 2% and 20% duty and always attached; a mixed workload's shares against "
    "the truth; a contended mutex loop with lock profiling off and on), budget (the agent's cost at "
    "deploy/agent.yaml's defaults, measured from outside: idle, busy, a process spawner and the "
    "ping-pong, beside profile-bpfcc and perf -g), dotnet (perf maps asked of a .NET 8 process), "
    "growth (each stage's RSS over 30 minutes of the busy load at the defaults; one run), startup "
    "(`run` at the defaults and `record --offcpu`, cold and warm: start to the collector's ready file "
    "and to its first sample drained, and where the time goes). Writes "
    "bench/results/<suite>.json and bench/RESULTS.md and prints the tables."
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def parser() -> argparse.ArgumentParser:
    ncpu = os.sysconf("SC_NPROCESSORS_ONLN")
    p = argparse.ArgumentParser(prog="python -m bench.run", description=DESCRIPTION)
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds; each runs every configuration once, in turn (default: %(default)s)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=4.0,
        help="size of the workload: about this many wall seconds alone (default: %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=ncpu, help="workload threads (default: the number of CPUs, %(default)s)"
    )
    p.add_argument("--rates", default="19,99", help="sampling rates in Hz, comma separated (default: %(default)s)")
    p.add_argument(
        "--high-rates",
        default="999,4999",
        help="overhead: rates where a profiler's cost is above the noise, for the cost per sample; "
        'comma separated, "" for none (default: %(default)s)',
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=900.0,
        help="longest wait, in seconds, before a run for the host to be quiet: no other "
        "profiler's BPF program loaded, little CPU in use (default: %(default)s)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, profiles)")
    p.add_argument(
        "--suites", default=",".join(SUITES), help="which benchmarks, comma separated (default: %(default)s)"
    )
    p.add_argument(
        "--round-trips",
        type=int,
        default=ROUND_TRIPS,
        help="offcpu: ping-pong round trips per run (default: %(default)s)",
    )
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse values out of range (p.error exits), and turn the comma-separated lists into lists."""
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not 0.5 <= args.seconds <= 600:
        p.error("--seconds must be between 0.5 and 600")
    if not 1 <= args.threads <= 4096:
        p.error("--threads must be between 1 and 4096")
    try:
        args.rates = [int(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        p.error(f"--rates {args.rates!r}: expected integers separated by commas, e.g. 19,99")
    if not args.rates or any(not 1 <= r <= 10000 for r in args.rates):
        p.error("--rates: each rate must be from 1 to 10000 Hz")
    try:
        args.high_rates = [int(x) for x in args.high_rates.split(",") if x.strip()]
    except ValueError:
        p.error(f"--high-rates {args.high_rates!r}: expected integers separated by commas, e.g. 999,4999")
    if any(not 1 <= r <= 10000 for r in args.high_rates):
        p.error("--high-rates: each rate must be from 1 to 10000 Hz")
    args.suites = [x.strip() for x in args.suites.split(",") if x.strip()]
    unknown = sorted(set(args.suites) - set(SUITES))
    if unknown or not args.suites:
        p.error(f"--suites: {', '.join(unknown) or 'none given'}; choose from {', '.join(SUITES)}")
    if args.round_trips < 1000:
        p.error("--round-trips must be at least 1000")


def machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "cpus": os.sysconf("SC_NPROCESSORS_ONLN"),
        "cpu_model": model,
        "memory_mb": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20),
        "python": platform.python_version(),
        "bcc": _dpkg_version("python3-bpfcc"),
        "gcc": _first_line(["gcc", "--version"]),
    }


def source_version() -> dict[str, Any]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = _first_line(["git", "-C", root, "rev-parse", "HEAD"])
    dirty = bool(_first_line(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"]))
    return {"commit": commit, "uncommitted_changes": dirty}


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out.strip() else ""


def _dpkg_version(pkg: str) -> str:
    return _first_line(["dpkg-query", "-W", "-f=${Version}", pkg])


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


class Bench(Protocol):
    """What main asks of every suite."""

    @property
    def our_prog_ids(self) -> Iterable[int]:
        """The BPF programs its profilers loaded, to check that none is left behind."""

    def run(self) -> dict[str, Any]: ...


# Each suite's table: how its section is made from its result, and its title.
SECTIONS: dict[str, tuple[Callable[[dict[str, Any]], Section], str]] = {
    "offcpu": (report.offcpu_section, "Off-CPU cost on a context-switch-heavy workload"),
    "scaling": (report.scaling_section, "Symbolizer throughput: 1 and 2 workers"),
    "tables": (tables_section, "Unwind table build time and size"),
    "unwind": (unwind_section, "DWARF unwinding in BPF: time per sample and slowdown"),
    "python": (python_section, "Python stacks: the runtime reader against py-spy"),
    "python_walk": (python_walk_section, "Python frames walked in BPF: time per sample with and without"),
    "runtimes": (runtimes_section, "Runtime stacks: the reader's CPU per stack, per runtime"),
    "jvm": (jvm_section, "JVM stacks: the reader's CPU per 30-frame stack, the workload's throughput"),
    "overhead": (overhead_section, "Measured overhead against the peers"),
    "alloc": (alloc_section, "Allocation and lock profiling: cost on the worst cases"),
    "budget": (budget_section, "The agent's cost at the shipped defaults, measured from outside"),
    "dotnet": (dotnet_section, ".NET perf maps on request: the reader's wait and the map written"),
    "growth": (growth_section, "Memory over a 30-minute busy run at the shipped defaults"),
    "startup": (startup_section, "Start-up: to the collector's ready file and its first sample, cold and warm"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench: run as root: it loads BPF programs (make bench does)", file=sys.stderr)
        return 1

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)  # clean up as on Ctrl-C

    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    results, failure, check = run_suites(args, benches(args))
    log(
        "BPF programs left behind: "
        + ("none" if check["ok"] else ", ".join(check["left"]))
        + " (checked with bpftool prog show)"
    )
    if failure:
        log(f"FAILED: {failure}")
        return 1
    head = {"date": date, "machine": machine(), "source": source_version(), "bpf_check": check}
    results = {name: {"benchmark": name, **head, **result} for name, result in results.items()}
    written = [report.write_json(name, result) for name, result in results.items()]
    written += write_tables(args.suites, results)
    print("wrote " + ", ".join(os.path.relpath(p) for p in written))
    return 0 if check["ok"] else 1


def benches(args: argparse.Namespace) -> dict[str, Bench]:
    return {
        "oncpu": OnCpuBench(args.rounds, args.seconds, args.threads, args.rates, args.quiet_wait, log, args.keep),
        "offcpu": PingPongBench(args.rounds, args.round_trips, log, args.keep),
        "scaling": ScalingBench(args.rounds, log, args.keep),
        "tables": TablesBench(args.rounds, log),
        "unwind": UnwindBench(args.rounds, args.rates, log, args.keep),
        "python": PythonBench(args.rounds, log, args.keep),
        "python_walk": PythonWalkBench(args.rounds, args.quiet_wait, log, args.keep),
        "runtimes": RuntimesBench(args.rounds, log, args.keep),
        "jvm": JvmBench(args.rounds, log, args.keep),
        "overhead": OverheadBench(
            args.rounds, args.seconds, args.rates, args.high_rates, args.quiet_wait, log, args.keep
        ),
        "alloc": AllocLockBench(args.rounds, log, args.keep),
        "budget": BudgetBench(args.rounds, log=log),
        "dotnet": DotNetBench(args.rounds, log, args.keep),
        "growth": GrowthBench(1, log=log),
        "startup": StartupBench(args.rounds, args.quiet_wait, log, args.keep),
    }


def run_suites(
    args: argparse.Namespace, benches: dict[str, Bench]
) -> tuple[dict[str, dict[str, Any]], str | None, dict[str, Any]]:
    """(each suite's result, what failed if one did, the check that no BPF program is left behind)."""
    results: dict[str, dict[str, Any]] = {}
    failure = None
    try:
        for name in args.suites:
            log(f"running {name}")
            results[name] = benches[name].run()
    except BenchError as e:
        failure = str(e)
    except KeyboardInterrupt:
        failure = "interrupted"
    finally:
        procs.stop_all()
        ours = set().union(*(b.our_prog_ids for b in benches.values()))
        check = bpf_left_behind(ours)
    return results, failure, check


def write_tables(suites: list[str], results: dict[str, dict[str, Any]]) -> list[Path]:
    """Print the tables of the suites run now; write RESULTS.md with every suite's, those not run now from
    their last results file."""
    shown: dict[str, dict[str, Any] | None] = {
        name: results[name] if name in results else report.read_json(name) for name in SUITES
    }
    extra: list[str] = []
    for name, (make_section, title) in SECTIONS.items():
        result = shown.get(name)
        if result:
            section = make_section(result)
            if name in suites:
                report.print_section(title, section)
            extra.append(report.md_section(title, name, section))
    oncpu = shown.get("oncpu")
    if "oncpu" in suites and oncpu is not None:
        report.print_oncpu(oncpu)
    return [report.write_results_md(oncpu, tuple(extra))] if oncpu else []


def bpf_left_behind(ours: set[int]) -> dict[str, Any]:
    """Is any program that bench's profilers loaded still loaded? (ids are never reused soon)."""
    deadline = time.monotonic() + 10.0
    while True:  # a program goes once the last fd on it closes: allow the kernel a moment
        try:
            loaded = {p["id"]: p.get("name", "?") for p in bpf.programs()}
        except BenchError as e:
            return {"ok": False, "ours": sorted(ours), "left": [str(e)]}
        left = [f"{loaded[i]} (prog {i})" for i in sorted(ours) if i in loaded]
        if not left or time.monotonic() > deadline:
            return {"ok": not left, "ours": sorted(ours), "left": left, "programs_loaded_at_end": len(loaded)}
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
