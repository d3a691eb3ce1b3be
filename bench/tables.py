"""Unwind table build time and size (symbolizer/cfi.py), with pyelftools' CFI decoding as the peer.

For libc, libpython3.11 and node (about 100 MB): the median of N in-process
builds (CPU seconds and wall seconds; N is --rounds), FDEs, rows, table bytes,
FDEs that needed FALLBACK, and the peak memory one build adds to a fresh
Python process (a separate process per module, so the figure is that build's
alone). The peer, in the same run: pyelftools decoding every FDE of libc's
.eh_frame (DWARFInfo.EH_CFI_entries() and get_decoded() on each FDE), median of
N, with the FDEs it raises on counted. Targets (issue 6): libc's table in
<= 1 s and node's in <= 15 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from elftools.dwarf.callframe import FDE
from elftools.elf.elffile import ELFFile

from bench import stats
from bench.procs import BenchError
from bench.report import _mmm
from symbolizer import cfi

MODULES = (
    ("libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", 1.0),
    ("libpython3.11", "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0", None),
    ("node", "/usr/bin/node", 15.0),
)
PEER_MODULE = "/usr/lib/x86_64-linux-gnu/libc.so.6"

# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the (large) parent across fork and exec.
_MEMORY_PROBE = """
import json, sys
from symbolizer import cfi
def hwm():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
before = hwm()
with open(sys.argv[1], "rb") as f:
    cfi.build_table(f)
print(json.dumps({"rss_before_kb": before, "rss_after_kb": hwm()}))
"""


class TablesBench:
    our_prog_ids: frozenset[int] = frozenset()  # loads no BPF

    def __init__(self, rounds: int, log: Callable[[str], None]) -> None:
        self.rounds = rounds
        self.log = log

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        modules = []
        for name, path, target in MODULES:
            real = os.path.realpath(path)
            if not os.path.exists(real):
                raise BenchError(f"{path} is missing: the tables suite measures it (apt-get install it)")
            self.log(f"tables: building the table of {name} {self.rounds} times")
            modules.append(self._module(name, real, target))
        self.log("tables: pyelftools decoding libc's CFI (the peer)")
        peer = self._peer(os.path.realpath(PEER_MODULE))
        return {
            "rounds": self.rounds,
            "modules": modules,
            "peer": peer,
            "seconds": round(time.monotonic() - started, 1),
        }

    def _module(self, name: str, path: str, target: float | None) -> dict[str, Any]:
        cpu, wall = [], []
        built = None
        for _ in range(self.rounds):
            with open(path, "rb") as f:
                c0, w0 = time.process_time(), time.perf_counter()
                built = cfi.build_table(f)
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
        assert built is not None
        probe = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE, path], check=False, capture_output=True, text=True, timeout=300
        )
        if probe.returncode:
            raise BenchError(f"memory probe of {name} failed: {probe.stderr.strip()[-500:]}")
        mem = json.loads(probe.stdout)
        cpu_s = stats.summary(cpu)
        return {
            "name": name,
            "path": path,
            "file_bytes": os.path.getsize(path),
            **cfi.describe(built),
            "cpu_s": cpu_s,
            "wall_s": stats.summary(wall),
            "target_s": target,
            "meets_target": None if target is None else cpu_s["median"] <= target,
            "peak_rss_added_mb": round((mem["rss_after_kb"] - mem["rss_before_kb"]) / 1024, 1),
        }

    def _peer(self, path: str) -> dict[str, Any]:
        cpu, wall = [], []
        fdes = errors = 0
        first_error = ""
        for _ in range(self.rounds):
            fdes = errors = 0
            with open(path, "rb") as f:
                c0, w0 = time.process_time(), time.perf_counter()
                for entry in ELFFile(f).get_dwarf_info().EH_CFI_entries():
                    if isinstance(entry, FDE):
                        fdes += 1
                        try:
                            entry.get_decoded()
                        except Exception as e:  # the peer's failures are what we count
                            errors += 1
                            first_error = first_error or f"{type(e).__name__}: {e}"[:200]
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
        return {
            "name": "pyelftools CFI decode (libc)",
            "path": path,
            "fdes": fdes,
            "fdes_raising": errors,
            "first_error": first_error,
            "cpu_s": stats.summary(cpu),
            "wall_s": stats.summary(wall),
        }


def section(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(caption, header, rows, notes) of the table build figures."""
    head = [
        "module",
        "file MB",
        "FDEs",
        "rows",
        "table KB",
        "FALLBACK FDEs",
        "build CPU s",
        "build wall s",
        "target",
        "peak RSS added MB",
    ]
    rows = []
    for m in result["modules"]:
        target = "" if m["target_s"] is None else f"≤ {m['target_s']:g} s " + ("met" if m["meets_target"] else "MISSED")
        rows.append(
            [
                m["name"],
                f"{m['file_bytes'] / 1e6:.1f}",
                f"{m['fdes']:,}",
                f"{m['rows']:,}",
                f"{m['bytes'] / 1024:,.0f}",
                str(m["fallback_fdes"]),
                _mmm(m["cpu_s"]),
                _mmm(m["wall_s"]),
                target,
                f"{m['peak_rss_added_mb']:.1f}",
            ]
        )
    p = result["peer"]
    rows.append(
        [
            p["name"],
            "",
            f"{p['fdes']:,}",
            "",
            "",
            f"{p['fdes_raising']} raise",
            _mmm(p["cpu_s"]),
            _mmm(p["wall_s"]),
            "",
            "",
        ]
    )
    libc = next(m for m in result["modules"] if m["name"] == "libc.so.6")
    caption = (
        f"unwind tables built by symbolizer/cfi.py, {result['rounds']} in-process builds per module, "
        f"median (min–max); the peer decodes the same libc in the same run"
    )
    notes = [
        f"pyelftools / ours on libc, CPU: {p['cpu_s']['median'] / libc['cpu_s']['median']:.0f}x"
        if libc["cpu_s"]["median"]
        else "",
        f"pyelftools' first error on libc: {p['first_error'] or 'none'}",
        "peak RSS added: VmHWM of a fresh Python process after one build minus before it (imports done)",
        f"full run: {result['seconds']} s",
    ]
    return caption, head, rows, [n for n in notes if n]
