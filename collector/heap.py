"""The collector's own memory: what it gives back to the kernel.

Owns: trimming glibc's heaps (malloc_trim, after compiling and after drains, at most one a
MALLOC_TRIM_GAP_S), and dropping the clean file pages of the compiler's libraries once the BPF
programs are loaded (page_out_compiler).

Must not: free or touch memory it did not map clean (a written private page dropped would come back
as the file's bytes), or import bcc.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

# Between the collector's heap trims after drains: early drains for new processes may come every
# second, and a trim costs 0.6-0.8 ms; regular drains (12-60 s apart) each get one.
MALLOC_TRIM_GAP_S = 10.0

# The compiler's libraries, mapped by bcc and not run again once the programs are loaded: their clean
# file pages (~80 MB of RSS) are dropped (MADV_DONTNEED) and fault back in from the file if ever needed.
# Only mappings with no page of their own (smaps Anonymous 0: not written, not RELRO) are dropped:
# a written private page dropped would come back as the file's bytes.
COMPILER_LIBRARIES = ("libLLVM", "libclang", "libbcc")
MADV_DONTNEED = 4


def page_out_compiler() -> None:
    """Drop the clean, never-written file mappings of COMPILER_LIBRARIES (MADV_DONTNEED)."""
    libc = _libc()
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return
    current: tuple[int, int] | None = None
    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
            lib = len(head) == 6 and any(name in head[5] for name in COMPILER_LIBRARIES)
            lo, hi = head[0].split("-")
            current = (int(lo, 16), int(hi, 16)) if lib and "w" not in head[1] else None
        elif current is not None and line.startswith("Anonymous:"):
            if int(line.split()[1]) == 0:
                libc.madvise(current[0], current[1] - current[0], MADV_DONTNEED)
            current = None


def malloc_trim() -> None:
    """Give the free pages of glibc's heaps back to the kernel (malloc_trim(0)).

    After compiling, and after drains (at most one a MALLOC_TRIM_GAP_S): a drain's batch buffers and
    /proc reads, freed, leave free chunks whose pages stay resident. Without this, on the growth suite's busy load, glibc's bytes in
    use stayed at ~14 MB (mallinfo2) while the collector's RSS grew from 70 to 75 MB in 10 minutes,
    and one trim then gave back 14 MB. A call costs 0.6-0.8 ms of CPU."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once: the heap trims after drains and the compiler's page-out use it."""
    return ctypes.CDLL("libc.so.6", use_errno=True)
