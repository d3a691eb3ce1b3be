"""Test harness: real stages and the receiver as processes, waiting with deadlines.

The helpers the test modules share: the pipeline under `ebpfprofiler run`
(Pipeline), the reference receiver (Receiver, with its fault-injection options
when asked), a lone `ebpfprofiler uploader` (launch_uploader) fed by a test
worker over its real socket (TestWorker), profiles to hand it (make_upload),
directories the stages' users can enter (open_dir), and where an ELF file
holds an address (vaddr_to_offset). The fixtures built on
them are in tests/conftest.py.

Every process started here is ended by pid by its owner (its stop() or kill(),
or the fixture that started it), even when the test fails. Waiting is polling
with a deadline, never a sleep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import zmq

from bench.polling import wait_for
from cli.run import die_with_parent
from receiver.store import list_profiles
from shared import config as config_mod
from shared import counters, endpoints, handoff, pprof
from shared.pprof import ProfileBuilder
from shared.privileges import ids as stage_ids
from shared.wire import ProfileUpload

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tests" / "workloads"
PY = sys.executable
# -O0: gcc 12 drops the frame of leaf functions at -O1 and above even with
# -mno-omit-leaf-frame-pointer (seen here), and the tests need every frame.
FRAME_POINTER_FLAGS = ["-O0", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]

# The deadline of a lone stage's start, stop and acknowledgements.
DEADLINE_S = 15
# The deadline of a short `ebpfprofiler record` run: the BPF compile, a few seconds recorded, the last windows written.
RECORD_TIMEOUT_S = 240
START_NS = 1_700_000_000_000_000_000  # 2023-11-14T22:13:20Z
END_NS = START_NS + 60_000_000_000
# Retries in tests wait milliseconds, not seconds.
FAST_BACKOFF = {"EBPFPROFILER_UPLOAD_BACKOFF_S": "0.01"}
# The overhead budget of a test's pipeline unless it sets one: all of one CPU, so the rate stays.
KEEP_RATE_BUDGET_PCT = 100.0
# A test worker offers unacknowledged profiles again after this (the stages use 10 s).
TEST_ACK_TIMEOUT_S = 1.0


def marked_lines(source: Path, tag: str, comment: str = "//") -> set[int]:
    """The 1-based lines of a workload's source that end in the comment `tag` ("// CALL_A", "# PARK")."""
    return {
        i for i, line in enumerate(source.read_text().splitlines(), 1) if line.rstrip().endswith(f"{comment} {tag}")
    }


def children(pid: int) -> list[int]:
    """The child processes of `pid`'s main thread ([] if it is gone)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def stop_process(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Stop a process this test started; kill it if it does not stop in time."""
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.returncode


def kill_and_reap(procs: Iterable[subprocess.Popen]) -> None:
    """The end of every test (the `started` fixtures): each process it started and that still runs
    is killed, with its group if it leads one of its own (start_new_session), and every one is reaped."""
    for p in procs:
        if p.poll() is None:
            try:
                own_group = os.getpgid(p.pid) == p.pid != os.getpgrp()
            except ProcessLookupError:
                own_group = False
            if own_group:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
        p.wait()


def bpf_holdings(pid: int) -> tuple[set[int], int]:
    """(ids of the BPF programs `pid` holds, number of perf event fds it holds)."""
    progs, perf = set(), 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target == "anon_inode:[perf_event]":
                perf += 1
            elif target == "anon_inode:bpf-prog" and (prog := bpf_prog_id(pid, fd)) is not None:
                progs.add(prog)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return progs, perf


def bpf_prog_id(pid: int, fd: int | str) -> int | None:
    """The id of the BPF program that `pid`'s descriptor `fd` holds (None: not a program)."""
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("prog_id:"):
            return int(line.split()[1])
    return None


def namespace_host_gaps(mountinfo: str = "/proc/self/mountinfo") -> str:
    """What this host lacks for unshare --mount-proc and systemd-nspawn, as a sentence per gap ("" if none).

    Added to the failure message of a test that starts namespaces, so a host's own mounts (a chroot
    whose / is no mount point, a cgroup v1 or read-only hierarchy) read as the host's, not the project's."""
    gaps = []
    try:
        mounts = [line.split() for line in Path(mountinfo).read_text().splitlines()]
    except OSError as e:
        return f"host lacks: a readable {mountinfo} ({e.strerror}): is /proc mounted?"
    # mountinfo: id parent dev root MOUNT_POINT OPTIONS [optional…] - FSTYPE source super-options
    points = {m[4]: m[m.index("-") + 1] for m in mounts if "-" in m}
    read_only = {m[4] for m in mounts if "ro" in m[5].split(",")}
    if "/" not in points:
        gaps.append(
            "/ is not a mount point (a chroot?): its mount propagation cannot be changed, which "
            "unshare --mount-proc and systemd-nspawn do; bind-mount the root onto itself "
            "(mount --bind DIR DIR) before entering it"
        )
    # systemd-nspawn boots systemd in the unified hierarchy, or in the named systemd one of a legacy layout
    hierarchy = next(
        (
            d
            for d in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd")
            if points.get(d) in ("cgroup2", "cgroup")
        ),
        None,
    )
    if hierarchy is None:
        gaps.append(
            f"no cgroup hierarchy for systemd: /sys/fs/cgroup is {points.get('/sys/fs/cgroup', 'not mounted')} "
            "with neither cgroup2 nor a name=systemd hierarchy (mount -t cgroup2 none /sys/fs/cgroup)"
        )
    elif hierarchy in read_only:
        gaps.append(f"{hierarchy} is read-only: systemd-nspawn creates the container's cgroup there")
    return ("host lacks: " + "; ".join(gaps)) if gaps else ""


