"""Frame resolution and profile building, on a live process built from source."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest

from ebpfprofiler.collector.filebroker import FileBroker
from ebpfprofiler.collector.procfs import read_maps, read_process
from ebpfprofiler.shared import pprof
from ebpfprofiler.symbolizer import profile as profile_mod
from ebpfprofiler.symbolizer.files import FileClient
from ebpfprofiler.symbolizer.frames import JIT_MODULE, UNKNOWN_MODULE, Frame, FrameResolver
from ebpfprofiler.symbolizer.window import ClosedWindow, ServiceWindow
from tests.harness import stop_process


@pytest.fixture
def live_jit(build) -> Iterator[tuple[subprocess.Popen, int]]:
    """The jit workload, running, with its perf map written: (process, code address)."""
    p = subprocess.Popen([str(build("jit")), "30", "own"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline().split()
        assert line[0] == "ready"
        yield p, int(line[1], 16)
    finally:
        stop_process(p)
        Path(f"/tmp/perf-{p.pid}.map").unlink(missing_ok=True)


@pytest.fixture
def resolver(tmp_path: Path) -> Iterator[FrameResolver]:
    """A resolver whose files come from a real file broker on a socket in tmp_path."""
    broker = FileBroker(str(tmp_path), allowed_uids={os.getuid()})
    files = FileClient(str(tmp_path))
    try:
        yield FrameResolver(files)
    finally:
        files.close()
        broker.close()


def symbol_vaddr(exe: Path, name: str) -> int:
    out = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    return int(next(ln.split()[0] for ln in out.splitlines() if ln.endswith(f" {name}")), 16)


def build_id(exe: Path) -> str:
    out = subprocess.run(["readelf", "-n", str(exe)], capture_output=True, text=True, check=True).stdout
    return re.search(r"Build ID: ([0-9a-f]+)", out).group(1)


def test_user_frames_get_module_build_id_offset_and_name(build, live_jit, resolver: FrameResolver) -> None:
    # given a live process and its executable mappings as the collector reads them
    p, code = live_jit
    exe = build("jit")
    proc = replace(read_process(p.pid, with_cmdline=False), mappings=read_maps(p.pid))
    text = next(m for m in proc.mappings if m.path == str(exe.resolve()))
    # PIE: the load address is where file offset 0 sits
    base = text.start - text.offset
    main_addr = base + symbol_vaddr(exe, "main")          # gcc -O0 PIE: vaddr == file offset
    call_jit = base + symbol_vaddr(exe, "call_jit")
    # when a stack (leaf first) is resolved: JIT code, a return address into
    # call_jit, a return address right after main's last byte, an unmapped address
    frames = resolver.user(proc, [code + 2, call_jit + 1, main_addr + 4, 0x10])
    # then each frame is what DESIGN.md says it is
    assert frames[0] == Frame(JIT_MODULE, "", code + 2, "jit_spin_loop")
    assert frames[1].function == "call_jit" and frames[1].module == str(exe.resolve())
    assert frames[1].build_id == build_id(exe)
    assert frames[1].address == call_jit + 1 - text.start + text.offset
    assert frames[2].function == "main"
    assert frames[3] == Frame(UNKNOWN_MODULE, "", 0x10, "")


def test_a_return_address_is_looked_up_at_its_call(build, live_jit, resolver: FrameResolver) -> None:
    # given a return address equal to the next function's first byte
    p, _ = live_jit
    exe = build("jit")
    proc = replace(read_process(p.pid, with_cmdline=False), mappings=read_maps(p.pid))
    text = next(m for m in proc.mappings if m.path == str(exe.resolve()))
    main = text.start - text.offset + symbol_vaddr(exe, "main")
    # then as a caller's frame it belongs to the function before; as the leaf to main
    caller = resolver.user(proc, [main + 1, main])[1]
    assert caller.function != "main" and caller.function
    assert resolver.user(proc, [main])[0].function == "main"


def test_a_closed_window_becomes_a_pprof_go_can_read(tmp_path: Path) -> None:
    # given a window with kernel and user frames and labels
    data = ServiceWindow()
    frames = (Frame("[kernel.kallsyms]", "", 0xffffffff81000010, "do_nanosleep"),
              Frame("/usr/bin/app", "abcd", 0x1234, "leaf"), Frame("/usr/bin/app", "abcd", 0x1000, "main"))
    labels = (("host", "h"), ("process.executable", "/usr/bin/app"), ("pid", "0123456789abcdef"))
    data.add(labels, frames, 3, 3_000)
    data.add(labels, frames[1:], 1, 1_000)
    w = ClosedWindow("offcpu", "/usr/bin/app", 10 * 10**9, 20 * 10**9, data)
    # when built
    gz, n = profile_mod.build(w, period=1)
    # then it reads back with every frame, value and label, root first
    prof = pprof.read(gz)
    assert n == 2 and prof.sample_types == (("samples", "count"), ("offcpu", "nanoseconds"))
    assert (prof.time_ns, prof.duration_ns) == (10 * 10**9, 10 * 10**9)
    stacks = {s.functions: s.values for s in prof.samples}
    assert stacks == {("main", "leaf", "do_nanosleep"): (3, 3000), ("main", "leaf"): (1, 1000)}
    assert all(s.labels == dict(labels) for s in prof.samples)
    leaf = prof.samples[0].frames[1]
    assert (leaf.module, leaf.build_id, leaf.address) == ("/usr/bin/app", "abcd", 0x1234)
    f = tmp_path / "p.pb.gz"
    f.write_bytes(gz)
    out = subprocess.run(["go", "tool", "pprof", "-raw", str(f)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "do_nanosleep" in out.stdout, out.stderr
    assert os.path.getsize(f) == len(gz)
