"""The wire format between stages: versioned messages, one encode, one decode.

Owns: every message that crosses a socket between stages (StackBatch
collector → symbolizer, with the UnwindRequests it carries; UnwindTable
symbolizer → collector; ProfileUpload symbolizer or runtime reader → uploader;
ProcessAnnouncement and RegsBatch collector → runtime readers; PythonProcess
runtime reader → collector, the answer to an announcement; PythonNameRequest
and PythonNames between a symbolizer and the runtime reader; FileRequest and
FileReply between a symbolizer and the collector's file broker), its version,
its size caps and its validation, and the splitting of a StackBatch or a
ProcessAnnouncement over MAX_BATCH_BYTES into parts that fit (encode_within). A message is a list of frames: frame 0 is a
JSON header {"v": WIRE_VERSION, "kind": ..., "body": {...}}; a ProfileUpload
carries the gzip pprof as frame 1, untouched, a RegsBatch its samples' stack
copies end to end as frame 1, and an UnwindTable its table
(shared/unwind_table.py format, checked by its reader) as frame 1. File messages are one frame,
one Unix datagram each (the file descriptor travels beside it as SCM_RIGHTS).

decode() treats its input as hostile: anything malformed, of another version
or over a cap raises WireError, which receivers count, log and skip.

Must not: open sockets, or know what a stage does with a message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from shared import runtime_registry
from shared.safestr import cut, quote

WIRE_VERSION = 1

# A drained second of a busy 64-CPU host at 999 Hz is a few MB of JSON; 64 MiB
# leaves room while bounding what one message can make a worker allocate. Senders
# split a larger StackBatch or ProcessAnnouncement (encode_within), never drop it whole.
MAX_BATCH_BYTES = 64 << 20
# What a stage's receiving socket lets in (ZMQ_MAXMSGSIZE, per frame). ZeroMQ answers a larger frame
# by dropping the connection, and with it everything queued on it, silently: the slack lets a frame
# a little over MAX_BATCH_BYTES reach decode(), which refuses it with a counted, logged WireError.
RECEIVE_LIMIT_BYTES = MAX_BATCH_BYTES + (64 << 10)
# A gzip pprof of one service and window; larger ones are a bug or an attack.
MAX_PROFILE_BYTES = 32 << 20
# Bounds on counts inside one message, so a small message cannot claim a huge one.
MAX_STACK_DEPTH = 512  # kernel limit is 127 frames per stack, DWARF walks 64
MAX_MAPPINGS_PER_PROCESS = 65536  # vm.max_map_count default is 65530
MAX_ITEMS = 10_000_000  # samples, stacks, processes in one batch
MAX_STRING = 4096  # paths, names, labels
U64 = (1 << 64) - 1

# The runtime readers' types follow from the registry.
PROFILE_TYPES = ("cpu", "offcpu", "alloc", "lock", *runtime_registry.PROFILE_TYPES)
# Values a sample carries beyond (count, value): alloc's inuse objects and bytes.
MAX_EXTRA_VALUES = 2
# An unwind table of one module: /usr/bin/node's is ~400K rows (6.4 MB); 64 MiB
# is ten times that and bounds what one answer can make the collector hold.
MAX_UNWIND_TABLE_BYTES = 64 << 20
# Unwind requests in one batch: the collector asks for a few modules per drain.
MAX_UNWIND_REQUESTS = 4096
UNWIND_STATUSES = ("ok", "none", "failed")
# Processes (new or exited) in one announcement: the collector sends the rest in the next one.
MAX_ANNOUNCED_PROCESSES = 4096
# On-CPU samples with registers in one RegsBatch: a drain of a 64-CPU host at 999 Hz is ~64K;
# the collector sends the rest in the next message.
MAX_REGS_SAMPLES = 65536
# Bytes of stack a RegsSample carries at most (bpf/oncpu.c copies ONCPU_REGS_STACK_BYTES).
MAX_REGS_STACK_BYTES = 4096
# Frames of a Python stack (bpf/python.h keeps PY_MAX_FRAMES = 64).
MAX_PYTHON_FRAMES = 256
# Frames named in one request or answer: a symbolizer asks for a batch's new frames of one process.
MAX_PYTHON_NAMES = 4096
# An offset in a PythonLayout: CPython's structs are a few KB.
MAX_PYTHON_OFFSET = 1 << 16


class WireError(ValueError):
    """A message that is not a valid message of this version; `reason` names the check that refused
    it, as a counter's name (receivers count refusals per reason, for `ebpfprofiler status`)."""

    # The reasons: another wire version; a frame over its byte cap; anything else malformed.
    REASONS = ("wire_version", "over_cap", "malformed")

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Mapping:
    """One executable mapping of a process, as /proc/<pid>/maps gives it."""

    start: int
    end: int
    offset: int
    path: str  # "" for anonymous memory; "[vdso]" and the like for special ones
    dev: str = ""  # "fd:01"
    inode: int = 0


@dataclass(frozen=True, slots=True)
class Process:
    """What the collector knows of a process; (pid, start_ticks) is its identity."""

    pid: int
    start_ticks: int  # field 22 of /proc/<pid>/stat: a reused pid is a new process
    uid: int
    nspid: int  # pid inside its pid namespace (names /tmp/perf-<nspid>.map)
    comm: str
    executable: str  # "" for kernel threads
    service: str  # container id, else executable, else "[kernel]"
    container_id: str = ""
    pod_uid: str = ""
    cmdline: tuple[str, ...] | None = None  # None unless strip_process_args is false
    mappings: tuple[Mapping, ...] = ()


