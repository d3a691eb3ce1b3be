"""Offsets of kernel struct members from the running kernel's BTF (collector/btfprog.member_offset).

bcc compiles against /lib/modules/<release>/build, which on these machines is another kernel's
headers; the off-CPU program's reads of task_struct fields use these offsets instead. Given the
kernel's own BTF, when a member is looked up, then its offset is the one bpftool reads from the
same BTF, anonymous structs and unions are looked through as C does, and a name the kernel does
not have is None, not a guess.
"""

from __future__ import annotations

import json
import subprocess
from functools import lru_cache

import pytest

from collector import offcpu
from collector.btfprog import member_offset

VMLINUX = "/sys/kernel/btf/vmlinux"


@lru_cache(maxsize=1)
def bpftool_types() -> dict[int, dict]:
    out = subprocess.run(
        ["bpftool", "-j", "btf", "dump", "file", VMLINUX], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return {t["id"]: t for t in json.loads(out)["types"]}


def bpftool_member(struct: str, member: str) -> tuple[int, int]:
    """(byte offset, type id) of a named member, as bpftool dumps the struct."""
    types = bpftool_types()
    t = next(t for t in types.values() if t["kind"] == "STRUCT" and t["name"] == struct)
    m = next(m for m in t["members"] if m["name"] == member)
    return m["bits_offset"] // 8, m["type_id"]


def test_the_offsets_the_off_cpu_program_reads_are_the_kernels() -> None:
    thread, thread_type = bpftool_member("task_struct", "thread")
    sp = next(m for m in bpftool_types()[thread_type]["members"] if m["name"] == "sp")["bits_offset"] // 8
    assert member_offset("task_struct", ("thread", "sp")) == thread + sp
    assert member_offset("task_struct", ("rseq",)) == bpftool_member("task_struct", "rseq")[0]
    defines = offcpu.bpf_defines()
    assert {k: defines[k] for k in ("OFFCPU_TASK_SP_OFFSET", "OFFCPU_TASK_RSEQ_OFFSET")} == {
        "OFFCPU_TASK_SP_OFFSET": thread + sp,
        "OFFCPU_TASK_RSEQ_OFFSET": bpftool_member("task_struct", "rseq")[0],
    }
    # and the run-queue wait's fields (bpf/offcpu.c offcpu_waited), each where bpftool has it
    info, info_type = bpftool_member("task_struct", "sched_info")
    se, se_type = bpftool_member("task_struct", "se")
    types = bpftool_types()

    def inner(type_id: int, name: str) -> int:
        return next(m for m in types[type_id]["members"] if m["name"] == name)["bits_offset"] // 8

    assert defines["OFFCPU_TASK_STORAGE"] == 1  # this kernel has task storage: no records by thread id
    assert defines["OFFCPU_SWITCH_PREV_STATE"] == 1  # the state from sched_switch's argument (5.18+)
    named = ("OFFCPU_TASK_SP_OFFSET", "OFFCPU_TASK_RSEQ_OFFSET", "OFFCPU_TASK_STORAGE", "OFFCPU_SWITCH_PREV_STATE")
    assert {k: v for k, v in defines.items() if k not in named} == {
        "OFFCPU_TASK_RUN_DELAY_OFFSET": info + inner(info_type, "run_delay"),
        "OFFCPU_TASK_LAST_QUEUED_OFFSET": info + inner(info_type, "last_queued"),
        "OFFCPU_TASK_CFS_RQ_OFFSET": se + inner(se_type, "cfs_rq"),
        "OFFCPU_CFS_RQ_RQ_OFFSET": bpftool_member("cfs_rq", "rq")[0],
        "OFFCPU_RQ_CLOCK_OFFSET": bpftool_member("rq", "clock")[0],
        "OFFCPU_RQ_CPU_OFFSET": bpftool_member("rq", "cpu")[0],
    }


def test_without_task_storage_the_records_are_keyed_by_the_pid_field_the_kernel_has() -> None:
    # a kernel before 5.11 (collector/features.py): bpf/offcpu.c reads task_struct.pid from a BTF pointer
    defines = offcpu.bpf_defines(task_storage=False)
    assert "OFFCPU_TASK_STORAGE" not in defines
    assert defines["OFFCPU_TASK_PID_OFFSET"] == bpftool_member("task_struct", "pid")[0]
    assert defines["OFFCPU_THREADS"] == offcpu.THREAD_RECORDS


def test_before_5_18_prev_state_is_read_from_the_task_field_the_kernel_has() -> None:
    # sched_switch gained prev_state in 5.18; before it, bpf/offcpu.c reads prev's own field
    defines = offcpu.bpf_defines(prev_state=False)
    assert "OFFCPU_SWITCH_PREV_STATE" not in defines
    assert (defines["OFFCPU_TASK_STATE_OFFSET"], defines["OFFCPU_TASK_STATE_SIZE"]) == (
        bpftool_member("task_struct", "__state")[0],
        4,
    )


def flattened(type_id: int, base_bits: int = 0) -> dict[str, int]:
    """Every member name reachable through anonymous members → its byte offset (bpftool's view)."""
    out: dict[str, int] = {}
    for m in bpftool_types()[type_id].get("members", []):
        if m["name"] == "(anon)":
            out.update(flattened(m["type_id"], base_bits + m["bits_offset"]))
        else:
            out.setdefault(m["name"], (base_bits + m["bits_offset"]) // 8)
    return out


def test_members_of_anonymous_unions_are_found_at_their_place_in_the_outer_struct() -> None:
    # struct sk_buff begins with an anonymous union of an anonymous struct {next, prev, and an
    # anonymous union {dev, dev_scratch}} and an rb_node; its fields nest two and three deep.
    skb = next(i for i, t in bpftool_types().items() if t["kind"] == "STRUCT" and t["name"] == "sk_buff")
    expected = flattened(skb)
    for name in ("next", "prev", "dev", "dev_scratch", "sk", "tstamp", "destructor", "len"):
        assert member_offset("sk_buff", (name,)) == expected[name], name
    assert expected["prev"] == expected["next"] + 8 and expected["dev"] == expected["dev_scratch"]


@pytest.mark.parametrize(
    "struct, path",
    [("task_struct", ("no_such_member",)), ("no_such_struct", ("pid",)), ("task_struct", ("thread", "no_such_member"))],
)
def test_a_name_the_kernel_does_not_have_is_none(struct: str, path: tuple[str, ...]) -> None:
    assert member_offset(struct, path) is None