def vaddr_to_offset(path: Path, vaddr: int) -> int:
    """File offset of `vaddr` in the ELF file `path`, from the PT_LOAD lines of `readelf -lW`."""
    out = subprocess.run(["readelf", "-lW", str(path)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts[:1] == ["LOAD"]:
            offset, start, filesz = int(parts[1], 16), int(parts[2], 16), int(parts[4], 16)
            if start <= vaddr < start + filesz:
                return vaddr - start + offset
    raise AssertionError(f"{vaddr:#x} is in no PT_LOAD of {path}")


def bpftool(*args: str) -> list[dict]:
    out = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out or "[]")


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("integration tests load BPF programs: run them as root (make test does)")


def stderr_file(workdir: Path, name: str) -> Path:
    """workdir/<name>.err for the first process of that name a test starts, then <name>1.err, <name>2.err..."""
    n = len(list(workdir.glob(f"{name}*.err")))
    return workdir / f"{name}{n or ''}.err"


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """What `proc` wrote to its stdout up to the end of a line, waiting at most `timeout` seconds."""
    line = b""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None, "started without stdout=PIPE"
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
    return line.decode(errors="replace")


def workload_fields(output: str) -> dict[str, str]:
    """The key=value pairs a test workload prints (other words are ignored)."""
    return dict(kv.split("=", 1) for kv in output.split() if "=" in kv)


class Receiver:
    """The reference receiver on 127.0.0.1, started as a process, until stop().

    It stores under `directory`. `options` are more of its options (the fault
    injection ones: --fail-ratio, --hang-s, --reject-status, --reject-reason);
    `port` 0 lets it pick a free one, read from the line it prints. Its stderr
    goes to the file `stderr` (log()) when given, else to the test's."""

    def __init__(self, directory: Path, *options: str, port: int = 0, stderr: Path | None = None) -> None:
        self.dir = directory
        self.stderr = stderr
        with open(stderr, "wb") if stderr else contextlib.nullcontext() as err:
            self.proc = subprocess.Popen(
                [PY, "-m", "cli.main", "receiver", "--listen", f"127.0.0.1:{port}", "--dir", str(directory), *options],
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.announcement = first_line(self.proc, DEADLINE_S)
        m = re.search(r"listening on (http://\S+)", self.announcement)
        if not m:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            raise AssertionError(
                f"receiver did not start: {self.announcement!r}" + (f"; {self.log()}" if stderr else "")
            )
        self.url = m.group(1)

    @classmethod
    def start(cls, workdir: Path, *options: str, port: int = 0, name: str = "receiver") -> Receiver:
        """One of the receivers of a test's `workdir`: they store in workdir/received, and each
        writes its stderr to a file of its own there (stderr_file)."""
        return cls(workdir / "received", *options, port=port, stderr=stderr_file(workdir, name))

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0

    def received(self) -> list[dict[str, Any]]:
        return list_profiles(str(self.dir)) if self.dir.exists() else []

    def received_ids(self) -> list[str]:
        return [m["id"] for m in self.received()]

    def log(self) -> str:
        return self.stderr.read_text() if self.stderr else ""

    def stop(self) -> int:
        code = stop_process(self.proc)
        if self.proc.stdout:
            self.proc.stdout.close()
        return code


def open_dir(prefix: str) -> Path:
    """A directory under /tmp that the stages' users can enter (pytest's are root-only).

    The caller removes it (shutil.rmtree) when done."""
    path = Path(tempfile.mkdtemp(prefix=f"ebpfprofiler-{prefix}-", dir="/tmp"))
    path.chmod(0o755)
    return path


def reserve_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a receiver started later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, cfg: config_mod.ProfilerConfig) -> Path:
    path.write_text(config_mod.dump(cfg))
    path.chmod(0o644)  # the stages read it as their own users
    return path


def give(stage: str, *paths: Path) -> None:
    """Hand `paths` to `stage`'s user: a stage started as root runs as its own user
    (shared/privileges.py), and `ebpfprofiler run` or the systemd units prepare its directories."""
    if os.geteuid() != 0:
        return
    uid, gid = stage_ids(stage)
    for p in paths:
        os.chown(p, uid, gid)


def make_upload(
    service: str = "/usr/bin/python3.11",
    n_samples: int = 2,
    *,
    start_ns: int = START_NS,
    length_ns: int = END_NS - START_NS,
    padding: bytes = b"",
) -> ProfileUpload:
    """A valid gzip pprof; `padding` (incompressible, if random) goes into a function name to size it."""
    b = ProfileBuilder(
        [("samples", "count"), ("cpu", "nanoseconds")],
        ("cpu", "nanoseconds"),
        period=52_631_578,
        time_ns=start_ns,
        duration_ns=length_ns,
    )
    m = b.mapping("main", service, "abcdef")
    for i in range(n_samples):
        b.sample([b.location(i, m, 0x1000 + i, [b.function(f"fn{i}")])], [1, 52_631_578], {"pid": 7})
    if padding:
        b.sample([b.location("pad", m, 0x9000, [b.function("pad_" + padding.hex())])], [1, 1], {"pid": 7})
        n_samples += 1
    return ProfileUpload(
        profile_id=uuid.uuid4().hex,
        host="web-1",
        service=service,
        profile_type="cpu",
        window_start_ns=start_ns,
        window_end_ns=start_ns + length_ns,
        samples=n_samples,
        pprof_gz=b.gzipped(),
    )


def http_config(tmp_path: Path, url: str, **changes: Any) -> config_mod.ProfilerConfig:
    return config_mod.ProfilerConfig(endpoint=url, local_dir=str(tmp_path / "unused"), **changes)


class ListHandler(logging.Handler):
    """Keeps the messages of one logger, for a test worker's log lines."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def text(self) -> str:
        return "\n".join(self.lines)


class TestWorker:
    """A symbolizer worker's hand-off side: a DEALER socket and a ProfileSender, used from one thread."""

    __test__ = False

    def __init__(self, run_dir: Path, ctx: zmq.Context, **sender_args: Any) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, sender_args.get("max_profiles", handoff.MAX_UNACKED_PROFILES))
        self.sock.connect(endpoints.uploader(str(run_dir)))
        self.logs = ListHandler()
        self.log = logging.getLogger(f"test-worker-{id(self)}")
        self.log.addHandler(self.logs)
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        sender_args.setdefault("ack_timeout_s", TEST_ACK_TIMEOUT_S)
        self.sender = handoff.ProfileSender(self.sock, self.log, **sender_args)

    def send(self, *uploads: ProfileUpload) -> None:
        for u in uploads:
            self.sender.send(u)

    def wait_acked(self, timeout: float = DEADLINE_S) -> None:
        def done() -> bool:
            self.sender.poll(20)
            return self.sender.pending_profiles == 0

        wait_for(f"acknowledgements ({self.sender.pending_profiles} pending; {self.sender.counts})", done, timeout)

    def close(self) -> None:
        self.sock.close()


