"""The symbolizer's disk cache of unwind tables, keyed by GNU build id, file identity and arch.

Owns: <state_dir>/unwind/<build id>.<identity>.<arch>.v<BUILDER_VERSION>.tbl — tables
in shared/unwind_table.py format, written atomically (shared/files.write_atomic),
the directory's total size bounded (MAX_CACHE_BYTES, least recently used
evicted: a hit touches its file's mtime), and every file checked with
unwind_table.decode() when read: a corrupt one is deleted and counted, and the
caller builds the table again. Several workers share the directory; a file
another one evicts or replaces under us is a miss, not an error.

Modules without a build id are not cached: nothing names them across restarts.
A build id alone is only what a file claims (a copy of libc's would get libc's
table served for the real libc): every entry is also bound to the identity of
the file it was built from (file_identity: device, inode, size, mtime, ctime),
so a table is served only for that same file.

Must not: write outside <state_dir>/unwind, or trust a file it reads.
"""

from __future__ import annotations

import logging
import os
import re
import time

from shared import unwind_table as ut
from shared.files import write_atomic
from shared.wire import MAX_UNWIND_TABLE_BYTES

log = logging.getLogger(__name__)

# All tables of a busy host (node's is 6 MB, libc's 0.5 MB, most far smaller) fit several times over.
MAX_CACHE_BYTES = 256 << 20
# Bumped when symbolizer/cfi.py changes what it builds, so old tables are not served (and age out).
BUILDER_VERSION = 1
# A temporary file older than this is left over from a crash mid-write and is removed.
STALE_TEMP_S = 3600.0
# Directory entries looked at per eviction scan: bounds the scan of a directory someone filled.
MAX_SCAN_ENTRIES = 100_000

_BUILD_ID = re.compile(r"[0-9a-f]{2,128}")
_IDENTITY = re.compile(r"[0-9a-f]{1,16}(?:-[0-9a-f]{1,16}){4}")


def file_identity(fd: int) -> str:
    """What binds a cached table to the file it was built from: (dev, inode, size, mtime, ctime) in hex.
    ctime cannot be set by a file's owner, so a new file that reuses an inode does not match."""
    st = os.fstat(fd)
    return "-".join(
        f"{v & (1 << 64) - 1:x}" for v in (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    )


class UnwindCache:
    def __init__(self, state_dir: str, max_bytes: int = MAX_CACHE_BYTES) -> None:
        self.dir = os.path.join(state_dir, "unwind")
        self.max_bytes = max_bytes
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        except OSError as e:  # tables are still built and sent, just not kept
            log.warning("cannot create the unwind table cache %s: %s", self.dir, e)
        self.stats = dict.fromkeys(("hits", "misses", "written", "corrupt", "evicted", "write_errors"), 0)

    def path(self, build_id: str, identity: str, arch: int) -> str | None:
        """The file of (build_id, identity, arch), None if they cannot name one."""
        if not _BUILD_ID.fullmatch(build_id) or not _IDENTITY.fullmatch(identity) or arch not in ut.ARCH_NAMES:
            return None
        return os.path.join(self.dir, f"{build_id}.{identity}.{ut.ARCH_NAMES[arch]}.v{BUILDER_VERSION}.tbl")

    def get(self, build_id: str, identity: str, arch: int) -> bytes | None:
        """The cached table of (build_id, identity, arch), validated; None on a miss or a corrupt file (deleted)."""
        path = self.path(build_id, identity, arch)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_UNWIND_TABLE_BYTES + 1)
        except FileNotFoundError:
            self.stats["misses"] += 1
            return None
        except OSError as e:
            self.stats["misses"] += 1
            log.warning("cannot read cached unwind table %s: %s", path, e)
            return None
        try:
            if len(data) > MAX_UNWIND_TABLE_BYTES:
                raise ut.UnwindTableError(f"{len(data)} bytes or more, over {MAX_UNWIND_TABLE_BYTES}")
            ut.decode(data, arch)
        except ut.UnwindTableError as e:
            self.stats["corrupt"] += 1
            log.warning("deleting corrupt cached unwind table %s (%d so far): %s", path, self.stats["corrupt"], e)
            self._unlink(path)
            return None
        try:  # noqa: SIM105
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        self.stats["hits"] += 1
        return data

    def put(self, build_id: str, identity: str, arch: int, table: bytes) -> None:
        """Store `table` (already validated by its builder); evict the oldest files past the size bound."""
        path = self.path(build_id, identity, arch)
        if path is None or len(table) > self.max_bytes:
            return
        try:
            write_atomic(path, table)
        except OSError as e:
            self.stats["write_errors"] += 1
            log.warning("cannot cache unwind table %s (%d so far): %s", path, self.stats["write_errors"], e)
            return
        self.stats["written"] += 1
        self._evict(keep=path)

    def _evict(self, keep: str) -> None:
        files: list[tuple[float, int, str]] = []
        total = 0
        now = time.time()
        try:
            with os.scandir(self.dir) as it:
                for i, entry in enumerate(it):
                    if i >= MAX_SCAN_ENTRIES:
                        break
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if entry.name.endswith(".tmp"):
                        if now - st.st_mtime > STALE_TEMP_S:
                            self._unlink(entry.path)
                        continue
                    if entry.name.endswith(".tbl") and entry.is_file(follow_symlinks=False):
                        files.append((st.st_mtime, st.st_size, entry.path))
                        total += st.st_size
        except OSError as e:
            log.warning("cannot scan the unwind table cache %s: %s", self.dir, e)
            return
        files.sort()
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            if self._unlink(path):
                self.stats["evicted"] += 1
            total -= size

    @staticmethod
    def _unlink(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("cannot remove %s: %s", path, e)
            return False
