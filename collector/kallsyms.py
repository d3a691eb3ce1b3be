"""Kernel symbols from /proc/kallsyms, for naming kernel frames.

Owns: reading the kernel's text symbols once and answering address → name.
bcc's own symbol cache refuses to read kallsyms unless euid is 0, and the
collector runs as its own user (CAP_SYSLOG lets it see the addresses).
Kept compact: addresses in one array, names in one bytes blob (~5 MB for
the ~150K text symbols of a distribution kernel with modules).

Must not: resolve user addresses (that is the symbolizer's, from ELF files).
"""

from __future__ import annotations

import bisect
import logging
from array import array

log = logging.getLogger(__name__)

# Text symbols only: functions are what kernel stacks point into.
_TEXT_TYPES = frozenset(b"tTwW")
# A name longer than this is cut (kernel names are at most KSYM_NAME_LEN, 512).
MAX_NAME_BYTES = 512


class KernelSymbols:
    def __init__(self, path: str = "/proc/kallsyms") -> None:
        rows: list[tuple[int, bytes]] = []
        with open(path, "rb") as f:
            for line in f:
                parts = line.split(None, 3)
                if len(parts) < 3 or parts[1][0] not in _TEXT_TYPES:
                    continue
                addr = int(parts[0], 16)
                if addr:
                    rows.append((addr, parts[2][:MAX_NAME_BYTES]))
        rows.sort()
        self._addrs = array("Q", (a for a, _ in rows))
        self._offsets = array("I")
        blob = bytearray()
        for _, name in rows:
            self._offsets.append(len(blob))
            blob += name
        self._offsets.append(len(blob))
        self._names = bytes(blob)
        if not rows:
            log.warning(
                "%s shows no kernel addresses (kptr_restrict, or no CAP_SYSLOG): kernel frames will have no names", path
            )

    def __len__(self) -> int:
        return len(self._addrs)

    def name(self, address: int) -> str:
        """The symbol containing `address`, or "" if it is below the first one."""
        i = bisect.bisect_right(self._addrs, address) - 1
        if i < 0:
            return ""
        return self._names[self._offsets[i] : self._offsets[i + 1]].decode("utf-8", "replace")
