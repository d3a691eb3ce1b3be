"""A split function's parts named in a stripped file (symbolizer/elf.py SPLIT_FUNCTIONS).

Debian's PGO builds of CPython 3.13-3.15 are stripped, and their eval loop runs in a part GCC split
away from the exported `_PyEval_EvalFrameDefault` (`.cold`, entered by jumps). Python frames are
spliced in place of that function's native frames (symbolizer/pystacks.py), so a frame in the split
part must read `_PyEval_EvalFrameDefault.cold`, as the unstripped file's .symtab names it.

The fixture is tests/fixtures/split_function.c built by gcc -O2 (its unlikely branch goes to a
`.cold` part); the expected ranges come from binutils' nm on the unstripped build, never from the
code under test.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from symbolizer.elf import read_elf

FIXTURE_C = Path(__file__).parent.parent / "fixtures" / "split_function.c"
EVAL = "_PyEval_EvalFrameDefault"


def nm_functions(path: Path) -> dict[str, tuple[int, int]]:
    """name → (start, end) of every sized symbol nm lists."""
    out = subprocess.run(["nm", "-S", str(path)], check=True, capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        m = re.match(r"^([0-9a-f]+) ([0-9a-f]+) [tTwW] (\S+)$", line)
        if m:
            start, size = int(m.group(1), 16), int(m.group(2), 16)
            got[m.group(3)] = (start, start + size)
    return got


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the unstripped build, the same stripped)."""
    if platform.machine() != "x86_64":
        pytest.skip("the jump scan is x86-64's (arm64: issue 44)")
    assert shutil.which("gcc") and shutil.which("strip"), "gcc and binutils build the fixture"
    out = tmp_path_factory.mktemp("split")
    full, stripped = out / "split", out / "split.stripped"
    subprocess.run(["gcc", "-O2", "-g0", "-rdynamic", "-o", str(full), str(FIXTURE_C)], check=True)
    subprocess.run(["strip", "-o", str(stripped), str(full)], check=True)
    return full, stripped


def test_a_stripped_files_split_part_is_named_as_its_symtab_names_it(built: tuple[Path, Path]) -> None:
    full, stripped = built
    truth = nm_functions(full)
    assert EVAL + ".cold" in truth, f"gcc did not split the fixture: {sorted(truth)}"
    cold_start, cold_end = truth[EVAL + ".cold"]
    # Given the stripped build (its .dynsym exports the function; its .symtab, with .cold, is gone)
    with stripped.open("rb") as f:
        symbols = read_elf(f)
    assert not symbols.has_symtab
    # Then every address of the split part, and of the exported part, names the function
    assert [symbols.function_at_address(a) for a in (cold_start, cold_end - 1)] == [EVAL + ".cold"] * 2
    start, end = truth[EVAL]
    assert [symbols.function_at_address(a) for a in (start, end - 1)] == [EVAL, EVAL]
    # and nothing past the part is taken for it
    assert symbols.function_at_address(cold_end) != EVAL + ".cold"


def test_an_unstripped_file_keeps_its_own_symtab_names(built: tuple[Path, Path]) -> None:
    full, _ = built
    truth = nm_functions(full)
    with full.open("rb") as f:
        symbols = read_elf(f)
    assert symbols.has_symtab
    cold_start, cold_end = truth[EVAL + ".cold"]
    assert symbols.function_at_address(cold_start) == EVAL + ".cold"
    assert symbols.function_at_address(cold_end - 1) == EVAL + ".cold"
