"""The disk cache of unwind tables (symbolizer/unwind_cache.py): by build id, validated, bounded."""

from __future__ import annotations

import os
from pathlib import Path

from shared import unwind_table as ut
from symbolizer.unwind_cache import UnwindCache, file_identity


def table(rows: int = 3) -> bytes:
    h = ut.Header(
        ut.ARCH_X86_64, span=0x10000, pc_base=0x1000, text_offset=0x1000, text_vaddr=0x1000, text_size=0x10000
    )
    body = [ut.Row(i * 4, 8 + 8 * i, 0, -8, ut.CFA_SP, ut.FP_SAME, ut.RA_SAVED) for i in range(rows - 1)]
    return ut.encode(h, [*body, ut.Row((rows - 1) * 4, 0, 0, 0, ut.CFA_FALLBACK, 0, 0)])


BID = "1ed993b64906213dfeb7f0fcc692ee71ff60e2d0"
IDENT = "fd01-3e8-5000-17f0b2c3d4e5f600-17f0b2c3d4e5f600"  # file_identity of the module it was built from


def file_of(cache: UnwindCache, build_id: str) -> str:
    """The file of build_id's x86-64 table of IDENT (a build id that names one, as the tests pass)."""
    path = cache.path(build_id, IDENT, ut.ARCH_X86_64)
    assert path is not None
    return path


def test_a_table_put_is_read_back_across_instances(tmp_path: Path) -> None:
    # given a table cached by one worker, when another (or a restarted one) reads the same build id
    UnwindCache(str(tmp_path)).put(BID, IDENT, ut.ARCH_X86_64, table())
    again = UnwindCache(str(tmp_path))
    # then it gets the same table, and nothing for another arch or build id
    assert again.get(BID, IDENT, ut.ARCH_X86_64) == table()
    assert again.get(BID, IDENT, ut.ARCH_AARCH64) is None
    assert again.get("00" * 20, IDENT, ut.ARCH_X86_64) is None
    assert again.stats["hits"] == 1 and again.stats["misses"] == 2
    assert oct((tmp_path / "unwind").stat().st_mode & 0o777) == "0o700"


def test_a_corrupt_file_is_deleted_and_counted(tmp_path: Path) -> None:
    cache = UnwindCache(str(tmp_path))
    cache.put(BID, IDENT, ut.ARCH_X86_64, table())
    path = Path(file_of(cache, BID))
    data = bytearray(path.read_bytes())
    data[-4] = 9  # the last row's cfa_kind: out of range
    path.write_bytes(bytes(data))
    assert cache.get(BID, IDENT, ut.ARCH_X86_64) is None
    assert not path.exists() and cache.stats["corrupt"] == 1
    # and the table put again afterwards is served
    cache.put(BID, IDENT, ut.ARCH_X86_64, table())
    assert cache.get(BID, IDENT, ut.ARCH_X86_64) == table()


def test_a_truncated_or_foreign_file_is_corrupt_too(tmp_path: Path) -> None:
    cache = UnwindCache(str(tmp_path))
    for junk in (table()[:-8], b"", b"\x7fELF" + b"\0" * 100):
        Path(file_of(cache, BID)).write_bytes(junk)
        assert cache.get(BID, IDENT, ut.ARCH_X86_64) is None
    assert cache.stats["corrupt"] == 3


def test_build_ids_that_cannot_name_a_file_are_not_cached(tmp_path: Path) -> None:
    cache = UnwindCache(str(tmp_path))
    for bad in ("", "../../etc/passwd", "ABCD", "a/b"):
        cache.put(bad, IDENT, ut.ARCH_X86_64, table())
        assert cache.get(bad, IDENT, ut.ARCH_X86_64) is None
    assert os.listdir(tmp_path / "unwind") == []


def test_the_total_size_is_bounded_and_the_least_recently_used_go_first(tmp_path: Path) -> None:
    size = len(table())
    cache = UnwindCache(str(tmp_path), max_bytes=3 * size)
    ids = [f"{i:02x}" * 20 for i in range(5)]
    for i, bid in enumerate(ids[:3]):
        cache.put(bid, IDENT, ut.ARCH_X86_64, table())
        os.utime(file_of(cache, bid), (1000 + i, 1000 + i))
    assert cache.get(ids[0], IDENT, ut.ARCH_X86_64) is not None  # used: now the newest
    # when two more tables are put into a cache that holds three
    cache.put(ids[3], IDENT, ut.ARCH_X86_64, table())
    cache.put(ids[4], IDENT, ut.ARCH_X86_64, table())
    # then the two least recently used are gone, and the directory is within its bound
    kept = {bid for bid in ids if os.path.exists(file_of(cache, bid))}
    assert kept == {ids[0], ids[3], ids[4]}
    assert sum(f.stat().st_size for f in (tmp_path / "unwind").iterdir()) <= 3 * size
    assert cache.stats["evicted"] == 2


def test_a_table_is_served_only_for_the_file_it_was_built_from(tmp_path: Path) -> None:
    # A file that copies libc's build id is another file: it never gets the table built from libc.
    real, copy = tmp_path / "libc.so.6", tmp_path / "copy.so"
    real.write_bytes(b"real")
    copy.write_bytes(b"copy")
    with open(real, "rb") as r, open(copy, "rb") as c:
        ident_real, ident_copy = file_identity(r.fileno()), file_identity(c.fileno())
    cache = UnwindCache(str(tmp_path / "state"))
    cache.put(BID, ident_real, ut.ARCH_X86_64, table())
    assert cache.get(BID, ident_copy, ut.ARCH_X86_64) is None
    assert cache.get(BID, ident_real, ut.ARCH_X86_64) == table()
    os.utime(real, (1, 1))  # the same inode, changed: no longer the file the table was built from
    with open(real, "rb") as r:
        assert cache.get(BID, file_identity(r.fileno()), ut.ARCH_X86_64) is None
