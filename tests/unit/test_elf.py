"""ELF symbols and build ids (symbolizer/elf.py) and the parse time budget (symbolizer/limits.py).

Fixtures are real binaries gcc builds from tests/fixtures/symbols.c; expected
answers come from binutils (nm, readelf), or from pyelftools' own plain API on
well-formed files, never from the code under test.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from types import FrameType
from typing import BinaryIO

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from elftools.elf.segments import NoteSegment

from symbolizer import elf
from symbolizer.elf import ElfCache, ElfError, ElfSymbols, read_elf
from symbolizer.files import ProcessGone
from symbolizer.limits import BudgetExceeded, time_budget
from tests.harness import vaddr_to_offset

FIXTURE_C = Path(__file__).parent.parent / "fixtures" / "symbols.c"
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
FUNCTIONS = ("fixture_alpha", "fixture_beta", "fixture_gamma", "fixture_local")

# name -> extra gcc flags; "based_shared" gives a shared library whose offsets differ from its addresses.
BUILDS = {
    "pie": ["-pie", "-fPIE"],
    "nopie": ["-no-pie", "-fno-pie"],
    "shared": ["-shared", "-fPIC"],
    "based_shared": ["-shared", "-fPIC", "-Wl,-Ttext-segment=0x10000"],
    "no_build_id": ["-Wl,--build-id=none"],
}


@pytest.fixture(scope="session")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the ELF fixtures")
    out = tmp_path_factory.mktemp("elf")
    built = {}
    for name, flags in BUILDS.items():
        built[name] = out / name
        subprocess.run(["gcc", "-O1", "-g0", *flags, "-o", str(built[name]), str(FIXTURE_C)], check=True)
    built["stripped_shared"] = out / "stripped_shared"
    subprocess.run(["strip", "--strip-all", "-o", str(built["stripped_shared"]), str(built["shared"])], check=True)
    built["renamed_shared"] = out / "renamed_shared"  # .symtab says symtab_alpha, .dynsym still fixture_alpha
    subprocess.run(
        ["objcopy", "--redefine-sym", "fixture_alpha=symtab_alpha", str(built["shared"]), str(built["renamed_shared"])],
        check=True,
    )
    return built


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def nm_functions(path: Path, dynamic: bool = False) -> dict[int, tuple[int, set[str]]]:
    """vaddr -> (size, names) of the defined text symbols nm lists."""
    found: dict[int, tuple[int, set[str]]] = {}
    for line in run("nm", "-S", "--defined-only", *(["-D"] if dynamic else []), str(path)).splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "TtWiI":
            vaddr, size = int(parts[0], 16), int(parts[1], 16)
            found.setdefault(vaddr, (size, set()))[1].add(parts[3].split("@")[0])
    return found


def readelf_build_id(path: Path) -> str:
    m = re.search(r"Build ID: ([0-9a-f]+)", run("readelf", "-n", str(path)))
    return m[1] if m else ""


def parse(path: Path) -> ElfSymbols:
    with open(path, "rb") as f:
        return read_elf(f)


# --- build ids ---------------------------------------------------------------


@pytest.mark.parametrize("build", ["pie", "nopie", "shared", "based_shared"])
def test_build_id_is_what_readelf_prints(binaries: dict[str, Path], build: str) -> None:
    # Given a binary linked with the default GNU build id note
    expected = readelf_build_id(binaries[build])
    assert len(expected) == 40
    # When it is read / Then the build id is readelf's, as lowercase hex
    assert parse(binaries[build]).build_id == expected


def test_binary_without_build_id_reads_with_empty_build_id(binaries: dict[str, Path]) -> None:
    # Given a binary linked with --build-id=none
    assert readelf_build_id(binaries["no_build_id"]) == ""
    # When it is read / Then it parses, with build id "" and its symbols
    symbols = parse(binaries["no_build_id"])
    assert symbols.build_id == ""
    (vaddr,) = [v for v, (_, names) in nm_functions(binaries["no_build_id"]).items() if "fixture_beta" in names]
    assert symbols.function_at(vaddr_to_offset(binaries["no_build_id"], vaddr)) == "fixture_beta"


def test_libc_build_id(binaries: dict[str, Path]) -> None:
    # Given the system libc / When read / Then its build id is readelf's
    assert parse(LIBC).build_id == readelf_build_id(LIBC)


# --- function_at ---------------------------------------------------------------


@pytest.mark.parametrize("build", ["pie", "nopie", "shared", "based_shared"])
def test_function_at_resolves_every_byte_of_each_function(binaries: dict[str, Path], build: str) -> None:
    # Given a binary and, from nm and readelf, the file offsets of its functions
    path = binaries[build]
    by_name = {name: (vaddr, size) for vaddr, (size, names) in nm_functions(path).items() for name in names}
    symbols = parse(path)
    for name in FUNCTIONS:
        vaddr, size = by_name[name]
        assert size > 0
        # When first, middle and last byte are looked up / Then each is the function
        for inside in (vaddr, vaddr + size // 2, vaddr + size - 1):
            assert symbols.function_at(vaddr_to_offset(path, inside)) == name, (name, hex(inside))


def test_translation_uses_program_headers_not_identity(binaries: dict[str, Path]) -> None:
    # Given builds whose text addresses differ from their file offsets
    for build in ("nopie", "based_shared"):
        path = binaries[build]
        (vaddr,) = [v for v, (_, names) in nm_functions(path).items() if "fixture_gamma" in names]
        offset = vaddr_to_offset(path, vaddr)
        assert offset != vaddr
        # When looked up by file offset / Then the function is found; by raw address it is not
        assert parse(path).function_at(offset) == "fixture_gamma"
        assert parse(path).function_at(vaddr) != "fixture_gamma"


@pytest.mark.parametrize("build", ["pie", "nopie", "shared"])
def test_offsets_outside_functions_are_none(binaries: dict[str, Path], build: str) -> None:
    # Given a binary
    path = binaries[build]
    symbols = parse(path)
    # When the ELF header, a negative offset or offsets past the end are looked up / Then None
    for offset in (0, 0x10, -1, path.stat().st_size, 1 << 40):
        assert symbols.function_at(offset) is None, offset


def test_stripped_library_resolves_exported_functions_from_dynsym(binaries: dict[str, Path]) -> None:
    # Given a shared library stripped of .symtab, so only .dynsym is left
    path, full = binaries["stripped_shared"], binaries["shared"]
    assert "fixture_local" not in {n for _, names in nm_functions(path, dynamic=True).values() for n in names}
    by_name = {name: vaddr for vaddr, (_, names) in nm_functions(full).items() for name in names}
    symbols = parse(path)
    # When its functions are looked up / Then exported ones resolve, the static one does not
    for name in ("fixture_alpha", "fixture_beta", "fixture_gamma"):
        assert symbols.function_at(vaddr_to_offset(path, by_name[name])) == name
    assert symbols.function_at(vaddr_to_offset(path, by_name["fixture_local"])) is None


def test_has_symtab_says_whether_a_symtab_gave_names(binaries: dict[str, Path]) -> None:
    # Given a library with a .symtab, the same stripped to .dynsym, and Debian's libc (.dynsym only)
    assert "symtab" in run("readelf", "-SW", str(binaries["shared"]))
    assert "symtab" not in run("readelf", "-SW", str(LIBC))
    # When read / Then has_symtab tells them apart
    assert parse(binaries["shared"]).has_symtab
    assert not parse(binaries["stripped_shared"]).has_symtab
    assert not parse(LIBC).has_symtab


def test_a_separate_debug_file_names_its_stripped_module_at_the_module_addresses(
    binaries: dict[str, Path], tmp_path: Path
) -> None:
    # Given a library whose file offsets differ from its addresses, stripped, and its
    # separate debug file (objcopy --only-keep-debug: .symtab kept, code SHT_NOBITS)
    full, stripped = binaries["based_shared"], tmp_path / "stripped"
    debug_path = tmp_path / "lib.debug"
    run("objcopy", "--only-keep-debug", str(full), str(debug_path))
    run("strip", "--strip-all", "-o", str(stripped), str(full))
    (vaddr,) = [v for v, (_, names) in nm_functions(full).items() if "fixture_local" in names]
    offset = vaddr_to_offset(stripped, vaddr)
    module, debug = parse(stripped), parse(debug_path)
    # When the debug file is read / Then it has the module's build id and addresses, and a .symtab
    assert debug.build_id == module.build_id == readelf_build_id(full)
    assert debug.has_symtab and module.loads_like(debug)
    # and the static function, unnamed by the module, is named at the module's address of its offset
    assert module.function_at(offset) is None
    assert module.address_of(offset) == vaddr
    assert debug.function_at_address(vaddr) == "fixture_local"
    # but not by the debug file's own offsets: its code has no file bytes
    assert debug.function_at(offset) is None


def test_symtab_name_is_preferred_over_dynsym(binaries: dict[str, Path]) -> None:
    # Given a library whose .symtab and .dynsym name the same function differently
    path = binaries["renamed_shared"]
    (vaddr,) = [v for v, (_, names) in nm_functions(path).items() if "symtab_alpha" in names]
    assert nm_functions(path, dynamic=True)[vaddr][1] == {"fixture_alpha"}
    # When it is looked up / Then the .symtab name wins
    assert parse(path).function_at(vaddr_to_offset(path, vaddr)) == "symtab_alpha"


def test_libc_qsort(binaries: dict[str, Path]) -> None:
    # Given libc's qsort address and its aliases, from nm -D
    dynamic = nm_functions(LIBC, dynamic=True)
    (vaddr,) = [v for v, (_, names) in dynamic.items() if "qsort" in names]
    size, aliases = dynamic[vaddr]
    symbols = parse(LIBC)
    # When its first and last byte are looked up by file offset / Then the name is qsort or an alias
    for inside in (vaddr, vaddr + size - 1):
        name = symbols.function_at(vaddr_to_offset(LIBC, inside))
        assert name in aliases and "qsort" in aliases, (name, aliases)


# --- hostile files ---------------------------------------------------------------


def scribble(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def symtab_header_offset(data: bytes) -> int:
    """File offset of the .symtab section header (from the ELF header, as readelf reads it)."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    (shnum,) = struct.unpack_from("<H", data, 0x3C)
    for i in range(shnum):
        if struct.unpack_from("<I", data, shoff + i * 64 + 4)[0] == 2:  # SHT_SYMTAB
            return shoff + i * 64
    raise AssertionError("no .symtab")


