"""The kernel's BPF run-time statistics: switched on by `make bench` and the tests that check the
programs' own figures against them (the collector leaves them off: collector/bpftime.py says why).

Owns: enabling the statistics (the BPF_ENABLE_STATS command of bpf(2), whose
descriptor keeps them on while it is open and ends its share when closed, so
a crash restores the previous state too; the kernel.bpf_stats_enabled sysctl
only where that command is refused, with the previous value written back at
close), and reading run_time_ns / run_cnt of a program by its descriptor
(BPF_OBJ_GET_INFO_BY_FD) — the same counters `bpftool prog show` prints.

Must not: load, attach or choose programs (the caller passes their
descriptors), or decide what the figures mean.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

from collector import syscalls
from collector.syscalls import BPF_ENABLE_STATS, BPF_OBJ_GET_INFO_BY_FD

# The one statistics type (include/uapi/linux/bpf.h); the commands are collector/syscalls.py's.
BPF_STATS_RUN_TIME = 0
# Offsets of id, run_time_ns and run_cnt in struct bpf_prog_info (stable uapi since 5.1).
PROG_INFO_ID = 4
PROG_INFO_RUN_TIME_NS = 192
PROG_INFO_RUN_CNT = 200
# A bpf_prog_info buffer larger than today's struct: the kernel fills what it knows.
PROG_INFO_SIZE = 256
STATS_SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"


class _EnableStatsAttr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("pad", ctypes.c_uint8 * 116)]


class _InfoByFdAttr(ctypes.Structure):
    _fields_ = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
        ("pad", ctypes.c_uint8 * 104),
    ]


@dataclass(frozen=True)
class ProgStats:
    run_time_ns: int
    run_cnt: int
    prog_id: int = 0  # the id `bpftool prog show` lists it by


def prog_stats(fd: int) -> ProgStats:
    """run_time_ns and run_cnt of the BPF program behind `fd` (counted only while statistics are on)."""
    buf = ctypes.create_string_buffer(PROG_INFO_SIZE)
    attr = _InfoByFdAttr(bpf_fd=fd, info_len=PROG_INFO_SIZE, info=ctypes.addressof(buf))
    syscalls.bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    raw = buf.raw
    return ProgStats(
        int.from_bytes(raw[PROG_INFO_RUN_TIME_NS : PROG_INFO_RUN_TIME_NS + 8], "little"),
        int.from_bytes(raw[PROG_INFO_RUN_CNT : PROG_INFO_RUN_CNT + 8], "little"),
        int.from_bytes(raw[PROG_INFO_ID : PROG_INFO_ID + 4], "little"),
    )


class RunTimeStats:
    """The kernel's BPF run-time statistics on from construction until close().

    `how` says which way: "BPF_ENABLE_STATS" (a descriptor held), "sysctl"
    (kernel.bpf_stats_enabled set to 1, its old value restored at close),
    "already on" (the sysctl was 1: left alone) or "" when neither worked
    (then run times stay 0 and the guard counts stage CPU only; `problem`
    says why, for the caller to log)."""

    def __init__(self, allow_sysctl: bool = True) -> None:
        """`allow_sysctl`: fall back to writing the sysctl; only for a process that keeps the
        privilege to write it back at close."""
        self.how = ""
        self.problem = ""  # why the statistics are off, for the caller's log
        self._fd = -1
        self._sysctl_before: str | None = None
        try:
            self._fd = syscalls.bpf(BPF_ENABLE_STATS, _EnableStatsAttr(type=BPF_STATS_RUN_TIME))
            self.how = "BPF_ENABLE_STATS"
            return
        except OSError as e:
            why = f"BPF_ENABLE_STATS refused ({errno.errorcode.get(e.errno or 0, e.errno)}; it needs CAP_SYS_ADMIN)"
        try:
            with open(STATS_SYSCTL) as f:
                before = f.read().strip()
            if before == "1":
                self.how = "already on (kernel.bpf_stats_enabled=1)"
                return
            if not allow_sysctl:
                self.problem = f"{why}; kernel.bpf_stats_enabled is {before}"
                return
            with open(STATS_SYSCTL, "w") as f:
                f.write("1")
            self._sysctl_before = before
            self.how = f"sysctl (kernel.bpf_stats_enabled=1, {before} restored at exit)"
        except OSError as e:
            self.problem = f"{why}; kernel.bpf_stats_enabled: {e.strerror}"

    @property
    def on(self) -> bool:
        return bool(self.how)

    def close(self) -> None:
        """Statistics back as they were before (the descriptor closed, or the sysctl written back)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._sysctl_before is not None:
            try:
                with open(STATS_SYSCTL, "w") as f:
                    f.write(self._sysctl_before)
            finally:
                self._sysctl_before = None
