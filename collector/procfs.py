"""What the collector learns about a process from /proc: identity, service, mappings.

Owns: parsing /proc/<pid>/{stat,status,exe,cgroup,cmdline,maps} and a bounded
cache of processes keyed by (pid, start time), so a reused pid is a new process.
Container ids and Kubernetes pod uids are recognised in cgroup paths of the
common runtimes (docker, containerd, cri-o, podman) and of kubepods slices.
A process's mapping table, as the wire encodes it, is capped by bytes
(MAX_MAPPING_TABLE_BYTES): what is left out is counted (stats["mappings_cut"])
and logged once per process, and still counts as covered, so that samples in
it do not make the table be read again at every drain.

Must not: open or parse the files a process maps (that is the symbolizer's job,
unprivileged), or send anything anywhere.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from shared import procstat
from shared.log import LogOnce
from shared.procstat import parse_stat
from shared.safestr import process_string
from shared.wire import Mapping, Process, mapping_bytes

log = logging.getLogger(__name__)

# /proc/<pid>/maps of a big JVM is a few MB; past this we keep what we read.
MAX_MAPS_BYTES = 16 << 20
# Executable mappings kept per process; the wire format caps at 65536 too.
MAX_EXEC_MAPPINGS = 65536
# Bytes of one process's mapping table on the wire. The table travels with every batch that holds
# the process's samples; a large real one (a JVM or a browser: ~2,000 executable mappings of ~100-byte
# rows) is ~0.2 MB, while one file with a long non-ASCII name mapped 15,000 times is ~40 MB and
# took whole batches past MAX_BATCH_BYTES. 2 MiB is ten times the real one, and 32 such tables fit a batch.
MAX_MAPPING_TABLE_BYTES = 2 << 20
# Processes whose metadata is cached; a host rarely runs more at once.
PROCESS_CACHE_ENTRIES = 32768
# /proc/<pid>/cmdline is capped by ARG_MAX; we keep this much of it.
MAX_CMDLINE_BYTES = 16 << 10
# Arguments kept: the wire takes at most this many (a 16 KiB cmdline of empty-ish args has 8K).
MAX_CMDLINE_ARGS = 4096
# Service name of kernel threads, which have no executable.
KERNEL_SERVICE = "[kernel]"

_CONTAINER_RE = re.compile(
    r"(?:docker|cri-containerd|crio|libpod|containerd)-([0-9a-f]{64})(?:\.scope)?"
    r"|/(?:docker|containerd|crio|libpod)/([0-9a-f]{64})"
    r"|/([0-9a-f]{64})(?:/|$)"
)
_POD_RE = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True)
class CgroupIdentity:
    container_id: str = ""
    pod_uid: str = ""


def parse_cgroup(text: str) -> CgroupIdentity:
    """Container id and pod uid from the text of /proc/<pid>/cgroup ("" when none)."""
    container = pod = ""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        if not container:
            m = _CONTAINER_RE.search(path)
            if m:
                container = next(g for g in m.groups() if g)
        if not pod:
            m = _POD_RE.search(path)
            if m:
                pod = m.group(1).replace("_", "-")
    return CgroupIdentity(container, pod)


def parse_status(text: str) -> tuple[int, int]:
    """(real uid, pid in the innermost pid namespace) from /proc/<pid>/status."""
    uid = nspid = -1
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[1])
        elif line.startswith("NSpid:"):
            nspid = int(line.split()[-1])
    return uid, nspid


def parse_maps(text: str) -> tuple[Mapping, ...]:
    """The executable mappings in the text of /proc/<pid>/maps, sorted by start."""
    out: list[Mapping] = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or "x" not in parts[1]:
            continue
        try:
            lo, hi = parts[0].split("-")
            start, end, offset, inode = int(lo, 16), int(hi, 16), int(parts[2], 16), int(parts[4])
        except ValueError:
            continue
        path = parts[5].strip() if len(parts) == 6 else ""
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        # The kernel writes a newline in a maps path as \012; undone so a path reads as readlink gives it.
        path = process_string(path.replace("\\012", "\n"))
        out.append(Mapping(start, end, offset, path, parts[3], inode))
        if len(out) >= MAX_EXEC_MAPPINGS:
            break
    out.sort(key=lambda m: m.start)
    return tuple(out)


def read_capped(path: str, cap: int = 1 << 16) -> str:
    """At most `cap` bytes of a /proc file, as text; bytes that are not UTF-8 kept as surrogates
    (surrogateescape), for the parsers to pass through shared/safestr.py's process_string."""
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", "surrogateescape")


def service_of(container_id: str, executable: str) -> str:
    """The service a process belongs to: its container, else its executable."""
    return container_id or executable or KERNEL_SERVICE


def read_process(pid: int, with_cmdline: bool, proc: str = "/proc") -> Process | None:
    """Everything but the mappings of `pid`, or None if it is gone."""
    base = f"{proc}/{pid}"
    try:
        comm, start = parse_stat(read_capped(f"{base}/stat"))
        uid, nspid = parse_status(read_capped(f"{base}/status"))
        try:
            exe = os.readlink(f"{base}/exe")
        except OSError:
            exe = ""  # kernel threads; or the process is exiting
        if exe.endswith(" (deleted)"):
            exe = exe[: -len(" (deleted)")]
        exe = process_string(exe)
        ident = parse_cgroup(read_capped(f"{base}/cgroup"))
        cmdline = None
        if with_cmdline:
            raw = read_capped(f"{base}/cmdline", MAX_CMDLINE_BYTES)
            cmdline = tuple(process_string(a) for a in raw.split("\0") if a)[:MAX_CMDLINE_ARGS]
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return Process(
        pid=pid,
        start_ticks=start,
        uid=max(uid, 0),
        nspid=nspid if nspid > 0 else pid,
        comm=comm,
        executable=exe,
        service=service_of(ident.container_id, exe),
        container_id=ident.container_id,
        pod_uid=ident.pod_uid,
        cmdline=cmdline,
    )


