"""The runtime reader's CPU per stack, per runtime, at 19 Hz: CPython beside PHP, Ruby and Node.js.

Workloads, one copy per CPU, each read by the runtime reader stage's own
Reader (runtimes/main.py), driven at 19 Hz in this process with only its
runtime's opt-in on (python_stacks and runtime_stacks: [python_legacy] for
CPython 3.11; runtime_stacks: [php], [ruby] or [node]): bench/workloads/py_cpu.py
under the host's CPython 3.11 (a main thread 20 Python frames deep and a
blocked thread); tests/workloads/php_split.php under the host's PHP 8.2
(Debian bookworm) and, chrooted in Debian trixie's root as in a container,
PHP 8.4 (a chain 3 to 4 frames deep); tests/workloads/ruby_split.rb under
trixie's Ruby 3.3, chrooted (a main thread 4 frames deep and a blocked
thread; the VM found by the scan); tests/workloads/node_split.js under the
host's Node 20 (JavaScript running: its stack scanned, 8 frames). The
copies are announced to it as the collector would (and nothing else on the host: the pipeline's reader also
reads every other process of its runtime, which on a shared machine made the
figures the host's, not the runtime's); after a second of ticks (detection,
warm caches), its CPU (process time: ticks, pid checks, reads, labels and
window adds) is taken over TIMED_S and divided by the stacks it read.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import procs, stats
from bench.procs import BenchError
from collector.procfs import read_process
from runtimes.main import Reader
from shared.config import ProfilerConfig
from shared.wire import ProcessAnnouncement

ROOT = Path(__file__).resolve().parent.parent
PY_WORKLOAD = Path(__file__).parent / "workloads" / "py_cpu.py"
PHP_WORKLOAD = ROOT / "tests" / "workloads" / "php_split.php"
RUBY_WORKLOAD = ROOT / "tests" / "workloads" / "ruby_split.rb"
NODE_WORKLOAD = ROOT / "tests" / "workloads" / "node_split.js"
SAMPLE_HZ = 19
# The reader detects a process in a tick or two after the collector announces it (within 1 s).
WARMUP_S = 3.0
# Wall seconds over which the reader's CPU is measured.
TIMED_S = 8.0
# The workloads' own deadline, past warm-up and timed part: they end by themselves.
WORKLOAD_S = 60


def _inside(trixie: Path) -> Path:
    """The workloads' directory inside the root, as the host sees it."""
    return trixie / "tmp" / f"ebpfprofiler-bench-{os.getpid()}"


def _cases(tmp: Path, trixie: Path) -> dict[str, tuple[list[str], dict[str, Any], str]]:
    """runtime → (argv of one copy, config changes, profile type)."""
    inside = Path("/") / _inside(trixie).relative_to(trixie)
    (trixie / inside.relative_to("/")).mkdir(parents=True, exist_ok=True)
    for w in (PHP_WORKLOAD, RUBY_WORKLOAD):
        shutil.copy(w, trixie / inside.relative_to("/") / w.name)
    host_php = tmp / PHP_WORKLOAD.name
    shutil.copy(PHP_WORKLOAD, host_php)
    return {
        "CPython 3.11": (
            ["/usr/bin/python3.11", str(PY_WORKLOAD), "100000000", "0"],
            {"python_stacks": True, "runtime_stacks": ("python_legacy",)},
            "python_wall",
        ),
        "PHP 8.2": (
            ["/usr/bin/php8.2", str(host_php), "split", str(WORKLOAD_S)],
            {"python_stacks": False, "runtime_stacks": ("php",)},
            "php_wall",
        ),
        "PHP 8.4 (chroot)": (
            ["chroot", str(trixie), "/usr/bin/php8.4", str(inside / PHP_WORKLOAD.name), "split", str(WORKLOAD_S)],
            {"python_stacks": False, "runtime_stacks": ("php",)},
            "php_wall",
        ),
        "Ruby 3.3 (chroot, VM found by scan)": (
            ["chroot", str(trixie), "/usr/bin/ruby3.3", str(inside / RUBY_WORKLOAD.name), str(WORKLOAD_S)],
            {"python_stacks": False, "runtime_stacks": ("ruby",)},
            "ruby_wall",
        ),
        "Node 20 (running JS: stack scanned)": (
            ["/usr/bin/node", "--max-inlined-bytecode-size=0", str(NODE_WORKLOAD), "split", str(WORKLOAD_S)],
            {"python_stacks": False, "runtime_stacks": ("node",)},
            "node_cpu",
        ),
    }


