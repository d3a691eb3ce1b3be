"""collector/pywalk.py: what the in-BPF Python walker is given, and how its stacks are read back.

Given each CPython version's layout (runtimes/cpython/layouts.py; 3.13+ from debug offsets recorded
from sid's interpreters), when it is turned into a py_proc, then every offset the walk reads is kept
and a layout the walk cannot use is refused with its reason; given a struct py_stack as the walk
leaves it (a ring, shims among the frames), when it is read, then its frames come leaf first, root-most
kept, shims dropped as entry marks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from collector import pywalk
from runtimes.cpython import layouts


def debug_layout(version: tuple[int, int]) -> layouts.Layout:
    """A 3.13+ layout whose debug offsets are numbered by their position (any values do for the checks
    here but the frame's, which are CPython 3.14's)."""
    extras = layouts.DEBUG[version]
    values = {name: 8 * i for i, name in enumerate(layouts.debug_field_offsets(extras))}
    frame = {"previous": 8, "executable": 0, "instr_ptr": 56, "owner": 74}
    values.update({f"interpreter_frame.{k}": v for k, v in frame.items()})
    return layouts.layout_from_debug(values, extras)


@pytest.mark.parametrize("version", [*layouts.LEGACY, *layouts.DEBUG])
def test_every_offset_the_walk_reads_is_in_the_proc_entry(version: tuple[int, int]) -> None:
    lay = layouts.LEGACY.get(version) or debug_layout(version)
    p = pywalk.proc_entry(lay, 0x7F0000001000)
    assert p.runtime == 0x7F0000001000
    assert (p.frame_previous, p.frame_executable, p.frame_instr_ptr, p.frame_owner) == (
        lay.frame_previous,
        lay.frame_executable,
        lay.frame_instr_ptr,
        lay.frame_owner,
    )
    assert p.tstate_thread_id == lay.tstate_thread_id
    assert p.frame_bytes == max(
        lay.frame_previous + 8, lay.frame_executable + 8, lay.frame_instr_ptr + 8, lay.frame_owner + 1
    )
    assert p.frame_bytes <= pywalk.PY_FRAME_BYTES
    assert p.skip_owners == sum(1 << o for o in lay.skip_owners)
    legacy = version in layouts.LEGACY
    assert (p.cframe_current_frame == pywalk.PY_NO_OFFSET) != legacy
    assert (p.frame_is_entry == pywalk.PY_NO_OFFSET) != (version == (3, 11))


def test_a_frame_field_past_the_bytes_read_is_refused_with_its_name() -> None:
    from dataclasses import replace

    lay = replace(layouts.LEGACY[(3, 12)], frame_owner=pywalk.PY_FRAME_BYTES)
    with pytest.raises(pywalk.LayoutRefused, match="frame_owner at 128"):
        pywalk.proc_entry(lay, 0x1000)
    with pytest.raises(pywalk.LayoutRefused, match="tstate_next"):
        pywalk.proc_entry(replace(layouts.LEGACY[(3, 12)], tstate_next=1 << 16), 0x1000)
    with pytest.raises(pywalk.LayoutRefused, match="_PyRuntime"):
        pywalk.proc_entry(layouts.LEGACY[(3, 12)], 0)


def raw_stack(frames: list[tuple[int, int, int]], walked: int, flags: int = 0) -> SimpleNamespace:
    """A struct py_stack: frame i of the walk (code, instr, flags) at i % PY_MAX_FRAMES."""
    ring = [SimpleNamespace(code=0, instr=0, flags=0) for _ in range(pywalk.PY_MAX_FRAMES)]
    for i, (code, instr, f) in enumerate(frames):
        ring[i % pywalk.PY_MAX_FRAMES] = SimpleNamespace(code=code, instr=instr, flags=f)
    return SimpleNamespace(walked=walked, flags=flags, frames=ring)


def test_shims_mark_their_callee_as_the_first_frame_of_its_call_and_are_dropped() -> None:
    shim = pywalk.PY_FRAME_SHIM
    raw = raw_stack([(0x10, 4, 0), (0x20, 8, 0), (0x99, 0, shim), (0x30, pywalk.PY_NO_INSTR, 0), (0x98, 0, shim)], 5)
    got = pywalk.stack_of(raw)
    assert [(f.code, f.instr, f.entry) for f in got.frames] == [(0x10, 4, False), (0x20, 8, True), (0x30, None, True)]
    assert not got.truncated and not got.cut


def test_a_walk_longer_than_the_ring_keeps_its_root_most_frames_and_says_so() -> None:
    n = pywalk.PY_MAX_FRAMES + 10
    got = pywalk.stack_of(raw_stack([(8 * (i + 1), 2 * i, 0) for i in range(n)], n))
    assert [f.code for f in got.frames] == [8 * (i + 1) for i in range(10, n)]
    assert got.truncated


def test_a_cut_walk_keeps_what_it_walked() -> None:
    got = pywalk.stack_of(raw_stack([(0x10, 0, pywalk.PY_FRAME_ENTRY)], 1, pywalk.PY_STACK_CUT))
    assert got.cut and got.frames[0].entry
