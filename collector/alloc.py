"""Allocation profiling: bpf/alloc.c's uprobes on libc's allocator, attached to target processes only, in bursts.

Owns: resolving a target's own libc and its malloc, calloc, realloc and free
when it appears; attaching their seven uprobes in bursts (BurstPlan: one a
period, at a random phase, for alloc_duty_pct of it; a sampling phase then a
tail that only ends live allocations) from a thread of its own, return probes
before entry probes and out in the other order, and every one detached when
the target goes, the tracer stops or profiling is paused; the sampling table
(quantiles of an exponential distribution) and each CPU's first countdown;
draining the double-buffered allocation counts, scaled from the sampling
phases to the whole time as the clock measured them (SampledTime: each drain
by its own time profiled over time sampled; a live allocation keeps its
drain's scale), and snapshots of the live allocations (inuse, sent
once per upload window by the collector), less the frees the bursts could not
see (estimated from the ones they saw, by stack); user stacks with the caller
frame the entry probe's walk skips put back; the lifetime of ids in the alloc
stack map; the live entries of processes that exited.

Must not: decide which processes are targets (collector/targets.py), or talk
to other stages.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import random
import re
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Container
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from collector import syscalls
from collector.bpfmaps import DoubleBuffer, LostCounters, RawDrain, delete_stacks, stale_ids, take_all
from collector.procfs import read_maps
from collector.sources import TargetedSource
from collector.targets import Target
from shared import privileges

log = logging.getLogger(__name__)

PROFILE_TYPE = "alloc"
# Names of the alloc_lost slots in bpf/alloc.c, in order; stack_gone is counted here.
LOST_REASONS = ("counts_map_full", "user_stack_not_recorded", "live_map_full", "pending_map_full", "stack_gone")
# Distinct (pid, tid, stack, caller) keys per drain.
ALLOC_COUNTS_ENTRIES = 16384
# Distinct allocation stacks kept (127 x 8 bytes each: 16 MiB).
ALLOC_STACK_ENTRIES = 16384
# Sampled allocations not yet freed, over all targets (~110 bytes each: 7 MB).
# At the default 64 KiB sampling that is 4 GiB of live heap; past it, counted as live_map_full.
ALLOC_LIVE_ENTRIES = 65536
# Five links a process, opened and closed by every burst: 640 at 128 targets, within a period.
MAX_ALLOC_PROCESSES = 128
# Quantiles of Exp(1) bpf/alloc.c draws the distance to the next sample point from.
EXP_ENTRIES = 256
# One burst per period, at a random phase in it: every instant is sampled with the same chance
# (duty) and every window of whole periods gets exactly its share; a second keeps a burst of the
# default 3% at 30 ms, long beside the ~1 ms its attach and detach take.
BURST_PERIOD_S = 1.0
# Bursts whose drain's scale their live allocations keep (inuse): ~68 min at one a second; an older
# allocation still live takes the scale over the whole run.
BURST_SCALES_KEPT = 4096
# Of a burst, the part that samples; the rest is its tail, in which frees (and addresses malloc
# hands out again) end what the sampling phase recorded, so short-lived blocks are seen freed.
SAMPLING_SHARE = 0.5
# Links opened or closed at once: closing one waits out a grace period (~50 ms here) after its
# breakpoints are gone, and five links a target must not wait in turn.
BURST_THREADS = 16
# bpf(2), include/uapi/linux/bpf.h: the probes are uprobe_multi links (Linux 6.6+), not perf events:
# closing a uprobe perf event holds the kernel's event_mutex through its grace period (~116 ms), so
# seven closed in turn kept malloc's breakpoint for ~0.8 s after every burst.
BPF_PROG_TYPE_KPROBE = 2
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
# A verifier log big enough for alloc.c's programs when a load fails.
PROG_LOG_BYTES = 1 << 20
# Stack ids unused for this many drains (and not referred to by a live allocation) are deleted.
STACK_KEEP_DRAINS = 10
STACK_SWEEP_EVERY = 5
# (symbol, entry program, return program or None)
PROBES = (
    ("malloc", "alloc_malloc_enter", "alloc_return_probe"),
    ("calloc", "alloc_calloc_enter", "alloc_return_probe"),
    ("realloc", "alloc_realloc_enter", "alloc_return_probe"),
    ("free", "alloc_free_enter", None),
)
RETURN_PROGRAM = "alloc_return_probe"  # one link for the three returns
PROGRAMS = (*tuple(entry for _, entry, _ in PROBES), RETURN_PROGRAM)
_LIBC = re.compile(r"libc(?:\.so(?:\.\d+)*|-\d+\.\d+\.so)$")


@dataclass(frozen=True)
class BurstPlan:
    """When the uprobes are on: `duty_pct` of every BURST_PERIOD_S, the first SAMPLING_SHARE of it sampling."""

    duty_pct: float
    period_s: float = BURST_PERIOD_S

    @property
    def always(self) -> bool:
        return self.duty_pct >= 100

    @property
    def attached_s(self) -> float:
        return self.period_s * min(self.duty_pct, 100) / 100

    @property
    def sampling_s(self) -> float:
        return self.period_s if self.always else self.attached_s * SAMPLING_SHARE

    @property
    def scale(self) -> int:
        """What one sampled byte stands for: the period over the sampling phase (an integer, so that
        in-burst sample distance times scale is the configured distance)."""
        return 1 if self.always else max(1, round(self.period_s / self.sampling_s))

    @property
    def seen_free_share(self) -> float:
        """The chance that a free at a random instant falls in a burst (its probes attached)."""
        return 1.0 if self.always else self.attached_s / self.period_s

    def in_burst_sample_bytes(self, sample_bytes: int) -> int:
        """The mean distance between samples while sampling, for one per `sample_bytes` overall."""
        return 0 if sample_bytes == 0 else max(1, sample_bytes // self.scale)

    def phase(self, rng: random.Random) -> float:
        """Seconds from a period's start to its burst's."""
        return rng.uniform(0, max(0.0, self.period_s - self.attached_s))


class SampledTime:
    """What a sample stands for, by the clock: the time profiled (a target attached, not paused) over
    the time sampled, as they were, not as BurstPlan planned them (a burst that starts late on a
    loaded host, a pause, a target that came in the middle of a drain). Two stopwatches, "profiled"
    and "sampled"; take() reads and restarts what they ran since the last take() (one drain), the
    totals keep running (inuse, the unseen frees). Not locked: AllocTracer calls it under its lock."""

    WATCHES = ("profiled", "sampled")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: dict[str, float | None] = dict.fromkeys(self.WATCHES)
        self._run: dict[str, float] = dict.fromkeys(self.WATCHES, 0.0)
        self.total: dict[str, float] = dict.fromkeys(self.WATCHES, 0.0)

    def set(self, watch: str, on: bool) -> None:
        now, since = self._clock(), self._since[watch]
        if on and since is None:
            self._since[watch] = now
        elif not on and since is not None:
            self._run[watch] += now - since
            self._since[watch] = None

    def take(self) -> tuple[float, float]:
        """(profiled, sampled) seconds since the last take(); a watch running is counted to now."""
        now = self._clock()
        for w in self.WATCHES:
            since = self._since[w]
            if since is not None:
                self._run[w] += now - since
                self._since[w] = now
            self.total[w] += self._run[w]
        out = (self._run["profiled"], self._run["sampled"])
        self._run = dict.fromkeys(self.WATCHES, 0.0)
        return out

    @staticmethod
    def scale(profiled: float, sampled: float, planned: float) -> float:
        """What one sampled byte stands for; `planned` (BurstPlan.scale) when nothing was sampled."""
        return profiled / sampled if sampled > 0 else planned


def bpf_defines(sample_bytes: int, duty_pct: float = 100.0) -> dict[str, int]:
    return {
        "ALLOC_SAMPLE_BYTES": BurstPlan(duty_pct).in_burst_sample_bytes(sample_bytes),
        "ALLOC_COUNTS_ENTRIES": ALLOC_COUNTS_ENTRIES,
        "ALLOC_STACK_ENTRIES": ALLOC_STACK_ENTRIES,
        "ALLOC_LIVE_ENTRIES": ALLOC_LIVE_ENTRIES,
    }


def exp_quantiles(n: int = EXP_ENTRIES) -> list[int]:
    """n quantiles of Exp(1) at (i + 0.5) / n, scaled so their mean is exactly 1, in 16.16 fixed point:
    the mean distance between sample points is then the configured number of bytes."""
    q = [-math.log(1 - (i + 0.5) / n) for i in range(n)]
    mean = sum(q) / n
    return [max(1, round(x / mean * 65536)) for x in q]


def first_countdowns(n_cpus: int, sample_bytes: int, rng: random.Random) -> list[int]:
    """Each CPU's bytes to its first sample point: a draw, as every later one is (a countdown that
    starts at 0 samples each CPU's first allocation, whatever its size)."""
    q = exp_quantiles()
    return [max(1, sample_bytes * rng.choice(q) >> 16) for _ in range(n_cpus)]


