"""collector/bpfmaps.take_all on real BPF hash maps: every entry, once, and the map left empty.

Given hash maps loaded by bcc with struct and u64 values, filled from user space with more
entries than one batch call takes (BATCH_ENTRIES), when take_all reads them, then it returns
each key once with its value, as ctypes objects like bcc's items(), and the maps are empty.
"""

from __future__ import annotations

from collector.bpfmaps import BATCH_ENTRIES, DWARF_STACK_ID_BASE, take_all, take_dwarf_stacks
from tests.harness import require_root

PROGRAM = """
struct key_t { u32 pid; u32 tid; s64 stack; };
struct val_t { u64 count; u64 ns; };
BPF_HASH(structs, struct key_t, struct val_t, 20000);
BPF_HASH(plain, u64, u64, 20000);
struct stack_t { u64 pcs[8]; };
BPF_HASH(stacks, u64, struct stack_t, 64);
"""
N = BATCH_ENTRIES * 2 + 123


def test_take_all_returns_every_entry_once_and_empties_the_map() -> None:
    require_root()
    from bcc import BPF

    b = BPF(text=PROGRAM)
    try:
        structs, plain = b["structs"], b["plain"]
        keys = (structs.Key * N)()
        values = (structs.Leaf * N)()
        for i in range(N):
            keys[i].pid, keys[i].tid, keys[i].stack = i, i + 1, -i
            values[i].count, values[i].ns = i * 3, i * 7
        structs.items_update_batch(keys, values)
        pk = (plain.Key * N)(*range(N))
        pv = (plain.Leaf * N)(*(i * 11 for i in range(N)))
        plain.items_update_batch(pk, pv)

        got = take_all(structs)
        assert len(got) == N
        assert {k.pid for k, _ in got} == set(range(N))
        assert all(
            k.tid == k.pid + 1 and k.stack == -k.pid and v.count == 3 * k.pid and v.ns == 7 * k.pid for k, v in got
        )
        assert len(list(structs.items())) == 0

        got_plain = take_all(plain)
        assert sorted((k.value, v.value) for k, v in got_plain) == [(i, i * 11) for i in range(N)]
        assert len(list(plain.items())) == 0
        assert take_all(plain) == []
    finally:
        b.cleanup()


def test_take_dwarf_stacks_copies_the_stacks_asked_for_and_empties_the_map() -> None:
    require_root()
    from bcc import BPF

    b = BPF(text=PROGRAM)
    try:
        stacks = b["stacks"]
        for h, pcs in ((11, [1, 2, 3]), (22, [4] * 8), (33, [5])):
            leaf = stacks.Leaf()
            for i, pc in enumerate(pcs):
                leaf.pcs[i] = pc
            stacks[stacks.Key(h)] = leaf
        user: dict[int, tuple[int, ...]] = {}
        kernel: dict[int, tuple[int, ...]] = {}
        missing = take_dwarf_stacks(stacks, [({11, 44}, user), ({22}, kernel)])
        # frames up to the first 0, or all of them; 44 is not there; 33 was not asked for
        assert user == {DWARF_STACK_ID_BASE + 11: (1, 2, 3)}
        assert kernel == {DWARF_STACK_ID_BASE + 22: (4,) * 8}
        assert missing == 1
        assert len(list(stacks.items())) == 0
    finally:
        b.cleanup()
