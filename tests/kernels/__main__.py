"""`python -m tests.kernels`: the project's kernel matrix (`make test-kernels`).

Boots Debian's own kernels (tests/kernels/debs.py) under qemu on one guest
disk holding the current working tree (tests/kernels/guestroot.py), runs the
smoke suite in each (tests/kernels/guest_smoke.py), and prints a table with
one row per kernel. Writes RESULTS/RUN_ID/{results.json,results.md} and each
guest's whole serial log beside them, and RESULTS/latest.{json,md}. Exit 1
if any required cell failed (CI runs it for bullseye and bookworm).

    python -m tests.kernels [--kernels bullseye,bookworm,...] [--results DIR] [--accel auto|tcg|kvm]

Owns: the order of the run, the table and the exit status.
Must not: change the host's settings or a guest's (see the modules it calls).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tests.kernels import boot, debs, guest_smoke, guestroot

DEFAULT_RESULTS = guestroot.REPO / "bench" / "results" / "kernels"
# Boot to the guest's init, and power-off, under TCG: ~1 min; on top of the suite's own budget.
BOOT_MARGIN_S = 300
GUEST_TIMEOUT_S = guest_smoke.SUITE_BUDGET_S + BOOT_MARGIN_S
# Lines of a failed kernel's console log printed at the end (the whole log stays in the results).
FAILED_LOG_LINES = 60
# The table's columns: (key of the row, header). Those of REQUIRED must pass.
COLUMNS = [
    ("kernel", "kernel"),
    ("boot", "boot"),
    ("preflight", "preflight"),
    ("fp", "FP %"),
    ("dwarf", "DWARF %"),
    ("offcpu", "off-CPU %"),
    ("offcpu_libc", "off-CPU via libc %"),
    ("python", "Python"),
    ("run", "run"),
    ("status", "status"),
    ("stop", "clean stop"),
    ("startup", "start-up s (record/run)"),
    ("panics", "panics"),
]
REQUIRED = ["boot", "preflight", "fp", "dwarf", "offcpu", "python", "run", "status", "stop"]
# Shown, not required: off-CPU stacks through libc's nanosleep need DWARF off-CPU (Linux 5.15).
INFORMATIONAL = ["offcpu_libc"]
# run's window judges a figure when it holds this many of the program's samples (19 Hz, 10 s: ~190).
MIN_STEADY_SAMPLES = 20
LEGEND = (
    "FP, DWARF, off-CPU: the share of the program's samples (off-CPU: blocked time) whose stack holds "
    "main→alpha→beta in `record -d 30` (its samples) [and in `run`'s 6th 10-s window]; a cell passes at "
    f"{guest_smoke.MIN_CHAIN_PCT}% of run's figure (record's 30 s include the seconds before a new process's "
    f"unwind tables arrive), of record's when run's window has fewer than {MIN_STEADY_SAMPLES} samples. Off-CPU via libc: shown, not required (its "
    "callers need DWARF off-CPU: Linux 5.15). Start-up: seconds from `record`/`run` to ready."
)
# Characters of a reason shown in a table cell (the whole reason is in the failures list and the JSON).
CELL_REASON_CHARS = 70


# What the host needs (deploy/setup.sh --test installs each: `make test-setup`).
HOST_TOOLS = ["qemu-system-x86_64", "debootstrap", "mke2fs", "cpio", "dpkg-deb", "apt-get", "chroot"]


def host_gaps() -> list[str]:
    """What this host lacks for the matrix, one phrase each."""
    gaps = [f"no {t} on PATH" for t in HOST_TOOLS if shutil.which(t) is None]
    if not boot.BUSYBOX.exists():
        gaps.append(f"no {boot.BUSYBOX} (busybox-static)")
    if os.geteuid() != 0:
        gaps.append("not root (debootstrap, chroot and mke2fs -d of a root's files need it)")
    return gaps


def log(msg: str) -> None:
    print(f"test-kernels: {msg}", flush=True)


def frame_pointer_flags() -> list[str]:
    """The tests' frame-pointer flags (tests/harness.py), for the guest's frame-pointer programs."""
    from tests.harness import FRAME_POINTER_FLAGS

    return list(FRAME_POINTER_FLAGS)


def cell(result: dict[str, Any] | None, steady: dict[str, Any] | None = None) -> tuple[str, bool]:
    """(the table cell, whether it passed) of one step's result. A figure's cell (`steady`: the same
    figure in `run`'s last whole window, {} if none) shows both; it passes on run's figure when there is
    one, as record's 30 s include the seconds before a new process's unwind tables arrive (~10-25 s
    under TCG), and on record's otherwise."""
    if result is None:
        return "✗ no result", False
    ok = result.get("status") == "ok"
    if steady is not None and result.get("pct") is not None:  # the whole reason is in the details
        text = f"{result['pct']}% ({result.get('samples', 0)})"
        if steady.get("pct") is not None and (steady.get("samples") or 0) >= MIN_STEADY_SAMPLES:
            ok = steady["pct"] >= guest_smoke.MIN_CHAIN_PCT
            text += f" [run: {steady['pct']}%]"
        elif steady.get("pct") is not None:
            text += f" [run: {steady['pct']}% of {steady.get('samples', 0)}]"
        few = "few samples" in str(result.get("reason", "")) and steady.get("pct") is None
        return (text if ok else f"✗ {text}{': too few samples' if few else ''}"), ok
    if ok:
        return "✓", True
    return f"✗ {result.get('reason') or 'failed'}", False


def short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= CELL_REASON_CHARS else text[: CELL_REASON_CHARS - 1] + "…"


def boot_cell(b: boot.BootResult | None, by_step: dict[str, dict[str, Any]], error: str) -> tuple[str, bool]:
    """The boot cell: ✓ when the suite started and finished, else why not (a panic, a timeout, silence)."""
    if b is None or error:
        return f"✗ {error or 'not booted'}", False
    limit = f"silent for {boot.SILENT_S:.0f} s" if b.silent else f"timeout {GUEST_TIMEOUT_S} s"
    if "env" not in by_step:
        if b.timed_out:
            return f"✗ {limit} before the suite started", False
        return f"✗ qemu exit {b.exit_code} before the suite started" + (
            f": {b.qemu_said}" if b.qemu_said else ""
        ), False
    if "done" not in by_step:
        ended = limit if b.timed_out else f"guest ended (qemu exit {b.exit_code})"
        return f"✗ {ended} before the suite finished" + (": kernel panic" if b.panics else ""), False
    return "✓", True


def row_of(name: str, release: str, b: boot.BootResult | None, error: str = "") -> dict[str, Any]:
    """One kernel's row: cells (short), passed flags, and everything reported."""
    results = b.results if b else []
    by_step: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.get("step") not in ("progress",):
            by_step[str(r.get("step"))] = r
    env = by_step.get("env", {})
    cells: dict[str, str] = {"kernel": f"{name} {env.get('uname_r', release)}"}
    passed: dict[str, bool] = {}
    cells["boot"], passed["boot"] = boot_cell(b, by_step, error)
    rec, run = by_step.get("record", {}), by_step.get("run", {})
    steady = run.get("steady") or {}
    for key in REQUIRED[1:] + INFORMATIONAL:
        figure = key in ("fp", "dwarf", "offcpu", "offcpu_libc")
        cells[key], ok = cell(by_step.get(key), (steady.get(key) or {}) if figure else None)
        if key in REQUIRED:
            passed[key] = ok
    cells["startup"] = f"{rec.get('ready_s') or '–'}/{run.get('ready_s') or '–'}"
    panics = b.panics if b else []
    cells["panics"] = f"✗ {len(panics)}: {panics[0].splitlines()[0].strip()}" if panics else "none"
    passed["panics"] = not panics
    return {
        "name": name,
        "release": env.get("uname_r", release),
        "cells": cells,
        "passed": passed,
        "env": env,
        "steps": by_step,
        "panics": panics,
        "boot": {
            "accel": b.accel,
            "seconds": b.seconds,
            "timed_out": b.timed_out,
            "exit": b.exit_code,
            "console_log": str(b.console_log),
        }
        if b
        else None,
        "failed": [k for k, ok in passed.items() if not ok],
    }


def table(rows: list[dict[str, Any]], markdown: bool) -> str:
    heads = [h for _, h in COLUMNS]
    body = [[short(r["cells"].get(k, "")) for k, _ in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(heads)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*heads), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body])


