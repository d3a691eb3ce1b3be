"""BTF-typed tracepoint programs (tp_btf) compiled by bcc and loaded by us.

bcc 0.26 compiles any C function of its module but loads only the program
types it knows; a tp_btf program (BPF_PROG_TYPE_TRACING attached to a raw
tracepoint by BTF id) is not one of them. It is what off-CPU profiling needs:
its arguments are typed task pointers, so a program can use task local
storage of the task switched in or woken (not only of the current one) and
read a sleeping task's kernel stack (bpf_get_task_stack), and it costs no
perf-event record per call, as a classic tracepoint does (measured on the
ping-pong: the classic sched_switch path made it several times slower).

Owns: libbpf (loaded once, by ctypes): its feature probes (probe_helper, probe_map_type), the
kernel's BTF (enum_has, member_offset); loading such a function (bcc's relocated instructions, map fds
already in place) with the bpf() syscall, the BTF id of its tracepoint
(libbpf's libbpf_find_vmlinux_btf_id), attaching and detaching it (a link
descriptor: closing it detaches), and closing it all; and the offsets of
kernel struct members in the running kernel's BTF (member_offset), for a
program that reads a field bcc's headers may place wrongly (bcc compiles
against /lib/modules/<release>/build, which may be another kernel's).

Must not: know what the programs do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from collections.abc import Sequence
from typing import Any

from collector import syscalls

# bpf(2) types of include/uapi/linux/bpf.h (kernel ABI, stable); its commands are collector/syscalls.py's.
_BPF_PROG_TYPE_TRACING = 26
_BPF_TRACE_RAW_TP = 23
_ATTR_BYTES = 128  # of union bpf_attr: more than PROG_LOAD's fields up to attach_btf_id
# The verifier's log when a load fails: enough for the last instructions and the reason.
_LOG_BYTES = 1 << 20
# How much of that log an error message quotes.
_LOG_QUOTED = 2000
# BTF kinds (include/uapi/linux/btf.h) member_offset looks through.
_BTF_KIND_PTR, _BTF_KIND_STRUCT, _BTF_KIND_UNION, _BTF_KIND_ENUM, _BTF_KIND_TYPEDEF = 2, 4, 5, 6, 8
_BTF_KIND_FUNC_PROTO = 13
_BTF_MODIFIERS = {8, 9, 10, 11, 18}  # typedef, volatile, const, restrict, type_tag
# A kernel type nests far less; bounds the walk through anonymous members and modifiers.
_BTF_MAX_DEPTH = 16


class BtfProgramError(RuntimeError):
    """A tp_btf program could not be loaded or attached; the message says why."""


_libbpf: Any = None


def _lib() -> Any:
    global _libbpf  # noqa: PLW0603
    if _libbpf is None:
        lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
        lib.libbpf_find_vmlinux_btf_id.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.libbpf_find_vmlinux_btf_id.restype = ctypes.c_int
        lib.btf__load_vmlinux_btf.argtypes = []
        lib.btf__load_vmlinux_btf.restype = ctypes.c_void_p
        lib.btf__free.argtypes = [ctypes.c_void_p]
        lib.btf__free.restype = None
        lib.btf__find_by_name_kind.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
        lib.btf__find_by_name_kind.restype = ctypes.c_int32
        lib.btf__type_by_id.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.btf__type_by_id.restype = ctypes.c_void_p
        lib.btf__name_by_offset.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.btf__name_by_offset.restype = ctypes.c_char_p
        lib.libbpf_probe_bpf_helper.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.libbpf_probe_bpf_helper.restype = ctypes.c_int
        lib.libbpf_probe_bpf_map_type.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.libbpf_probe_bpf_map_type.restype = ctypes.c_int
        _libbpf = lib
    return _libbpf


def probe_helper(prog_type: int, helper: int) -> bool | None:
    """Whether programs of `prog_type` may call BPF helper `helper` on this kernel (libbpf loads a
    tiny program that calls it); None when it cannot tell (no privilege to load programs)."""
    ret = _lib().libbpf_probe_bpf_helper(prog_type, helper, None)
    return None if ret < 0 else ret == 1


def probe_map_type(map_type: int) -> bool | None:
    """Whether this kernel creates maps of `map_type` (libbpf creates one); None when it cannot tell."""
    ret = _lib().libbpf_probe_bpf_map_type(map_type, None)
    return None if ret < 0 else ret == 1


def enum_has(enum_name: str, member: str) -> bool | None:
    """Whether enum `enum_name` of the running kernel's BTF names `member`; None without BTF."""
    lib = _lib()
    btf = lib.btf__load_vmlinux_btf()
    if not btf:
        return None
    try:
        type_id = lib.btf__find_by_name_kind(btf, enum_name.encode(), _BTF_KIND_ENUM)
        if type_id <= 0:
            return False
        ptr = lib.btf__type_by_id(btf, type_id)
        _name_off, info, _size = struct.unpack("III", ctypes.string_at(ptr, 12))
        vlen = info & 0xFFFF
        values = ctypes.string_at(ptr + 12, 8 * vlen)  # struct btf_enum: name_off, val
        return any(
            lib.btf__name_by_offset(btf, struct.unpack_from("I", values, 8 * i)[0]) == member.encode()
            for i in range(vlen)
        )
    finally:
        lib.btf__free(btf)


