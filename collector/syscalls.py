"""The raw system calls the collector makes that Python's os module lacks: bpf(2) and perf_event_open(2).

Owns: their numbers on each machine the collector runs on (they differ: bpf(2) is 321 on x86-64
and 280 on arm64, where 321 is unassigned and answers ENOSYS), the one wrapper each, the bpf(2)
command numbers, and the perf-event ioctls. Every module that calls bpf(2) itself
(collector/btfprog.py, collector/bpfstats.py, collector/alloc.py) and collector/perfevents.py call
them here; bcc's and libbpf's own calls (map batches, feature probes) are theirs.

Must not: know what a program, a map or an event is for; build attribute structures beyond the
perf_event_attr fields the collector sets.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct

# (bpf, perf_event_open) by `uname -m`: arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h (arm64 uses the generic table).
SYSCALL_NUMBERS: dict[str, tuple[int, int]] = {
    "x86_64": (321, 298),
    "aarch64": (280, 241),
}

# bpf(2) commands (enum bpf_cmd, include/uapi/linux/bpf.h: kernel ABI, stable).
BPF_PROG_LOAD = 5
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_LINK_CREATE = 28
BPF_ENABLE_STATS = 32

# perf_event_attr (include/uapi/linux/perf_event.h): PERF_ATTR_SIZE_VER5 (Linux 4.1) covers every field
# the collector sets; the kernel zero-fills the rest.
PERF_ATTR_SIZE = 112
PERF_TYPE_SOFTWARE = 1
PERF_TYPE_TRACEPOINT = 2
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_FLAG_FD_CLOEXEC = 8
_ATTR_DISABLED = 1 << 0  # the flags word's first bit: created stopped
# ioctls: _IO('$', n) and _IOW('$', n, u64 / u32); the same encoding on x86-64 and arm64.
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_DISABLE = 0x2401
PERF_EVENT_IOC_PERIOD = 0x40082404
PERF_EVENT_IOC_SET_BPF = 0x40042408

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class UnsupportedMachine(OSError):
    """The collector does not know this machine's system call numbers."""


def _numbers() -> tuple[int, int]:
    machine = os.uname().machine
    try:
        return SYSCALL_NUMBERS[machine]
    except KeyError:
        raise UnsupportedMachine(
            f"bpf(2) and perf_event_open(2) numbers are not known for {machine}; "
            f"supported: {', '.join(SYSCALL_NUMBERS)}"
        ) from None


def bpf(cmd: int, attr: ctypes.Array | ctypes.Structure, size: int | None = None) -> int:
    """bpf(cmd, attr, size): its non-negative result, or OSError with the kernel's errno."""
    ret = _libc.syscall(
        ctypes.c_long(_numbers()[0]),
        ctypes.c_long(cmd),
        ctypes.byref(attr),
        ctypes.c_uint(ctypes.sizeof(attr) if size is None else size),
    )
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def perf_attr(type_: int, config: int, sample_period: int, disabled: bool = True) -> ctypes.Array:
    """A perf_event_attr of `type_` and `config`, sampling every `sample_period` (a period, not a frequency)."""
    attr = ctypes.create_string_buffer(PERF_ATTR_SIZE)
    # type, size, config, sample_period, sample_type, read_format, flags, wakeup_events
    struct.pack_into(
        "IIQQQQQI", attr, 0, type_, PERF_ATTR_SIZE, config, sample_period, 0, 0, _ATTR_DISABLED if disabled else 0, 1
    )
    return attr


def perf_event_open(attr: ctypes.Array, pid: int, cpu: int, group_fd: int = -1) -> int:
    """A perf event descriptor (close-on-exec), or OSError with the kernel's errno."""
    ret = _libc.syscall(
        ctypes.c_long(_numbers()[1]),
        attr,
        ctypes.c_int(pid),
        ctypes.c_int(cpu),
        ctypes.c_int(group_fd),
        ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC),
    )
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def perf_ioctl(fd: int, request: int, arg: int = 0) -> None:
    """One of the PERF_EVENT_IOC_* requests: ENABLE and DISABLE take no argument, SET_BPF a program
    descriptor, PERIOD a new sample period."""
    if request == PERF_EVENT_IOC_PERIOD:
        fcntl.ioctl(fd, request, struct.pack("Q", arg))
    else:
        fcntl.ioctl(fd, request, arg)