class RuntimesBench:
    def __init__(self, rounds: int, log: Callable[[str], None], keep: bool) -> None:
        self.rounds, self.log, self.keep = rounds, log, keep
        self.our_prog_ids: set[int] = set()  # none: no BPF here
        self.copies = os.sysconf("SC_NPROCESSORS_ONLN")

    def _one(self, argv: list[str], cfg: dict[str, Any], profile_type: str, d: Path) -> dict[str, Any]:
        d.mkdir(parents=True)
        copies = [procs.start(argv) for _ in range(self.copies)]
        reader = Reader(ProfilerConfig(plain_pid=True, cpu_budget=100.0, **cfg), str(d), str(d))
        try:
            procs.sleep_until_wall(time.time() + WARMUP_S / 3)  # past the interpreters' start-up
            found = [p for p in (read_process(c.pid, False) for c in copies) if p is not None]
            reader.targets.announce(
                ProcessAnnouncement(host="bench", time_ns=time.time_ns(), processes=tuple(found), exited=(), full=True)
            )
            period = 1.0 / SAMPLE_HZ
            for _ in range(SAMPLE_HZ):  # detection, then the caches warm
                reader.tick(time.time_ns())
                time.sleep(period)
            before, c0, t0 = reader.stats["stacks"], time.process_time(), time.monotonic()
            next_tick = time.monotonic()
            while time.monotonic() - t0 < TIMED_S:
                reader.tick(time.time_ns())
                next_tick += period
                time.sleep(max(0.0, next_tick - time.monotonic()))
            cpu, wall, stacks = time.process_time() - c0, time.monotonic() - t0, reader.stats["stacks"] - before
        finally:
            reader.inbox.close()
            reader.outbox.close()
            for c in copies:
                procs.stop(c)
        if not stacks:
            raise BenchError(f"the runtime reader read no {profile_type} stack of {argv[0]}: {reader.targets.stats}")
        return {
            "reader_cpu_share": cpu / wall,
            "reader_us_per_stack": 1e6 * cpu / stacks,
            "stacks": stacks,
            "dropped": reader.dropped(),
        }

    def run(self) -> dict[str, Any]:
        tmp = Path(tempfile.mkdtemp(prefix="ebpfprofiler-bench-runtimes-"))
        os.chmod(tmp, 0o755)
        t_start = time.monotonic()
        runs: list[dict[str, dict[str, Any]]] = []
        from bench.assets import runtime_roots  # the cached Debian root the PHP and Ruby tests use

        trixie = runtime_roots.trixie()
        try:
            cases = _cases(tmp, trixie)
            for r in range(self.rounds):
                row = {}
                for i, (name, (argv, cfg, ptype)) in enumerate(cases.items()):
                    row[name] = self._one(argv, cfg, ptype, tmp / f"r{r}-{i}")
                    self.log(
                        f"runtimes round {r + 1}/{self.rounds} {name}: reader "
                        f"{row[name]['reader_us_per_stack']:.0f} us CPU per stack, "
                        f"{100 * row[name]['reader_cpu_share']:.2f}% of a CPU, {row[name]['stacks']} stacks"
                    )
                runs.append(row)
        finally:
            shutil.rmtree(_inside(trixie), ignore_errors=True)
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        names = list(runs[0]) if runs else []
        summary = {
            n: {
                "us_per_stack": stats.summary([row[n]["reader_us_per_stack"] for row in runs]),
                "cpu_share": stats.summary([row[n]["reader_cpu_share"] for row in runs]),
            }
            for n in names
        }
        return {
            "workload": f"{self.copies} copies (one per CPU) per runtime",
            "method": __doc__,
            "sample_hz": SAMPLE_HZ,
            "rounds": self.rounds,
            "runtimes": names,
            "runs": runs,
            "summary": summary,
            "seconds": round(time.monotonic() - t_start, 1),
        }


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the runtimes suite."""
    from bench.report import _mmm

    head = ["runtime", "reader µs CPU per stack", "reader share of a CPU"]
    rows = [
        [n, _mmm(result["summary"][n]["us_per_stack"], "{:.0f}"), _mmm(result["summary"][n]["cpu_share"], "{:.4f}")]
        for n in result["runtimes"]
    ]
    caption = f"{result['workload']}; {result['sample_hz']} Hz; {result['rounds']} rounds; median (min–max)"
    notes = [
        "µs per stack: the Reader's CPU over its ticks (pid checks, reads, labels, window adds) divided by "
        "the stacks it read; detection and the first second of ticks excluded",
        f"full run: {result['seconds']} s",
    ]
    return caption, head, rows, notes
