"""Which processes are alloc or lock targets: the config's target specs matched against /proc.

Owns: parsing a target spec (an executable name or absolute path, a container
id or a prefix of one, cgroup:/path), matching it against a process, and
TargetWatcher: a scan of /proc each drain that reports the matching
processes that appeared and the ones that exited (or exec'd into something
that no longer matches) since the last scan.

Must not: attach anything (collector/alloc.py and collector/lock.py do), or
read more of a process than its exe link, stat and cgroup.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from collector.procfs import parse_cgroup, parse_stat, read_capped
from shared.procstat import start_ticks

log = logging.getLogger(__name__)

# New processes read per scan: a fork storm is taken over a few scans, not in one.
MAX_NEW_PER_SCAN = 4096
# /proc/<pid>/cgroup of a process in a deep hierarchy is a few hundred bytes.
MAX_CGROUP_BYTES = 16 << 10
_CONTAINER_ID = re.compile(r"[0-9a-f]{12,64}")


@dataclass(frozen=True)
class Target:
    pid: int
    start_ticks: int
    executable: str
    spec: str  # the spec it matched (for the log)


@dataclass(frozen=True)
class _Proc:
    executable: str
    comm: str
    container_id: str
    cgroup: str  # the cgroup v2 path ("0::/path"), "" without one


def matches(spec: str, p: _Proc) -> bool:
    """Does `spec` (validated by shared/config) name this process?"""
    if spec.startswith("cgroup:"):
        path = spec[len("cgroup:") :].rstrip("/") or "/"
        return bool(p.cgroup) and (path == "/" or p.cgroup == path or p.cgroup.startswith(path + "/"))  # noqa: PLR1714 - two different values
    if _CONTAINER_ID.fullmatch(spec) and p.container_id.startswith(spec):
        return True
    if spec.startswith("/"):
        return p.executable == spec
    return os.path.basename(p.executable) == spec or (bool(p.comm) and p.comm == spec[:15])


def _cgroup_v2_path(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return ""


class TargetWatcher:
    """Matching processes as they come and go; each scan costs one readlink per process."""

    def __init__(self, specs: Iterable[str], proc: str = "/proc", self_pid: int | None = None) -> None:
        self.specs = tuple(specs)
        self.proc = proc
        self._self = os.getpid() if self_pid is None else self_pid
        self._seen: dict[int, tuple[str, int]] = {}  # pid → (exe link, start ticks) as last read
        self.targets: dict[int, Target] = {}

    def _read(self, pid: int, exe: str) -> tuple[int, Target | None]:
        base = f"{self.proc}/{pid}"
        comm, start = parse_stat(read_capped(f"{base}/stat", 4096))
        cgroup_text = read_capped(f"{base}/cgroup", MAX_CGROUP_BYTES)
        p = _Proc(exe, comm, parse_cgroup(cgroup_text).container_id, _cgroup_v2_path(cgroup_text))
        for spec in self.specs:
            if matches(spec, p):
                return start, Target(pid, start, exe, spec)
        return start, None

    def _same_start(self, pid: int, start: int) -> bool:
        """A target's pid still names the same process (not exited and reused by one with the same exe)."""
        return start_ticks(pid, self.proc) == start

    def scan(self) -> tuple[list[Target], list[Target]]:
        """(targets that appeared, targets that are gone) since the previous scan."""
        if not self.specs:
            return [], []
        try:
            pids = [int(n) for n in os.listdir(self.proc) if n.isdigit()]
        except OSError as e:
            log.warning("cannot list %s: %s", self.proc, e.strerror)
            return [], []
        appeared: list[Target] = []
        gone: list[Target] = []
        alive: set[int] = set()
        budget = MAX_NEW_PER_SCAN
        for pid in pids:
            if pid == self._self:
                continue
            try:
                exe = os.readlink(f"{self.proc}/{pid}/exe")
            except OSError:
                continue  # a kernel thread, or gone
            alive.add(pid)
            seen = self._seen.get(pid)
            if seen is not None and seen[0] == exe and (pid not in self.targets or self._same_start(pid, seen[1])):
                continue
            if budget <= 0:
                alive.discard(pid)  # not read yet: next scan
                continue
            budget -= 1
            try:
                start, target = self._read(pid, exe)
            except (OSError, ValueError, IndexError, StopIteration):
                alive.discard(pid)
                continue
            self._seen[pid] = (exe, start)
            old = self.targets.get(pid)
            if old is not None and (target is None or old.start_ticks != start):
                gone.append(self.targets.pop(pid))  # exec'd into a non-target, or the pid was reused
            if target is not None and pid not in self.targets:
                self.targets[pid] = target
                appeared.append(target)
        for pid in [p for p in self._seen if p not in alive]:
            del self._seen[pid]
            if pid in self.targets:
                gone.append(self.targets.pop(pid))
        return appeared, gone
