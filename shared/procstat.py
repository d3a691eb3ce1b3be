"""/proc/<pid>/stat: the one parser of its line, and the one reader of a process's start time.

A process is named by (pid, start time in clock ticks), field 22 of its stat line, so that a
reused pid is a new process; every stage that checks that a pid still names the process it
knew reads it here.

Owns: splitting a stat line after the command name (which may hold spaces and parentheses),
and reading the line with a size cap; whether a pid exists at all (kill(pid, 0): no read).

Must not: keep state, or read any other /proc file.
"""

from __future__ import annotations

import os

from shared.safestr import process_string

# A stat line is ~300 bytes: 52 numeric fields and a comm of at most 64 bytes.
MAX_STAT_BYTES = 4096


def stat_fields(text: str) -> list[str]:
    """The fields after the command name: field N of the line (man 5 proc) is [N - 3]."""
    return text[text.rindex(")") + 2 :].split()


def parse_stat(text: str) -> tuple[str, int]:
    """(comm, start time in clock ticks) from /proc/<pid>/stat."""
    lpar, rpar = text.index("("), text.rindex(")")
    comm = process_string(text[lpar + 1 : rpar])
    return comm, int(stat_fields(text)[19])


def read_stat(pid: int, proc: str = "/proc") -> str | None:
    """The stat line of `pid` (at most MAX_STAT_BYTES), or None if the process is gone."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            return f.read(MAX_STAT_BYTES).decode("utf-8", "surrogateescape")
    except OSError:
        return None


def identity(pid: int, proc: str = "/proc") -> tuple[str, int] | None:
    """(comm, start time in clock ticks) of `pid`, or None if the process is gone (or its line is
    malformed): an exec keeps the start time and changes the name."""
    text = read_stat(pid, proc)
    if text is None:
        return None
    try:
        return parse_stat(text)
    except (ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether a process (or zombie) has this pid in our pid namespace: kill(pid, 0), which needs no
    privilege to tell (EPERM: it exists) and reads nothing of it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def start_ticks(pid: int, proc: str = "/proc") -> int | None:
    """Field 22 of /proc/<pid>/stat, or None if the process is gone (or its line is malformed)."""
    text = read_stat(pid, proc)
    if text is None:
        return None
    try:
        return int(stat_fields(text)[19])
    except (ValueError, IndexError):
        return None