@dataclass(frozen=True, slots=True)
class Sample:
    """Aggregated samples of one (pid, tid, user stack, kernel stack)."""

    pid: int
    tid: int
    user_stack: int  # index into StackBatch.user_stacks, -1 if none
    kernel_stack: int  # index into StackBatch.kernel_stacks, -1 if none
    count: int  # samples (cpu), blocking intervals (offcpu), waits (lock), allocations (alloc)
    value: int  # nanoseconds: on-CPU, blocked or waiting time; bytes (alloc)
    extra: tuple[int, ...] = ()  # alloc: (inuse objects, inuse bytes); at most MAX_EXTRA_VALUES
    python_stack: int = -1  # index into StackBatch.python_stacks, -1 if none


@dataclass(frozen=True, slots=True)
class PyFrameRef:
    """One Python frame as the walk in BPF saw it (bpf/python.h): named later, by the runtime reader."""

    code: int  # the code object's address in the process
    instr: int | None  # bytes from the code's first code unit to its instruction; None: not started
    entry: bool  # the first frame of its _PyEval_EvalFrameDefault call


@dataclass(frozen=True, slots=True)
class PythonStack:
    """The Python frames of a sample, leaf first (collector/pywalk.py)."""

    frames: tuple[PyFrameRef, ...]
    truncated: bool = False  # frames were left out at the leaf end (a deep stack keeps its root-most)
    cut: bool = False  # the walk ended at a frame that failed validation


@dataclass(frozen=True, slots=True)
class UnwindRequest:
    """The collector asks for the unwind table of the module pid maps at [start, end)."""

    pid: int
    start_ticks: int  # the process it means (a reused pid is refused by the file broker)
    start: int
    end: int
    dev: str  # the module's identity, as /proc/<pid>/maps gives it
    inode: int


@dataclass(frozen=True, slots=True)
class UnwindTable:
    """A symbolizer's answer to an UnwindRequest: the module's table, or why there is none."""

    dev: str
    inode: int
    path: str
    build_id: str  # "" when the module has none
    status: str  # one of UNWIND_STATUSES: ok (table attached), none (no CFI), failed
    reason: str = ""
    table: bytes = b""  # shared/unwind_table.py format when status is ok


@dataclass(frozen=True, slots=True)
class StackBatch:
    """One drain of one profile type's BPF maps, for the services routed to one worker."""

    host: str
    profile_type: str
    sample_hz: int
    time_ns: int  # wall clock of the drain (unix ns)
    processes: tuple[Process, ...]
    user_stacks: tuple[tuple[int, ...], ...]  # addresses, leaf first
    kernel_stacks: tuple[tuple[int, ...], ...]
    samples: tuple[Sample, ...]
    kernel_symbols: dict[int, str] = field(default_factory=dict)  # address → name
    lost: dict[str, int] = field(default_factory=dict)  # reason → samples
    unwind_requests: tuple[UnwindRequest, ...] = ()
    python_stacks: tuple[PythonStack, ...] = ()


@dataclass(frozen=True, slots=True)
class ProfileUpload:
    """One gzip pprof of one service, window and profile type."""

    profile_id: str
    host: str
    service: str
    profile_type: str
    window_start_ns: int
    window_end_ns: int
    samples: int
    pprof_gz: bytes


@dataclass(frozen=True, slots=True)
class ProcessAnnouncement:
    """The collector tells runtime readers which processes run (without mappings) and which exited.

    `full` marks a periodic re-announcement of every live process the collector
    has announced, so a reader that started (or restarted) late catches up."""

    host: str
    time_ns: int
    processes: tuple[Process, ...]
    exited: tuple[tuple[int, int], ...] = ()  # (pid, start_ticks)
    full: bool = False


@dataclass(frozen=True, slots=True)
class RegsSample:
    """One on-CPU sample of a thread of a process the collector marked (collector/regs.py): its user
    registers when it was taken, and a copy of its stack from sp up (len(stack) bytes; may be empty)."""

    pid: int
    start_ticks: int
    tid: int
    time_ns: int  # CLOCK_MONOTONIC of the sample
    ip: int
    sp: int
    fp: int
    stack: bytes


@dataclass(frozen=True, slots=True)
class RegsBatch:
    """The collector tells runtime readers the on-CPU samples of marked processes, with their registers;
    each sample stands for period_ns of CPU time."""

    host: str
    time_ns: int
    period_ns: int
    samples: tuple[RegsSample, ...]


@dataclass(frozen=True, slots=True)
class PythonLayout:
    """Where a CPython version keeps what the walk in BPF reads (collector/pywalk.py Layout), in bytes."""

    runtime_interpreters_head: int
    interp_threads_head: int
    tstate_next: int
    tstate_thread_id: int
    tstate_current_frame: int
    cframe_current_frame: int | None  # 3.11/3.12
    frame_previous: int
    frame_executable: int
    frame_instr_ptr: int
    frame_owner: int
    frame_is_entry: int | None  # 3.11
    code_adaptive: int
    skip_owners: frozenset[int]
    tag_mask: int


@dataclass(frozen=True, slots=True)
class PythonProcess:
    """A runtime reader answers the collector's announcement of a process it found to be CPython: where
    its _PyRuntime is, and its version's layout, for the walk in BPF (collector/pywalk.py)."""

    pid: int
    start_ticks: int
    version: str
    runtime: int
    layout: PythonLayout