@dataclass
class UploaderProcess:
    """`ebpfprofiler uploader` with its stderr in a file; ended by pid by whoever started it."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    state_dir: Path
    stderr: Path

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def dead_letter_dir(self) -> Path:
        return self.state_dir / "dead-letter"

    def spooled(self) -> list[str]:
        return sorted(p.name for p in self.spool_dir.glob("*.prof")) if self.spool_dir.exists() else []

    def log(self) -> str:
        return self.stderr.read_text()

    def counters(self) -> dict[str, int]:
        """RUN_DIR/uploader.counters.json's counts as last written (as they change, and at exit: the
        exit line's totals); read whether or not it still runs, unlike `ebpfprofiler status`."""
        path = self.run_dir / "uploader.counters.json"
        counts: dict[str, int] = json.loads(path.read_text())["counters"] if path.exists() else {}
        return counts

    def stop(self, timeout: float = DEADLINE_S) -> int:
        """SIGTERM, then the exit code (killed after a deadline if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"uploader ignored SIGTERM; log:\n{self.log()}") from None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def uploader_command(config: Path, run_dir: Path, state_dir: Path) -> list[str]:
    return [
        PY,
        "-P",  # the checkout (the working directory) must not shadow the code view the stage reads
        "-m",
        "cli.main",
        "uploader",
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
        "--state-dir",
        str(state_dir),
    ]


def launch_uploader(
    workdir: Path,
    cfg: config_mod.ProfilerConfig,
    *,
    state_dir: Path | None = None,
    env: dict[str, str] | None = None,
    name: str = "uploader",
) -> UploaderProcess:
    """Start an uploader and wait for its ready file; the caller ends it (kill() or stop())."""
    run_dir = workdir / "run"
    state_dir = state_dir or workdir / "state"
    for d in (run_dir, state_dir):
        if not d.exists():
            d.mkdir()
            give("uploader", d)
    ready = Path(endpoints.ready_file(str(run_dir), "uploader"))
    if ready.exists():
        ready.unlink()  # left by a killed predecessor
    stderr = stderr_file(workdir, name)
    config = write_config(workdir / f"{name}.yaml", cfg)
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            uploader_command(config, run_dir, state_dir),
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, **(env or {})},
        )
    u = UploaderProcess(proc, run_dir, state_dir, stderr)
    try:
        wait_for("the uploader's ready file", lambda: ready.exists() or proc.poll() is not None, DEADLINE_S)
    except AssertionError:
        u.kill()
        raise
    if proc.poll() is not None:
        raise AssertionError(f"uploader exited with {proc.returncode}:\n{u.log()}")
    return u


class Pipeline:
    """`ebpfprofiler run` with a config of the test's, until stop().

    Its runtime, state and config live in an open directory of its own
    (removed at stop), as the stages run as their own users; a test that sets
    local_dir puts it under such a directory too (open_dir). `env` is added to
    the stages' environment (EBPFPROFILER_DISABLE_FEATURES: a kernel without them)."""

    def __init__(
        self,
        workdir: Path,
        cfg: config_mod.ProfilerConfig,
        shipped_budget: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        if cfg.overhead_budget_pct == config_mod.DEFAULT_OVERHEAD_BUDGET_PCT and not shipped_budget:
            # A test's pipeline samples at the rate the test asked for: the overhead guard would
            # halve it on this 2-CPU machine (start-up windows build unwind tables). A test of the
            # guard sets a budget of its own, or keeps the shipped one (shipped_budget).
            cfg = cfg.replace(overhead_budget_pct=KEEP_RATE_BUDGET_PCT)
        self.cfg = cfg
        self.final_counters: dict[str, dict[str, int]] | None = None
        self.root = open_dir("pipeline")
        self.run_dir = self.root / "run"
        self.state_dir = self.root / "state"
        self.config_path = write_config(self.root / "agent.yaml", cfg)
        self.log_path = workdir / "pipeline.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - the pipeline's log, open until stop()
        self.proc = subprocess.Popen(
            [
                PY,
                "-m",
                "cli.main",
                "run",
                "--config",
                str(self.config_path),
                "--run-dir",
                str(self.run_dir),
                "--state-dir",
                str(self.state_dir),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            # a pytest killed mid-test (a CI timeout) must not leave `run` and its BPF programs loaded
            preexec_fn=die_with_parent,  # noqa: PLW1509 - prctl(PR_SET_PDEATHSIG) must run in the child
        )
        stages = ["uploader", "collector"] + [f"symbolizer-{w}" for w in range(cfg.symbolizer_workers)]
        try:
            wait_for("every stage to be ready", lambda: self._ready(stages), timeout=90)
        except AssertionError:
            self.stop()
            raise AssertionError(f"pipeline did not start:\n{self.log()}") from None

    def _ready(self, stages: list[str]) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"pipeline exited with {self.proc.returncode}:\n{self.log()}")
        return all(os.path.exists(endpoints.ready_file(str(self.run_dir), s)) for s in stages)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def counters(self) -> dict[str, dict[str, int]]:
        """Every RUN_DIR/<stage>.counters.json as last written (the supervisor's `run` one counts each
        stage's exits), whether or not its stage still runs, unlike `ebpfprofiler status`; after stop(),
        as the stages left them."""
        if self.final_counters is not None:
            return self.final_counters
        out: dict[str, dict[str, int]] = {}
        for path in sorted(self.run_dir.glob("*" + counters.SUFFIX)):
            try:
                out[path.name.removesuffix(counters.SUFFIX)] = json.loads(path.read_text())["counters"]
            except (OSError, ValueError, KeyError):
                continue  # being replaced: write_atomic renames over it
        return out

    def exits(self) -> dict[str, int]:
        """Stage → how often it exited and was restarted by `run` (none: {})."""
        return {k.removesuffix("_exits"): v for k, v in self.counters().get("run", {}).items()}

    def stop(self) -> int:
        code = stop_process(self.proc, timeout=90)
        self._log.close()
        self.final_counters = self.counters()
        shutil.rmtree(self.root, ignore_errors=True)
        return code


@dataclass
class Received:
    """A profile the test receiver stored: its metadata and the profile read back."""

    meta: dict
    profile: pprof.ReadProfile


def read_received(directory: Path) -> list[Received]:
    """Every profile stored in the receiver's `directory`."""
    return [Received(m, pprof.read(Path(m["path"]).read_bytes())) for m in list_profiles(str(directory))]
