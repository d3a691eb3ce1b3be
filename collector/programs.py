"""Compiles the BPF program families the config asks for into one bcc module.

Owns: the bcc BPF object: one compile (LLVM costs seconds and ~100 MB, so
once), the -D sizes every program is built with, and unloading it all.
A family that is not asked for is not compiled, so it cannot be loaded or
attached (offcpu: false loads no sched_switch program).

Must not: attach, drain or interpret maps (oncpu.py and offcpu.py do).
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from bcc import BPF  # type: ignore[import-not-found]

FAMILIES = ("oncpu", "offcpu")


class Programs:
    def __init__(self, bpf_dir: str, families: Sequence[str], defines: Mapping[str, int]) -> None:
        unknown = set(families) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown BPF program families: {sorted(unknown)}")
        for f in families:
            path = os.path.join(bpf_dir, f"{f}.c")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"BPF program {path} not found (--bpf-dir {bpf_dir})")
        # Concatenated, not #included: bcc generates TRACEPOINT_PROBE argument
        # structs only for the main source.
        text = "\n".join(_read(os.path.join(bpf_dir, f"{f}.c")) for f in families)
        cflags = [f"-D{k}={v}" for k, v in defines.items()]
        self.families = tuple(families)
        self.bpf = BPF(text=text.encode(), cflags=cflags)

    def close(self) -> None:
        """Detach whatever is still attached and unload every program and map."""
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
