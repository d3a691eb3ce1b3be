"""The collector's side of unwind tables, in real BPF maps: bounds checks, eviction, per-process entries.

Given the collector's programs compiled with a small row map (ROWS) and its
UnwindTables bound to a real unwind.sock, when answers built from this host's
libraries arrive over ZeroMQ as a symbolizer sends them, then: tables that
pass the bounds check are in unwind_rows byte for byte (for modules the
collector asked for); a process that maps
them gets its sorted mappings in unwind_procs; when the rows run out, the
least recently sampled module is evicted (counted) and the others stay; and
a table that fails the check, or a message that is not one, is a counted skip.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from collector import unwind
from collector.procfs import read_maps
from collector.programs import Programs
from shared import endpoints, unwind_table
from shared.stage_code import default_bpf_dir
from shared.wire import Process, Sample, StackBatch, UnwindTable, encode
from symbolizer import cfi
from tests.harness import require_root, wait_for

LIB = "/usr/lib/x86_64-linux-gnu"
LIBC, LIBSTDCXX, LIBM = f"{LIB}/libc.so.6", f"{LIB}/libstdc++.so.6", f"{LIB}/libm.so.6"
# libc (~28K rows) and libstdc++ (~34K) fit; libm (~6K) then needs one of them gone.
ROWS = 64_000


class Setup:
    def __init__(self, run_dir: Path) -> None:
        defines = {
            "COUNTS_ENTRIES": 1024,
            "STACK_ENTRIES": 1024,
            "START_ENTRIES": 1024,
            "OFFCPU_MIN_NS": 0,
            **unwind.bpf_defines(False),
            "UNWIND_ROWS": ROWS,
        }
        self.programs = Programs(default_bpf_dir(), ["oncpu"], defines)
        self.ctx = zmq.Context()
        self.tables = unwind.UnwindTables(
            self.programs.bpf, ["oncpu"], str(run_dir), self.ctx, rows=ROWS, max_table_rows=ROWS
        )
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(endpoints.unwind(str(run_dir)))

    def send(self, path: str, table: bytes | None = None) -> tuple[str, int]:
        """Sample this process in `path`, so the collector asks for its table, and answer as a symbolizer
        would; the module's (dev, inode) as /proc/<pid>/maps names it. (An answer nobody asked for is
        dropped: tests/integration/test_hostile_processes.py.)"""
        st = os.stat(path)
        key = (f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino)
        self.tables.annotate(me_sampled_in(path))
        assert key in self.tables._requested, f"the collector did not ask for {path}"
        if table is None:
            with open(path, "rb") as f:
                table = cfi.build_table(f).table
        self.push.send_multipart(encode(UnwindTable(key[0], key[1], path, "", "ok", table=table)))
        return key

    def settle(self, key: tuple[str, int]) -> None:
        def done() -> bool:
            self.tables.receive()
            return key in self.tables.modules or key in self.tables.unavailable

        wait_for(f"the collector to take the table of {key}", done, timeout=10)

    def rows_in_map(self, key: tuple[str, int]) -> bytes:
        m = self.tables.modules[key]
        leaf = self.programs.bpf["unwind_modules"][ctypes.c_int(m.slot)]
        assert (leaf.row_start, leaf.row_count) == (m.row_start, m.table.row_count)
        rows = self.programs.bpf["unwind_rows"]
        return b"".join(bytes(rows[ctypes.c_int(i)]) for i in range(m.row_start, m.row_start + leaf.row_count))

    def close(self) -> None:
        self.push.close()
        self.tables.close()
        self.programs.close()
        self.ctx.term()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    require_root()
    s = Setup(tmp_path)
    try:
        yield s
    finally:
        s.close()


def me_sampled_in(path: str) -> StackBatch:
    """A batch with one sample of this test process whose stack is one address inside `path`."""
    maps = read_maps(os.getpid())
    m = next(m for m in maps if m.path == os.path.realpath(path))
    me = Process(
        pid=os.getpid(),
        start_ticks=1,
        uid=0,
        nspid=os.getpid(),
        comm="pytest",
        executable="",
        service="test",
        mappings=maps,
    )
    return StackBatch(
        host="h",
        profile_type="cpu",
        sample_hz=99,
        time_ns=0,
        processes=(me,),
        user_stacks=((m.start + 16,),),
        kernel_stacks=(),
        samples=(Sample(me.pid, me.pid, 0, -1, 1, 1),),
    )


def test_a_table_is_loaded_byte_for_byte_and_a_process_gets_its_mapping(setup: Setup) -> None:
    # given libc's table, sent by a "symbolizer"
    key = setup.send(LIBC)
    setup.settle(key)
    # then its rows are in the map as built, and the module is not asked for
    table = setup.tables.modules[key].table
    assert setup.rows_in_map(key) == table.rows
    # when this process (which maps libc) is sampled in libc
    batch = setup.tables.annotate(me_sampled_in(LIBC))
    assert all((r.dev, r.inode) != key for r in batch.unwind_requests)
    # then its unwind_procs entry holds libc's executable mapping, biased for the rows
    entry = setup.programs.bpf["unwind_procs"][ctypes.c_uint32(os.getpid())]
    text = next(m for m in read_maps(os.getpid()) if m.path == LIBC)
    assert entry.count == 1
    e = entry.maps[0]
    assert (e.start, e.end, e.module) == (text.start, text.end, setup.tables.modules[key].slot)
    assert e.bias == unwind_table.bias(table, text.start, text.offset)
    assert e.span == table.header.span


def test_full_rows_evict_the_least_recently_sampled_module(setup: Setup) -> None:
    # given libc and libstdc++ loaded, and this process sampled in libc after both arrived
    libc, cxx = setup.send(LIBC), setup.send(LIBSTDCXX)
    setup.settle(libc)
    setup.settle(cxx)
    setup.tables.annotate(me_sampled_in(LIBC))
    libc_rows = setup.rows_in_map(libc)
    # when libm's table arrives and the rows are full
    m = setup.send(LIBM)
    setup.settle(m)
    # then libstdc++ (least recently sampled) was evicted and counted; libc stays, untouched
    assert setup.tables.stats["evicted"] == 1
    assert cxx not in setup.tables.modules and libc in setup.tables.modules and m in setup.tables.modules
    assert setup.rows_in_map(libc) == libc_rows
    assert setup.rows_in_map(m) == setup.tables.modules[m].table.rows
    # and once evicted, it is not asked for again at once (REQUEST_RETRY_S)
    assert cxx in setup.tables._requested


def test_a_table_that_fails_the_bounds_check_or_garbage_is_a_counted_skip(setup: Setup) -> None:
    # given a real table whose second row's pc goes backwards, and a message that is no message
    with open(LIBM, "rb") as f:
        good = bytearray(cfi.build_table(f).table)
    header = unwind_table.HEADER.size
    good[header + 16 : header + 20] = (0).to_bytes(4, "little")
    setup.push.send_multipart([b"not json", b"x"])
    key = setup.send(LIBM, bytes(good))
    setup.settle(key)
    # then nothing is loaded, the module is not asked for again, and both are counted
    assert key not in setup.tables.modules
    assert setup.tables.unavailable[key].startswith("rejected")
    assert setup.tables.stats["rejected"] == 2
    assert setup.tables.stats["loaded"] == 0
