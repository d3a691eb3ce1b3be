"""runtimes/memory.py on a real process (this one): reads, batched reads with failures among them, caps.

process_vm_readv of one's own pid needs no privilege, so these run anywhere.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import pytest

from runtimes.memory import (
    MAX_READ_BYTES,
    MemoryReadError,
    ProcessMemory,
    ReadBudget,
)

# An address no process maps: the first page above the zero page is never mapped here (mmap_min_addr).
UNMAPPED = 0x1000


def buffer(text: bytes) -> tuple[ctypes.Array, int]:
    buf = ctypes.create_string_buffer(text, len(text))
    return buf, ctypes.addressof(buf)


def test_read_many_returns_each_readable_range_and_none_for_the_others() -> None:
    # Given three buffers in this process and, between them, an unmapped range and a bad size
    (_a, pa), (_b, pb), (_c, pc) = buffer(b"alpha"), buffer(b"bravo!"), buffer(b"charlie")
    mem = ProcessMemory(os.getpid(), ReadBudget(1 << 20))
    # When they are read together
    got = mem.read_many([(pa, 5), (UNMAPPED, 8), (pb, 6), (pc, 0), (pc, 7)])
    # Then the readable ones come back whole, the unmapped one and the bad size as None, in
    # two system calls (the kernel stops at the unmapped range; the rest is read after it)
    assert got == [b"alpha", None, b"bravo!", None, b"charlie"]
    assert mem.reads == 2
    assert mem.budget.used == 5 + 8 + 6 + 7


def test_read_many_charges_the_budget_and_stops_when_it_is_spent() -> None:
    _a, pa = buffer(b"x" * 64)
    mem = ProcessMemory(os.getpid(), ReadBudget(100))
    assert mem.read_many([(pa, 64)]) == [b"x" * 64]
    with pytest.raises(MemoryReadError) as e:
        mem.read_many([(pa, 64)])
    assert e.value.reason == "budget"


def test_reads_of_a_process_that_is_gone_say_so() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    mem = ProcessMemory(p.pid, ReadBudget(1 << 20))
    with pytest.raises(MemoryReadError) as e:
        mem.read_many([(0x400000, 8)])
    assert e.value.reason == "gone"
    with pytest.raises(MemoryReadError) as e:
        mem.read(0x400000, 8)
    assert e.value.reason == "gone"


def test_a_read_larger_than_the_cap_is_refused_before_any_system_call() -> None:
    _a, pa = buffer(b"y")
    mem = ProcessMemory(os.getpid(), ReadBudget(1 << 30))
    with pytest.raises(MemoryReadError) as e:
        mem.read(pa, MAX_READ_BYTES + 1)
    assert e.value.reason == "too_large" and mem.reads == 0
    assert mem.read_many([(pa, MAX_READ_BYTES + 1)]) == [None] and mem.reads == 0


def guarded_pages() -> tuple[mmap.mmap, int, int]:
    """Three anonymous pages of this process, the first made unreadable (PROT_NONE), the other two filled
    with their page number and offset: (the mapping, its address, the page size)."""
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 3 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    for i in range(3 * page // 4):
        m[i * 4 : i * 4 + 4] = (i * 4).to_bytes(4, "little")
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base), ctypes.c_size_t(page), 0) == 0, os.strerror(ctypes.get_errno())
    return m, base, page


def test_read_window_reads_below_an_address_down_to_the_first_unreadable_page() -> None:
    # Given three pages whose first may not be read
    m, base, page = guarded_pages()
    mem = ProcessMemory(os.getpid(), ReadBudget(1 << 20))
    # When 16 bytes in the third page are read with 8 KiB below them, in one system call
    at = base + 2 * page + 100
    start, data = mem.read_window(at, 16, 2 * page)
    # Then the window runs from the second page's start to the end of the 16 bytes: the unreadable
    # page only shortened it; its bytes are the memory's, in order
    assert mem.reads == 1
    assert start == base + page and len(data) == page + 100 + 16
    assert data[:4] == page.to_bytes(4, "little") and data[-16:-12] == (2 * page + 100).to_bytes(4, "little")
    # and with nothing below allowed, it is a plain read
    assert mem.read_window(at, 16, 0) == (at, mem.read(at, 16))
    del data
    m.close()


def test_read_window_fails_as_read_does_when_the_address_itself_is_unreadable() -> None:
    m, base, page = guarded_pages()
    mem = ProcessMemory(os.getpid(), ReadBudget(1 << 20))
    with pytest.raises(MemoryReadError) as e:
        mem.read_window(base + 8, 8, page)
    assert e.value.reason == "unmapped"
    with pytest.raises(MemoryReadError) as e:
        mem.read_window(base + page, 8, MAX_READ_BYTES)
    assert e.value.reason == "too_large"
    m.close()
