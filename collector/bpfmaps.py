"""Reading the BPF maps that both sampling families share the shape of.

Owns: the flip of a double-buffered counts map (its two maps put in the array of maps the
programs count through, and the grace period for programs still writing the retired buffer),
reading and clearing a retired buffer, reading stacks by id, which ids of a long-lived stack map
may go, and turning per-CPU loss counters into deltas.

Must not: know what a count means (on-CPU samples or off-CPU intervals).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Ids of DWARF-unwound user stacks in a RawDrain: their 64-bit hash plus this,
# so they never meet the small ids of bcc's stack maps.
DWARF_STACK_ID_BASE = 1 << 64

# Programs running on the old buffer when it is flipped finish within
# microseconds (they run with preemption off); this is ample.
FLIP_GRACE_S = 0.005
# Entries a retired map gives per bpf(BPF_MAP_LOOKUP_AND_DELETE_BATCH) call: one call where bcc's
# items() and clear() make four per key (next key, lookup; next key, delete), which on a host
# starting hundreds of processes a second was the collector's largest cost.
BATCH_ENTRIES = 4096
# errnos of a kernel or map type without batch operations: the map is then walked key by key.
_NO_BATCH = (errno.EINVAL, errno.EOPNOTSUPP, 524)  # 524: the kernel's ENOTSUPP


@dataclass
class RawDrain:
    """One drain: counts by key, and the stacks the keys refer to (leaf first)."""

    samples: list[tuple] = field(default_factory=list)
    # (pid, tid, user stack id, kernel stack id, count, value[, extra values[, Python stack hash]]): value
    # in ns, or bytes (alloc); the hash names a stack of python_stacks (collector/pywalk.py)
    user_stacks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    kernel_stacks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    python_stacks: dict[int, Any] = field(default_factory=dict)  # hash → collector/pywalk.py PyStack


class DoubleBuffer:
    """counts_0/counts_1 selected by a one-element `active` array the program reads.

    The programs reach the two maps through the array of maps <prefix>_count_maps (bpf/common.h:
    the count step is one inline function for every family), which is filled here, once."""

    def __init__(self, bpf: Any, prefix: str) -> None:
        self._bpf = bpf
        self._prefix = prefix
        self._active = 0
        maps = bpf[f"{prefix}_count_maps"]
        for i in (0, 1):
            maps[ctypes.c_int(i)] = ctypes.c_int(bpf[f"{prefix}_counts_{i}"].get_fd())
        bpf[f"{prefix}_active"][ctypes.c_int(0)] = ctypes.c_uint32(0)

    def retire(self) -> tuple[int, Any]:
        """Make the other buffer active; (index, counts table) of the one retired."""
        old = self._active
        self._active ^= 1
        self._bpf[f"{self._prefix}_active"][ctypes.c_int(0)] = ctypes.c_uint32(self._active)
        time.sleep(FLIP_GRACE_S)
        return old, self._bpf[f"{self._prefix}_counts_{old}"]


@dataclass
class StackRefs:
    """The stacks the keys of one drain name: stack-map ids, and hashes of DWARF-unwound user stacks
    and of Python stacks."""

    user: set[int] = field(default_factory=set)
    kernel: set[int] = field(default_factory=set)
    hashes: set[int] = field(default_factory=set)
    python: set[int] = field(default_factory=set)


def _objects(array: Any, n: int, kind: type) -> list[Any]:
    """The first n elements as bcc's items() gives them: ctypes objects, also of a simple type (an
    array of c_uint64 gives ints)."""
    got = array[:n]
    return [kind(x) for x in got] if issubclass(kind, ctypes._SimpleCData) else got


def take_all(table: Any) -> list[tuple[Any, Any]]:
    """Every (key, value) of a retired hash map, deleted as it is read.

    By BPF_MAP_LOOKUP_AND_DELETE_BATCH through libbcc (bcc 0.26's own items_lookup_and_delete_batch
    passes one variable as both the batch cursor and the count, so it is not used); where the
    kernel has no batch operations for the map, key by key with bcc's items() and clear()."""
    from bcc import libbcc  # the collector's bcc; imported here so that tests of the rest need none

    lib = libbcc.lib
    out: list[tuple[Any, Any]] = []
    cursor, next_cursor, count = ctypes.c_uint32(0), ctypes.c_uint32(0), ctypes.c_uint32(0)
    first = True
    while True:
        keys, values = (table.Key * BATCH_ENTRIES)(), (table.Leaf * BATCH_ENTRIES)()
        count.value = BATCH_ENTRIES
        res = lib.bpf_lookup_and_delete_batch(
            table.map_fd,
            None if first else ctypes.byref(cursor),
            ctypes.byref(next_cursor),
            ctypes.byref(keys),
            ctypes.byref(values),
            ctypes.byref(count),
        )
        err = ctypes.get_errno() if res != 0 else 0
        out.extend(zip(_objects(keys, count.value, table.Key), _objects(values, count.value, table.Leaf)))
        if res == 0:
            cursor.value = next_cursor.value
            first = False
            continue
        if err == errno.ENOENT or (res < 0 and -res == errno.ENOENT):
            return out
        if first and not out and (err in _NO_BATCH or -res in _NO_BATCH):
            items = list(table.items())
            table.clear()
            return items
        raise OSError(err or -res, f"BPF_MAP_LOOKUP_AND_DELETE_BATCH: {errno.errorcode.get(err or -res, '?')}")


