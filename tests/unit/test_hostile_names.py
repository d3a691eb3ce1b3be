"""Control bytes in symbol names (issue 40, case 5): they never reach a terminal or forge a line.

A profiled process names its functions (its ELF symbols, its perf map). The symbolizer makes each
name a string by the process-string rule (shared/safestr.process_string); the folded writer and
the top table `record` prints write every name through shared/safestr.printable, so a pprof from
anywhere (one handed to `ebpfprofiler report`) cannot either.
"""

from __future__ import annotations

import shutil
import subprocess
from io import BytesIO
from pathlib import Path

import pytest

from report import profiles
from shared import pprof
from shared.safestr import printable, process_string, unescape
from symbolizer import perfmap
from symbolizer.elf import read_elf
from tests.harness import vaddr_to_offset

FIXTURE_C = Path(__file__).parent.parent / "fixtures" / "symbols.c"
# Clears root's screen, then forges a table row and a folded line of its own.
FORGED = "\x1b[2J\x1b[H\n    99.0s  99.0%     99.0s  99.0%  forged\rx;y 1000000\n\x9b31m\u2028\u202e"
PERIOD = 10_000_000


def raw_controls(text: str) -> list[str]:
    """The characters of `text` a terminal acts on, or that break a line, but the newlines kept."""
    return [
        c
        for c in text
        if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029\u202a\u202b\u202c\u202d\u202e")
    ]


def profile_of(path: Path, stacks: dict[tuple[str, ...], int]) -> list[profiles.Loaded]:
    b = pprof.ProfileBuilder(
        [("samples", "count"), ("cpu", "nanoseconds")],
        ("cpu", "nanoseconds"),
        PERIOD,
        1_700_000_000_000_000_000,
        2_000_000_000,
    )
    m = b.mapping("exe", "/usr/bin/a", "abc")
    for stack, n in stacks.items():
        locs = [b.location((name,), m, 0x1000 + i, [b.function(name)]) for i, name in enumerate(stack)]
        b.sample(list(reversed(locs)), [n, n * PERIOD], {"process.executable": "/usr/bin/a", "pid": "1"})
    path.write_bytes(b.gzipped())
    return profiles.load([str(path)])


def test_an_elf_symbol_with_control_bytes_reaches_neither_table_nor_folded_raw(tmp_path: Path) -> None:
    if shutil.which("gcc") is None or shutil.which("objcopy") is None:
        pytest.skip("gcc and objcopy build the ELF fixture")
    # Given a real library whose .symtab names fixture_beta with escape sequences and newlines
    lib, hostile = tmp_path / "lib.so", tmp_path / "hostile.so"
    subprocess.run(["gcc", "-O1", "-g0", "-shared", "-fPIC", "-o", str(lib), str(FIXTURE_C)], check=True)
    subprocess.run(["objcopy", f"--redefine-sym=fixture_beta={FORGED}", str(lib), str(hostile)], check=True)
    nm = subprocess.run(["nm", "--defined-only", str(lib)], check=True, capture_output=True, text=True).stdout
    (vaddr,) = [int(line.split()[0], 16) for line in nm.splitlines() if line.endswith(" fixture_beta")]
    # When the symbolizer reads its name
    with open(hostile, "rb") as f:
        name = read_elf(f).function_at(vaddr_to_offset(hostile, vaddr))
    # Then the name carries every byte, escaped: no control character
    assert name is not None and unescape(name) == FORGED.encode()
    assert not raw_controls(name)
    # And through a pprof, the top table and the folded stacks show it on its own line, escaped
    loaded = profile_of(tmp_path / "cpu-20261201T000000Z-1.pb.gz", {("main", name): 3, ("main", "work"): 1})
    table = profiles.top_table(loaded)
    assert not raw_controls(table) and len(table.splitlines()) == 1 + 3
    assert next(line for line in table.splitlines() if "forged" in line).endswith(printable(name))
    folded = profiles.folded(loaded)
    assert not raw_controls(folded) and len(folded.splitlines()) == 2


def test_a_pprof_from_anywhere_with_control_characters_is_printed_escaped(tmp_path: Path) -> None:
    # Given a pprof (not the agent's) whose function names hold raw control characters
    loaded = profile_of(
        tmp_path / "cpu-20261201T000000Z-1.pb.gz", {("main", FORGED): 5, ("main;x\n", "work\x00"): 2, ("\x7f\x85",): 1}
    )
    # When `record`'s table and the folded stacks are written
    table, folded = profiles.top_table(loaded), profiles.folded(loaded)
    # Then no control character is in either, each row is one line, and the names read escaped
    assert not raw_controls(table) and not raw_controls(folded)
    assert len(table.splitlines()) == 1 + 5 and len(folded.splitlines()) == 3
    assert folded.splitlines()[0] == f"main;{printable(FORGED).replace(';', ':')} 5"
    assert "\\x1b[2J" in table and "\\u009b31m" in table and "\\u202e" in table
    assert "main:x\\x0a;work\\x00 2" in folded


def test_a_perf_map_name_with_control_bytes_is_escaped() -> None:
    starts, _, names, bad = perfmap._parse(BytesIO(b"7f0000001000 40 js:\x1b]0;owned\x07 \x1b[2Jhandler\n"))
    assert bad == 0 and list(starts) == [0x7F0000001000]
    assert names == (process_string(b"js:\x1b]0;owned\x07 \x1b[2Jhandler"),)
    assert not raw_controls(names[0]) and "\\x1b" in names[0]


def test_a_profile_type_from_a_pprof_is_a_word_or_profile(tmp_path: Path) -> None:
    # Given a pprof, named without the local_dir's TYPE- prefix, whose sample type is a path and an escape
    b = pprof.ProfileBuilder([("samples", "count"), ("../../x\x1b[2J", "count")], ("cpu", "count"), 1, 0, 1)
    m = b.mapping("exe", "/usr/bin/a", "")
    b.sample([b.location(("f",), m, 0x1000, [b.function("f")])], [1, 1], {"pid": "1"})
    (tmp_path / "plain.pb.gz").write_bytes(b.gzipped())
    # Then its type, which names output files (out.TYPE.folded) and is printed, is the plain "profile"
    assert [x.profile_type for x in profiles.load([str(tmp_path / "plain.pb.gz")])] == ["profile"]
