"""Kernel symbols from a recorded /proc/kallsyms."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.kallsyms import KernelSymbols

RECORDED = Path(__file__).parents[1] / "fixtures" / "proc" / "kallsyms.txt"


def rows() -> list[tuple[int, str, str]]:
    out = []
    for line in RECORDED.read_text().splitlines():
        addr, kind, name = line.split()[:3]
        out.append((int(addr, 16), kind, name))
    return out


def test_addresses_inside_a_function_name_it() -> None:
    syms = KernelSymbols(str(RECORDED))
    text = sorted((a, n) for a, k, n in rows() if k in "tTwW" and a)
    for (addr, name), nxt in zip(text, [*text[1:], (None, None)]):
        assert syms.name(addr) == name
        if nxt[0] is not None and nxt[0] > addr + 1:
            assert syms.name(nxt[0] - 1) == name
    assert syms.name(text[0][0] - 1) == ""


def test_only_text_symbols_with_addresses_are_kept() -> None:
    syms = KernelSymbols(str(RECORDED))
    assert len(syms) == sum(1 for a, k, _ in rows() if k in "tTwW" and a)
    assert syms.name(0xFFFFFFFFC0A00010) == "mod_func"
    assert "some_data" not in {syms.name(a) for a, _, _ in rows()}


def test_hidden_addresses_give_no_names(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hidden = tmp_path / "kallsyms"
    hidden.write_text("".join(f"0000000000000000 T {n}\n" for _, _, n in rows()))
    syms = KernelSymbols(str(hidden))
    assert len(syms) == 0 and syms.name(0xFFFFFFFF81000000) == ""
    # the log line is the feature: it tells the operator why kernel frames have no names
    assert "no kernel addresses" in caplog.text
