"""Frame resolution and profile building, on a live process built from source."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from collector.filebroker import FileBroker
from collector.procfs import read_maps, read_process
from shared import pprof
from shared.window import ClosedWindow, ServiceWindow
from shared.wire import Process
from symbolizer import elf
from symbolizer import profile as profile_mod
from symbolizer.elf import ElfCache
from symbolizer.files import FileClient
from symbolizer.frames import JIT_MODULE, UNKNOWN_MODULE, Frame, FrameResolver
from tests.harness import stop_process, vaddr_to_offset, wait_for

LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
DEBUG_DIR = Path("/usr/lib/debug/.build-id")


@pytest.fixture
def live_jit(build: Callable[..., Path]) -> Iterator[tuple[subprocess.Popen, int]]:
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
def files(tmp_path: Path) -> Iterator[FileClient]:
    """A client of a real file broker on a socket in tmp_path."""
    broker = FileBroker(str(tmp_path), allowed_uids={os.getuid()})
    client = FileClient(str(tmp_path))
    try:
        yield client
    finally:
        client.close()
        broker.close()


@pytest.fixture
def resolver(files: FileClient) -> FrameResolver:
    """A resolver whose files come from a real file broker."""
    return FrameResolver(files)


def symbol_vaddr(exe: Path, name: str) -> int:
    out = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    return int(next(ln.split()[0] for ln in out.splitlines() if ln.endswith(f" {name}")), 16)


def build_id(exe: Path) -> str:
    out = subprocess.run(["readelf", "-n", str(exe)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert m is not None
    return m.group(1)


def has_symtab(path: Path) -> bool:
    out = subprocess.run(["readelf", "-SW", str(path)], capture_output=True, text=True, check=True).stdout
    return " .symtab " in out


def live(pid: int) -> Process:
    proc = read_process(pid, with_cmdline=False)
    assert proc is not None
    return replace(proc, mappings=read_maps(pid))


def maps_name(pid: int, path: Path) -> bool:
    """The process has exec'd `path` and mapped it: /proc/PID/exe changes at the start of execve,
    before the new program's segments are mapped, so the exe link alone is not enough."""
    return os.readlink(f"/proc/{pid}/exe") == str(path) and str(path) in Path(f"/proc/{pid}/maps").read_text()


def address_in(proc: Process, module: Path, file_offset: int) -> int:
    """The address `file_offset` of `module` is mapped at in `proc` (module matched by file name)."""
    m = next(
        m
        for m in proc.mappings
        if Path(m.path).name == module.name and m.offset <= file_offset < m.offset + m.end - m.start
    )
    return m.start + file_offset - m.offset


@pytest.mark.needs_root
def test_user_frames_get_module_build_id_offset_and_name(
    build: Callable[..., Path], live_jit: tuple[subprocess.Popen, int], resolver: FrameResolver
) -> None:
    # given a live process and its executable mappings as the collector reads them
    p, code = live_jit
    exe = build("jit")
    proc = live(p.pid)
    text = next(m for m in proc.mappings if m.path == str(exe.resolve()))
    # PIE: the load address is where file offset 0 sits
    base = text.start - text.offset
    main_addr = base + symbol_vaddr(exe, "main")  # gcc -O0 PIE: vaddr == file offset
    call_jit = base + symbol_vaddr(exe, "call_jit")
    # when a stack (leaf first) is resolved: JIT code, a return address into
    # call_jit, a return address right after main's last byte, an unmapped address
    frames = resolver.user(proc, [code + 2, call_jit + 1, main_addr + 4, 0x10])
    # then each frame is what docs/architecture.md ("Data flow") says it is
    assert frames[0] == Frame(JIT_MODULE, "", code + 2, "jit_spin_loop")
    assert frames[1].function == "call_jit" and frames[1].module == str(exe.resolve())
    assert frames[1].build_id == build_id(exe)
    assert frames[1].address == call_jit + 1 - text.start + text.offset
    assert frames[2].function == "main"
    assert frames[3] == Frame(UNKNOWN_MODULE, "", 0x10, "")


@pytest.mark.needs_root
def test_a_return_address_is_looked_up_at_its_call(
    build: Callable[..., Path], live_jit: tuple[subprocess.Popen, int], resolver: FrameResolver
) -> None:
    # given a return address equal to the next function's first byte
    p, _ = live_jit
    exe = build("jit")
    proc = live(p.pid)
    text = next(m for m in proc.mappings if m.path == str(exe.resolve()))
    main = text.start - text.offset + symbol_vaddr(exe, "main")
    # then as a caller's frame it belongs to the function before; as the leaf to main
    caller = resolver.user(proc, [main + 1, main])[1]
    assert caller.function != "main" and caller.function
    assert resolver.user(proc, [main])[0].function == "main"


