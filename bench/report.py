"""Bench output: the printed tables, bench/results/<name>.json and bench/RESULTS.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"


def _mmm(s: dict[str, Any], fmt: str = "{:.3f}") -> str:
    """ "median (min–max)" of a stats.summary()."""
    if not s or s.get("median") is None:
        return "n/a"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def oncpu_tables(result: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """(header, rows) of the overhead table and of the CPU-per-sample table."""
    summ = result["summary"]
    head1 = [
        "configuration",
        "elapsed s",
        "throughput Munits/s",
        "slowdown vs none",
        "vs profile-bpfcc same Hz",
        "profiler CPU s during run",
    ]
    rows1 = []
    for c in result["configurations"]:
        e = summ["configurations"][c["key"]]
        none = c["kind"] == "none"
        rows1.append(
            [
                c["label"],
                _mmm(e["elapsed_s"]),
                _mmm(e["throughput_munits_per_s"], "{:.0f}"),
                "1 (reference)" if none else _mmm(e["slowdown_vs_none"]),
                _mmm(e["vs_peer"]) if "vs_peer" in e else "",
                "" if none else _mmm(e["profiler_cpu_s_during_workload"]),
            ]
        )
    rates = result["settings"]["rates_hz"]
    head2 = ["stage"] + [f"{hz} Hz" for hz in rates]
    per = summ["cpu_per_10k_samples_s"]
    rows2 = []
    for stage, label in (("collector", "collector"), ("symbolizers", "symbolizer"), ("uploader", "uploader")):
        rows2.append([label] + [_mmm(per[str(hz)][stage]) for hz in rates])
    rows2.append(["samples per interval"] + [_mmm(per[str(hz)]["samples_per_interval"], "{:.0f}") for hz in rates])
    rows2.append(["coverage"] + [_mmm(per[str(hz)]["coverage"], "{:.2f}") for hz in rates])
    return head1, rows1, head2, rows2


def text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(c or " " for c in r) + " |" for r in rows]
    return "\n".join(out)


def oncpu_caption(result: dict[str, Any]) -> str:
    w, m, s = result["workload"], result["machine"], result["settings"]
    return (
        f"cpu_loop: {w['units']} units ({w['iterations']:.2e} iterations) on {w['threads']} threads, "
        f"{s['rounds']} rounds alternating; {m['cpus']} CPUs ({m['cpu_model']}), Linux {m['kernel']}; "
        f"{result['date']}"
    )


def oncpu_notes(result: dict[str, Any]) -> list[str]:
    result["summary"]["configurations"]
    notes = []

    def other(r: dict[str, Any]) -> float:
        return max(r["other_cpu_s"], r.get("other_cpu_interval_s", 0.0))

    worst = max(result["runs"], key=other)
    notes.append(
        f"other processes' CPU during a measurement: max {other(worst):.2f} s "
        f"(round {worst['round']}, {worst['config']}); steal max "
        f"{max(r['host_cpu']['steal_s'] for r in result['runs']):.2f} s"
    )
    waited = sum(r["quiet_wait_s"] for r in result["runs"] + result["discarded_runs"])
    if waited:
        notes.append(f"waited {waited:.0f} s in all for other profilers and busy processes to go")
    if result["discarded_runs"]:
        notes.append(
            f"{len(result['discarded_runs'])} disturbed run(s) discarded and run again: "
            + ", ".join(f"round {r['round']} {r['config']} ({other(r):.2f} s)" for r in result["discarded_runs"])
        )
    late = sum(
        r.get("workload_profiles_built_after_t2", 0) + r.get("workload_profiles_before_t0_built_after_t0", 0)
        for r in result["runs"]
    )
    if late:
        notes.append(
            f"{late} profile(s) with workload samples were built on the wrong side of T0 or T2 "
            f"(CPU per 10k samples is off by their build cost)"
        )
    disturbed = [r for r in result["runs"] if r["disturbed"]]
    if disturbed:
        notes.append(
            f"{len(disturbed)} of {len(result['runs'])} runs still disturbed after "
            f"{result['settings']['max_attempts']} attempts (other CPU > "
            f"{result['settings']['disturbed_share']:.0%} of the workload's): "
            + ", ".join(f"round {r['round']} {r['config']} ({other(r):.2f} s)" for r in disturbed)
        )
    b = result["bpf_check"]
    notes.append(
        "BPF programs left behind: "
        + ("none" if b["ok"] else ", ".join(b["left"]))
        + f" (`bpftool prog show` after the last run; bench's profilers loaded {len(b['ours'])} "
        f"program(s){_ids(b['ours'])})"
    )
    notes.append(f"full run: {result['bench_seconds']:.0f} s")
    return notes


def _ids(ids: list[int]) -> str:
    if not ids:
        return ""
    return f", ids {ids[0]}" if len(ids) == 1 else f", ids {min(ids)}–{max(ids)}"


def print_oncpu(result: dict[str, Any]) -> str:
    h1, r1, h2, r2 = oncpu_tables(result)
    text = "\n".join(
        [
            "",
            "On-CPU overhead — " + oncpu_caption(result),
            "median (min–max) over rounds; slowdown = elapsed / elapsed of `none` in the same round (>1: slower)",
            "",
            text_table(h1, r1),
            "",
            "pipeline CPU seconds per 10,000 samples, median (min–max) over rounds",
            "",
            text_table(h2, r2),
            "",
        ]
        + [f"- {n}" for n in oncpu_notes(result)]
        + [""]
    )
    print(text, flush=True)
    return text


def read_json(name: str) -> dict[str, Any] | None:
    """The last results of a suite, or None."""
    try:
        return json.loads((RESULTS_DIR / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def write_json(name: str, result: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def offcpu_section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the ping-pong table."""
    head = ["configuration", "round trips/s", "ratio to none (same round)"]
    rows = []
    for c in result["configs"]:
        e = result["summary"][c]
        rows.append(
            [c, _mmm(e["round_trips_per_s"], "{:,.0f}"), "1 (reference)" if c == "none" else _mmm(e["ratio_to_none"])]
        )
    for name, why in result["not_run"].items():
        rows.append([name, "not run", why])
    caption = (
        f"{result['workload']}; pipeline at {result['sample_hz']} Hz; {result['rounds']} rounds, "
        "configurations in turn; median (min–max); ratio < 1: slower"
    )
    return caption, head, rows, [f"full run: {result['seconds']} s"]


