"""The runtime reader's interpreter probe against files a container's root controls (issue 15, item 4).

- runtimes/elfsyms.py: a crafted 40 MB "python3.13" (16 MiB string table without
  a NUL, 1M symbols) is read within its time budget, never for hours.
- runtimes/cpython/version.py: in a chroot (a container's stand-in), the path the
  probe tries first inside the root is a FIFO, or an absolute symlink to a FIFO
  outside the root: the probe neither hangs nor leaves the root, and still finds
  the interpreter the process maps.
"""

from __future__ import annotations

import os
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimes.cpython import version as cpython_version
from runtimes.elfsyms import READ_SECONDS, ElfSymbolError, read_symbols
from runtimes.memory import ProcessMemory, ReadBudget
from runtimes.runtime import FileCache, ProcessContext
from tests.harness import WORKLOADS, stop_process, wait_for

SYMBOLS = 1_000_000
STRTAB = 16 << 20


def crafted_elf(path: Path) -> None:
    """ELF header, one PT_LOAD, and sections: null, .dynsym of SYMBOLS entries, a string table of 'A's."""
    ehdr = struct.Struct("<16sHHIQQQIHHHHHH")
    phdr = struct.Struct("<IIQQQQQQ")
    shdr = struct.Struct("<IIQQQQIIQQ")
    sym = struct.Struct("<IBBHQQ")
    phoff = ehdr.size
    syms_off = phoff + phdr.size
    str_off = syms_off + SYMBOLS * sym.size
    shoff = str_off + STRTAB
    with path.open("wb") as f:
        f.write(
            ehdr.pack(
                b"\x7fELF\x02\x01\x01" + bytes(9),
                3,
                62,
                1,
                0,
                phoff,
                shoff,
                0,
                ehdr.size,
                phdr.size,
                1,
                shdr.size,
                3,
                0,
            )
        )
        f.write(phdr.pack(1, 5, 0, 0, 0, 4096, 4096, 4096))
        f.write(b"".join(sym.pack((i * 4099) % (STRTAB - 1), 0x11, 0, 1, 0x1000 + i, 8) for i in range(SYMBOLS)))
        f.write(b"A" * STRTAB)
        f.write(shdr.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
        f.write(shdr.pack(1, 11, 2, 0, syms_off, SYMBOLS * sym.size, 2, 1, 8, sym.size))
        f.write(shdr.pack(9, 3, 2, 0, str_off, STRTAB, 0, 0, 1, 0))


def test_a_crafted_symbol_table_costs_at_most_the_time_budget(tmp_path: Path) -> None:
    path = tmp_path / "python3.13"
    crafted_elf(path)
    started = time.monotonic()
    with path.open("rb") as f:
        try:
            info = read_symbols(f, cpython_version.SYMBOLS)
            assert info.symbols == {}
        except ElfSymbolError as e:
            assert "took more than" in str(e)
    assert time.monotonic() - started < READ_SECONDS + 1.5


@pytest.fixture
def chrooted_python(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """fake_python (static) as ROOT/python3.13, run chrooted in ROOT: (process, ROOT)."""
    if os.geteuid() != 0:
        pytest.fail("chroot needs root (make test runs as root)")
    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(
        ["gcc", "-O0", "-static", "-o", str(root / "python3.13"), str(WORKLOADS / "fake_python.c")],
        check=True,
        timeout=120,
    )
    p = subprocess.Popen(["chroot", str(root), "/python3.13", "ok"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        wait_for("the chrooted interpreter", lambda: os.readlink(f"/proc/{p.pid}/exe") == str(root / "python3.13"))
        assert p.stdout is not None and b"tid" in p.stdout.readline()
        yield p, root
    finally:
        stop_process(p)


def probe(pid: int, fifo: Path) -> object:
    """detect() in a thread; a FIFO it would block on is opened for writing at the deadline to free it."""
    out: list[object] = []
    t = threading.Thread(
        target=lambda: out.append(
            cpython_version.detect(
                ProcessContext(pid, "/proc", ProcessMemory(pid, ReadBudget(1 << 20)), FileCache()),
                modern=True,
                legacy=True,
            )
        ),
        daemon=True,
    )
    t.start()
    t.join(10)
    hung = t.is_alive()
    if hung:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        t.join(10)
        os.close(fd)
    assert not hung, "the probe blocked on a FIFO"
    return out[0]


@pytest.mark.parametrize("plant", ["fifo", "symlink_out"])
@pytest.mark.needs_root
def test_the_probe_does_not_hang_on_a_fifo_or_follow_a_symlink_out_of_the_root(
    chrooted_python: tuple[subprocess.Popen, Path], tmp_path: Path, plant: str
) -> None:
    p, root = chrooted_python
    # maps shows the host's path ROOT/python3.13; inside the root that names ROOT/ROOT/python3.13
    planted = root / str(root).lstrip("/") / "python3.13"
    planted.parent.mkdir(parents=True)
    outside = tmp_path / "outside.fifo"
    os.mkfifo(outside)
    if plant == "fifo":
        os.mkfifo(planted)
        fifo = planted
    else:
        planted.symlink_to(outside)  # absolute: followed from the host's root by a plain open()
        fifo = outside
    got = probe(p.pid, fifo)
    assert isinstance(got, cpython_version.Target), got
    assert got.version.startswith("3.13")