def take_counts(counts: Any, out: RawDrain, values: Callable[[Any], tuple[int, int]]) -> StackRefs:
    """Move a retired counts map into out.samples, emptying it; `values` turns a map value into
    (count, value in ns). A DWARF stack (key.user_hash) gets the id DWARF_STACK_ID_BASE + hash; a Python
    stack (key.py_hash, bpf/python.h) is named by its hash after the values, and in refs.python."""
    refs = StackRefs()
    for k, v in take_all(counts):
        py = getattr(k, "py_hash", 0)
        if k.user_hash:
            refs.hashes.add(k.user_hash)
            user = DWARF_STACK_ID_BASE + k.user_hash
        else:
            user = k.user_stack
            if user >= 0:
                refs.user.add(user)
        if py:
            refs.python.add(py)
            out.samples.append((k.pid, k.tid, user, k.kernel_stack, *values(v), (), py))
        else:
            out.samples.append((k.pid, k.tid, user, k.kernel_stack, *values(v)))
        if k.kernel_stack >= 0:
            refs.kernel.add(k.kernel_stack)
    return refs


def read_stacks(table: Any, ids: Iterable[int], out: dict[int, tuple[int, ...]]) -> int:
    """Copy the stacks `ids` into `out`; the number of ids the map no longer holds."""
    missing = 0
    for sid in ids:
        try:
            out[sid] = tuple(table.walk(sid))
        except KeyError:
            missing += 1
    return missing


def read_dwarf_stacks(table: Any, hashes: Iterable[int], out: dict[int, tuple[int, ...]]) -> int:
    """Copy the DWARF stacks `hashes` (struct unwind_stack, zero after the last frame) into `out`
    under DWARF_STACK_ID_BASE + hash; the number the map no longer holds."""
    missing = 0
    for h in hashes:
        try:
            pcs = table[ctypes.c_uint64(h)].pcs
        except KeyError:
            missing += 1
            continue
        frames = []
        for pc in pcs:
            if pc == 0:
                break
            frames.append(pc)
        out[DWARF_STACK_ID_BASE + h] = tuple(frames)
    return missing


def take_dwarf_stacks(table: Any, wanted: Sequence[tuple[Iterable[int], dict[int, tuple[int, ...]]]]) -> int:
    """Empty a retired map of DWARF stacks in batches (take_all), copying the stacks each (hashes,
    out) of `wanted` names into its out under DWARF_STACK_ID_BASE + hash; the number of hashes the
    map no longer held. One read of the whole map, where a lookup per stack and then take_all to
    empty it read each one twice (a syscall and bcc's wrapping per stack)."""
    held = {k.value: v for k, v in take_all(table)}
    missing = 0
    for hashes, out in wanted:
        for h in hashes:
            stack = held.get(h)
            if stack is None:
                missing += 1
                continue
            pcs = list(stack.pcs)
            out[DWARF_STACK_ID_BASE + h] = tuple(pcs[: pcs.index(0)] if 0 in pcs else pcs)
    return missing


def delete_dwarf_stacks(table: Any, hashes: Iterable[int]) -> None:
    for h in hashes:
        with contextlib.suppress(KeyError):
            del table[ctypes.c_uint64(h)]


def stale_ids(present: Iterable[int], keep: set[int], last_used: dict[int, int], horizon: int) -> list[int]:
    """The ids of a stack map that may go: not in `keep` (still referred to) and not used by a drain
    since `horizon` (last_used: id → drain; an id it does not know counts as never used). They are
    dropped from last_used; the caller deletes them from the map."""
    stale = [i for i in present if i not in keep and last_used.get(i, -1) < horizon]
    for i in stale:
        last_used.pop(i, None)
    return stale


def delete_stacks(table: Any, ids: Iterable[int]) -> None:
    for sid in ids:
        with contextlib.suppress(KeyError):
            del table[ctypes.c_int(sid)]


class LostCounters:
    """Per-CPU loss counters in kernel → losses since the previous read, by reason."""

    def __init__(self, table: Any, reasons: Sequence[str]) -> None:
        self._table = table
        self._reasons = reasons
        self._seen = [0] * len(reasons)

    def delta(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i, reason in enumerate(self._reasons):
            total = sum(self._table[ctypes.c_int(i)])
            if total > self._seen[i]:
                out[reason] = total - self._seen[i]
            self._seen[i] = total
        return out
