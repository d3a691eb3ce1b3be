"""`ebpfprofiler status`: what the running profiler cost in its last upload window, as a table.

Owns: reading RUN_DIR/status.json (written by the collector's overhead guard,
collector/overhead.py) and RUN_DIR/kernel.json (written by the collector at start,
collector/features.py: the kernel's features, what it refused, how it holds its
privileges) and each running stage's counters of checks that fired
(RUN_DIR/<stage>.counters.json, shared/counters.py) as untrusted input of
bounded size, telling whether the collector that wrote them still runs, and
printing the figures.

Must not: signal, start or change any stage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from shared import counters, endpoints
from shared.procstat import alive

STATUS_FILE = "status.json"  # collector/overhead.py's STATUS_FILE (not imported: that module is the collector's)
KERNEL_FILE = "kernel.json"  # collector/features.py's STATUS_FILE
# A status file is a few KiB; anything larger is not one.
MAX_STATUS_BYTES = 1 << 20


def parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Print the running kernel's features as the collector found them (each one missing, "
        "and what the agent does without it; what the config asked for and the kernel refused; "
        "whether the collector holds CAP_SYS_ADMIN), then what the running profiler cost in its "
        "last upload window: CPU time and RSS "
        "of every stage's process, the kernel's BPF run time of each of the collector's "
        "programs (run count and ns per run), samples and lost samples, the sampling rate "
        "the overhead guard allows against the configured one, and the budget "
        "(overhead_budget_pct; change it in the config file and send SIGHUP to `ebpfprofiler "
        "run` or the collector). Reads RUN_DIR/kernel.json, which the collector writes when it is "
        "ready, and RUN_DIR/status.json, which it writes at the end of each upload window. Exit 0 with the table, 1 when no collector runs, 2 when "
        "one runs but no window has ended yet.",
    )
    p.add_argument(
        "--run-dir",
        default=endpoints.DEFAULT_RUN_DIR,
        help="runtime directory of the running profiler (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the status file as it is, not as a table")
    return p.parse_args(argv)


def collector_pid(run_dir: str) -> int | None:
    """The pid in the collector's ready file, if that process runs."""
    try:
        with open(endpoints.ready_file(run_dir, "collector")) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if alive(pid) else None


def load(run_dir: str, name: str = STATUS_FILE) -> dict[str, Any] | None:
    path = os.path.join(run_dir, name)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STATUS_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(raw) > MAX_STATUS_BYTES:
        raise ValueError(f"{path} is larger than {MAX_STATUS_BYTES} bytes: not a status file")
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not a JSON object")  # ValueError, as for the others: a bad file, not a bad call
    return doc


def kernel_lines(doc: dict[str, Any]) -> list[str]:
    """The kernel part of the status: its release, each feature it lacks and what the agent does without
    it, what the config asked for and was refused, and how the collector holds CAP_SYS_ADMIN."""
    feats = doc.get("features", {})
    have = sorted(n for n, f in feats.items() if isinstance(f, dict) and f.get("available"))
    lines = [f"kernel: {doc.get('release')}; features: {', '.join(have) or 'none'}"]
    for name, f in sorted(feats.items()):
        if isinstance(f, dict) and not f.get("available"):
            lines.append(f"  missing {name} ({f.get('why')}; {f.get('since')}): {f.get('without')}")
    for r in doc.get("refused", []):
        if isinstance(r, dict):
            lines.append(f"  refused: {r.get('what')}: {r.get('why')}")
    lines.append(f"  CAP_SYS_ADMIN: {doc.get('cap_sys_admin')}")
    if doc.get("cpus_not_sampled"):
        lines.append(f"  CPUs offline at start, not sampled: {doc['cpus_not_sampled']}")
    return lines


def check_lines(checks: dict[str, dict[str, int]]) -> list[str]:
    """Each stage's checks that fired since it started (hostile input skipped, cut or refused), by reason."""
    lines = []
    for stage, counts in sorted(checks.items()):
        fired = {k: v for k, v in sorted(counts.items()) if v}
        lines.append(f"  {stage}: " + (", ".join(f"{k} {v}" for k, v in fired.items()) or "none"))
    return ["checks that fired, since each stage started:"] + (lines or ["  none"])


def _ms(ns: Any) -> str:
    return f"{int(ns) / 1e6:.1f} ms"


def _mb(b: Any) -> str:
    return f"{int(b) / 2**20:.1f} MB"