def tracepoint_arity(tracepoint: str) -> int | None:
    """How many arguments raw tracepoint `tracepoint` passes a tp_btf program in the running kernel (its
    btf_trace_<name> typedef: a pointer to a function of (void *, args...)); None without BTF or it.
    They change: sched_switch gained prev_state as its fourth in 5.18."""
    lib = _lib()
    btf = lib.btf__load_vmlinux_btf()
    if not btf:
        return None
    try:
        type_id = lib.btf__find_by_name_kind(btf, f"btf_trace_{tracepoint}".encode(), _BTF_KIND_TYPEDEF)
        for _ in range(_BTF_MAX_DEPTH):
            if type_id <= 0:
                return None
            ptr = lib.btf__type_by_id(btf, type_id)
            if not ptr:
                return None
            _name_off, info, size_or_type = struct.unpack("III", ctypes.string_at(ptr, 12))
            kind = (info >> 24) & 0x1F
            if kind == _BTF_KIND_FUNC_PROTO:
                return (info & 0xFFFF) - 1
            if kind not in (_BTF_KIND_TYPEDEF, _BTF_KIND_PTR):
                return None
            type_id = size_or_type
        return None
    finally:
        lib.btf__free(btf)


def member_offset(struct_name: str, path: tuple[str, ...]) -> int | None:
    """The byte offset of struct_name.path[0].path[1]... in the running kernel's BTF, or None."""
    return member_offsets(struct_name, [path])[0]


def member_offsets(struct_name: str, paths: Sequence[tuple[str, ...]]) -> list[int | None]:
    """The byte offsets of members of struct_name (each a path through nested members), the
    kernel's BTF loaded once for all of them.

    Anonymous struct and union members are looked through, as C does; None for a path when the
    kernel has no BTF, the struct or a member is not there, or a member is a bit field."""
    lib = _lib()
    btf = lib.btf__load_vmlinux_btf()
    if not btf:
        return [None] * len(paths)
    try:
        struct_id = lib.btf__find_by_name_kind(btf, struct_name.encode(), _BTF_KIND_STRUCT)
        return [_path_offset(lib, btf, struct_id, path) if struct_id > 0 else None for path in paths]
    finally:
        lib.btf__free(btf)


def _path_offset(lib: Any, btf: int, type_id: int, path: tuple[str, ...]) -> int | None:
    total = 0
    for name in path:
        found = _find_member(lib, btf, type_id, name, 0)
        if found is None:
            return None
        bits, type_id = found
        if bits % 8:
            return None
        total += bits // 8
    return total