def read_maps(pid: int, proc: str = "/proc") -> tuple[Mapping, ...]:
    try:
        return parse_maps(read_capped(f"{proc}/{pid}/maps", MAX_MAPS_BYTES))
    except OSError:
        return ()


def cap_table(maps: tuple[Mapping, ...], cap: int = MAX_MAPPING_TABLE_BYTES) -> tuple[tuple[Mapping, ...], int]:
    """The mappings of `maps` that fit `cap` bytes on the wire, in address order, and how many did not.
    The smallest rows go first: a process that maps one long-named file thousands of times loses
    those, not its executable and libraries."""
    sizes = [mapping_bytes(m) for m in maps]
    if sum(sizes) <= cap:
        return maps, 0
    kept: list[Mapping] = []
    used = 0
    for size, m in sorted(zip(sizes, maps), key=lambda x: (x[0], x[1].start)):
        if used + size > cap:
            break
        kept.append(m)
        used += size
    kept.sort(key=lambda m: m.start)
    return tuple(kept), len(maps) - len(kept)


def covers(starts: list[int], ends: list[int], address: int) -> bool:
    i = bisect.bisect_right(starts, address) - 1
    return i >= 0 and address < ends[i]


# A process in the table: it (with the mappings sent), and the starts and ends of all its executable
# mappings, those the byte cap left out included.
_Entry = tuple[Process, list[int], list[int]]


class ProcessTable:
    """Processes seen recently, keyed by pid and checked against their start time.

    Mappings are re-read only when a sampled address falls outside the known
    executable mappings (a dlopen, a new JIT region), not on every drain.
    """

    def __init__(self, with_cmdline: bool, proc: str = "/proc", capacity: int = PROCESS_CACHE_ENTRIES) -> None:
        self._with_cmdline = with_cmdline
        self._proc = proc
        self._capacity = capacity
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._exited: dict[int, Process] = {}  # found exited by the last forget_exited()
        # mappings_cut: mappings left out of tables read (MAX_MAPPING_TABLE_BYTES);
        # tables_cut: tables read that were cut.
        self.stats = {"read": 0, "maps_read": 0, "gone": 0, "forgotten": 0, "mappings_cut": 0, "tables_cut": 0}
        self._log_once = LogOnce(log)

    def get(self, pid: int, addresses: Iterable[int] = ()) -> Process | None:
        """The process `pid` with mappings that cover `addresses` where it can. A process is read
        again when its start time changed (a new process under a reused pid) or its name did (an
        exec keeps the start time: a child counted between fork and exec had its parent's program)."""
        entry = self._entries.get(pid)
        identity = procstat.identity(pid, self._proc)
        if identity is None:
            self.stats["gone"] += 1
            # Exited since it was sampled: what we knew is still the best answer.
            return entry[0] if entry else None
        comm, start = identity
        if entry is None or entry[0].start_ticks != start or entry[0].comm != comm:
            p = read_process(pid, self._with_cmdline, self._proc)
            if p is None:
                self.stats["gone"] += 1
                return None
            self.stats["read"] += 1
            entry = self._refresh(p)
        else:
            p, starts, ends = entry
            if any(not covers(starts, ends, a) for a in addresses):
                entry = self._refresh(p)
        self._entries[pid] = entry
        self._entries.move_to_end(pid)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return entry[0]

    def known(self, pid: int) -> bool:
        """Whether `pid` is in the table as the process it is now (the same start time and name, from
        /proc/PID/stat alone): read already, so a new-process event for it needs no early drain."""
        entry = self._entries.get(pid)
        if entry is None:
            return False
        return procstat.identity(pid, self._proc) == (entry[0].comm, entry[0].start_ticks)

    def forget_exited(self, alive: Callable[[int], bool] = procstat.alive) -> int:
        """Called after each drain: forget the processes that had exited at the last call (their last
        samples, in the buffer that drain did not take, came with this one), and note those that
        have exited since. Without it the table kept every process it ever read, mappings and
        all, up to PROCESS_CACHE_ENTRIES (on bench growth's busy load the collector grew 2.9 MB in
        30 minutes that way). How many were forgotten."""
        forgotten = 0
        for pid, p in self._exited.items():
            entry = self._entries.get(pid)
            if entry is not None and entry[0] is p:  # not read again since (a reused pid)
                del self._entries[pid]
                forgotten += 1
        self._exited = {pid: entry[0] for pid, entry in self._entries.items() if not alive(pid)}
        self.stats["forgotten"] += forgotten
        return forgotten

    def __len__(self) -> int:
        return len(self._entries)

    def _refresh(self, p: Process) -> _Entry:
        self.stats["maps_read"] += 1
        maps = read_maps(p.pid, self._proc)
        kept, cut = cap_table(maps)
        if cut:
            self.stats["mappings_cut"] += cut
            self.stats["tables_cut"] += 1
            self._log_once(
                ("mappings_cut", p.pid, p.start_ticks),
                logging.WARNING,
                "pid %d (%s): its %d executable mappings take more than %d bytes on the wire; %d "
                "left out (those with the longest names; their samples have no module), counted as "
                "mappings_cut in status; logged once for this process",
                p.pid,
                p.comm,
                len(maps),
                MAX_MAPPING_TABLE_BYTES,
                cut,
            )
        return replace(p, mappings=kept), [m.start for m in maps], [m.end for m in maps]
