"""Compiles the BPF program families the config asks for into one bcc module.

Owns: the bcc BPF object: one compile (LLVM costs seconds and ~100 MB, so
once), the -D sizes every program is built with, the pid namespace the
programs name tasks in, and unloading it all.
A family that is not asked for is not compiled, so it cannot be loaded or
attached (offcpu: false loads no sched_switch program).

Must not: attach, drain or interpret maps (oncpu.py and offcpu.py do).
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from bcc import BPF

from ebpfprofiler.collector import bpftime

FAMILIES = ("oncpu", "offcpu", "lock", "alloc")
# PROC_PID_INIT_INO: the inode of the host's (initial) pid namespace.
INIT_PID_NS_INO = 0xEFFFFFFC


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
        # structs only for the main source. common.h comes first, then the
        # DWARF unwinder both families use when it is on.
        headers = ["common.h"] + (["unwind.h"] if "DWARF_UNWIND" in defines else [])
        text = "\n".join(_read(os.path.join(bpf_dir, f)) for f in headers + [f"{f}.c" for f in families])
        cflags = [f"-D{k}={v}" for k, v in {**defines, **bpftime.bpf_defines(), **pid_namespace_defines()}.items()]
        self.families = tuple(families)
        self.bpf = BPF(text=text.encode(), cflags=cflags)

    def close(self) -> None:
        """Detach whatever is still attached and unload every program and map."""
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None


def pid_namespace_defines(ns_path: str = "/proc/self/ns/pid") -> dict[str, int]:
    """PIDNS_DEV/PIDNS_INO when the collector runs in a pid namespace other than the host's.

    BPF sees host pids; a collector in a container reads its own /proc, so
    the programs must ask for ids in its namespace (bpf/common.h)."""
    st = os.stat(ns_path)
    if st.st_ino == INIT_PID_NS_INO:
        return {}
    return {"PIDNS_DEV": st.st_dev, "PIDNS_INO": st.st_ino}


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