@dataclass(frozen=True, slots=True)
class PythonNameRequest:
    """A symbolizer asks the runtime reader to name Python frames of one process: (code, instr) pairs as
    the walk recorded them (PyFrameRef; instr -1: not started)."""

    request_id: int
    pid: int
    start_ticks: int
    frames: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class PythonNames:
    """The runtime reader's answer: (code, instr, function, file, line) of each frame it could name (the
    others are left out: not a code object of that process, or the process is gone)."""

    request_id: int
    pid: int
    start_ticks: int
    names: tuple[tuple[int, int, str, str, int], ...]


# PythonLayout's offsets, as a PythonProcess carries them (the two optional ones absent when None).
PYTHON_LAYOUT_OFFSETS = (
    "runtime_interpreters_head",
    "interp_threads_head",
    "tstate_next",
    "tstate_thread_id",
    "tstate_current_frame",
    "cframe_current_frame",
    "frame_previous",
    "frame_executable",
    "frame_instr_ptr",
    "frame_owner",
    "frame_is_entry",
    "code_adaptive",
)
_OPTIONAL_PYTHON_OFFSETS = frozenset({"cframe_current_frame", "frame_is_entry"})

FILE_KINDS = ("module", "perf_map", "debug")
# gone: the process exited (or its pid is another process's): says nothing about the file.
FILE_ERRORS = ("missing", "gone", "refused", "unreadable", "bad_request")
# A file request or reply is a few hundred bytes.
MAX_FILE_MESSAGE_BYTES = 8192
# A build id in a debug file request, in hex: SHA-1 ids are 40; longer ones have no debug files to name.
MAX_BUILD_ID_HEX = 64
_LOWER_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class FileRequest:
    """A symbolizer asks the collector to open a file of a profiled process."""

    pid: int
    start_ticks: int  # the process it means: a reused pid is refused
    kind: str  # "module": the executable mapping [start, end); "perf_map": /tmp/perf-<nspid>.map;
    start: int = 0  # "debug": the separate debug file of build_id (process's root, else host's)
    end: int = 0
    build_id: str = ""  # lowercase hex, in "debug" requests only


@dataclass(frozen=True, slots=True)
class FileReply:
    """The answer: ok (the descriptor comes with it), or why not."""

    ok: bool
    error: str = ""  # one of FILE_ERRORS when not ok
    reason: str = ""


Message = (
    StackBatch
    | ProfileUpload
    | FileRequest
    | FileReply
    | UnwindTable
    | ProcessAnnouncement
    | RegsBatch
    | PythonProcess
    | PythonNameRequest
    | PythonNames
)


def encode(msg: Message) -> list[bytes]:
    """The ZeroMQ frames of a message."""
    for cls, encoder in _ENCODERS.items():
        if isinstance(msg, cls):
            return encoder(msg)
    raise TypeError(f"not a wire message: {type(msg).__name__}")


def _encode_stack_batch(msg: StackBatch) -> list[bytes]:
    body = {
        "host": msg.host,
        "profile_type": msg.profile_type,
        "sample_hz": msg.sample_hz,
        "time_ns": msg.time_ns,
        "processes": [_process_json(p) for p in msg.processes],
        "user_stacks": msg.user_stacks,
        "kernel_stacks": msg.kernel_stacks,
        "samples": [[s.pid, s.tid, s.user_stack, s.kernel_stack, s.count, s.value, *s.extra] for s in msg.samples],
        "kernel_symbols": [[a, n] for a, n in msg.kernel_symbols.items()],
        "lost": msg.lost,
        "unwind_requests": [[r.pid, r.start_ticks, r.start, r.end, r.dev, r.inode] for r in msg.unwind_requests],
    }
    if msg.python_stacks:
        body["python_stacks"] = [_python_stack_json(st) for st in msg.python_stacks]
        body["python_samples"] = [[i, s.python_stack] for i, s in enumerate(msg.samples) if s.python_stack >= 0]
    return [_header("stack_batch", body)]


def _python_stack_json(st: PythonStack) -> list[Any]:
    frames = [[f.code, -1 if f.instr is None else f.instr, int(f.entry)] for f in st.frames]
    return [frames, int(st.truncated) | int(st.cut) << 1]


def _encode_python_process(msg: PythonProcess) -> list[bytes]:
    lay = msg.layout
    layout = {k: getattr(lay, k) for k in PYTHON_LAYOUT_OFFSETS if getattr(lay, k) is not None}
    body = {
        "pid": msg.pid,
        "start_ticks": msg.start_ticks,
        "version": msg.version,
        "runtime": msg.runtime,
        "layout": layout,
        "skip_owners": sorted(lay.skip_owners),
        "tag_mask": lay.tag_mask,
    }
    return [_header("python_process", body)]


def _encode_python_name_request(msg: PythonNameRequest) -> list[bytes]:
    body = {"request_id": msg.request_id, "pid": msg.pid, "start_ticks": msg.start_ticks, "frames": msg.frames}
    return [_header("python_name_request", body)]


def _encode_python_names(msg: PythonNames) -> list[bytes]:
    body = {"request_id": msg.request_id, "pid": msg.pid, "start_ticks": msg.start_ticks, "names": msg.names}
    return [_header("python_names", body)]


def _encode_unwind_table(msg: UnwindTable) -> list[bytes]:
    body = {
        "dev": msg.dev,
        "inode": msg.inode,
        "path": msg.path,
        "build_id": msg.build_id,
        "status": msg.status,
        "reason": msg.reason,
    }
    return [_header("unwind_table", body), msg.table]


