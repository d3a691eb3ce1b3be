"""`ebpfprofiler record -- COMMAND ARGS...`: the command's side of a recording.

Owns: splitting record's options from the command at `--`; the runtime names of `--runtime`
(python, node, jvm, php, ruby, dotnet, all) and the config values each turns on, from
shared/runtime_registry.py; starting the command (as the user sudo was run by, else as root) once
the agent is ready; the command's process tree, followed from /proc as it grows (a pid is the
command's when its parent chain reaches the command; record is the children's subreaper, so an
orphan of the tree comes back to it rather than to init); forwarding a stop signal; and the exit
status, mapped as a shell maps it (a command killed by signal N: 128 + N).

Must not: profile anything itself (the agent does; record keeps the tree's samples at the end),
or wait on a child other than the command and the tree's orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared import procstat
from shared.runtime_registry import RUNTIMES
from shared.safestr import cut, printable

# The runtime reader's folder names that `--runtime` calls otherwise (the name people type).
_CLI_NAMES = {"cpython": "python"}
ALL = "all"

# prctl(2) option: orphaned descendants are re-parented to this process instead of init.
PR_SET_CHILD_SUBREAPER = 36


def runtime_names() -> dict[str, tuple[str, ...]]:
    """`--runtime` name → the runtime_stacks opt-ins it turns on (python: every CPython, python_stacks
    too), one per runtime of the registry."""
    return {_CLI_NAMES.get(spec.name, spec.name): tuple(o for o, _ in spec.opt_ins) for spec in RUNTIMES}


@dataclass(frozen=True)
class Runtimes:
    """What `--runtime` (and `--python`) asked for, as config values."""

    python_stacks: bool = False
    runtime_stacks: tuple[str, ...] = ()

    @property
    def wanted(self) -> bool:
        return self.python_stacks or bool(self.runtime_stacks)


def parse_runtimes(values: Sequence[str]) -> Runtimes:
    """`values`: each a comma-separated list of names (or `all`). ValueError naming the bad name and
    the valid ones."""
    names = runtime_names()
    chosen: list[str] = []
    for value in values:
        for name in (n.strip().lower() for n in value.split(",")):
            if name == ALL:
                chosen.extend(names)
            elif name in names:
                chosen.append(name)
            else:
                raise ValueError(
                    f"--runtime: unknown runtime '{printable(cut(name or '(empty)', 40))}'; "
                    f"valid: {', '.join(names)} (comma-separated), or {ALL}"
                )
    opt_ins = tuple(dict.fromkeys(o for n in chosen for o in names[n]))
    return Runtimes(python_stacks="python" in chosen, runtime_stacks=opt_ins)


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """(record's options, the command after the first `--`, or None without one)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def exit_status(returncode: int) -> int:
    """A child's status as a shell gives it: its exit code, or 128 + N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class RunAs:
    """Who the command runs as: sudo's invoking user (SUDO_UID, SUDO_GID) when record runs under sudo,
    else record's own user (root)."""

    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] | None = None
    name: str = "root"

    def popen_kwargs(self) -> dict[str, object]:
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups or ())}


def run_as(environ: Mapping[str, str]) -> RunAs:
    """The invoking user from sudo's variables, when both are plain non-root ids; else root."""
    try:
        uid, gid = int(environ.get("SUDO_UID", "")), int(environ.get("SUDO_GID", ""))
    except ValueError:
        return RunAs()
    if uid <= 0 or gid < 0:
        return RunAs()
    try:
        name = pwd.getpwuid(uid).pw_name
        groups: tuple[int, ...] = tuple(os.getgrouplist(name, gid))
    except (KeyError, OSError):
        name, groups = f"uid {uid}", (gid,)
    return RunAs(uid, gid, groups, name)


def find_command(command: Sequence[str]) -> str | None:
    """Why `command` cannot be run (said before the agent starts), or None."""
    if not command:
        return "no command after --"
    if shutil.which(command[0]) is None:
        return f"{printable(cut(command[0], 200))}: command not found"
    return None


