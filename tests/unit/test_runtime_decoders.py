"""The runtime readers' pure decoders: CPython's location tables (runtimes/cpython/lines.py) and
version detection (runtimes/cpython/version.py, runtimes/php, runtimes/ruby).

The location tables are real ones: those of this interpreter's own code objects (CPython 3.11,
the format lines.py decodes), checked against CPython's own decoder (code.co_positions()).
Version detection is run on the maps line a process would show, in a /proc laid out in a
temporary directory, and on this test's own interpreter for the whole path.
"""

from __future__ import annotations

import dis
import io
import json
import os
import platform
import types
from pathlib import Path

from runtimes.cpython import lines, version
from runtimes.memory import ProcessMemory, ReadBudget
from runtimes.php import _scan as php_scan
from runtimes.ruby import _version as ruby_version
from runtimes.runtime import FileCache, ProcessContext, Refusal

# Bytes the whole-path detection may read from this process (its Py_Version and type objects).
DETECT_READ_BYTES = 1 << 20


def _code_objects(*modules: types.ModuleType) -> list[types.CodeType]:
    out: list[types.CodeType] = []
    todo = [obj.__code__ for m in modules for obj in vars(m).values() if isinstance(obj, types.FunctionType)]
    todo += [
        f.__code__
        for m in modules
        for cls in vars(m).values()
        if isinstance(cls, type)
        for f in vars(cls).values()
        if isinstance(f, types.FunctionType)
    ]
    while todo:
        code = todo.pop()
        out.append(code)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return out


def test_addr2line_agrees_with_cpython_on_every_instruction_of_real_code() -> None:
    codes = _code_objects(json.decoder, json.encoder, dis, os.path)
    assert len(codes) > 100
    checked = 0
    for code in codes:
        for unit, (line, *_rest) in enumerate(code.co_positions()):
            got = lines.addr2line(code.co_linetable, code.co_firstlineno, 2 * unit)
            assert got == (-1 if line is None else line), (code.co_qualname, 2 * unit)
            checked += 1
    assert checked > 10_000
    # past the last instruction the table covers nothing
    code = codes[0]
    assert lines.addr2line(code.co_linetable, code.co_firstlineno, len(code.co_code)) is None


