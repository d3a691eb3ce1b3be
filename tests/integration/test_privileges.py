"""Privilege separation: every stage runs as docs/architecture.md's table (shared/privileges.py) says, and no more.

Given the pipeline started as root by `ebpfprofiler run`, then each stage
runs as its own user with exactly its capabilities and no_new_privs, the
unprivileged stages cannot do what they must not, the sockets are reachable
only by the agent's group, and hostile messages on them are dropped while
the stage goes on.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from receiver.store import list_profiles
from shared import counters, endpoints, privileges
from shared.config import ProfilerConfig
from shared.wire import MAX_BATCH_BYTES, WireError
from tests.harness import PY, Pipeline, Receiver, require_root, wait_for

STAGES = {"collector": "collector", "symbolizer-0": "symbolizer", "uploader": "uploader"}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, Receiver]]:
    require_root()
    work = tmp_path_factory.mktemp("privileges")
    receiver = Receiver(work / "received")
    try:
        pipeline = Pipeline(
            work, ProfilerConfig(sample_hz=19, upload_interval_s=2, offcpu=False, endpoint=receiver.url)
        )
        try:
            yield pipeline, receiver
        finally:
            pipeline.stop()
    finally:
        receiver.stop()


def status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def stage_pid(pipeline: Pipeline, stage: str) -> int:
    return int(Path(endpoints.ready_file(str(pipeline.run_dir), stage)).read_text())


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_has_its_user_capabilities_and_no_new_privs(running: tuple[Pipeline, Receiver], stage: str) -> None:
    pipeline, _ = running
    st = status(stage_pid(pipeline, stage))
    table = privileges.STAGES[STAGES[stage]]
    user = pwd.getpwnam(table.user)
    agent = grp.getgrnam(privileges.AGENT_GROUP).gr_gid
    assert st["Uid"].split() == [str(user.pw_uid)] * 4
    assert st["Gid"].split() == [str(agent)] * 4 and st["Groups"].split() == [str(agent)]
    want = privileges.mask(table.caps)
    for key in ("CapEff", "CapPrm", "CapBnd"):
        assert int(st[key], 16) == want, f"{stage} {key} {st[key]} != {want:016x}"
    assert int(st["CapAmb"], 16) == 0 and int(st["CapInh"], 16) == 0
    assert st["NoNewPrivs"] == "1"


def as_stage(stage: str, code: str) -> str:
    """Run `code` in a fresh process that has taken `stage`'s identity; its stdout."""
    script = f"from shared import privileges\nprivileges.become({stage!r})\n{code}"
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


BPF_SYSCALL = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
attr = (ctypes.c_uint32 * 5)(2, 4, 4, 1, 0)   # BPF_MAP_TYPE_ARRAY, key 4, value 4, 1 entry
ret = libc.syscall(321, 0, attr, ctypes.sizeof(attr))   # bpf(BPF_MAP_CREATE)
print(ret, os.strerror(ctypes.get_errno()))
"""

OPEN = """
import sys
for path in sys.argv[1:] if len(sys.argv) > 1 else PATHS:
    try:
        open(path).read(1)
        print(path, "readable")
    except OSError as e:
        print(path, e.strerror)
"""


def test_the_symbolizer_can_neither_load_bpf_nor_read_shadow() -> None:
    require_root()
    assert as_stage("symbolizer", BPF_SYSCALL) == "-1 Operation not permitted"
    assert as_stage("symbolizer", "PATHS = ['/etc/shadow']" + OPEN) == "/etc/shadow Permission denied"
    # and the collector's identity can (a positive control for the probe above)
    assert as_stage("collector", BPF_SYSCALL).split()[0] != "-1"


def test_the_uploader_cannot_read_other_processes_memory_maps(started: list[subprocess.Popen]) -> None:
    require_root()
    root_process = subprocess.Popen(["sleep", "60"])
    started.append(root_process)
    paths = ["/proc/1/maps", f"/proc/{root_process.pid}/maps"]
    lines = as_stage("uploader", f"PATHS = {paths!r}" + OPEN).splitlines()
    assert lines == [f"{p} Permission denied" for p in paths]


def test_sockets_are_reachable_by_the_agent_group_only(running: tuple[Pipeline, Receiver]) -> None:
    pipeline, _ = running
    agent = grp.getgrnam(privileges.AGENT_GROUP).gr_gid
    d = os.stat(pipeline.run_dir)
    assert d.st_gid == agent and stat.S_IMODE(d.st_mode) == 0o3770
    socks = [p for p in pipeline.run_dir.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert {p.name for p in socks} >= {"symbolizer-0.sock", "uploader.sock", "files.sock"}
    for p in socks:
        st = p.stat()
        assert st.st_gid == agent and not st.st_mode & 0o007, f"{p.name} mode {stat.S_IMODE(st.st_mode):o}"


def test_malformed_and_oversized_messages_are_dropped_and_the_worker_goes_on(
    running: tuple[Pipeline, Receiver], started: list[subprocess.Popen]
) -> None:
    pipeline, receiver = running
    pid = stage_pid(pipeline, "symbolizer-0")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(endpoints.symbolizer(str(pipeline.run_dir), 0))
    try:
        # given garbage, a message of another version, one just over the wire cap (counted
        # by decode), and one far over it (the transport's limit cuts that sender off)
        sent = time.time_ns()
        push.send_multipart([b"\x00garbage"])
        push.send_multipart([b'{"v": 99, "kind": "stack_batch", "body": {}}'])
        push.send_multipart([b"x" * (MAX_BATCH_BYTES + 1)])
        push.send_multipart([b"x" * (4 * MAX_BATCH_BYTES)])
    finally:
        push.close()
        ctx.term()

    # then each is counted by the check that refused it (in status: the worker writes its counters as
    # its windows close), the worker is the same process, and profiles keep coming
    def refused() -> dict[str, int]:
        shown = counters.read_all(str(pipeline.run_dir)).get("symbolizer-0", {})
        return {reason: shown.get(f"bad_messages_{reason}", 0) for reason in WireError.REASONS}

    wait_for("the drops to be counted", lambda: min(refused().values()) >= 1, 30)  # one of each, at least
    assert stage_pid(pipeline, "symbolizer-0") == pid and Path(f"/proc/{pid}").exists()
    # a process on CPU, so that the next windows have samples whatever else the host runs (an idle
    # host may give none for longer than the wait)
    started.append(subprocess.Popen([PY, "-I", "-S", "-c", "while True: pass"]))
    wait_for(
        "a profile of a window after the garbage",
        lambda: any(int(m["start"]) > sent for m in list_profiles(str(receiver.dir))),
        timeout=30,
    )
