"""The one string rule (shared/safestr.py) and where the collector applies it (collector/procfs.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from collector.procfs import parse_maps, parse_stat
from shared import wire
from shared.safestr import CUT_MARKER, MAX_PROCESS_STRING, process_string, unescape


def test_escaping_is_lossless_valid_utf8_without_control_characters() -> None:
    rng = random.Random(15)
    samples = [b"/tmp/\xff\xfe/hot", b"a\\x41\\\\", "/opt/héllo/ünï".encode(), b"\xed\xa0\x80", b"\n\t\x7f", b""]
    samples += [bytes(rng.randrange(256) for _ in range(rng.randrange(40))) for _ in range(2000)]
    for raw in samples:
        s = process_string(raw)
        s.encode("utf-8")  # no surrogates
        assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in s), s
        assert unescape(s) == raw
        assert process_string(raw.decode("utf-8", "surrogateescape")) == s  # str from os.readlink
    assert process_string("/usr/bin/python3.11") == "/usr/bin/python3.11"


def test_long_strings_are_cut_with_a_marker_naming_the_whole() -> None:
    a, b = process_string(b"\n" * 1400 + b"a"), process_string(b"\n" * 1400 + b"b")
    assert len(a) == len(b) == MAX_PROCESS_STRING <= wire.MAX_STRING
    assert CUT_MARKER in a and a != b


def test_maps_line_over_4k_keeps_its_mapping_under_a_cut_name() -> None:
    path = "/tmp/x/" + "\\012" * 1400 + "/hot"  # as the kernel writes newlines in maps
    line = f"55d0c0a00000-55d0c0a01000 r-xp 00001000 fd:01 1234                       {path}\n"
    assert len(line) > 4096
    (m,) = parse_maps(line + "7f0000000000-7f0000001000 r-xp 00000000 00:00 0 \n")[:1]
    assert m.start == 0x55D0C0A00000 and m.inode == 1234
    assert m.path == process_string(("/tmp/x/" + "\n" * 1400 + "/hot").encode())
    assert len(m.path) <= MAX_PROCESS_STRING


def test_comm_with_bytes_that_are_not_utf8() -> None:
    text = b"42 (a\xff)b) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 999 20".decode("utf-8", "surrogateescape")
    comm, start = parse_stat(text)
    assert comm == "a\\xff)b" and start == 999


def test_quoted_values_are_cut_even_when_huge() -> None:
    from shared import config as config_mod
    from shared.safestr import quote

    for value in ("x" * 3_000_000, [[0] * 1_000_000], {"k" * 10_000: 1}, b"\xff" * 100_000, 10**4000, 10**5000):
        assert len(quote(value)) < 300
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.check("sample_hz", "9" * 3_000_000)
    assert len(str(e.value)) < 1000


def test_a_command_line_of_many_tiny_arguments_still_fits_the_wire(tmp_path: Path) -> None:
    from collector.procfs import read_process

    pid = tmp_path / "4242"
    pid.mkdir()
    (pid / "stat").write_bytes(b"4242 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 999 20")
    (pid / "status").write_bytes(b"Uid:\t0\t0\t0\t0\nNSpid:\t4242\n")
    (pid / "cgroup").write_bytes(b"0::/\n")
    (pid / "cmdline").write_bytes(b"a\0" * 8000)
    p = read_process(4242, with_cmdline=True, proc=str(tmp_path))
    assert p is not None and p.cmdline is not None and len(p.cmdline) == 4096
    got = wire.decode(wire.encode(wire.ProcessAnnouncement("h", 0, (p,))))
    assert isinstance(got, wire.ProcessAnnouncement) and got.processes[0].cmdline == p.cmdline