def table(doc: dict[str, Any]) -> str:
    """The status as aligned text."""
    age = time.time() - int(doc.get("time_ns", 0)) / 1e9
    window_s = float(doc.get("window_s", 0)) or 1.0
    lines = [
        f"window: {window_s:.1f} s, ended {age:.0f} s ago (collector pid {doc.get('pid')})",
        f"sampling rate: {doc.get('next_rate_hz')} Hz (configured {doc.get('configured_hz')} Hz"
        + (f"; last decision: {doc['decision']} from {doc.get('rate_hz')} Hz" if doc.get("decision") else "")
        + ")",
        (
            f"overhead: {float(doc.get('used_pct', 0)):.3f}% of one CPU (budget {doc.get('budget_pct')}%): "
            f"stages {_ms(doc.get('stage_ns', 0))} + BPF {_ms(doc.get('bpf_ns', 0))}"
        ),
        f"BPF run times: {doc.get('bpf_stats') or 'not measured'}",
        "",
    ]
    rows = [("stage", "pid", "CPU", "% of one CPU", "RSS")]
    cpu, rss, pids = doc.get("stage_cpu_ns", {}), doc.get("stage_rss_bytes", {}), doc.get("stage_pids", {})
    for stage in sorted(cpu):
        rows.append(
            (
                stage,
                str(pids.get(stage, "")),
                _ms(cpu[stage]),
                f"{100 * int(cpu[stage]) / 1e9 / window_s:.3f}",
                _mb(rss.get(stage, 0)),
            )
        )
    rows.append(("", "", "", "", ""))
    rows.append(("BPF program", "runs", "run time", "% of one CPU", "ns per run"))
    for name, p in sorted(doc.get("bpf", {}).items()):
        n, t = int(p.get("run_cnt", 0)), int(p.get("run_time_ns", 0))
        rows.append((name, str(n), _ms(t), f"{100 * t / 1e9 / window_s:.3f}", str(t // n) if n else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += ["", f"samples: {doc.get('samples', {})}; lost: {doc.get('lost') or 'none'}"]
    lines += ["", "cost model terms in this window (README, Overhead):"] + [f"  {t}" for t in cost_terms(doc)]
    return "\n".join(lines)


def cost_terms(doc: dict[str, Any]) -> list[str]:
    """The cost model's terms that one window's figures give: BPF time per sample and per context
    switch, new processes, and the stages' CPU a second (the fixed cost plus what the load adds)."""
    bpf = doc.get("bpf", {})

    def prog(name: str) -> tuple[int, int]:
        p = bpf.get(name, {})
        return int(p.get("run_time_ns", 0)), int(p.get("run_cnt", 0))

    window_s = float(doc.get("window_s", 0)) or 1.0
    out = []
    t, n = prog("on_cpu_sample")
    out.append(f"per sample: {t // n} ns of BPF ({n} samples)" if n else "per sample: no samples")
    switch_t, switches = prog("offcpu_switch")
    if switches:
        rest = sum(prog(name)[0] for name in bpf if name.startswith("offcpu_") and name != "offcpu_switch")
        out.append(
            f"per context switch: {(switch_t + rest) // switches} ns of BPF, off-CPU programs together "
            f"({switches / window_s:.0f} switches a second)"
        )
    out.append(
        f"new processes: {int(doc.get('new_processes', 0))} in the window "
        f"({int(doc.get('new_processes', 0)) / window_s:.1f} a second)"
    )
    out.append(f"stages: {int(doc.get('stage_ns', 0)) / 1e6 / window_s:.2f} ms of CPU a second")
    return out


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler status") -> int:
    args = parse_args(argv, prog)
    pid = collector_pid(args.run_dir)
    if pid is None:
        print(
            f"{prog}: no collector is running with run directory {args.run_dir} (no live "
            f"collector.ready there); start the profiler with `ebpfprofiler run`, or pass --run-dir",
            file=sys.stderr,
        )
        return 1
    try:
        doc = load(args.run_dir)
        kernel = load(args.run_dir, KERNEL_FILE)
    except (OSError, ValueError) as e:
        print(f"{prog}: cannot read the status file: {e}", file=sys.stderr)
        return 1
    if kernel is not None and kernel.get("pid") != pid:
        kernel = None
    if kernel is not None and not args.json:
        print("\n".join(kernel_lines(kernel)) + "\n")
    if doc is None or doc.get("pid") != pid:
        print(
            f"{prog}: the collector (pid {pid}) runs, but no upload window has ended since it started; "
            f"the first figures come at the end of the first window (upload_interval_s)",
            file=sys.stderr,
        )
        return 2
    checks = counters.read_all(args.run_dir)
    print(
        json.dumps({**doc, "kernel": kernel, "checks": checks}, indent=2, sort_keys=True)
        if args.json
        else table(doc) + "\n\n" + "\n".join(check_lines(checks))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