def _encode_profile(msg: ProfileUpload) -> list[bytes]:
    body = {
        "profile_id": msg.profile_id,
        "host": msg.host,
        "service": msg.service,
        "profile_type": msg.profile_type,
        "window_start_ns": msg.window_start_ns,
        "window_end_ns": msg.window_end_ns,
        "samples": msg.samples,
    }
    return [_header("profile", body), msg.pprof_gz]


def _encode_announcement(msg: ProcessAnnouncement) -> list[bytes]:
    body = {
        "host": msg.host,
        "time_ns": msg.time_ns,
        "full": msg.full,
        "processes": [_process_json(p) for p in msg.processes],
        "exited": [[pid, ticks] for pid, ticks in msg.exited],
    }
    return [_header("process_announcement", body)]


def _encode_regs_batch(msg: RegsBatch) -> list[bytes]:
    body = {
        "host": msg.host,
        "time_ns": msg.time_ns,
        "period_ns": msg.period_ns,
        "samples": [[r.pid, r.start_ticks, r.tid, r.time_ns, r.ip, r.sp, r.fp, len(r.stack)] for r in msg.samples],
    }
    return [_header("regs_batch", body), b"".join(r.stack for r in msg.samples)]


def _encode_file_request(msg: FileRequest) -> list[bytes]:
    body = {
        "pid": msg.pid,
        "start_ticks": msg.start_ticks,
        "kind": msg.kind,
        "start": msg.start,
        "end": msg.end,
        "build_id": msg.build_id,
    }
    return [_header("file_request", body)]


def _encode_file_reply(msg: FileReply) -> list[bytes]:
    return [_header("file_reply", {"ok": msg.ok, "error": msg.error, "reason": msg.reason})]


# Each message class's encoder, in the order encode() tries them.
_ENCODERS: dict[type, Callable[[Any], list[bytes]]] = {
    StackBatch: _encode_stack_batch,
    UnwindTable: _encode_unwind_table,
    ProfileUpload: _encode_profile,
    ProcessAnnouncement: _encode_announcement,
    RegsBatch: _encode_regs_batch,
    FileRequest: _encode_file_request,
    FileReply: _encode_file_reply,
    PythonProcess: _encode_python_process,
    PythonNameRequest: _encode_python_name_request,
    PythonNames: _encode_python_names,
}


def decode(frames: Sequence[bytes]) -> Message:
    """The message in `frames`; WireError if it is not a valid one."""
    if not frames or len(frames) > 2:
        raise WireError(f"expected 1 or 2 frames, got {len(frames)}")
    head = frames[0]
    if len(head) > MAX_BATCH_BYTES:  # json_object's own check, with its reason
        raise WireError(f"header of {len(head)} bytes is over the cap of {MAX_BATCH_BYTES}", "over_cap")
    doc = json_object(head, MAX_BATCH_BYTES, "header")
    if doc.get("v") != WIRE_VERSION:
        raise WireError(f"wire version {quote(doc.get('v'))}, this build speaks {WIRE_VERSION}", "wire_version")
    kind, body = doc.get("kind"), doc.get("body")
    if not isinstance(body, dict):
        raise WireError("body is not a JSON object")
    try:
        if isinstance(kind, str) and kind in _FILE_KINDS:
            if len(frames) != 1 or len(head) > MAX_FILE_MESSAGE_BYTES:
                raise WireError(f"a {kind} is one frame of at most {MAX_FILE_MESSAGE_BYTES} bytes")
            return _FILE_KINDS[kind](body)
        k = _KINDS.get(kind) if isinstance(kind, str) else None
        if k is None:
            raise WireError(f"unknown message kind {quote(kind)}")
        if len(frames) != k.frames:
            raise WireError(f"{k.name} has {'one frame' if k.frames == 1 else 'two frames'}")
        data = bytes(frames[1]) if k.frames == 2 else b""
        if k.cap and len(data) > k.cap:
            raise WireError(f"{k.what} of {len(data)} bytes is over the cap of {k.cap}", "over_cap")
        return k.decode(body, data)
    except (KeyError, TypeError) as e:
        raise WireError(f"{quote(kind)}: malformed body ({type(e).__name__}: {cut(str(e))})") from None


def json_object(frame: bytes, cap: int, what: str, error: type[Exception] = WireError) -> dict[str, Any]:
    """The JSON object in `frame`, at most `cap` bytes; `error` naming `what` otherwise."""
    if len(frame) > cap:
        raise error(f"{what} of {len(frame)} bytes is over the cap of {cap}")
    try:
        doc = json.loads(frame)
    except (ValueError, RecursionError) as e:
        # ValueError: UnicodeDecodeError, JSONDecodeError, and an integer of more digits than
        # int() takes (sys.get_int_max_str_digits, 4,300), which json raises as a plain ValueError.
        raise error(f"{what} is not JSON: {cut(str(e))}") from None
    if not isinstance(doc, dict):
        raise error(f"{what} is not a JSON object")
    return doc


# ---------------------------------------------------------------- bounded by bytes

Splittable = TypeVar("Splittable", StackBatch, ProcessAnnouncement)


def encode_within(
    msg: Splittable, max_bytes: int = MAX_BATCH_BYTES
) -> tuple[list[tuple[Splittable, list[bytes]]], list[Splittable]]:
    """`msg` as messages of at most `max_bytes` each, with their frames: the message itself when it fits,
    else parts of it (a batch split by process, then one process's samples in halves; an announcement
    by its lists), each a valid message; and the parts that cannot be made to fit (one sample with its
    process; the collector's cap on a mapping table keeps that from happening)."""
    frames = encode(msg)
    if len(frames[0]) <= max_bytes:
        return [(msg, frames)], []
    halves = _batch_halves(msg) if isinstance(msg, StackBatch) else _announcement_halves(msg)
    if halves is None:
        return [], [msg]
    fit: list[tuple[Splittable, list[bytes]]] = []
    unfit: list[Splittable] = []
    for half in halves:
        f, u = encode_within(half, max_bytes)
        fit += f
        unfit += u
    return fit, unfit