def survivors_to_forget(debt: float, seen_freed: int, seen_share: float) -> tuple[int, float]:
    """(live entries of a stack to forget now, debt carried): each free of a survivor (an allocation
    that outlived its burst) the bursts saw stands for (1 - share) / share they could not see."""
    debt += seen_freed * (1 - seen_share) / seen_share
    n = int(debt + 1e-9)  # 0.95 / 0.05 is 18.999...: not one short
    return n, max(0.0, debt - n)


def libc_of(pid: int) -> str | None:
    """The path (inside the process's root) of the libc `pid` maps, or None."""
    for m in read_maps(pid):
        if _LIBC.search(m.path):
            return m.path
    return None


class _ProgLoadAttr(ctypes.Structure):
    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
        ("pad", ctypes.c_uint8 * 80),
    ]


class _UprobeMultiAttr(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("multi_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("pad", ctypes.c_uint8 * 84),
    ]


def load_uprobe_multi(bpf: Any, name: str) -> int:
    """Load bcc's compiled `name` as a uprobe_multi program (bcc 0.26 loads kprobe programs with no
    expected attach type, which BPF_LINK_CREATE refuses); it joins bpf.funcs, so bcc unloads it and
    the collector's run-time statistics count it."""
    from bcc import BPF  # only the collector imports bcc
    from bcc.libbcc import lib

    fn = name.encode()
    start, size = lib.bpf_function_start(bpf.module, fn), lib.bpf_function_size(bpf.module, fn)
    if not start:
        raise ValueError(f"no BPF program {name} in the compiled module")
    license = ctypes.c_char_p(lib.bpf_module_license(bpf.module))
    log_buf = ctypes.create_string_buffer(PROG_LOG_BYTES)
    attr = _ProgLoadAttr(
        prog_type=BPF_PROG_TYPE_KPROBE,
        insn_cnt=size // 8,
        insns=start,
        license=ctypes.cast(license, ctypes.c_void_p).value or 0,
        log_level=0,
        log_size=PROG_LOG_BYTES,
        log_buf=ctypes.addressof(log_buf),
        kern_version=lib.bpf_module_kern_version(bpf.module),
        prog_name=fn[:15],
        expected_attach_type=BPF_TRACE_UPROBE_MULTI,
    )
    try:
        fd = syscalls.bpf(syscalls.BPF_PROG_LOAD, attr)
    except OSError:
        attr.log_level = 1
        try:
            fd = syscalls.bpf(syscalls.BPF_PROG_LOAD, attr)
        except OSError as e:
            raise OSError(
                e.errno, f"loading {name}: {e.strerror}: {log_buf.value[-2000:].decode(errors='replace')}"
            ) from e
    bpf.funcs[fn] = BPF.Function(bpf, fn, fd)
    return fd


def open_link(prog_fd: int, path: bytes, offsets: list[int], pid: int, ret: bool) -> int:
    """A uprobe_multi link: `prog_fd` on `offsets` of the file `path`, in process `pid` only."""
    offs = (ctypes.c_uint64 * len(offsets))(*offsets)
    cpath = ctypes.c_char_p(path)
    attr = _UprobeMultiAttr(
        prog_fd=prog_fd,
        attach_type=BPF_TRACE_UPROBE_MULTI,
        path=ctypes.cast(cpath, ctypes.c_void_p).value or 0,
        offsets=ctypes.addressof(offs),
        cnt=len(offsets),
        multi_flags=BPF_F_UPROBE_MULTI_RETURN if ret else 0,
        pid=pid,
    )
    return syscalls.bpf(syscalls.BPF_LINK_CREATE, attr)


@dataclass
class _Attached:
    target: Target
    libc: str
    path: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)  # symbol -> file offset in libc, resolved once
    links: list[int] = field(default_factory=list)  # open link descriptors, return link first