def details(rows: list[dict[str, Any]]) -> str:
    """Per kernel: the guest's facts, each failure's whole reason and the log lines that said why."""
    out = []
    for r in rows:
        env = r["env"]
        out.append(f"### {r['name']} ({r['release']})\n")
        if env:
            out.append(
                f"- perf_event_paranoid={env.get('perf_event_paranoid')}, memlock {env.get('memlock')}, "
                f"BTF {'yes' if env.get('btf') else 'no'}, {env.get('python3')}, bcc {env.get('bcc')}, "
                f"headers {env.get('headers')}"
            )
        if r["boot"]:
            out.append(
                f"- boot: {r['boot']['accel']}, {r['boot']['seconds']} s in the guest; serial log "
                f"{r['boot']['console_log']}"
            )
        for key in r["failed"]:
            step = r["steps"].get(key, {})
            out.append(f"- **{key}**: {step.get('reason') or r['cells'].get(key, '')}")
        for key in ("preflight", "record", "run"):
            step = r["steps"].get(key, {})
            lines = step.get("notable") or []
            if key == "preflight" and step.get("output"):
                lines = step["output"].strip().splitlines()[-12:]
            if lines and (key in r["failed"] or key == "preflight" or step.get("status") != "ok" or r["failed"]):
                out.append(f"- {key} said:\n\n```\n" + "\n".join(lines[-20:]) + "\n```")
        for p in r["panics"]:
            out.append("- panic:\n\n```\n" + p + "\n```")
        out.append("")
    return "\n".join(out)