def mapping_bytes(m: Mapping) -> int:
    """Bytes `m` takes in an encoded message: its row and the comma after it."""
    return len(json.dumps(_mapping_json(m), separators=(",", ":"))) + 1  # ASCII: characters are bytes


def _batch_halves(b: StackBatch) -> tuple[StackBatch, StackBatch] | None:
    groups: dict[int, list[Sample]] = {p.pid: [] for p in b.processes}
    for s in b.samples:
        groups.setdefault(s.pid, []).append(s)
    if len(groups) > 1:
        pids = list(groups)
        firsts, seconds = set(pids[: len(pids) // 2]), set(pids[len(pids) // 2 :])
        return (
            _batch_part(b, firsts, [s for p in firsts for s in groups[p]], True),
            _batch_part(b, seconds, [s for p in seconds for s in groups[p]], False),
        )
    if len(b.samples) > 1:
        every = set(groups)
        half = len(b.samples) // 2
        return (
            _batch_part(b, every, list(b.samples[:half]), True),
            _batch_part(b, every, list(b.samples[half:]), False),
        )
    if len(b.unwind_requests) > 1:
        half = len(b.unwind_requests) // 2
        return (
            replace(b, unwind_requests=b.unwind_requests[:half]),
            replace(
                b,
                samples=(),
                user_stacks=(),
                kernel_stacks=(),
                python_stacks=(),
                kernel_symbols={},
                lost={},
                unwind_requests=b.unwind_requests[half:],
            ),
        )
    return None


def _batch_part(b: StackBatch, pids: set[int], samples: list[Sample], first: bool) -> StackBatch:
    """The part of `b` with the processes `pids` and `samples`, its stacks renumbered; the host-wide
    loss counts, and unwind requests of no process in it, travel with the first part."""
    user: dict[int, int] = {}
    kernel: dict[int, int] = {}
    user_stacks: list[tuple[int, ...]] = []
    kernel_stacks: list[tuple[int, ...]] = []

    def renumber(i: int, stacks: tuple[tuple[int, ...], ...], index: dict[int, int], out: list[tuple[int, ...]]) -> int:
        if i < 0:
            return -1
        j = index.get(i)
        if j is None:
            j = index[i] = len(out)
            out.append(stacks[i])
        return j

    python: dict[int, int] = {}
    python_stacks: list[PythonStack] = []

    def renumber_python(i: int) -> int:
        if i < 0:
            return -1
        j = python.get(i)
        if j is None:
            j = python[i] = len(python_stacks)
            python_stacks.append(b.python_stacks[i])
        return j

    part = [
        replace(
            s,
            user_stack=renumber(s.user_stack, b.user_stacks, user, user_stacks),
            kernel_stack=renumber(s.kernel_stack, b.kernel_stacks, kernel, kernel_stacks),
            python_stack=renumber_python(s.python_stack),
        )
        for s in samples
    ]
    kaddrs = {a for st in kernel_stacks for a in st}
    known = {p.pid for p in b.processes}
    return replace(
        b,
        processes=tuple(p for p in b.processes if p.pid in pids),
        user_stacks=tuple(user_stacks),
        kernel_stacks=tuple(kernel_stacks),
        samples=tuple(part),
        python_stacks=tuple(python_stacks),
        kernel_symbols={a: n for a, n in b.kernel_symbols.items() if a in kaddrs},
        lost=b.lost if first else {},
        unwind_requests=tuple(r for r in b.unwind_requests if r.pid in pids or (first and r.pid not in known)),
    )


def _announcement_halves(a: ProcessAnnouncement) -> tuple[ProcessAnnouncement, ProcessAnnouncement] | None:
    if len(a.processes) > 1:
        half = len(a.processes) // 2
        return (replace(a, processes=a.processes[:half]), replace(a, processes=a.processes[half:], exited=()))
    if len(a.exited) > 1:
        half = len(a.exited) // 2
        return replace(a, exited=a.exited[:half]), replace(a, processes=(), exited=a.exited[half:])
    return None


# ---------------------------------------------------------------- encoding


def _header(kind: str, body: dict[str, Any]) -> bytes:
    return json.dumps({"v": WIRE_VERSION, "kind": kind, "body": body}, separators=(",", ":")).encode()


def _process_json(p: Process) -> dict[str, Any]:
    return {
        "pid": p.pid,
        "start_ticks": p.start_ticks,
        "uid": p.uid,
        "nspid": p.nspid,
        "comm": p.comm,
        "executable": p.executable,
        "service": p.service,
        "container_id": p.container_id,
        "pod_uid": p.pod_uid,
        "cmdline": list(p.cmdline) if p.cmdline is not None else None,
        "mappings": [_mapping_json(m) for m in p.mappings],
    }


def _mapping_json(m: Mapping) -> list[Any]:
    return [m.start, m.end, m.offset, m.path, m.dev, m.inode]


# ---------------------------------------------------------------- decoding

T = TypeVar("T")


def _int(v: Any, what: str, low: int = 0, high: int = U64) -> int:
    if type(v) is not int or not low <= v <= high:
        raise WireError(f"{what}: {quote(v)} is not an integer in [{low}, {high}]")
    return v


def _str(v: Any, what: str) -> str:
    if type(v) is not str or len(v) > MAX_STRING:
        raise WireError(f"{what}: not a string of at most {MAX_STRING} characters")
    return v


def _list(v: Any, what: str, cap: int = MAX_ITEMS) -> list[Any]:
    if type(v) is not list or len(v) > cap:
        raise WireError(f"{what}: not a list of at most {cap} items")
    return v


def _each(v: Any, what: str, item: Callable[[Any, str], T], cap: int = MAX_ITEMS) -> tuple[T, ...]:
    return tuple(item(x, what) for x in _list(v, what, cap))


def _stack(v: Any, what: str) -> tuple[int, ...]:
    return _each(v, what, _int, MAX_STACK_DEPTH)


def _mapping(v: Any, what: str) -> Mapping:
    m = _list(v, what, 6)
    if len(m) != 6:
        raise WireError(f"{what}: a mapping has 6 fields")
    start, end = _int(m[0], what), _int(m[1], what)
    if end < start:
        raise WireError(f"{what}: end {end:#x} before start {start:#x}")
    return Mapping(start, end, _int(m[2], what), _str(m[3], what), _str(m[4], what), _int(m[5], what))


def _process(v: Any, what: str) -> Process:
    if type(v) is not dict:
        raise WireError(f"{what}: not an object")
    cmd = v["cmdline"]
    return Process(
        pid=_int(v["pid"], "pid", 0, 1 << 32),
        start_ticks=_int(v["start_ticks"], "start_ticks"),
        uid=_int(v["uid"], "uid", 0, 1 << 32),
        nspid=_int(v["nspid"], "nspid", 0, 1 << 32),
        comm=_str(v["comm"], "comm"),
        executable=_str(v["executable"], "executable"),
        service=_str(v["service"], "service"),
        container_id=_str(v["container_id"], "container_id"),
        pod_uid=_str(v["pod_uid"], "pod_uid"),
        cmdline=None if cmd is None else _each(cmd, "cmdline", _str, 4096),
        mappings=_each(v["mappings"], "mappings", _mapping, MAX_MAPPINGS_PER_PROCESS),
    )


def _batch(b: dict[str, Any]) -> StackBatch:
    profile_type = _str(b["profile_type"], "profile_type")
    if profile_type not in PROFILE_TYPES:
        raise WireError(f"profile_type {quote(profile_type)} is not one of {PROFILE_TYPES}")
    user_stacks = _each(b["user_stacks"], "user_stacks", _stack)
    kernel_stacks = _each(b["kernel_stacks"], "kernel_stacks", _stack)
    nu, nk = len(user_stacks), len(kernel_stacks)

    def sample(v: Any, what: str) -> Sample:
        s = _list(v, what, 6 + MAX_EXTRA_VALUES)
        if not 6 <= len(s) <= 6 + MAX_EXTRA_VALUES:
            raise WireError(f"{what}: a sample has 6 to {6 + MAX_EXTRA_VALUES} fields")
        return Sample(
            pid=_int(s[0], "sample pid", 0, 1 << 32),
            tid=_int(s[1], "sample tid", 0, 1 << 32),
            user_stack=_int(s[2], "user_stack index", -1, nu - 1),
            kernel_stack=_int(s[3], "kernel_stack index", -1, nk - 1),
            count=_int(s[4], "count"),
            value=_int(s[5], "value"),
            extra=tuple(_int(x, "extra value") for x in s[6:]),
        )

    def ksym(v: Any, what: str) -> tuple[int, str]:
        pair = _list(v, what, 2)
        if len(pair) != 2:
            raise WireError(f"{what}: not an [address, name] pair")
        return _int(pair[0], what), _str(pair[1], what)

    samples = _each(b["samples"], "samples", sample)
    python_stacks = _each(b.get("python_stacks", []), "python_stacks", _python_stack)
    if python_stacks or "python_samples" in b:
        samples = _with_python_stacks(samples, b["python_samples"], len(python_stacks))
    return StackBatch(
        host=_str(b["host"], "host"),
        profile_type=profile_type,
        sample_hz=_int(b["sample_hz"], "sample_hz", 1, 1_000_000),
        time_ns=_int(b["time_ns"], "time_ns"),
        processes=_each(b["processes"], "processes", _process),
        user_stacks=user_stacks,
        kernel_stacks=kernel_stacks,
        samples=samples,
        python_stacks=python_stacks,
        kernel_symbols=dict(_each(b["kernel_symbols"], "kernel_symbols", ksym)),
        lost={_str(k, "lost reason"): _int(n, "lost count") for k, n in _dict(b["lost"], "lost").items()},
        unwind_requests=_each(b.get("unwind_requests", []), "unwind_requests", _unwind_request, MAX_UNWIND_REQUESTS),
    )


def _python_stack(v: Any, what: str) -> PythonStack:
    pair = _list(v, what, 2)
    if len(pair) != 2:
        raise WireError(f"{what}: a Python stack is [frames, flags]")

    def frame(f: Any, what: str) -> PyFrameRef:
        t = _list(f, what, 3)
        if len(t) != 3:
            raise WireError(f"{what}: a Python frame is [code, instr, entry]")
        instr = _int(t[1], "instr", -1, 1 << 32)
        return PyFrameRef(_int(t[0], "code", 1), None if instr == -1 else instr, bool(_int(t[2], "entry", 0, 1)))

    flags = _int(pair[1], "python stack flags", 0, 3)
    return PythonStack(_each(pair[0], what, frame, MAX_PYTHON_FRAMES), bool(flags & 1), bool(flags & 2))


def _with_python_stacks(samples: tuple[Sample, ...], pairs: Any, n: int) -> tuple[Sample, ...]:
    """`samples` with the Python stacks [sample index, python stack index] `pairs` name."""
    out = list(samples)
    for pair in _list(pairs, "python_samples"):
        p = _list(pair, "python_samples", 2)
        if len(p) != 2:
            raise WireError("python_samples: not a [sample, python stack] pair")
        i = _int(p[0], "python sample", 0, len(out) - 1)
        out[i] = replace(out[i], python_stack=_int(p[1], "python stack index", 0, n - 1))
    return tuple(out)


def _python_process(b: dict[str, Any]) -> PythonProcess:
    offsets = _dict(b["layout"], "layout")
    unknown = set(offsets) - set(PYTHON_LAYOUT_OFFSETS)
    if unknown:
        raise WireError(f"layout: unknown offsets {sorted(quote(k) for k in unknown)}")
    values: dict[str, int | None] = {}
    for name in PYTHON_LAYOUT_OFFSETS:
        if name not in offsets and name in _OPTIONAL_PYTHON_OFFSETS:
            values[name] = None
        else:
            values[name] = _int(offsets[name], name, 0, MAX_PYTHON_OFFSET - 1)
    owners = _each(b["skip_owners"], "skip_owners", lambda v, w: _int(v, w, 0, 7), 8)
    layout = PythonLayout(
        **values,  # type: ignore[arg-type]
        skip_owners=frozenset(owners),
        tag_mask=_int(b["tag_mask"], "tag_mask", 0, 7),
    )
    return PythonProcess(
        pid=_int(b["pid"], "pid", 1, 1 << 32),
        start_ticks=_int(b["start_ticks"], "start_ticks"),
        version=_str(b["version"], "version"),
        runtime=_int(b["runtime"], "runtime", 1),
        layout=layout,
    )


def _python_name_request(b: dict[str, Any]) -> PythonNameRequest:
    def pair(v: Any, what: str) -> tuple[int, int]:
        p = _list(v, what, 2)
        if len(p) != 2:
            raise WireError(f"{what}: not a [code, instr] pair")
        return _int(p[0], "code", 1), _int(p[1], "instr", -1, 1 << 32)

    return PythonNameRequest(
        request_id=_int(b["request_id"], "request_id"),
        pid=_int(b["pid"], "pid", 1, 1 << 32),
        start_ticks=_int(b["start_ticks"], "start_ticks"),
        frames=_each(b["frames"], "frames", pair, MAX_PYTHON_NAMES),
    )


def _python_names(b: dict[str, Any]) -> PythonNames:
    def name(v: Any, what: str) -> tuple[int, int, str, str, int]:
        n = _list(v, what, 5)
        if len(n) != 5:
            raise WireError(f"{what}: not [code, instr, function, file, line]")
        return (
            _int(n[0], "code", 1),
            _int(n[1], "instr", -1, 1 << 32),
            _str(n[2], "function"),
            _str(n[3], "file"),
            _int(n[4], "line", 0, 1 << 31),
        )

    return PythonNames(
        request_id=_int(b["request_id"], "request_id"),
        pid=_int(b["pid"], "pid", 1, 1 << 32),
        start_ticks=_int(b["start_ticks"], "start_ticks"),
        names=_each(b["names"], "names", name, MAX_PYTHON_NAMES),
    )


def _announcement(b: dict[str, Any]) -> ProcessAnnouncement:
    def exited(v: Any, what: str) -> tuple[int, int]:
        pair = _list(v, what, 2)
        if len(pair) != 2:
            raise WireError(f"{what}: not a [pid, start_ticks] pair")
        return _int(pair[0], what, 1, 1 << 32), _int(pair[1], what)

    full = b["full"]
    if type(full) is not bool:
        raise WireError("full is not a boolean")
    return ProcessAnnouncement(
        host=_str(b["host"], "host"),
        time_ns=_int(b["time_ns"], "time_ns"),
        processes=_each(b["processes"], "processes", _process, MAX_ANNOUNCED_PROCESSES),
        exited=_each(b["exited"], "exited", exited, MAX_ANNOUNCED_PROCESSES),
        full=full,
    )


def _regs_batch(b: dict[str, Any], stacks: bytes) -> RegsBatch:
    rows = _list(b["samples"], "samples", MAX_REGS_SAMPLES)
    if len(stacks) > len(rows) * MAX_REGS_STACK_BYTES:
        raise WireError(f"{len(stacks)} bytes of stacks for {len(rows)} samples")
    out: list[RegsSample] = []
    at = 0
    for row in rows:
        r = _list(row, "regs sample", 8)
        if len(r) != 8:
            raise WireError("a regs sample is [pid, start_ticks, tid, time_ns, ip, sp, fp, stack bytes]")
        n = _int(r[7], "regs sample stack bytes", 0, MAX_REGS_STACK_BYTES)
        if at + n > len(stacks):
            raise WireError("regs samples name more stack bytes than the message carries")
        out.append(
            RegsSample(
                pid=_int(r[0], "pid", 1, 1 << 32),
                start_ticks=_int(r[1], "start_ticks"),
                tid=_int(r[2], "tid", 1, 1 << 32),
                time_ns=_int(r[3], "time_ns"),
                ip=_int(r[4], "ip"),
                sp=_int(r[5], "sp"),
                fp=_int(r[6], "fp"),
                stack=stacks[at : at + n],
            )
        )
        at += n
    if at != len(stacks):
        raise WireError(f"{len(stacks) - at} stack bytes no regs sample names")
    return RegsBatch(
        host=_str(b["host"], "host"),
        time_ns=_int(b["time_ns"], "time_ns"),
        period_ns=_int(b["period_ns"], "period_ns", 1, 1 << 40),
        samples=tuple(out),
    )


def _unwind_request(v: Any, what: str) -> UnwindRequest:
    r = _list(v, what, 6)
    if len(r) != 6:
        raise WireError(f"{what}: an unwind request has 6 fields")
    start, end = _int(r[2], what), _int(r[3], what)
    if not start < end:
        raise WireError(f"{what}: needs start < end")
    return UnwindRequest(
        pid=_int(r[0], what, 1, 1 << 32),
        start_ticks=_int(r[1], what),
        start=start,
        end=end,
        dev=_str(r[4], what),
        inode=_int(r[5], what),
    )


def _unwind_table(b: dict[str, Any], table: bytes) -> UnwindTable:
    status = _str(b["status"], "status")
    if status not in UNWIND_STATUSES:
        raise WireError(f"unwind status {quote(status)} is not one of {UNWIND_STATUSES}")
    if (status == "ok") != bool(table):
        raise WireError("an unwind table comes with status ok, and only then")
    return UnwindTable(
        dev=_str(b["dev"], "dev"),
        inode=_int(b["inode"], "inode"),
        path=_str(b["path"], "path"),
        build_id=_str(b["build_id"], "build_id"),
        status=status,
        reason=_str(b["reason"], "reason"),
        table=table,
    )


def _dict(v: Any, what: str) -> dict[str, Any]:
    if type(v) is not dict or len(v) > 1000:
        raise WireError(f"{what}: not an object of at most 1000 keys")
    return v


def _profile(b: dict[str, Any], pprof_gz: bytes) -> ProfileUpload:
    profile_type = _str(b["profile_type"], "profile_type")
    if profile_type not in PROFILE_TYPES:
        raise WireError(f"profile_type {quote(profile_type)} is not one of {PROFILE_TYPES}")
    start, end = _int(b["window_start_ns"], "window_start_ns"), _int(b["window_end_ns"], "window_end_ns")
    if end < start:
        raise WireError("window ends before it starts")
    return ProfileUpload(
        profile_id=_str(b["profile_id"], "profile_id"),
        host=_str(b["host"], "host"),
        service=_str(b["service"], "service"),
        profile_type=profile_type,
        window_start_ns=start,
        window_end_ns=end,
        samples=_int(b["samples"], "samples"),
        pprof_gz=pprof_gz,
    )


def _file_request(b: dict[str, Any]) -> FileRequest:
    kind = _str(b["kind"], "kind")
    if kind not in FILE_KINDS:
        raise WireError(f"file kind {quote(kind)} is not one of {FILE_KINDS}")
    start, end = _int(b["start"], "start"), _int(b["end"], "end")
    if kind == "module" and not start < end:
        raise WireError("a module request needs start < end")
    build_id = _str(b.get("build_id", ""), "build_id")
    if (kind == "debug") != bool(build_id):
        raise WireError("a debug request, and only a debug request, names a build id")
    if build_id and not (2 <= len(build_id) <= MAX_BUILD_ID_HEX and _LOWER_HEX.issuperset(build_id)):
        raise WireError(f"build_id is not 2 to {MAX_BUILD_ID_HEX} lowercase hex digits")
    return FileRequest(
        pid=_int(b["pid"], "pid", 1, 1 << 32),
        start_ticks=_int(b["start_ticks"], "start_ticks"),
        kind=kind,
        start=start,
        end=end,
        build_id=build_id,
    )


def _file_reply(b: dict[str, Any]) -> FileReply:
    ok = b["ok"]
    if type(ok) is not bool:
        raise WireError("ok is not a boolean")
    error = _str(b["error"], "error")
    if not ok and error not in FILE_ERRORS:
        raise WireError(f"error {quote(error)} is not one of {FILE_ERRORS}")
    return FileReply(ok=ok, error=error, reason=_str(b["reason"], "reason"))


# The kinds decode() takes (after their decoders, which they name).
@dataclass(frozen=True)
class _Kind:
    """How a message kind is framed: its frames, its second frame's cap, and the decoder of its body."""

    name: str  # as the frame-count error says it ("a profile", "an unwind_table")
    frames: int
    decode: Callable[[dict[str, Any], bytes], Message]
    cap: int = 0  # the second frame's own cap in bytes (0: none)
    what: str = ""  # the second frame, as its over-cap error names it


_KINDS: dict[str, _Kind] = {
    "stack_batch": _Kind("a stack_batch", 1, lambda body, _: _batch(body)),
    "profile": _Kind("a profile", 2, _profile, MAX_PROFILE_BYTES, "profile"),
    "unwind_table": _Kind("an unwind_table", 2, _unwind_table, MAX_UNWIND_TABLE_BYTES, "unwind table"),
    "process_announcement": _Kind("a process_announcement", 1, lambda body, _: _announcement(body)),
    "regs_batch": _Kind("a regs_batch", 2, _regs_batch),
    "python_process": _Kind("a python_process", 1, lambda body, _: _python_process(body)),
    "python_name_request": _Kind("a python_name_request", 1, lambda body, _: _python_name_request(body)),
    "python_names": _Kind("a python_names", 1, lambda body, _: _python_names(body)),
}
# The file broker's messages: one small frame each.
_FILE_KINDS: dict[str, Callable[[dict[str, Any]], Message]] = {"file_request": _file_request, "file_reply": _file_reply}
