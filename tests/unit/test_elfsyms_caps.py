"""The runtime reader's symbol reading against crafted files: a fake libjvm.so with a huge .symtab (issue 40).

runtimes/elfsyms.py reads the symbol tables of whatever file a process maps under the interpreter's
name. Each crafted file here (tests/elf_builder.py) breaks one cap: a section header that claims a
table of 2^40 bytes; one 100,000-symbol table listed 2,000 times; tables over MAX_SYMBOL_BYTES; a read
over READ_SECONDS. Each is refused with the kind of the cap that fired (the reader counts refusals by
it), after reading a bounded number of bytes; the runtime contract's refusal carries the kind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO

import pytest

from runtimes import elfsyms
from runtimes.jvm import vmstructs
from runtimes.runtime import FileCache, Mapping, ProcessContext, Refusal, mapped_file_facts
from tests.elf_builder import symbol_table_elf

# Symbols of the table the tests list many times: 2.4 MB.
SYMBOLS = 100_000


class Counting:
    """A real file, with the bytes read from it counted."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.read_bytes = f, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.read_bytes += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def fileno(self) -> int:
        return self.f.fileno()


def read(path: Path) -> tuple[elfsyms.ElfInfo | elfsyms.ElfSymbolError, int, float]:
    """(what read_symbols gave for the JVM's names, or its error; bytes read; seconds)."""
    began = time.monotonic()
    with open(path, "rb") as f:
        counted = Counting(f)
        try:
            got: elfsyms.ElfInfo | elfsyms.ElfSymbolError = elfsyms.read_symbols(counted, vmstructs.SYMBOLS)  # type: ignore[arg-type]  # a file, counted
        except elfsyms.ElfSymbolError as e:
            got = e
    return got, counted.read_bytes, time.monotonic() - began


def test_a_section_header_claiming_a_huge_table_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "libjvm.so"
    path.write_bytes(symbol_table_elf(10, claimed_bytes=1 << 40))
    got, n, _ = read(path)
    assert isinstance(got, elfsyms.ElfSymbolError) and got.kind == "symbols_over_cap", got
    assert n < 4096, n


def test_one_table_listed_many_times_is_read_once(tmp_path: Path) -> None:
    # Given a file whose section headers list the same 100,000-symbol .symtab 2,000 times
    path = tmp_path / "libjvm.so"
    path.write_bytes(symbol_table_elf(SYMBOLS, tables=2000))
    # When its symbols are read
    got, n, took = read(path)
    # Then the table is read once (an ELF file has one .symtab): no error, about its size read, quickly
    assert isinstance(got, elfsyms.ElfInfo), got
    assert got.symbols == {}
    assert n < 2 * SYMBOLS * 24 + (1 << 20), n
    assert took < elfsyms.READ_SECONDS / 2, took


def test_tables_over_the_byte_cap_are_refused_before_they_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(elfsyms, "MAX_SYMBOL_BYTES", SYMBOLS * 24 // 2)
    path = tmp_path / "libjvm.so"
    path.write_bytes(symbol_table_elf(SYMBOLS))
    got, n, _ = read(path)
    assert isinstance(got, elfsyms.ElfSymbolError) and got.kind == "bytes_over_cap", got
    assert n < 4096, n


def test_a_read_over_its_time_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elfsyms, "READ_SECONDS", 0.0)
    path = tmp_path / "libjvm.so"
    path.write_bytes(symbol_table_elf(SYMBOLS))
    got, _, _ = read(path)
    assert isinstance(got, elfsyms.ElfSymbolError) and got.kind == "time", got


def test_the_refusal_names_the_cap_for_the_counters(tmp_path: Path) -> None:
    # Given a process mapping a libjvm.so whose section header claims a huge table (this process
    # stands in for it: the file is opened by the host's path with the mapped inode)
    path = tmp_path / "libjvm.so"
    path.write_bytes(symbol_table_elf(10, claimed_bytes=1 << 40))
    mod = Mapping(0x1000, 0x2000, "r-xp", 0, path.stat().st_ino, str(path))
    ctx = ProcessContext(1, str(tmp_path / "no-proc"), None, FileCache())  # type: ignore[arg-type]  # no memory read
    # When its facts are read / Then the refusal says why and carries the cap's kind
    got = mapped_file_facts(ctx, mod, "jvm", lambda f: elfsyms.read_symbols(f, vmstructs.SYMBOLS))
    assert isinstance(got, Refusal) and got.kind == "elf_symbols_over_cap", got
    assert "unreadable ELF file: " in got.reason and "symbols, more than" in got.reason, got.reason