def stop_on_signals() -> None:
    """SIGTERM, SIGHUP and SIGINT end the run through its `finally` blocks, which kill qemu and every
    other process it started (SIGINT too when this was started in the background, where it is ignored)."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--kernels",
        default=",".join(debs.SUITES),
        help=f"comma-separated, from {', '.join(debs.SUITES)} (default: all)",
    )
    p.add_argument("--results", default=str(DEFAULT_RESULTS), help="results directory (default: %(default)s)")
    p.add_argument(
        "--accel",
        choices=["auto", "tcg", "kvm"],
        default="auto",
        help="auto: KVM only if a stock kernel boots with it here, else TCG (default)",
    )
    args = p.parse_args(argv)
    args.names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in debs.SUITES]
    if unknown:
        p.error(f"unknown kernels {unknown}; known: {', '.join(debs.SUITES)}")
    return args


def results_dir(base: str, run_id: str) -> Path:
    """The run's own directory under `base`, whose contents stay out of git."""
    outdir = Path(base) / run_id
    outdir.mkdir(parents=True, exist_ok=True)
    ignore = outdir.parent / ".gitignore"  # serial logs and initrds are a run's, not the repository's
    if not ignore.exists():
        ignore.write_text("# written by python -m tests.kernels: every run's results stay out of git\n*\n")
    return outdir


def fetch_kernels(names: list[str], rows: list[dict[str, Any]]) -> dict[str, debs.KernelDebs]:
    """Each named suite's kernel packages; a suite that cannot be fetched is a row that says why."""
    kernels: dict[str, debs.KernelDebs] = {}
    for n in names:
        try:
            kernels[n] = debs.fetch(n, log)
            log(f"{n}: {kernels[n].release} ({kernels[n].version})")
        except Exception as e:  # the others run
            rows.append(row_of(n, "?", None, f"download: {e}"[:300]))
    return kernels


def hung_guest(name: str, b: boot.BootResult, outdir: Path) -> str:
    """What a first boot that went silent said last; its console log kept as NAME.hung.console.log."""
    last = [r for r in b.results if r.get("step") == "progress"]
    kept = outdir / f"{name}.hung.console.log"
    b.console_log.replace(kept)
    where = f" after {last[-1].get('message', '')[:120]!r}" if last else ""
    return f"went silent for {boot.SILENT_S:.0f} s{where} (log {kept.name})"


def boot_each(
    kernels: dict[str, debs.KernelDebs], root: Path, image: Path, outdir: Path, accel: str, rows: list[dict[str, Any]]
) -> tuple[str, dict[str, float]]:
    """Boots each kernel on the guest disk, a row each; the accelerator used and each kernel's seconds."""
    per_kernel: dict[str, float] = {}
    for n, k in kernels.items():
        t = time.monotonic()
        initrd = outdir / f"{n}.initrd.img"
        try:
            mods = boot.make_initrd(root, k.release, initrd)
            kernel = guestroot.vmlinuz(root, k.release)
        except Exception as e:
            rows.append(row_of(n, k.release, None, f"initrd: {e}"[:300]))
            continue
        if accel == "auto":
            accel = "kvm" if boot.kvm_boots(kernel, initrd, image, outdir, log) else "tcg"
        log(f"booting {n} ({k.release}, {accel}; initrd loads {', '.join(mods)}; deadline {GUEST_TIMEOUT_S} s)")
        b = boot.boot(k.release, kernel, initrd, image, outdir, accel, GUEST_TIMEOUT_S, log, name=n)
        hung = ""
        if b.silent and not b.panics:  # a hung guest, not a failed step: booted once more, and said
            hung = hung_guest(n, b, outdir)
            log(f"{n}: {hung}; booting it once more")
            b = boot.boot(k.release, kernel, initrd, image, outdir, accel, GUEST_TIMEOUT_S, log, name=n)
        initrd.unlink(missing_ok=True)
        row = row_of(n, k.release, b)
        if hung:
            row["hung_first"] = hung
            row["cells"]["boot"] += f" (2nd boot: the 1st {hung})"
        rows.append(row)
        per_kernel[n] = round(time.monotonic() - t, 1)
        summary = ", ".join(f"{c}: {row['cells'][c]}" for c in [*REQUIRED, "startup", "panics"])
        log(f"{n}: {summary} ({per_kernel[n]:.0f} s)")
    return accel, per_kernel


