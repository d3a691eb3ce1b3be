"""Who each stage runs as: its own system user, its capabilities and no others.

Owns: the privilege table of docs/architecture.md ("Processes") as data (STAGES), and become(), which a
stage calls first thing. Started as root (how `ebpfprofiler run` starts it),
the stage drops to its user in the agent's group, keeps exactly its
capabilities across the uid change (keep-caps, then effective, permitted,
inheritable and bounding sets limited) and sets no_new_privs. Started as its
user already (systemd: User= and AmbientCapabilities=), it drops whatever it
holds beyond its table entry and sets no_new_privs.

Must not: create users (deploy/ and make setup do), or grant anything.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
from dataclasses import dataclass

import _prctl
import prctl

AGENT_GROUP = "ebpfprofiler"

# linux/capability.h; python-prctl does not name CAP_CHECKPOINT_RESTORE (5.9+).
CAP_DAC_READ_SEARCH = 2
CAP_SETGID = 6
CAP_SETUID = 7
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24
CAP_SYSLOG = 34
CAP_PERFMON = 38
CAP_BPF = 39
CAP_CHECKPOINT_RESTORE = 40
CAPABILITY_NAMES: dict[int, str] = {
    CAP_DAC_READ_SEARCH: "CAP_DAC_READ_SEARCH",
    CAP_SYS_PTRACE: "CAP_SYS_PTRACE",
    CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
    CAP_SYS_RESOURCE: "CAP_SYS_RESOURCE",
    CAP_SYSLOG: "CAP_SYSLOG",
    CAP_PERFMON: "CAP_PERFMON",
    CAP_BPF: "CAP_BPF",
    CAP_CHECKPOINT_RESTORE: "CAP_CHECKPOINT_RESTORE",
}

# What the collector needs each of its capabilities for, in the order collector/preflight.py
# reports them: its row of STAGES below.
COLLECTOR_CAPS: dict[int, str] = {
    CAP_BPF: "load BPF programs and create maps",
    CAP_PERFMON: "open system-wide perf events and attach to tracepoints",
    CAP_SYS_PTRACE: "read /proc/<pid>/maps and exe of other users' processes",
    CAP_SYSLOG: "read kernel addresses in /proc/kallsyms",
    CAP_DAC_READ_SEARCH: "read tracefs event ids and /proc files of other users",
    CAP_CHECKPOINT_RESTORE: "open /proc/<pid>/map_files/* for the symbolizer",
}


@dataclass(frozen=True)
class StagePrivileges:
    user: str
    caps: frozenset[int]


STAGES: dict[str, StagePrivileges] = {
    # BPF programs and perf events; /proc/<pid>/{maps,exe,map_files,root} of every
    # process; kernel addresses in /proc/kallsyms; tracefs event ids.
    "collector": StagePrivileges("ebpfprofiler-collector", frozenset(COLLECTOR_CAPS)),
    "symbolizer": StagePrivileges("ebpfprofiler-symbolizer", frozenset()),
    "uploader": StagePrivileges("ebpfprofiler-uploader", frozenset()),
    # process_vm_readv of other users' processes, nothing else.
    "runtime": StagePrivileges("ebpfprofiler-runtime", frozenset({CAP_SYS_PTRACE})),
}


# Capabilities a stage takes only when its config asks for what needs them.
OPTIONAL_CAPS: dict[str, frozenset[int]] = {
    # alloc_targets: creating a uprobe takes CAP_SYS_ADMIN since Linux 6.16 (CAP_PERFMON before):
    # a uprobe writes a breakpoint into another process's code.
    "collector": frozenset({CAP_SYS_ADMIN}),
    # runtime_stacks: [dotnet]: only the connector the runtime reader forks at start keeps them, to
    # connect to a .NET process's diagnostics socket as that process's user (runtimes/dotnet/connect.py);
    # the reader itself drops them once it has forked it.
    "runtime": frozenset({CAP_SETGID, CAP_SETUID}),
}


class PrivilegeError(RuntimeError):
    """The stage cannot take the identity the table gives it; the message says how to fix it."""


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return CAP_CHECKPOINT_RESTORE


def ids(stage: str) -> tuple[int, int]:
    """(uid, gid of the agent's group) of a stage's user."""
    priv = STAGES[stage]
    try:
        uid = pwd.getpwnam(priv.user).pw_uid
        gid = grp.getgrnam(AGENT_GROUP).gr_gid
    except KeyError as e:
        raise PrivilegeError(
            f"{e.args[0]} does not exist: create the agent's users with `make setup` "
            f"(or `make install`, or systemd-sysusers deploy/sysusers.conf)"
        ) from None
    return uid, gid


def agent_uids() -> frozenset[int]:
    """The uids of the stages' users that exist: the agent's own processes, by the user each runs as."""
    out = set()
    for priv in STAGES.values():
        try:
            out.add(pwd.getpwnam(priv.user).pw_uid)
        except KeyError:
            continue
    return frozenset(out)


def become(stage: str, extra: frozenset[int] = frozenset()) -> None:
    """Run as `stage`'s user with exactly its capabilities (and those of `extra`, which must be among
    its OPTIONAL_CAPS), and no_new_privs."""
    priv = STAGES[stage]
    if not extra <= OPTIONAL_CAPS.get(stage, frozenset()):
        raise ValueError(f"{stage} has no optional capabilities {sorted(extra)}")
    keep = priv.caps | extra
    caps = sorted(keep)
    if os.geteuid() == 0:
        uid, gid = ids(stage)
        # The kernel clears the parent-death signal (`ebpfprofiler run` arms it before exec) when
        # the uids change: without it again, a stage whose `run` was killed (SIGKILL, the OOM
        # killer) would run on, its BPF programs attached, with nobody to stop it.
        death_signal, parent = prctl.get_pdeathsig(), os.getppid()
        for cap in range(_last_cap() + 1):  # needs CAP_SETPCAP: before the uid change
            if cap not in keep:
                prctl.capbset.drop(cap)
        prctl.set_keepcaps(True)
        os.setgroups([gid])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        prctl.set_keepcaps(False)
        if death_signal:
            prctl.set_pdeathsig(death_signal)
            if os.getppid() != parent:  # it died while the signal was off: as if it had come
                os.kill(os.getpid(), death_signal)
    # One capset: effective = permitted = the stage's caps it holds (one it
    # lacks cannot be had; preflight names it), inheritable empty.
    # (python-prctl's C layer takes plain numbers; its Python layer does not
    # know CAP_CHECKPOINT_RESTORE, and its limit() can only clear.)
    keep_only(frozenset(caps))
    prctl.set_no_new_privs(1)
    os.umask(0o007)  # sockets and files: the agent's group, nobody else
    if os.geteuid() == 0 or os.getuid() == 0:
        raise PrivilegeError(f"{stage} is still root after dropping privileges")


def keep_only(caps: frozenset[int]) -> None:
    """Effective = permitted = those of `caps` this process holds, inheritable empty: one capset
    (a capability given up here cannot be had again)."""
    now = held()
    keep = sorted(c for c in caps if now["CapPrm"] >> c & 1)
    want = sum(1 << c for c in keep)
    # Holding exactly these already (a systemd unit without capabilities): nothing
    # to change, and such units need not allow the capset system call.
    if not (now["CapEff"] == now["CapPrm"] == want and now["CapInh"] == 0 and now.get("CapAmb", 0) == 0):
        others = [c for c in range(_last_cap() + 1) if c not in keep]
        _prctl.set_caps(keep, keep, [], others, others, list(range(_last_cap() + 1)))


def uids_with(stage: str) -> set[int]:
    """root, this process's own user, and `stage`'s user if it exists: the peers a stage trusts as `stage`."""
    uids = {0, os.geteuid()}
    with contextlib.suppress(PrivilegeError):
        uids.add(ids(stage)[0])
    return uids


def held(status_path: str = "/proc/self/status") -> dict[str, int]:
    """CapEff, CapPrm, CapBnd, CapAmb, CapInh and NoNewPrivs of a process, as integers."""
    out: dict[str, int] = {}
    with open(status_path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh"):
                out[key] = int(value.strip(), 16)
            elif key == "NoNewPrivs":
                out[key] = int(value.strip())
    return out


def mask(caps: frozenset[int]) -> int:
    return sum(1 << c for c in caps)
