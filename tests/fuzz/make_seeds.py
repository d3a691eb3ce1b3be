"""Write the fuzz seeds in tests/fuzz/seeds/ from real inputs: `python -m tests.fuzz.make_seeds` (as root).

The seeds are committed; run this again only to refresh them. Each comes from
something real: the collector's messages about this very process, a program of
tests/workloads built by gcc, its unwind table as the symbolizer builds it, a
JIT's perf map, agent config documents, and a receiver request.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

from collector.procfs import read_maps, read_process
from shared import wire
from symbolizer import cfi
from tests.harness import END_NS, START_NS, WORKLOADS, make_upload

SEEDS = Path(__file__).resolve().parent / "seeds"
SEP = b"\n\0\n"


def put(target: str, name: str, data: bytes) -> None:
    (SEEDS / target).mkdir(parents=True, exist_ok=True)
    (SEEDS / target / name).write_bytes(data)


def frames(msg: wire.Message) -> bytes:
    fs = wire.encode(msg)
    return fs[0] + (SEP + fs[1] if len(fs) > 1 else b"")


def gcc(out: Path, source: str, *flags: str) -> Path:
    subprocess.run(["gcc", *flags, "-o", str(out), str(WORKLOADS / source), "-lpthread"], check=True)
    return out


def stack_batch(me: wire.Process) -> wire.StackBatch:
    """A collector's batch about this process: two samples (one with a value), a kernel stack, a request."""
    return wire.StackBatch(
        host="web-1",
        profile_type="cpu",
        sample_hz=19,
        time_ns=START_NS,
        processes=(me,),
        user_stacks=((me.mappings[0].start + 16, me.mappings[0].start + 32),),
        kernel_stacks=((0xFFFFFFFF81000000,),),
        samples=(
            wire.Sample(me.pid, me.pid, 0, 0, 3, 3 * 52_631_578),
            wire.Sample(me.pid, me.pid + 1, 0, -1, 1, 4096, (1, 4096)),
        ),
        kernel_symbols={0xFFFFFFFF81000000: "do_syscall_64"},
        lost={"stack_map_full": 2},
        unwind_requests=(
            wire.UnwindRequest(
                me.pid,
                me.start_ticks,
                me.mappings[0].start,
                me.mappings[0].end,
                me.mappings[0].dev,
                me.mappings[0].inode,
            ),
        ),
    )


def put_elf_seeds(work: Path) -> bytes:
    """Programs built by gcc, stripped and not, and the unwind table of the stripped one: that table."""
    prog = gcc(work / "cfi_prog", "cfi_prog.c", "-O2", "-fomit-frame-pointer")
    stripped = work / "cfi_prog.stripped"
    subprocess.run(["strip", "--strip-all", "-o", str(stripped), str(prog)], check=True)
    with stripped.open("rb") as f:
        table = cfi.build_table(f).table
    put("cfi", "cfi_prog.stripped", stripped.read_bytes())
    put("unwind_table", "cfi_prog.tbl", table)
    put("elf", "cfi_prog", prog.read_bytes())
    put("elf", "cfi_prog.stripped", stripped.read_bytes())
    fake = gcc(work / "python3.13", "fake_python.c", "-O0")
    put("elfsyms", "python3.13", fake.read_bytes())
    return table


def put_wire_seeds(me: wire.Process, table: bytes) -> None:
    """One of each message the stages exchange, about this process."""
    put("wire", "stack_batch.bin", frames(stack_batch(me)))
    put(
        "wire",
        "unwind_table.bin",
        frames(
            wire.UnwindTable(me.mappings[0].dev, me.mappings[0].inode, me.mappings[0].path, "ab" * 20, "ok", "", table)
        ),
    )
    put("wire", "unwind_none.bin", frames(wire.UnwindTable("fd:01", 7, "/x", "", "none", "no .eh_frame")))
    put("wire", "profile.bin", frames(make_upload(n_samples=3)))
    put(
        "wire",
        "announcement.bin",
        frames(wire.ProcessAnnouncement("web-1", START_NS, (replace(me, mappings=()),), ((123, 456),), True)),
    )
    put("wire", "file_request.bin", frames(wire.FileRequest(me.pid, me.start_ticks, "debug", build_id="ab" * 20)))
    put("wire", "file_reply.bin", frames(wire.FileReply(False, "refused", "perf-1.map is a symlink")))


def put_perf_map_seeds(work: Path) -> None:
    """A real JIT's perf map, and a Node-like one."""
    jit = gcc(work / "jit", "jit.c", "-O0")
    p = subprocess.Popen([str(jit), "1", "own"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().startswith("ready")
    perf = Path(f"/tmp/perf-{p.pid}.map")
    put("perf_map", "jit.map", perf.read_bytes())
    p.wait(30)
    perf.unlink(missing_ok=True)
    put(
        "perf_map",
        "node_like.map",
        b"".join(b"%x %x LazyCompile:~fn%d /app/index.js:%d\n" % (0x3A0000 + i * 64, 48, i, i) for i in range(50)),
    )


def put_config_and_receiver_seeds() -> None:
    """Agent config documents, and receiver requests (an upload, and an empty profile)."""
    put("remote_config", "enabled.json", json.dumps({"enabled": False, "upload_interval_s": 30}).encode())
    put("remote_config", "refused.json", json.dumps({"sample_hz": 99, "endpoint": "http://x"}).encode())
    query = (
        f"source=ebpf&type=cpu&service=%2Fusr%2Fbin%2Fpython3.11&host=web-1&start={START_NS}&end={END_NS}"
    ).encode()
    body = make_upload(n_samples=3).pprof_gz
    put("receiver", "upload.bin", query + SEP + str(len(body)).encode() + SEP + body)
    put("receiver", "empty_profile.bin", query + SEP + b"20" + SEP + gzip.compress(b"\x32\x00"))


def main() -> None:
    work = Path(tempfile.mkdtemp())
    myself = read_process(os.getpid(), with_cmdline=True)
    assert myself is not None  # this process is alive
    me = replace(myself, mappings=read_maps(os.getpid())[:8])
    table = put_elf_seeds(work)
    put_wire_seeds(me, table)
    put_perf_map_seeds(work)
    put_config_and_receiver_seeds()
    subprocess.run(["rm", "-rf", str(work)], check=True)
    for d in sorted(SEEDS.iterdir()):
        print(d.name, sorted(f.name for f in d.iterdir()))


if __name__ == "__main__":
    main()
