"""bpf/common.h's counts_add, the count step every family shares, on real BPF maps.

Given a program built on common.h that counts (count, ns) values under a key user space chooses,
through a double buffer of two small hash maps that collector/bpfmaps.DoubleBuffer puts in the
array of maps, when this process makes the traced syscall, then a key counted again is added to
(both words), a new key is inserted while the map has room, a key that finds the map full is
reported to the caller (which counts it lost), and after DoubleBuffer.retire() the counts go to the
other map while the retired one is read whole.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any  # bcc's BPF and its tables: bcc has no type hints

from collector.bpfmaps import DoubleBuffer, take_all
from tests.harness import ROOT, require_root

# Entries of each counts map: small, so that the test fills one.
ENTRIES = 4
PROGRAM = """
struct t_key { u32 pid; u32 k; };
struct t_value { u64 count; u64 ns; };
BPF_HASH(t_counts_0, struct t_key, struct t_value, ENTRIES);
BPF_HASH(t_counts_1, struct t_key, struct t_value, ENTRIES);
BPF_ARRAY_OF_MAPS(t_count_maps, "t_counts_0", 2);
BPF_ARRAY(t_active, u32, 1);
BPF_ARRAY(t_next, u32, 1);      // the key the next call counts under (user space sets it)
BPF_ARRAY(t_lost, u64, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    if (bpf_get_current_pid_tgid() >> 32 != TEST_PID)
        return 0;
    u32 zero = 0;
    u32 *buf = t_active.lookup(&zero);
    u32 *next = t_next.lookup(&zero);
    if (!buf || !next)
        return 0;
    u32 b = *buf;
    struct t_key key = {TEST_PID, *next};
    struct t_value add = {1, 10};
    void *counts = t_count_maps.lookup(&b);
    if (!counts || counts_add(counts, &key, (u64 *)&add, sizeof(add) / sizeof(u64))) {
        u64 *n = t_lost.lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
    }
    return 0;
}
"""


def _count(b: Any, key: int, times: int = 1) -> None:
    b["t_next"][ctypes.c_int(0)] = ctypes.c_uint32(key)
    for _ in range(times):
        os.getppid()


def _values(table: Any) -> dict[int, tuple[int, int]]:
    return {k.k: (v.count, v.ns) for k, v in table.items()}


def test_counts_add_adds_inserts_reports_a_full_map_and_follows_the_flip() -> None:
    require_root()
    from bcc import BPF

    common = (ROOT / "bpf" / "common.h").read_text()
    b = BPF(text=(common + PROGRAM).encode(), cflags=[f"-DTEST_PID={os.getpid()}", f"-DENTRIES={ENTRIES}"])
    try:
        buffers = DoubleBuffer(b, "t")
        lost = b["t_lost"]
        _count(b, 1, times=3)
        assert _values(b["t_counts_0"]) == {1: (3, 30)}
        for k in range(2, ENTRIES + 1):
            _count(b, k)
        assert len(_values(b["t_counts_0"])) == ENTRIES and lost[ctypes.c_int(0)].value == 0
        _count(b, ENTRIES + 1, times=2)  # the map is full: reported, not counted
        assert lost[ctypes.c_int(0)].value == 2
        _count(b, 1)  # a key already there is still added to
        assert _values(b["t_counts_0"])[1] == (4, 40)

        old, counts = buffers.retire()
        _count(b, ENTRIES + 1)
        assert old == 0 and _values(b["t_counts_1"]) == {ENTRIES + 1: (1, 10)}
        assert sorted((k.k, v.count) for k, v in take_all(counts)) == [(1, 4)] + [(k, 1) for k in range(2, ENTRIES + 1)]
        assert _values(b["t_counts_0"]) == {} and lost[ctypes.c_int(0)].value == 2
    finally:
        b.cleanup()