def hostile_files(binaries: dict[str, Path]) -> dict[str, bytes]:
    pie = binaries["pie"].read_bytes()
    rng = random.Random(1)
    symtab = symtab_header_offset(pie)
    return {
        "empty": b"",
        "not_elf": FIXTURE_C.read_bytes(),
        "magic_only": b"\x7fELF",
        "first_100_bytes": pie[:100],
        "first_4_KiB": pie[:4096],
        "random_after_magic": b"\x7fELF" + rng.randbytes(8192),
        "random_after_valid_ident": b"\x7fELF\x02\x01\x01" + bytes(9) + b"\x03\x00" + rng.randbytes(8192),
        "elf32": pie[:4] + b"\x01" + pie[5:],
        "relocatable_type": scribble(pie, 0x10, "<H", 1),
        "shoff_huge": scribble(pie, 0x28, "<Q", 0xFFFF_FFFF_FFFF_0000),
        "shoff_near_end": scribble(pie, 0x28, "<Q", len(pie) - 10),
        "shnum_max": scribble(pie, 0x3C, "<H", 0xFFFF),
        "shnum_past_end": scribble(pie, 0x3C, "<H", 4000),
        "phnum_max": scribble(pie, 0x38, "<H", 0xFFFF),
        "phoff_huge": scribble(pie, 0x20, "<Q", 1 << 62),
        "symtab_size_huge": scribble(pie, symtab + 0x20, "<Q", 1 << 40),
        "symtab_entsize_zero": scribble(pie, symtab + 0x38, "<Q", 0),
        "symtab_link_not_strtab": scribble(pie, symtab + 0x28, "<I", 0),
        "symtab_link_out_of_range": scribble(pie, symtab + 0x28, "<I", 60000),
    }