def become_subreaper() -> None:
    """Orphans of the command's tree come back to this process (not to init), so their parent chain
    still names the tree. Best effort: without it, an orphan seen only after its parent exited is missed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def start(command: Sequence[str], who: RunAs) -> subprocess.Popen[bytes]:
    """The command, in record's process group (a Ctrl-C on the terminal reaches it as it would without
    record), its standard streams record's own."""
    return subprocess.Popen(list(command), **who.popen_kwargs())  # type: ignore[call-overload]


def exit_of(proc: subprocess.Popen[bytes]) -> int | None:
    """The command's exit status as a shell gives it once it has exited, else None; the command is left
    unreaped (a zombie keeps its pid, so no other process can take it before the last drain names its
    samples: it is reaped once the agent has stopped)."""
    if proc.returncode is not None:
        return exit_status(proc.returncode)
    try:
        got = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return exit_status(proc.wait())
    if got is None or got.si_pid != proc.pid:
        return None
    if got.si_code == os.CLD_EXITED:
        return int(got.si_status)
    return 128 + int(got.si_status)  # CLD_KILLED, CLD_DUMPED: the signal


def describe(status: int) -> str:
    """An exit status for a person: "exit 3", "killed by SIGTERM, exit 143"."""
    if status > 128:
        try:
            return f"killed by {signal.Signals(status - 128).name}, exit {status}"
        except ValueError:
            pass
    return f"exit {status}"


class ProcessTree:
    """The command and its descendants, found in /proc as they appear: a new pid is the tree's when its
    parent is (or when it is an orphan re-parented to `me`, the subreaper, outside `other_session`:
    the agent's). Only pids not looked at before are read (one stat read each), so a scan of a host
    whose processes do not change is a directory listing."""

    def __init__(self, root: int, me: int, other_session: int, proc: str = "/proc") -> None:
        self.root, self.me, self.other_session, self.proc = root, me, other_session, proc
        self.members: set[int] = {root}
        self.orphans: set[int] = set()  # members re-parented to `me`: reaped here
        self._seen: set[int] = set()

    def scan(self) -> None:
        try:
            pids = {int(n) for n in os.listdir(self.proc) if n.isdigit()}
        except OSError:
            return
        parents: dict[int, tuple[int, int]] = {}  # new pid → (ppid, session)
        for pid in pids - self._seen:
            text = procstat.read_stat(pid, self.proc)
            if text is None:
                continue
            try:
                fields = procstat.stat_fields(text)
                parents[pid] = (int(fields[1]), int(fields[3]))
            except (ValueError, IndexError):
                continue
        changed = True
        while changed:  # a new child of a new child: until nothing more joins
            changed = False
            for pid, (ppid, sid) in list(parents.items()):
                orphan = ppid == self.me and pid != self.root and sid != self.other_session
                if ppid in self.members or orphan:
                    self.members.add(pid)
                    if orphan:
                        self.orphans.add(pid)
                    del parents[pid]
                    changed = True
        self._seen = pids  # a pid gone from /proc is looked at again if it comes back
        self.reap_orphans()

    def reap_orphans(self) -> None:
        for pid in list(self.orphans):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.orphans.discard(pid)


def forward(proc: subprocess.Popen[bytes], signum: int, count: int) -> None:
    """Pass a stop signal record received on to the command: SIGINT only when it did not come from the
    terminal (the terminal's Ctrl-C reaches the command itself: it shares record's process group),
    SIGTERM always; the third stop signal kills it (SIGKILL)."""
    if proc.returncode is not None:
        return
    if count >= 3:
        signum = signal.SIGKILL
    elif signum == signal.SIGINT and _foreground_of_terminal():
        return
    with contextlib.suppress(ProcessLookupError):  # a zombie (exited, not yet reaped) takes it silently
        os.kill(proc.pid, signum)


def _foreground_of_terminal() -> bool:
    """Whether record's process group is its terminal's foreground group (a Ctrl-C went to all of it)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)