@pytest.mark.needs_root
def test_frames_resolved_again_come_from_memory_until_the_mappings_change(
    build: Callable[..., Path], live_jit: tuple[subprocess.Popen, int], files: FileClient
) -> None:
    # given a live process, and a stack of it resolved once (a frame in its executable, one in JIT code)
    p, code = live_jit
    exe = build("jit")
    proc = live(p.pid)
    text = next(m for m in proc.mappings if m.path == str(exe.resolve()))
    stack = [code + 2, text.start - text.offset + symbol_vaddr(exe, "call_jit") + 1]
    cache = ElfCache()
    resolver = FrameResolver(files, elf_cache=cache)
    first = resolver.user(proc, stack)
    looked_up = cache.stats["hits"] + cache.stats["parsed"]
    # when it is resolved again, in a later batch (the same process and mappings, new objects)
    again = resolver.user(replace(proc, mappings=tuple(replace(m) for m in proc.mappings)), stack)
    # then the frames are the same and the module's symbols were not looked up again; the JIT frame
    # was named again from the perf map (which may name it differently later), and both counted
    assert again == first and first[1].function == "call_jit" and first[0].function == "jit_spin_loop"
    assert cache.stats["hits"] + cache.stats["parsed"] == looked_up
    assert resolver.stats["user_frames"] == 4 and resolver.stats["jit_named"] == 2 and resolver.stats["named"] == 2
    # and when the process's mappings change, its frames are resolved afresh
    resolver.user(replace(proc, mappings=proc.mappings[:-1] if proc.mappings[-1] != text else proc.mappings[1:]), stack)
    assert cache.stats["hits"] + cache.stats["parsed"] > looked_up


def test_a_closed_window_becomes_a_pprof_go_can_read(tmp_path: Path) -> None:
    # given a window with kernel and user frames and labels
    data = ServiceWindow()
    frames = (
        Frame("[kernel.kallsyms]", "", 0xFFFFFFFF81000010, "do_nanosleep"),
        Frame("/usr/bin/app", "abcd", 0x1234, "leaf"),
        Frame("/usr/bin/app", "abcd", 0x1000, "main"),
    )
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


def test_an_empty_label_is_left_out_not_read_back_as_the_number_0() -> None:
    # given a sample whose thread has no name (its comm could not be read)
    data = ServiceWindow()
    labels = (("pid", "1"), ("thread.name", ""), ("thread.id", "7"))
    data.add(labels, (Frame("/usr/bin/app", "abcd", 0x1000, "main"),), 1, 1_000)
    # when built and read back
    gz, _ = profile_mod.build(ClosedWindow("cpu", "/usr/bin/app", 0, 10**9, data), period=1)
    # then the label is absent, so a reader's .get("thread.name", "") is a string
    assert pprof.read(gz).samples[0].labels == {"pid": "1", "thread.id": "7"}


# --- names from separate debug files, found by build id ---


@pytest.mark.needs_root
def test_libc_static_functions_are_named_from_libc_debug_file(
    build: Callable[..., Path], live_jit: tuple[subprocess.Popen, int], resolver: FrameResolver
) -> None:
    # given a live process whose stack runs main <- __libc_start_call_main, and qsort's msort_with_tmp:
    # static functions of Debian's libc, which has no .symtab, named only in libc6-dbg's debug file
    p, _ = live_jit
    libc_id = build_id(LIBC)
    debug = DEBUG_DIR / libc_id[:2] / f"{libc_id[2:]}.debug"
    assert debug.is_file(), f"{debug} is missing: deploy/setup.sh installs libc6-dbg"
    assert not has_symtab(LIBC) and has_symtab(debug)
    proc = live(p.pid)
    exe = build("jit")
    main = address_in(proc, exe.resolve(), vaddr_to_offset(exe, symbol_vaddr(exe, "main")))
    start_call_main, msort = (
        address_in(proc, LIBC, vaddr_to_offset(LIBC, symbol_vaddr(debug, name)))
        for name in ("__libc_start_call_main", "msort_with_tmp.part.0")
    )
    # when stacks with return addresses into them are resolved (leaf first)
    frames = resolver.user(proc, [main + 4, start_call_main + 4])
    leaf = resolver.user(proc, [msort + 1])[0]
    # then they are named, and carry libc's path and build id
    assert [f.function for f in frames] == ["main", "__libc_start_call_main"]
    assert leaf.function == "msort_with_tmp.part.0"
    assert (frames[1].module, frames[1].build_id) == (str(LIBC), libc_id)
    assert resolver.stats["debug_named"] == 2


# A made-up build id: no debug file on the host has it; the second is another build's.
STATIC_ID, OTHER_ID = "5a" * 20, "6b" * 20