def scaling_section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the symbolizer throughput table."""
    rec = result["recorded"]
    head = ["symbolizer workers", "samples/s", "speedup over 1 worker (same round)"]
    summ = result["summary"]
    rows = [
        ["1", _mmm(summ["1 worker"], "{:,.0f}"), "1 (reference)"],
        ["2", _mmm(summ["2 workers"], "{:,.0f}"), _mmm(summ["speedup"], "{:.2f}")],
    ]
    caption = (
        f"a stream of {rec['batches']} batches ({rec['samples']:,} samples) recorded from the collector "
        f"at {rec['sample_hz']} Hz over {rec['seconds']:.0f} s, replayed {rec['repeat']} times as fast as "
        f"the workers take it; {result['rounds']} rounds, 1 and 2 workers in turn; median (min–max)"
    )
    cpu = [r["worker_cpu_s"] for r in result["runs"] if r["workers"] == 2]
    notes = [
        f"worker CPU seconds in the 2-worker runs (how evenly the services spread): {cpu}",
        f"full run: {result['seconds']} s",
    ]
    return caption, head, rows, notes


def print_section(title: str, section: tuple[str, list[str], list[list[str]], list[str]]) -> str:
    caption, head, rows, notes = section
    text = "\n".join(["", f"{title} — {caption}", "", text_table(head, rows), ""] + [f"- {n}" for n in notes] + [""])
    print(text, flush=True)
    return text


def md_section(title: str, json_name: str, section: tuple[str, list[str], list[list[str]], list[str]]) -> str:
    caption, head, rows, notes = section
    return "\n".join(
        [
            f"## {title}",
            "",
            f"{caption[0].upper()}{caption[1:]}. Raw figures: [results/{json_name}.json](results/{json_name}.json).",
            "",
            md_table(head, rows),
            "",
        ]
        + [f"- {n}" for n in notes]
        + [""]
    )


def write_results_md(result: dict[str, Any], extra_sections: tuple[str, ...] = ()) -> Path:
    h1, r1, h2, r2 = oncpu_tables(result)
    text = "\n".join(
        [
            "# Bench results",
            "",
            "Written by `make bench` (bench/run.py) on every run; the raw figures are in",
            "[results/oncpu.json](results/oncpu.json) and the method in [README.md](README.md).",
            "",
            "## On-CPU overhead",
            "",
            oncpu_caption(result) + ".",
            "",
            "Median (min–max) over rounds. Slowdown = elapsed / elapsed of `none` in the same round (> 1: slower); "
            "vs profile-bpfcc = elapsed under the pipeline / elapsed under profile-bpfcc at the same rate, "
            "same round (< 1: the pipeline costs the workload less).",
            "",
            md_table(h1, r1),
            "",
            "### Pipeline CPU seconds per 10,000 samples",
            "",
            "Median (min–max) over rounds; 1-s profile windows (an upper bound for the symbolizer and "
            "uploader with the default 60-s windows).",
            "",
            md_table(h2, r2),
            "",
        ]
        + [f"- {n}" for n in oncpu_notes(result)]
        + [""]
        + list(extra_sections)
    )
    tmp = RESULTS_MD.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, RESULTS_MD)
    return RESULTS_MD
