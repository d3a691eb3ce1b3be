"""BTF-typed tracepoint programs (tp_btf) compiled by bcc and loaded by us.

bcc 0.26 compiles any C function of its module but loads only the program
types it knows; a tp_btf program (BPF_PROG_TYPE_TRACING attached to a raw
tracepoint by BTF id) is not one of them. It is what off-CPU profiling needs:
its arguments are typed task pointers, so a program can use task local
storage of the task switched in or woken (not only of the current one) and
read a sleeping task's kernel stack (bpf_get_task_stack), and it costs no
perf-event record per call, as a classic tracepoint does (measured on the
ping-pong: the classic sched_switch path made it several times slower).

Owns: loading such a function (bcc's relocated instructions, map fds
already in place) with the bpf() syscall, the BTF id of its tracepoint
(libbpf's libbpf_find_vmlinux_btf_id), attaching and detaching it (a link
descriptor: closing it detaches), and closing it all.

Must not: know what the programs do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from typing import Any

# bpf(2) commands and types of include/uapi/linux/bpf.h (kernel ABI, stable).
_SYS_BPF = 321                      # x86-64
_BPF_PROG_LOAD = 5
_BPF_RAW_TRACEPOINT_OPEN = 17
_BPF_PROG_TYPE_TRACING = 26
_BPF_TRACE_RAW_TP = 23
_ATTR_BYTES = 128                   # of union bpf_attr: more than PROG_LOAD's fields up to attach_btf_id
# The verifier's log when a load fails: enough for the last instructions and the reason.
_LOG_BYTES = 1 << 20
# How much of that log an error message quotes.
_LOG_QUOTED = 2000


class BtfProgramError(RuntimeError):
    """A tp_btf program could not be loaded or attached; the message says why."""


_libc = ctypes.CDLL(None, use_errno=True)
_libbpf: Any = None


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    fd = _libc.syscall(_SYS_BPF, cmd, attr, _ATTR_BYTES)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def tracepoint_btf_id(tracepoint: str) -> int:
    """The vmlinux BTF id of raw tracepoint `tracepoint` (its btf_trace_<name> typedef)."""
    global _libbpf
    if _libbpf is None:
        _libbpf = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
        _libbpf.libbpf_find_vmlinux_btf_id.argtypes = [ctypes.c_char_p, ctypes.c_int]
        _libbpf.libbpf_find_vmlinux_btf_id.restype = ctypes.c_int
    btf_id = _libbpf.libbpf_find_vmlinux_btf_id(tracepoint.encode(), _BPF_TRACE_RAW_TP)
    if btf_id <= 0:
        raise BtfProgramError(f"the kernel's BTF has no raw tracepoint {tracepoint} ({btf_id})")
    return int(btf_id)


class BtfProgram:
    """One function of a bcc module, loaded as a tp_btf program on `tracepoint`."""

    def __init__(self, bpf: Any, fn_name: str, tracepoint: str) -> None:
        self.name = fn_name
        self.tracepoint = tracepoint
        self._link = -1
        insns = bpf.dump_func(fn_name.encode())
        code = ctypes.create_string_buffer(insns, len(insns))
        license_ = ctypes.create_string_buffer(b"GPL")
        log = ctypes.create_string_buffer(_LOG_BYTES)
        attr = ctypes.create_string_buffer(_ATTR_BYTES)
        # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf
        struct.pack_into("IIQQIIQ", attr, 0, _BPF_PROG_TYPE_TRACING, len(insns) // 8, ctypes.addressof(code),
                         ctypes.addressof(license_), 1, _LOG_BYTES, ctypes.addressof(log))
        struct.pack_into("15s", attr, 48, fn_name.encode()[:15])          # prog_name (16 with its NUL)
        struct.pack_into("I", attr, 68, _BPF_TRACE_RAW_TP)                  # expected_attach_type
        struct.pack_into("I", attr, 108, tracepoint_btf_id(tracepoint))     # attach_btf_id
        try:
            self.fd = _bpf(_BPF_PROG_LOAD, attr)
        except OSError as e:
            text = log.value.decode("utf-8", "replace")
            raise BtfProgramError(f"loading {fn_name} on {tracepoint}: {e.strerror}; verifier: "
                                  f"{text[-_LOG_QUOTED:]}") from None

    @property
    def attached(self) -> bool:
        return self._link >= 0

    def attach(self) -> None:
        if self._link >= 0:
            return
        attr = ctypes.create_string_buffer(_ATTR_BYTES)
        struct.pack_into("QI", attr, 0, 0, self.fd)     # name: none (the program's BTF id names it)
        try:
            self._link = _bpf(_BPF_RAW_TRACEPOINT_OPEN, attr)
        except OSError as e:
            raise BtfProgramError(f"attaching {self.name} to {self.tracepoint}: {e.strerror}") from None

    def detach(self) -> None:
        if self._link >= 0:
            os.close(self._link)
            self._link = -1

    def close(self) -> None:
        self.detach()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