class UprobeLinks:
    """The uprobe_multi links of bpf/alloc.c's programs on targets' libc: the programs loaded once,
    each target's links opened and closed at once from a pool of BURST_THREADS."""

    def __init__(self, bpf: Any, stats: dict[str, int]) -> None:
        self.prog_fds = {name: load_uprobe_multi(bpf, name) for name in PROGRAMS}
        self.stats = stats  # burst_attach_failed is counted here
        self._pool = ThreadPoolExecutor(BURST_THREADS, thread_name_prefix="alloc-probes")

    def attach(self, targets: list[_Attached], raise_errors: bool = False) -> None:
        """Each target's return link (malloc, calloc and realloc's returns), then its four entry links
        opened at once. An entry whose return goes unseen (a call that began before its return link)
        costs that one sample, no more (bpf/alloc.c replaces such a record; a burst's end clears them)."""
        failed: dict[int, Exception] = {}
        rets = [sym for sym, _e, ret in PROBES if ret]
        for group in (
            [(a, RETURN_PROGRAM, rets, True) for a in targets],
            [(a, entry, [sym], False) for a in targets for sym, entry, _r in PROBES],
        ):
            for (a, *_), r in zip(group, self._pool.map(self._open, group)):
                if isinstance(r, Exception):
                    failed.setdefault(a.target.pid, r)
                else:
                    a.links.append(r)
        bad = [a for a in targets if a.target.pid in failed]
        self.detach(bad)
        for a in bad:  # the process exited since the last scan: remove() follows
            if raise_errors:
                raise failed[a.target.pid]
            self.stats["burst_attach_failed"] += 1
            log.debug("allocation profiling: burst attach to pid %d: %s", a.target.pid, failed[a.target.pid])

    def _open(self, job: tuple[_Attached, str, list[str], bool]) -> int | Exception:
        a, prog, syms, ret = job
        try:
            return open_link(self.prog_fds[prog], a.path, [a.offsets[s] for s in syms], a.target.pid, ret)
        except OSError as e:
            return e

    def detach(self, targets: list[_Attached]) -> None:
        """Every link of `targets` closed at once: each close removes its breakpoints, then waits out
        a grace period."""
        links = [fd for a in targets for fd in a.links]
        for a in targets:
            a.links.clear()
        list(self._pool.map(os.close, links))

    def close(self) -> None:
        self._pool.shutdown()