def test_addr2line_turns_malformed_tables_into_none() -> None:
    code = json.decoder.JSONDecoder.raw_decode.__code__
    table = code.co_linetable
    last = 2 * (len(code.co_code) // 2 - 1)
    assert lines.addr2line(table, code.co_firstlineno, last) is not None
    assert lines.addr2line(table[: len(table) // 2], code.co_firstlineno, last) is None  # cut short
    assert lines.addr2line(b"", code.co_firstlineno, 0) is None
    assert lines.addr2line(bytes([0x00]), 1, 0) is None  # an entry without its high bit
    # an entry's first byte is 1CCCCLLL: code C, length L + 1 code units
    assert lines.addr2line(bytes([0xF0]), 1, 0) is None  # code 14 (long form) with no fields
    assert lines.addr2line(bytes([0xE8]) + b"\x7f" * 20, 1, 0) is None  # code 13, a varint longer than 64 bits
    assert lines.addr2line(bytes([0xE8, 0x03]), 1, 0) is None  # code 13, delta -1: line 0 is no line
    assert lines.addr2line(bytes([0xF8]), 7, 0) == -1  # code 15: no location
    assert lines.addr2line(bytes([0xE8, 0x04]), 7, 0) == 9  # code 13, delta +2
    assert lines.addr2line(bytes([0xD9, 0, 0]), 7, 2) == 8  # code 11 (delta 1), 2 units: covers offset 2


def _fake_proc(tmp_path: Path, pid: int, *maps_lines: str) -> str:
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "maps").write_text("".join(line + "\n" for line in maps_lines))
    return str(tmp_path)


def _context(pid: int, proc: str = "/proc", read_bytes: int = 0) -> ProcessContext:
    return ProcessContext(pid, proc, ProcessMemory(pid, ReadBudget(read_bytes)), FileCache())


def _maps_line(path: str, perms: str = "r-xp", offset: int = 0x1000) -> str:
    return f"7f0000000000-7f0000100000 {perms} {offset:08x} 08:01 1234 {path}"


def test_cpython_versions_are_named_by_the_file_and_unsupported_ones_refused(tmp_path: Path) -> None:
    cases = {
        "/usr/bin/python2.7": "only CPython 3 is read",
        "/usr/bin/python3.10": "CPython 3.10 and older are not supported",
        "/usr/lib/libpython3.13t.so.1.0": "a free-threaded build",
    }
    for pid, (path, reason) in enumerate(cases.items(), start=100):
        proc = _fake_proc(tmp_path, pid, _maps_line(path))
        got = version.detect(_context(pid, proc), modern=True, legacy=True)
        assert isinstance(got, Refusal) and reason in got.reason, (path, got)
    # A file mapped but never executed is not the interpreter; no python at all is not a target.
    proc = _fake_proc(tmp_path, 200, _maps_line("/usr/bin/python3.11", perms="r--p"), _maps_line("/usr/bin/bash"))
    assert version.detect(_context(200, proc), modern=True, legacy=True) is None
    # The library holds the runtime when both are mapped; flags and versions come from the name.
    proc = _fake_proc(tmp_path, 300, _maps_line("/usr/bin/python3.12"), _maps_line("/usr/lib/libpython3.12d.so.1.0"))
    mods = version._modules(_context(300, proc).mappings)
    assert [(os.path.basename(m.path), m.major, m.minor, m.flags) for m in mods] == [
        ("libpython3.12d.so.1.0", 3, 12, "d"),
        ("python3.12", 3, 12, ""),
    ]
    assert version.parse_hexversion(0x030D05F0) == (3, 13, 5)


def test_cpython_detection_of_this_interpreter_reads_its_version_from_memory() -> None:
    pid = os.getpid()
    process = _context(pid, read_bytes=DETECT_READ_BYTES)
    major, minor, _ = (int(x) for x in platform.python_version_tuple())
    got = version.detect(process, modern=True, legacy=False)
    assert isinstance(got, Refusal)
    assert f"CPython {major}.{minor} is read only with runtime_stacks: [python_legacy]" in got.reason
    target = version.detect(process, modern=True, legacy=True)
    assert isinstance(target, version.Target), target
    assert target.version == platform.python_version()


def test_php_version_and_build_are_found_across_scan_chunks() -> None:
    from runtimes import php

    pad = b"\0" * (php.SCAN_CHUNK - 10)  # the marker straddles the first chunk's end
    blob = pad + b"X-Powered-By: PHP/8.2.29\0" + b"\0" * 100 + b"API20220829,NTS\0"
    assert php_scan(io.BytesIO(blob)) == ((8, 2, 29), "NTS")
    assert php_scan(io.BytesIO(b"API20240924,TS ")) == (None, "TS")
    assert php_scan(io.BytesIO(b"no markers here")) == (None, None)


def test_ruby_version_comes_from_the_library_name() -> None:
    assert ruby_version("libruby-3.3.so.3.3.8") == (3, 3)
    assert ruby_version("libruby.so.3.4.1") == (3, 4)
    assert ruby_version("libruby-3.4.so") == (3, 4)
    assert ruby_version("libruby.so") is None
    assert ruby_version("libruby-static.a") is None


def test_mapped_paths_are_the_files_own_bytes(tmp_path: Path) -> None:
    # A path with bytes that are not UTF-8, and one with a newline (the kernel writes it as \012).
    (tmp_path / "400").mkdir()
    (tmp_path / "400" / "maps").write_bytes(
        b"7f0000000000-7f0000100000 r-xp 00001000 08:01 1234 /opt/\xff\xfe/python3.11\n"
        b"7f0000100000-7f0000200000 r-xp 00001000 08:01 1235 /opt/a\\012b/libpython3.12.so.1.0\n"
    )
    paths = [m.path for m in _context(400, str(tmp_path)).mappings]
    assert [os.fsencode(p) for p in paths] == [b"/opt/\xff\xfe/python3.11", b"/opt/a\nb/libpython3.12.so.1.0"]
    # and CPython's detection finds the interpreter among them, the library first
    assert [os.path.basename(m.path) for m in version._modules(_context(400, str(tmp_path)).mappings)] == [
        "libpython3.12.so.1.0",
        "python3.11",
    ]