def write_results(outdir: Path, doc: dict[str, Any]) -> None:
    """results.json and results.md of the run (and latest.* beside the runs), and the table on stdout."""
    rows, names, timings, per_kernel = doc["rows"], doc["kernels"], doc["timings"], doc["per_kernel_s"]
    md = (
        f"# Kernel matrix {doc['run_id']}\n\n`python -m tests.kernels --kernels {','.join(names)}` on "
        f"{doc['host']} ({doc['accel']}); {timings['total_s']:.0f} s in all (downloads {timings['download_s']:.0f} s, "
        f"guest disk {timings['prepare_s']:.0f} s; per kernel: "
        f"{', '.join(f'{n} {s:.0f} s' for n, s in per_kernel.items())}).\n\n"
        f"{table(rows, markdown=True)}\n\n{LEGEND}\n\n## Details\n\n{details(rows)}"
    )
    (outdir / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    (outdir / "results.md").write_text(md)
    shutil.copy2(outdir / "results.json", outdir.parent / "latest.json")
    shutil.copy2(outdir / "results.md", outdir.parent / "latest.md")
    print("\n" + table(rows, markdown=False) + "\n\n" + LEGEND + "\n", flush=True)
    log(f"wrote {outdir / 'results.md'}, {outdir / 'results.json'} and the serial logs beside them")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    gaps = host_gaps()
    if gaps:
        print(
            f"test-kernels: this host cannot run the matrix: {'; '.join(gaps)}; `make test-setup` installs "
            "the tools (run as root)",
            file=sys.stderr,
        )
        return 2
    started = time.monotonic()
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    outdir = results_dir(args.results, run_id)
    log(f"results in {outdir}")
    timings: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    t = time.monotonic()
    kernels = fetch_kernels(args.names, rows)
    timings["download_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    image = guestroot.KERNEL_CACHE / "disk.img"
    prep: dict[str, object] = {}
    try:
        prep = guestroot.make_image(list(kernels.values()), image, {"fp_flags": frame_pointer_flags()}, log)
    except Exception as e:  # no disk: every kernel's row says why
        rows += [row_of(n, k.release, None, f"guest disk: {e}"[:300]) for n, k in kernels.items()]
        kernels = {}
    timings["prepare_s"] = round(time.monotonic() - t, 1)
    accel, per_kernel = boot_each(kernels, Path(str(prep.get("root", ""))), image, outdir, args.accel, rows)
    timings["total_s"] = round(time.monotonic() - started, 1)
    order = {n: i for i, n in enumerate(debs.SUITES)}  # the table in the suites' order, whatever ran first
    rows.sort(key=lambda r: order.get(r["name"], 99))
    failed = {r["name"]: r["failed"] for r in rows if r["failed"]}
    doc = {
        "run_id": run_id,
        "host": platform.release(),
        "accel": accel,
        "kernels": args.names,
        "timings": timings,
        "per_kernel_s": per_kernel,
        "prepare": prep,
        "rows": rows,
        "failed": failed,
    }
    write_results(outdir, doc)
    for r in rows:  # the logs go with a CI checkout: the ends of a failed or hung guest's are said here
        for kept in sorted(outdir.glob(f"{r['name']}.*console.log")) if r["failed"] or "hung_first" in r else []:
            tail = kept.read_text(errors="replace").splitlines()[-FAILED_LOG_LINES:]
            log(f"{kept.name}, its last {len(tail)} lines:\n" + "\n".join(tail))
    if failed:
        log("FAILED: " + "; ".join(f"{n}: {', '.join(f)}" for n, f in failed.items()))
        return 1
    log("every kernel passed every step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
