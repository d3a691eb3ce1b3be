"""symbolizer/names.py: the name sources FrameResolver asks, each a NameSource.

Given a resolver whose perf maps come from a real file, when it names stacks, then a kernel
frame takes the collector's kallsyms name (none: ""), anonymous frames are named from the perf
map read once per stack, a process that exited before it was read (no mappings) is not asked
for one, and a frame no source names keeps no name.
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.wire import Mapping, Process
from symbolizer.files import FileClient
from symbolizer.frames import JIT_MODULE, KERNEL_MODULE, UNKNOWN_MODULE, Frame, FrameResolver
from symbolizer.names import DebugFileNames, KernelNames, ModuleNames, NameSource, PerfMapNames
from symbolizer.perfmap import PerfMapCache

JIT_START = 0x7000_0000
JIT_END = JIT_START + 0x1000


def _proc(mappings: tuple[Mapping, ...]) -> Process:
    return Process(
        pid=4242,
        start_ticks=7,
        uid=os.getuid(),
        nspid=4242,
        comm="jit",
        executable="/jit",
        service="/jit",
        mappings=mappings,
    )


class _NoFiles(FileClient):
    """A FileClient stand-in for frames that need no module file: none is asked for."""

    def __init__(self) -> None:
        super().__init__(run_dir="")  # connects only when a file is asked for, and none is

    def perf_map(self, pid: int, start_ticks: int) -> int:
        raise AssertionError("the resolver's own perf map cache is the one these tests pass")


def test_every_source_is_a_name_source() -> None:
    for source in (ModuleNames, DebugFileNames, PerfMapNames, KernelNames):
        assert NameSource in source.__mro__  # they subclass the protocol for its defaults


def test_kernel_frames_take_the_collectors_names() -> None:
    resolver = FrameResolver(_NoFiles())  # no file is read for kernel frames
    assert resolver.kernel([0x10, 0x20], {0x10: "schedule"}) == [
        Frame(KERNEL_MODULE, "", 0x10, "schedule"),
        Frame(KERNEL_MODULE, "", 0x20, ""),
    ]


def test_anonymous_frames_are_named_from_the_perf_map_read_once_per_stack(tmp_path: Path) -> None:
    perf_map = tmp_path / "perf-4242.map"
    perf_map.write_text(f"{JIT_START:x} 100 jitted_fn\n")
    opened: list[int] = []

    def opener(pid: int, start_ticks: int) -> int:
        opened.append(pid)
        return os.open(perf_map, os.O_RDONLY)

    resolver = FrameResolver(_NoFiles(), perf_maps=PerfMapCache(opener))
    proc = _proc((Mapping(JIT_START, JIT_END, 0, ""),))
    frames = resolver.user(proc, [JIT_START + 8, JIT_START + 0x800, 0x10])
    assert frames == [
        Frame(JIT_MODULE, "", JIT_START + 8, "jitted_fn"),
        Frame(JIT_MODULE, "", JIT_START + 0x800, ""),
        Frame(UNKNOWN_MODULE, "", 0x10, ""),
    ]
    assert opened == [4242]
    assert resolver.stats["jit_named"] == 1 and resolver.stats["no_mapping"] == 1

    gone = _proc(())
    assert resolver.user(gone, [JIT_START + 8]) == [Frame(UNKNOWN_MODULE, "", JIT_START + 8, "")]
    assert opened == [4242] and resolver.stats["perf_map_skipped_gone"] == 1