HOSTILE = [
    "empty",
    "not_elf",
    "magic_only",
    "first_100_bytes",
    "first_4_KiB",
    "random_after_magic",
    "random_after_valid_ident",
    "elf32",
    "relocatable_type",
    "shoff_huge",
    "shoff_near_end",
    "shnum_max",
    "shnum_past_end",
    "phnum_max",
    "phoff_huge",
    "symtab_size_huge",
    "symtab_entsize_zero",
    "symtab_link_not_strtab",
    "symtab_link_out_of_range",
]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_file_is_elf_error_quickly(binaries: dict[str, Path], tmp_path: Path, case: str) -> None:
    # Given a malformed file
    path = tmp_path / case
    path.write_bytes(hostile_files(binaries)[case])
    # When it is read / Then ElfError, and nothing else, well within a second
    started = time.monotonic()
    with pytest.raises(ElfError) as raised:
        parse(path)
    assert time.monotonic() - started < 1.0
    assert str(raised.value)


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_file_is_skipped_logged_and_cached(
    binaries: dict[str, Path], tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a malformed file behind an ElfCache
    path = tmp_path / case
    path.write_bytes(hostile_files(binaries)[case])
    cache, opened = ElfCache(), []

    def opener() -> BinaryIO:
        opened.append(path)
        return open(path, "rb")

    # When it is asked for twice
    with caplog.at_level(logging.WARNING, logger=elf.__name__):
        first = cache.get(("dev", case), opener)
        second = cache.get(("dev", case), opener)
    # Then it is None both times, opened once, counted once and logged once with key and reason
    assert first is None and second is None
    assert len(opened) == 1
    assert cache.stats["skipped"] == 1 and cache.stats["parsed"] == 0 and cache.stats["hits"] == 1
    warnings = [r for r in caplog.records if r.name == elf.__name__]
    # the log line is the feature: a skipped file is logged once with its key and reason (the count is above)
    assert len(warnings) == 1 and case in warnings[0].getMessage()


def test_randomly_corrupted_binaries_never_raise_anything_but_elf_error(binaries: dict[str, Path]) -> None:
    # Given 300 copies of a real binary with a few random bytes overwritten, mostly in the headers
    pie = binaries["pie"].read_bytes()
    (shoff,) = struct.unpack_from("<Q", pie, 0x28)
    rng = random.Random(7)
    started = time.monotonic()
    outcomes = {"parsed": 0, "error": 0}
    for _ in range(300):
        data = bytearray(pie)
        for _ in range(rng.randint(1, 8)):
            where = rng.choice(
                (
                    rng.randrange(0x40),
                    rng.randrange(0x40, 0x400),
                    rng.randrange(shoff, len(pie)),
                    rng.randrange(len(pie)),
                )
            )
            data[where] = rng.randrange(256)
        # When each is read / Then it parses or is ElfError; anything else fails the test
        try:
            read_elf(BytesIO(bytes(data)))
            outcomes["parsed"] += 1
        except ElfError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0
    assert time.monotonic() - started < 10.0


# --- bounded reads -----------------------------------------------------------------

# The largest single read the parser makes: the section header table at its cap (256 KiB).
LARGEST_READ = elf.MAX_SECTION_HEADERS * 64


class RecordingFile(BytesIO):
    """A file that records the size of every read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.reads: list[int | None] = []

    def read(self, size: int | None = -1) -> bytes:
        self.reads.append(size)
        return super().read(size)


def assert_reads_bounded(f: RecordingFile) -> None:
    assert f.reads
    assert all(size is not None and 0 <= size <= LARGEST_READ for size in f.reads), max(f.reads, key=str)


def section_header_offset(data: bytes, index: int) -> int:
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    return shoff + index * 64


_U64_MAX = (1 << 64) - 1


def usable_files(binaries: dict[str, Path]) -> dict[str, bytes]:
    """Malformed in ways pyelftools' convenience API would follow; each still has readable symbols."""
    pie = binaries["pie"].read_bytes()
    (shstrndx,) = struct.unpack_from("<H", pie, 0x3E)
    # Section names are never read: point .shstrtab at 4 MiB without a NUL, appended at the end.
    unterminated = scribble(pie, section_header_offset(pie, shstrndx) + 0x18, "<Q", len(pie))
    unterminated = scribble(unterminated, section_header_offset(pie, shstrndx) + 0x20, "<Q", 4 << 20)
    build_id_note = pie.index(struct.pack("<III", 4, 20, 3) + b"GNU\0")
    return {
        "section_names_unterminated": unterminated + b"A" * (4 << 20),
        "build_id_descsz_huge": scribble(pie, build_id_note + 4, "<I", 0xFFFF_FFF0),
        # e_shnum 0 means "count in section 0's sh_size": read as no sections, not as 2^64 of them.
        "extended_section_count": scribble(
            scribble(pie, 0x3C, "<H", 0), section_header_offset(pie, 0) + 0x20, "<Q", _U64_MAX
        ),
    }


@pytest.mark.parametrize("build", ["pie", "shared", "stripped_shared"])
def test_well_formed_binaries_are_read_in_bounded_pieces(binaries: dict[str, Path], build: str) -> None:
    # Given a well-formed binary / When read
    f = RecordingFile(binaries[build].read_bytes())
    read_elf(f)
    # Then every read asked for an explicit size no larger than the biggest table
    assert_reads_bounded(f)


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_files_are_read_in_bounded_pieces(binaries: dict[str, Path], case: str) -> None:
    # Given a malformed file / When read
    f = RecordingFile(hostile_files(binaries)[case])
    with pytest.raises(ElfError):
        read_elf(f)
    # Then no read was unbounded or larger than the biggest table
    if case != "empty":
        assert_reads_bounded(f)


@pytest.mark.parametrize("case", ["section_names_unterminated", "build_id_descsz_huge", "extended_section_count"])
def test_malformed_but_usable_files_parse_in_bounded_reads(binaries: dict[str, Path], case: str) -> None:
    # Given a binary with a trap for readers that follow sizes or strings the file claims
    data = usable_files(binaries)[case]
    path = binaries["pie"]
    (vaddr,) = [v for v, (_, names) in nm_functions(path).items() if "fixture_beta" in names]
    f = RecordingFile(data)
    # When it is read
    started = time.monotonic()
    symbols = read_elf(f)
    # Then quickly, in bounded reads, touching a fraction of the file
    assert time.monotonic() - started < 1.0
    assert_reads_bounded(f)
    assert sum(size for size in f.reads if size is not None) < 256 << 10
    # And what the trap does not touch is still read
    if case == "extended_section_count":
        assert symbols.build_id == readelf_build_id(path)
        assert symbols.function_at(vaddr_to_offset(path, vaddr)) is None
    else:
        expected_id = "" if case == "build_id_descsz_huge" else readelf_build_id(path)
        assert symbols.build_id == expected_id
        assert symbols.function_at(vaddr_to_offset(path, vaddr)) == "fixture_beta"


# --- agreement with pyelftools' plain API ----------------------------------------------


def pyelftools_view(path: Path) -> tuple[str, dict[int, set[str]], list[tuple[int, int, int]]]:
    """Build id, defined function symbols (vaddr -> names) and PT_LOADs, as pyelftools' plain API reads them."""
    with open(path, "rb") as f:
        e = ELFFile(f)
        build_id = next(
            (
                n.n_desc
                for seg in e.iter_segments("PT_NOTE")
                if isinstance(seg, NoteSegment)
                for n in seg.iter_notes()
                if n.n_type == "NT_GNU_BUILD_ID"
            ),
            "",
        )
        functions: dict[int, set[str]] = {}
        for section in e.iter_sections():
            if section["sh_type"] in ("SHT_SYMTAB", "SHT_DYNSYM"):
                assert isinstance(section, SymbolTableSection)
                for sym in section.iter_symbols():
                    if (
                        sym["st_info"]["type"] in ("STT_FUNC", "STT_LOOS")
                        and sym["st_shndx"] != "SHN_UNDEF"
                        and sym["st_value"]
                        and sym.name
                    ):
                        functions.setdefault(sym["st_value"], set()).add(sym.name)
        loads = [(s["p_offset"], s["p_vaddr"], s["p_filesz"]) for s in e.iter_segments("PT_LOAD")]
    return build_id, functions, loads


@pytest.mark.parametrize("build", ["pie", "nopie", "shared", "based_shared", "stripped_shared", "libc"])
def test_agrees_with_pyelftools_plain_api_on_well_formed_files(binaries: dict[str, Path], build: str) -> None:
    # Given a well-formed binary and what pyelftools' convenience API reads from it
    path = LIBC if build == "libc" else binaries[build]
    build_id, functions, loads = pyelftools_view(path)
    assert functions
    # When it is read
    symbols = parse(path)
    # Then the build id is the same, and each function start resolves to one of its names there
    assert symbols.build_id == build_id
    for vaddr, names in functions.items():
        (offset,) = [o + vaddr - v for o, v, size in loads if v <= vaddr < v + size]
        assert symbols.function_at(offset) in names, (hex(vaddr), names)


def test_budget_expiring_inside_a_read_is_reported_as_over_budget() -> None:
    # Given a file whose read of the ELF header (64 bytes, in shared/elf.py) is where the budget runs out
    class SlowFile(BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            if size == 64:  # and what caught it raised something else (as construct did)
                raise ValueError("wrapped") from BudgetExceeded("took longer than 5s")
            return super().read(size)

    # When it is read / Then ElfError says it took too long, and only that, though it came wrapped
    with pytest.raises(ElfError) as raised:
        read_elf(SlowFile(LIBC.read_bytes()[:4096]))
    assert str(raised.value) == "took longer than 5s"


def test_parse_over_budget_is_elf_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a budget far below what parsing libc takes
    monkeypatch.setattr(elf, "ELF_PARSE_SECONDS", 1e-4)
    # When libc is read / Then ElfError says it took too long
    with pytest.raises(ElfError, match="took longer than"):
        parse(LIBC)


def test_file_larger_than_cap_is_elf_error(tmp_path: Path) -> None:
    # Given a sparse file one byte over MAX_FILE_BYTES that starts like our binaries
    path = tmp_path / "huge"
    with open(path, "wb") as f:
        f.write(LIBC.read_bytes()[:4096])
        f.truncate(elf.MAX_FILE_BYTES + 1)
    # When it is read / Then ElfError names the size, without reading it
    with pytest.raises(ElfError, match="larger than"):
        parse(path)


# --- ElfCache --------------------------------------------------------------------


def test_cache_hit_does_not_open_again(binaries: dict[str, Path]) -> None:
    # Given an ElfCache that has read a binary once
    cache, opened = ElfCache(), []

    def opener() -> BinaryIO:
        opened.append(1)
        return open(binaries["pie"], "rb")

    first = cache.get("pie", opener)
    # When the same key is asked for again / Then the same symbols come back without opening the file
    assert cache.get("pie", opener) is first
    assert first is not None and first.build_id == readelf_build_id(binaries["pie"])
    assert len(opened) == 1
    assert cache.stats["parsed"] == 1 and cache.stats["hits"] == 1


def test_a_file_the_check_rejects_is_cached_counted_and_logged_once(
    binaries: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    # Given a check that refuses every build id but one the file does not have
    cache, opened = ElfCache(), []

    def opener() -> BinaryIO:
        opened.append(1)
        return open(binaries["pie"], "rb")

    def check(symbols: ElfSymbols) -> str:
        return "" if symbols.build_id == "00" else f"build id {symbols.build_id}, not 00"

    # When it is asked for three times
    with caplog.at_level(logging.WARNING, logger=elf.__name__):
        results = [cache.get("debug", opener, check=check) for _ in range(3)]
    # Then it is unusable each time, parsed once, counted once and logged once, with the reason
    assert results == [None, None, None] and len(opened) == 1
    assert cache.stats["rejected"] == 1 and cache.stats["parsed"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == elf.__name__]
    # the log line is the feature: a rejected file is logged once with the reason (the count is above)
    assert len(warnings) == 1 and "not 00" in warnings[0]


def test_cache_is_a_bounded_lru(binaries: dict[str, Path]) -> None:
    # Given a cache of two entries holding a and b, with a used last
    cache = ElfCache(max_entries=2)
    opens: list[str] = []

    def opener(name: str) -> Callable[[], BinaryIO]:
        def open_it() -> BinaryIO:
            opens.append(name)
            return open(binaries[name], "rb")

        return open_it

    cache.get("pie", opener("pie"))
    cache.get("nopie", opener("nopie"))
    cache.get("pie", opener("pie"))
    # When a third key is added
    cache.get("shared", opener("shared"))
    # Then the least recently used (nopie) was evicted, pie was kept
    assert cache.stats["evicted"] == 1
    cache.get("pie", opener("pie"))
    cache.get("nopie", opener("nopie"))
    assert opens == ["pie", "nopie", "shared", "nopie"]


def test_unreadable_file_is_retried_after_a_while(binaries: dict[str, Path]) -> None:
    # Given an opener that fails the first time (the fd went away), then works
    cache, calls = ElfCache(), []

    def opener() -> BinaryIO:
        calls.append(1)
        if len(calls) == 1:
            raise PermissionError("denied")
        return open(binaries["pie"], "rb")

    # When asked at t=0, t=1 and after UNREADABLE_RETRY_S
    assert cache.get("k", opener, now=0.0) is None
    assert cache.get("k", opener, now=1.0) is None
    later = cache.get("k", opener, now=elf.UNREADABLE_RETRY_S + 1)
    # Then it is counted unreadable once, not retried at once, and read after the wait
    assert cache.stats["unreadable"] == 1 and cache.stats["skipped"] == 0
    assert len(calls) == 2
    assert later is not None and later.function_at(0) is None


def test_a_file_asked_for_through_an_exited_process_is_not_remembered(binaries: dict[str, Path]) -> None:
    # Given the file broker's answer that the process a frame came from has exited
    cache, calls = ElfCache(), []

    def opener() -> BinaryIO:
        calls.append(1)
        if len(calls) == 1:
            raise ProcessGone("process 4242 is gone")
        return open(binaries["pie"], "rb")

    # When the next process that maps the same file asks a moment later
    assert cache.get("k", opener, now=0.0) is None
    later = cache.get("k", opener, now=0.1)
    # Then the file is opened for it (a short-lived process must not hide libc's names for a minute)
    assert len(calls) == 2 and later is not None


# --- time_budget ---------------------------------------------------------------


def test_time_budget_interrupts_a_long_block_and_restores_the_handler() -> None:
    # Given a handler already installed for SIGALRM
    def previous(signum: int, frame: FrameType | None) -> None:
        pass

    old = signal.signal(signal.SIGALRM, previous)
    try:
        # When a busy loop runs under a 50 ms budget
        started = time.monotonic()
        with pytest.raises(BudgetExceeded), time_budget(0.05):
            while True:
                pass
        # Then it is interrupted promptly, the handler is back and no timer is left
        assert time.monotonic() - started < 1.0
        assert signal.getsignal(signal.SIGALRM) is previous
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, old)


def test_time_budget_restores_an_outer_timer() -> None:
    # Given an outer 30 s timer / When a short block runs under its own budget
    old = signal.signal(signal.SIGALRM, lambda s, f: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        with time_budget(5.0):
            pass
        # Then the outer timer is still pending with about its remaining time
        assert 29.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_time_budget_outside_main_thread_runs_without_budget() -> None:
    # Given a worker thread / When it runs a block longer than its budget
    result: list[str] = []

    def work() -> None:
        with time_budget(0.01):
            time.sleep(0.05)
        result.append("done")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    # Then the block completes and no timer was set
    assert result == ["done"]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_long_symbol_names_are_cut_to_the_cap(binaries: dict[str, Path], tmp_path: Path) -> None:
    # Given a library whose .symtab names fixture_beta with 3000 characters
    long_name = "n" * 3000
    path = tmp_path / "long_name.so"
    subprocess.run(
        ["objcopy", f"--redefine-sym=fixture_beta={long_name}", str(binaries["shared"]), str(path)], check=True
    )
    (vaddr,) = [v for v, (_, names) in nm_functions(path).items() if long_name in names]
    # When it is looked up / Then the name is cut to MAX_SYMBOL_NAME_BYTES
    assert parse(path).function_at(vaddr_to_offset(path, vaddr)) == long_name[: elf.MAX_SYMBOL_NAME_BYTES]