@pytest.fixture
def stripped_in_root(build: Callable[..., Path], tmp_path: Path) -> Iterator[tuple[Process, Path, Callable[..., Path]]]:
    """The offcpu workload, static, with build id STATIC_ID and stripped of .symtab, running
    chrooted in its own root (as in a container): (process, unstripped build, place) where
    place(build_id, *flags) installs the debug file of the build with that id (and extra gcc
    flags) as the root's debug file for STATIC_ID (root-owned, mode 0644) and returns its path."""
    root = tmp_path / "root"
    root.mkdir()
    full = build("offcpu", ["-O0", "-static", f"-Wl,--build-id=0x{STATIC_ID}"])
    subprocess.run(["strip", "--strip-all", "-o", str(root / "offcpu"), str(full)], check=True)

    def place(debug_of: str, *flags: str) -> Path:
        path = root / "usr/lib/debug/.build-id" / STATIC_ID[:2] / f"{STATIC_ID[2:]}.debug"
        path.parent.mkdir(parents=True, exist_ok=True)
        source = build("offcpu", ["-O0", "-static", f"-Wl,--build-id=0x{debug_of}", *flags])
        subprocess.run(["objcopy", "--only-keep-debug", str(source), str(path)], check=True)
        path.chmod(0o644)
        return path

    p = subprocess.Popen(["chroot", str(root), "/offcpu", "tiny", "30"], stdout=subprocess.DEVNULL)
    try:  # chroot(8) execs the workload in the same process
        wait_for("the chrooted workload to run", lambda: maps_name(p.pid, root / "offcpu"))
        assert os.readlink(f"/proc/{p.pid}/root") == str(root)
        yield live(p.pid), full, place
    finally:
        stop_process(p)


def tiny_wait_address(proc: Process, full: Path) -> int:
    return address_in(proc, Path("offcpu"), vaddr_to_offset(full, symbol_vaddr(full, "tiny_wait")))


@pytest.mark.needs_root  # chroot
def test_a_module_in_its_own_root_is_named_from_that_roots_debug_file(
    stripped_in_root: tuple[Process, Path, Callable[..., Path]], files: FileClient
) -> None:
    # given a stripped module running in its own root, whose debug file only that root has
    proc, full, place = stripped_in_root
    place(STATIC_ID)
    resolver = FrameResolver(files)
    # when an address in a static function of it is resolved
    frame = resolver.user(proc, [tiny_wait_address(proc, full)])[0]
    # then the function is named from the root's debug file
    assert frame.function == "tiny_wait" and frame.build_id == STATIC_ID
    assert resolver.stats["debug_named"] == 1


@pytest.mark.parametrize(
    "debug_of, flags, reason",
    [
        (OTHER_ID, (), f"has build id {OTHER_ID}"),  # another build
        (STATIC_ID, ("-Wl,-Ttext-segment=0x800000",), "loads at other addresses"),  # the id, but moved
    ],
)
@pytest.mark.needs_root  # chroot
def test_a_debug_file_of_another_build_is_ignored_counted_and_logged_once(
    stripped_in_root: tuple[Process, Path, Callable[..., Path]],
    files: FileClient,
    caplog: pytest.LogCaptureFixture,
    debug_of: str,
    flags: tuple[str, ...],
    reason: str,
) -> None:
    # given a stripped module whose root has, at its build id's path, the debug file of another build
    proc, full, place = stripped_in_root
    assert build_id(place(debug_of, *flags)) == debug_of
    cache = ElfCache()
    resolver = FrameResolver(files, elf_cache=cache)
    # when an address in it is resolved, twice
    with caplog.at_level(logging.WARNING, logger=elf.__name__):
        frames = [resolver.user(proc, [tiny_wait_address(proc, full)])[0] for _ in range(2)]
    # then no name comes from it; it was parsed once, rejected once and logged once, saying why
    assert [f.function for f in frames] == ["", ""] and frames[0].build_id == STATIC_ID
    assert cache.stats["rejected"] == 1 and resolver.stats["debug_named"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == elf.__name__]
    # the log line is the feature: the wrong debug file is logged once with the build id and why (counted above)
    assert len(warnings) == 1 and STATIC_ID in warnings[0] and reason in warnings[0]


@pytest.mark.needs_root  # chroot
def test_a_roots_debug_file_names_only_the_processes_of_that_root(
    stripped_in_root: tuple[Process, Path, Callable[..., Path]],
    files: FileClient,
    tmp_path: Path,
    started: list[subprocess.Popen],
) -> None:
    # given a stripped module with the debug file in its container's root, and a host process mapping
    # a module that claims the same build id (the host has no debug file for it)
    proc, full, place = stripped_in_root
    place(STATIC_ID)
    host_copy = tmp_path / "host-offcpu"
    shutil.copy(Path(os.readlink(f"/proc/{proc.pid}/exe")), host_copy)
    p = subprocess.Popen([str(host_copy), "tiny", "30"], stdout=subprocess.DEVNULL)
    started.append(p)
    wait_for("the host copy to run", lambda: maps_name(p.pid, host_copy))
    host = live(p.pid)
    resolver = FrameResolver(files)
    # when the container's process is resolved first, then the host's
    in_root = resolver.user(proc, [tiny_wait_address(proc, full)])[0]
    offset = vaddr_to_offset(full, symbol_vaddr(full, "tiny_wait"))
    on_host = resolver.user(host, [address_in(host, host_copy, offset)])[0]
    # then the root's names stay with the root's process
    assert in_root.function == "tiny_wait"
    assert on_host.build_id == STATIC_ID and on_host.function != "tiny_wait", on_host