class AllocMaps:
    """bpf/alloc.c's maps as the tracer reads them: the double-buffered counts and their losses, the
    stack map and the lifetime of its ids, the live allocations and the frees of survivors the
    bursts saw."""

    def __init__(self, bpf: Any) -> None:
        self.buffers = DoubleBuffer(bpf, "alloc")
        self.lost = LostCounters(bpf["alloc_lost"], LOST_REASONS[:4])
        self.stacks = bpf["alloc_stacks"]
        self.live = bpf["alloc_live"]
        self.pending = bpf["alloc_pending"]
        self.survivors_freed = bpf["alloc_survivors_freed"]
        self._debt: dict[tuple[int, int, int], float] = defaultdict(float)
        self._last_used: dict[int, int] = {}
        self.drains = 0

    def forget_live(self, pids: set[int]) -> int:
        """The live entries of `pids` deleted; how many."""
        keys = [k for k in self.live if k.pid in pids]
        for k in keys:
            with contextlib.suppress(KeyError):
                del self.live[k]
        return len(keys)

    def forget_unseen_frees(self, seen_share: Callable[[], float]) -> int:
        """For each free of a survivor the bursts saw, forget the (1 - share) / share live entries of
        its stack (the oldest) whose frees fell between bursts; returns how many were forgotten."""
        seen = {(k.pid, k.user_stack, k.caller): v.value for k, v in self.survivors_freed.items()}
        if not seen:
            return 0
        self.survivors_freed.clear()
        due: dict[tuple[int, int, int], int] = {}
        for key, n in seen.items():
            due[key], self._debt[key] = survivors_to_forget(self._debt[key], n, seen_share())
        by_stack: dict[tuple[int, int, int], list[tuple[int, Any]]] = defaultdict(list)
        for k, v in self.live.items():
            key = (k.pid, v.user_stack, v.caller)
            if due.get(key):
                by_stack[key].append((v.burst, k))
        forgotten = 0
        for key, entries in by_stack.items():
            entries.sort(key=lambda e: e[0])
            for _, k in entries[: due[key]]:
                try:
                    del self.live[k]
                    forgotten += 1
                except KeyError:
                    pass
        return forgotten

    def live_rows(
        self, attached: Container[int], scales: dict[int, float], overall: float
    ) -> list[tuple[int, int, int, int, int, int]]:
        """The live allocations of `attached` processes by stack, each scaled by its burst's scale
        (`overall` for a burst no longer kept); the entries of other processes deleted."""
        sums: dict[tuple[int, int, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
        gone: list[Any] = []  # entries of processes no longer attached (exited while paused)
        for k, v in self.live.items():
            if k.pid not in attached:
                gone.append(k)
                continue
            s = sums[(k.pid, v.tid, v.user_stack, v.caller)]
            x = scales.get(v.burst, overall)
            s[0] += v.objects_milli * x
            s[1] += v.bytes * x
        for k in gone:
            with contextlib.suppress(KeyError):
                del self.live[k]
        return [(*key, round(o), round(b)) for key, (o, b) in sums.items()]

    def raw(self, rows: list[tuple[int, int, int, int, int, int]], inuse: bool) -> RawDrain:
        """`rows` (pid, tid, stack id, caller, objects x 1000, bytes) as a RawDrain, with their stacks."""
        out = RawDrain()
        ids: dict[tuple[int, int], int] = {}
        walked: dict[int, tuple[int, ...] | None] = {}
        gone = 0
        for pid, tid, sid, caller, objects_milli, nbytes in rows:
            key = (sid, caller)
            uid = ids.get(key)
            if uid is None:
                frames: tuple[int, ...] = ()
                if sid >= 0:
                    if sid not in walked:
                        try:
                            walked[sid] = tuple(self.stacks.walk(sid))
                        except KeyError:
                            walked[sid] = None
                    stack = walked[sid]
                    if stack is None:
                        gone += 1
                    else:
                        frames = stack
                        self._last_used[sid] = self.drains
                if caller:  # the frame the entry probe's walk skipped
                    frames = (*frames[:1], caller, *frames[1:])
                uid = ids[key] = len(ids)
                out.user_stacks[uid] = frames
            objects = (objects_milli + 500) // 1000
            if inuse:
                out.samples.append((pid, tid, uid, -1, 0, 0, (objects, nbytes)))
            else:
                out.samples.append((pid, tid, uid, -1, objects, nbytes, (0, 0)))
        if gone:
            out.lost["stack_gone"] = gone
        return out

    def sweep(self) -> None:
        """Delete the stack ids unused for STACK_KEEP_DRAINS drains that no live or pending entry refers to."""
        present = [k.value for k in self.stacks]
        for sid in present:  # an id no drain has used yet may belong to a call still in progress: young
            self._last_used.setdefault(sid, self.drains)
        keep = {v.user_stack for v in self.live.values()} | {v.user_stack for v in self.pending.values()}
        delete_stacks(self.stacks, stale_ids(present, keep, self._last_used, self.drains - STACK_KEEP_DRAINS))


def _seed_sampling(bpf: Any, plan: BurstPlan, sample_bytes: int, rng: random.Random) -> None:
    """The sampling table (alloc_exp) and each CPU's first countdown (alloc_left)."""
    table = bpf["alloc_exp"]
    for i, v in enumerate(exp_quantiles()):
        table[ctypes.c_int(i)] = ctypes.c_uint32(v)
    left = bpf["alloc_left"]
    left[ctypes.c_int(0)] = left.Leaf(*first_countdowns(left.total_cpu, plan.in_burst_sample_bytes(sample_bytes), rng))


def _no_cap_hint() -> str:
    """Why an attach may have failed, when the collector lacks CAP_SYS_ADMIN."""
    if privileges.held()["CapEff"] >> privileges.CAP_SYS_ADMIN & 1:
        return ""
    return (
        " (the collector lacks CAP_SYS_ADMIN, which creating a uprobe takes on Linux 6.16+: under "
        'systemd add it with a drop-in, see README "Allocation and lock profiles")'
    )


def _log_ready(plan: BurstPlan, sample_bytes: int) -> None:
    """The tracer's first log line: how it samples."""
    how = f"one sample per {sample_bytes} bytes on average" if sample_bytes else "every allocation"
    when = (
        "uprobes attached all the time"
        if plan.always
        else f"uprobes attached {plan.attached_s * 1e3:.0f} ms of every {plan.period_s:g} s at a "
        f"random phase ({plan.sampling_s * 1e3:.0f} ms sampling, one per "
        f"{plan.in_burst_sample_bytes(sample_bytes)} bytes, scaled x{plan.scale})"
    )
    log.info(
        "allocation profiling ready: uprobes on libc malloc, calloc, realloc, free of target processes; %s; %s",
        how,
        when,
    )


class AllocTracer(TargetedSource):
    profile_type = PROFILE_TYPE
    dwarf = False  # bpf/alloc.c has no DWARF path: its stacks are the stack map's frame-pointer walks

    def __init__(self, bpf: Any, sample_bytes: int, duty_pct: float = 100.0) -> None:
        self.sample_bytes = sample_bytes
        self.plan = BurstPlan(duty_pct)
        self.stats = {
            "attached": 0,
            "attach_failed": 0,
            "no_libc": 0,
            "over_cap": 0,
            "detached": 0,
            "bursts": 0,
            "burst_attach_failed": 0,
            "survivors_forgotten": 0,
        }
        self.probes = UprobeLinks(bpf, self.stats)
        self._rng = random.Random()
        _seed_sampling(bpf, self.plan, sample_bytes, self._rng)
        self._state = bpf["alloc_state"]
        self._burst = 0
        self._set_state(sampling=self.plan.always)
        self.maps = AllocMaps(bpf)
        self.attached: dict[int, _Attached] = {}  # targets (their probes on in bursts, or always)
        self.waiting: dict[int, Target] = {}  # targets while paused
        self.paused = False
        self._lock = threading.RLock()  # attached, the probes, alloc_state: the burst thread and the loop
        self._stop = threading.Event()
        self.on_s = 0.0  # probes attached, summed over bursts
        # The clock of the estimate: what a sample stands for is the time profiled over the time
        # sampled, as they were, not as planned (a burst that starts late, a detach that waits out a
        # grace period, a loaded host: the plan's one burst a period is not what happens).
        self._time = SampledTime()
        self._burst_scale: OrderedDict[int, float] = OrderedDict()  # burst -> the scale of the drain that took it
        self._scaled_through = 0
        self._thread: threading.Thread | None = None
        if not self.plan.always:
            self._thread = threading.Thread(target=self._bursts, name="alloc-bursts", daemon=True)
            self._thread.start()
        _log_ready(self.plan, sample_bytes)

    def _set_state(self, sampling: bool) -> None:
        st = self._state[ctypes.c_int(0)]
        st.sampling = int(sampling)
        st.burst = self._burst
        self._state[ctypes.c_int(0)] = st

    # ------------------------------------------------------------ targets

    def add(self, t: Target) -> None:
        with self._lock:
            if self.paused:
                self.waiting[t.pid] = t
                return
            a = self._resolve(t)
            if a is None:
                return
            self.attached[t.pid] = a
            self._clock_profiling()
            self.stats["attached"] += 1
            self._log_attached(a)

    def _resolve(self, t: Target) -> _Attached | None:
        """`t`'s libc and the offsets of its allocator (its probes attached at once when always on);
        None, counted and logged, when it cannot be profiled."""
        if len(self.attached) >= MAX_ALLOC_PROCESSES:
            self.stats["over_cap"] += 1
            log.warning(
                "allocation profiling: %d processes attached already (the cap); pid %d (%s) is not profiled",
                MAX_ALLOC_PROCESSES,
                t.pid,
                t.executable,
            )
            return None
        libc = libc_of(t.pid)
        if libc is None:
            self.stats["no_libc"] += 1
            log.warning(
                "allocation profiling: pid %d (%s) maps no libc (static, or another allocator only); not profiled",
                t.pid,
                t.executable,
            )
            return None
        from bcc import BPF  # only the collector imports bcc

        path = f"/proc/{t.pid}/root{libc}".encode()
        a = _Attached(t, libc, path)
        try:
            for sym, _entry, _ret in PROBES:
                a.offsets[sym] = BPF._check_path_symbol(path, sym.encode(), None, t.pid)[1]
            if self.plan.always:
                self.probes.attach([a], raise_errors=True)
        except Exception as e:  # bcc raises bare Exception, the kernel OSError; the process may have exited
            self.probes.detach([a])
            self.stats["attach_failed"] += 1
            log.warning(
                "allocation profiling: cannot attach to pid %d (%s): %s%s", t.pid, t.executable, e, _no_cap_hint()
            )
            return None
        return a

    def _log_attached(self, a: _Attached) -> None:
        t, n = a.target, 2 * len(PROBES) - 1
        if self.plan.always:
            log.info(
                "allocation profiling: %d uprobes attached to pid %d (%s, target %r) in %s (%d links)",
                n,
                t.pid,
                t.executable,
                t.spec,
                a.libc,
                len(a.links),
            )
        else:
            log.info(
                "allocation profiling: %d uprobes resolved in pid %d (%s, target %r) in %s; attached in "
                "bursts of %.0f ms a second",
                n,
                t.pid,
                t.executable,
                t.spec,
                a.libc,
                self.plan.attached_s * 1e3,
            )

    def target_pids(self) -> set[int]:
        return set(self.attached)

    def snapshot(self) -> RawDrain:
        """The live allocations, once per upload window (inuse())."""
        return self.inuse()

    def counts(self) -> dict[str, int]:
        return dict(self.stats)

    def remove(self, t: Target) -> None:
        with self._lock:
            self.waiting.pop(t.pid, None)
            a = self.attached.pop(t.pid, None)
            if a is None:
                return
            self._clock_profiling()
            self.probes.detach([a])
            self.stats["detached"] += 1
            dropped = self.maps.forget_live({t.pid})
        log.info(
            "allocation profiling: pid %d (%s) is gone: uprobes detached, %d live allocations forgotten",
            t.pid,
            t.executable,
            dropped,
        )

    # ------------------------------------------------------------ bursts

    def _bursts(self) -> None:
        """One burst a period at a random phase, until close()."""
        period_start = time.monotonic()
        while not self._stop.is_set():
            start = period_start + self.plan.phase(self._rng)
            period_start += self.plan.period_s
            if self._stop.wait(max(0.0, start - time.monotonic())):
                return
            try:
                self.burst()
            except Exception:  # a burst that failed must not end profiling; its probes are off (burst's finally)
                log.exception("allocation profiling: a burst failed")
            now = time.monotonic()
            period_start = max(period_start, now)

    def burst(self) -> None:
        """Probes on for the sampling phase, sampling off for the tail, probes off; then no thread's
        pending record can wait for a return any more."""
        with self._lock:
            if self.paused or not self.attached:
                return
            self._burst += 1
            self._set_state(sampling=True)
            self.probes.attach(list(self.attached.values()))
            on = time.monotonic()  # the entry probes went on last
            self._time.set("sampled", True)
        try:
            self._stop.wait(max(0.0, self.plan.sampling_s - (time.monotonic() - on)))
            with self._lock:
                self._end_sampling()
            self._stop.wait(max(0.0, self.plan.attached_s - (time.monotonic() - on)))
        finally:
            with self._lock:
                self._end_sampling()
                off = time.monotonic()
                self.probes.detach(list(self.attached.values()))
                self.maps.pending.clear()
                self.on_s += off - on
                self.stats["bursts"] += 1

    def _end_sampling(self) -> None:
        """The sampling phase is over (if it was on): sampling off in the kernel, its time counted."""
        self._set_state(sampling=False)
        self._time.set("sampled", False)

    def _clock_profiling(self) -> None:
        """The profiled time runs while a target is attached and profiling is not paused (called under
        the lock as they change); with probes always on, it is sampled time too."""
        on = bool(self.attached) and not self.paused
        self._time.set("profiled", on)
        if self.plan.always:
            self._time.set("sampled", on)

    def _seen_free_share(self) -> float:
        """The share of the time the probes were attached (a free then is seen), since start."""
        with self._lock:
            profiled = self._time.total["profiled"]
            if self.plan.always or profiled <= 0 or self._time.total["sampled"] <= 0:
                return self.plan.seen_free_share
            return min(1.0, max(1e-3, self.on_s / profiled))

    def attach(self) -> None:
        """After detach(): every target again."""
        with self._lock:
            if not self.paused:
                return
            self.paused = False
            waiting, self.waiting = self.waiting, {}
            for t in waiting.values():
                self.add(t)
        log.info("allocation profiling attached again to %d processes", len(self.attached))

    def detach(self) -> None:
        """Every uprobe off (remote config paused profiling, or the collector stops); targets are kept."""
        with self._lock:
            if self.paused:
                return
            self.probes.detach(list(self.attached.values()))
            for pid, a in list(self.attached.items()):
                self.waiting[pid] = a.target
            self.attached.clear()
            self.maps.live.clear()
            self.paused = True
            self._clock_profiling()
        log.info("allocation profiling detached")

    # ------------------------------------------------------------ maps

    def drain(self) -> RawDrain:
        """The allocations counted since the previous drain, scaled from the sampling phases to the
        whole time: count and value are (objects, bytes)."""
        self.maps.drains += 1
        _, counts = self.maps.buffers.retire()
        with self._lock:
            x = SampledTime.scale(*self._time.take(), self.plan.scale)
            # the live allocations of these bursts keep this scale (inuse): a leak that stopped
            # growing keeps its size, not one that moves with the next drain's timing
            for b in range(self._scaled_through + 1, self._burst + 1):
                self._burst_scale[b] = x
            self._scaled_through = self._burst
            while len(self._burst_scale) > BURST_SCALES_KEPT:
                self._burst_scale.popitem(last=False)
        rows = [
            (k.pid, k.tid, k.user_stack, k.caller, round(v.objects_milli * x), round(v.bytes * x))
            for k, v in take_all(counts)
        ]
        out = self.maps.raw(rows, inuse=False)
        out.lost.update(self.maps.lost.delta())
        if self.maps.drains % STACK_SWEEP_EVERY == 0:
            self.forget_unseen_frees()
            self.maps.sweep()
        return out

    def forget_unseen_frees(self) -> int:
        """For each free of a survivor the bursts saw, forget the (1 - share) / share live entries of
        its stack (the oldest) whose frees fell between bursts; returns how many were forgotten."""
        forgotten = self.maps.forget_unseen_frees(self._seen_free_share)
        self.stats["survivors_forgotten"] += forgotten
        return forgotten

    def inuse(self) -> RawDrain:
        """Allocations sampled and not freed, by stack, scaled like drain(): extra values (inuse
        objects, inuse bytes)."""
        self.forget_unseen_frees()
        with self._lock:
            overall = SampledTime.scale(self._time.total["profiled"], self._time.total["sampled"], self.plan.scale)
            scales = dict(self._burst_scale)
        return self.maps.raw(self.maps.live_rows(self.attached, scales, overall), inuse=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self.probes.detach(list(self.attached.values()))
            self.attached.clear()
        self.probes.close()
        if self.stats["bursts"]:
            log.info("allocation profiling: %d bursts, probes attached %.1f s in all", self.stats["bursts"], self.on_s)