def _find_member(lib: Any, btf: int, type_id: int, name: str, depth: int) -> tuple[int, int] | None:
    """(bit offset, type id) of member `name` of struct or union `type_id`, anonymous ones included."""
    if depth > _BTF_MAX_DEPTH:
        return None
    kind, vlen, kflag, members = _btf_type(lib, btf, type_id, depth)
    if kind not in (_BTF_KIND_STRUCT, _BTF_KIND_UNION) or members is None:
        return None
    for i in range(vlen):
        name_off, member_type, offset = struct.unpack_from("III", members, 12 * i)
        bits = offset & 0xFFFFFF if kflag else offset
        member_name = lib.btf__name_by_offset(btf, name_off) or b""
        if member_name == name.encode():
            return bits, member_type
        if not member_name:
            inner = _find_member(lib, btf, member_type, name, depth + 1)
            if inner is not None:
                return bits + inner[0], inner[1]
    return None


def _btf_type(lib: Any, btf: int, type_id: int, depth: int) -> tuple[int, int, int, bytes | None]:
    """(kind, vlen, kind_flag, member records) of `type_id` after typedefs and qualifiers."""
    for _ in range(_BTF_MAX_DEPTH - depth + 1):
        ptr = lib.btf__type_by_id(btf, type_id)
        if not ptr:
            return -1, 0, 0, None
        _name_off, info, size_or_type = struct.unpack("III", ctypes.string_at(ptr, 12))
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        if kind in _BTF_MODIFIERS:
            type_id = size_or_type
            continue
        return kind, vlen, kflag, ctypes.string_at(ptr + 12, 12 * vlen)
    return -1, 0, 0, None


def tracepoint_btf_id(tracepoint: str) -> int:
    """The vmlinux BTF id of raw tracepoint `tracepoint` (its btf_trace_<name> typedef)."""
    btf_id = _lib().libbpf_find_vmlinux_btf_id(tracepoint.encode(), _BPF_TRACE_RAW_TP)
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
        # Loaded without a verifier log first: at log level 1 the kernel formats a line per instruction it
        # checks, which took the off-CPU loads from 0.9 to 4.6 s of CPU here (and minutes under emulation);
        # the log is asked for only to quote a refusal.
        for level in (0, 1):
            attr = ctypes.create_string_buffer(_ATTR_BYTES)
            # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf
            struct.pack_into(
                "IIQQIIQ",
                attr,
                0,
                _BPF_PROG_TYPE_TRACING,
                len(insns) // 8,
                ctypes.addressof(code),
                ctypes.addressof(license_),
                level,
                _LOG_BYTES if level else 0,
                ctypes.addressof(log) if level else 0,
            )
            struct.pack_into("15s", attr, 48, fn_name.encode()[:15])  # prog_name (16 with its NUL)
            struct.pack_into("I", attr, 68, _BPF_TRACE_RAW_TP)  # expected_attach_type
            struct.pack_into("I", attr, 108, tracepoint_btf_id(tracepoint))  # attach_btf_id
            try:
                self.fd = syscalls.bpf(syscalls.BPF_PROG_LOAD, attr)
                return
            except OSError as e:
                if not level:
                    first = e  # the refusal; the log pass may fail otherwise (ENOSPC: the log overflowed)
                    if e.errno == errno.E2BIG:  # too complex: the log of a million instructions says no more,
                        raise BtfProgramError(  # and under emulation took as long again as the check itself
                            f"loading {fn_name} on {tracepoint}: {e.strerror} (the verifier's instruction or "
                            f"complexity limit)"
                        ) from None
                    continue
                text = log.value.decode("utf-8", "replace")
                raise BtfProgramError(
                    f"loading {fn_name} on {tracepoint}: {first.strerror}; verifier: {text[-_LOG_QUOTED:]}"
                ) from None

    @property
    def attached(self) -> bool:
        return self._link >= 0

    def attach(self) -> None:
        if self._link >= 0:
            return
        attr = ctypes.create_string_buffer(_ATTR_BYTES)
        struct.pack_into("QI", attr, 0, 0, self.fd)  # name: none (the program's BTF id names it)
        try:
            self._link = syscalls.bpf(syscalls.BPF_RAW_TRACEPOINT_OPEN, attr)
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
