"""The on-CPU sampling perf events: one cpu-clock event per CPU, opened once at start, a BPF program on each.

Opened once, not at every attach: Debian and Ubuntu kernels ship kernel.perf_event_paranoid=3,
under which perf_event_open(2) takes CAP_SYS_ADMIN (Debian's patch; CAP_PERFMON is not enough).
The collector holds that capability only while it opens these events at start, then drops it
(docs/architecture.md, "perf_event_paranoid"); pausing, resuming and changing the rate afterwards
are ioctls on the open descriptors, which need no capability. A CPU that comes online later has no
event: it is named in the log at start and in `ebpfprofiler status`, and is sampled once the
collector restarts.

Owns: the descriptors, their program, enabling, disabling and the sample period, and closing them.

Must not: load or choose the program (the caller passes its descriptor), or read what it counts.
"""

from __future__ import annotations

import logging
import os

from collector import syscalls

log = logging.getLogger(__name__)

ONLINE_CPUS = "/sys/devices/system/cpu/online"
POSSIBLE_CPUS = "/sys/devices/system/cpu/possible"


def cpu_list(text: str) -> list[int]:
    """CPU numbers of a kernel cpulist ("0-3,8,10-11")."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def read_cpus(path: str) -> list[int]:
    with open(path) as f:
        return cpu_list(f.read())


class CpuClockEvents:
    """cpu-clock sampling events on every online CPU, each running `prog_fd` at every sample."""

    def __init__(self, prog_fd: int, period_ns: int, online: str = ONLINE_CPUS, possible: str = POSSIBLE_CPUS) -> None:
        self.period_ns = period_ns
        self.enabled = False
        self.fds: list[int] = []
        self.cpus = read_cpus(online)
        try:
            self.uncovered = sorted(set(read_cpus(possible)) - set(self.cpus))
        except OSError:
            self.uncovered = []
        attr = syscalls.perf_attr(syscalls.PERF_TYPE_SOFTWARE, syscalls.PERF_COUNT_SW_CPU_CLOCK, period_ns)
        try:
            for cpu in self.cpus:
                fd = syscalls.perf_event_open(attr, -1, cpu)
                self.fds.append(fd)
                syscalls.perf_ioctl(fd, syscalls.PERF_EVENT_IOC_SET_BPF, prog_fd)
        except OSError:
            self.close()
            raise

    def enable(self) -> None:
        for fd in self.fds:
            syscalls.perf_ioctl(fd, syscalls.PERF_EVENT_IOC_ENABLE)
        self.enabled = True

    def disable(self) -> None:
        for fd in self.fds:
            syscalls.perf_ioctl(fd, syscalls.PERF_EVENT_IOC_DISABLE)
        self.enabled = False

    def set_period(self, period_ns: int) -> None:
        """Sample every `period_ns` from now on (the events stay open; enabled or not, as they were)."""
        for fd in self.fds:
            syscalls.perf_ioctl(fd, syscalls.PERF_EVENT_IOC_PERIOD, period_ns)
        self.period_ns = period_ns

    def close(self) -> None:
        """Close every descriptor: the kernel detaches the program from each."""
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)
        self.enabled = False
