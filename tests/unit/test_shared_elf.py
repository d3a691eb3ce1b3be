"""shared/elf.py, the one bounded reader of hostile ELF files: what it reads of a real library, and the
kind of each refusal (the stages turn kinds into their own errors and counters)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from shared import elf
from tests.elf_builder import symbol_table_elf

LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")


def reader(data: bytes, max_bytes: int = 1 << 30) -> elf.Reader:
    return elf.Reader(io.BytesIO(data), max_bytes)


def kind_of(data: bytes, max_bytes: int = 1 << 30) -> str:
    try:
        r = reader(data, max_bytes)
        h = elf.read_header(r)
        elf.section_headers(r, h)
        elf.program_headers(r, h)
    except elf.ElfError as e:
        return e.kind
    return ""


def test_libc_headers_build_id_and_names() -> None:
    with open(LIBC, "rb") as f:
        r = elf.Reader(f, 1 << 30)
        h = elf.read_header(r)
        phdrs, shdrs = elf.program_headers(r, h), elf.section_headers(r, h)
        names = elf.section_names(r, h, shdrs, 1 << 20)
        assert h.e_type == elf.ET_DYN and h.e_machine in (elf.EM_X86_64, elf.EM_AARCH64)
        assert any(p.p_type == elf.PT_LOAD and p.p_flags & elf.PF_X for p in phdrs)
        assert b".eh_frame" in names and b".dynsym" in names
        assert len(elf.build_id(r, phdrs)) == 40  # a SHA-1


def test_each_refusal_has_its_kind() -> None:
    good = symbol_table_elf(4)
    assert kind_of(good) == ""
    assert kind_of(b"MZ\x90\x00" + good[4:]) == "not_elf"
    assert kind_of(good[:4] + b"\x01" + good[5:]) == "unsupported"  # 32-bit
    assert kind_of(good[:5] + b"\x02" + good[6:]) == "unsupported"  # big-endian
    assert kind_of(good[:4] + b"\x07" + good[5:]) == "malformed"  # no such class
    assert kind_of(good[:40]) == "malformed"  # a header cut short
    assert kind_of(good, max_bytes=len(good) - 1) == "file_over_cap"
    many = bytearray(good)
    many[0x38:0x3A] = (elf.MAX_PROGRAM_HEADERS + 1).to_bytes(2, "little")  # e_phnum
    assert kind_of(bytes(many)) == "over_cap"
    wrong = bytearray(good)
    wrong[0x3A:0x3C] = (elf.SHDR.size - 8).to_bytes(2, "little")  # e_shentsize
    assert kind_of(bytes(wrong)) == "malformed"


def test_a_symbol_table_reads_in_chunks_through_its_string_table() -> None:
    data = symbol_table_elf(10, name=b"spam")
    r = reader(data)
    h = elf.read_header(r)
    shdrs = elf.section_headers(r, h)
    (symtab,) = [sh for sh in shdrs if sh.sh_type == elf.SHT_SYMTAB]
    strings = elf.linked_strings(shdrs, symtab)
    table = elf.StringTable(r, strings.sh_offset, strings.sh_size, max_name=3, window=8)
    chunks = list(elf.symbol_chunks(r, symtab, 4))
    assert [len(c) // elf.SYM.size for c in chunks] == [4, 4, 2]
    entries = [e for c in chunks for e in elf.SYM.iter_unpack(c)]
    assert [table.name(e[0]) for e in entries[1:]] == [b"spa"] * 9  # cut to max_name
    with pytest.raises(elf.ElfError):
        table.name(strings.sh_size)


def test_a_note_running_past_its_segment_ends_the_walk() -> None:
    note = elf.NHDR.pack(4, 20, elf.NT_GNU_BUILD_ID) + b"GNU\0" + bytes(range(20))
    assert elf.note_build_id(note, 4) == bytes(range(20)).hex()
    assert elf.note_build_id(note[:-1], 4) == ""
    too_long = elf.NHDR.pack(4, elf.MAX_BUILD_ID_BYTES + 4, elf.NT_GNU_BUILD_ID) + b"GNU\0" + bytes(68)
    assert elf.note_build_id(too_long, 4) == ""


def test_caused_by_finds_the_budget_behind_a_wrapped_error() -> None:
    class Budget(Exception):
        pass

    try:
        try:
            raise Budget("took longer than 1s")
        except Budget as e:
            raise ValueError("wrapped") from e
    except ValueError as wrapped:
        found = elf.caused_by(wrapped, Budget)
    assert isinstance(found, Budget) and str(found) == "took longer than 1s"
    assert elf.caused_by(ValueError("alone"), Budget) is None
