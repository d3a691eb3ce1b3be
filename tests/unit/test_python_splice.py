"""symbolizer/pystacks.py and profile.py: Python frames spliced into native stacks, and how the pprof reads.

Given the native user frames of a CPython 3.11 process in `sorted(data, key=keyfn)` called from
`run` called from `<module>` (leaf first, as the symbolizer resolves Debian 12's python3.11: 3.11
runs a Python-to-Python call in the same `_PyEval_EvalFrameDefault`, so `run` and `<module>` share
one eval call and `keyfn`, called back from C, has its own) and the Python frames the walk in BPF
recorded for it, when they are spliced, then each eval call's frames take its native eval frame's
place, the C frames between stay, and every mismatch is named by kind.
"""

from __future__ import annotations

from shared import pprof
from shared.window import ClosedWindow, ServiceWindow
from shared.wire import PyFrameRef, PythonStack
from symbolizer import profile as profile_mod
from symbolizer.frames import Frame
from symbolizer.pystacks import (
    FEWER_CALLS,
    MORE_CALLS,
    NO_EVAL_FRAME,
    PYTHON_MODULE,
    TRUNCATED_FRAME,
    AnyFrame,
    PythonFrame,
    placeholder,
    splice,
)

EXE = "/usr/bin/python3.11"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
PID, START = 4242, 987654
# (code object address, instruction offset) of each Python function in the recording
KEYFN, RUN, MODULE = (0x7F3A11C2B0, 24), (0x7F3A11C1F0, 58), (0x7F3A11E030, 112)


def native(*names: str) -> tuple[Frame, ...]:
    """User frames (leaf first) of python3.11, libc's last three."""
    return tuple(
        Frame(LIBC if n in ("__libc_start_call_main", "__libc_start_main_impl") else EXE, "ab12", i, n)
        for i, n in enumerate(names)
    )


# Leaf first, as recorded: keyfn's eval call, the C of sorted(), the eval call running run and <module>.
SORTED_STACK = native(
    "_PyEval_EvalFrameDefault",
    "_PyFunction_Vectorcall",
    "list_sort_impl",
    "builtin_sorted",
    "_PyEval_EvalFrameDefault",
    "_PyEval_Vector",
    "PyEval_EvalCode",
    "run_mod",
    "Py_RunMain",
    "Py_BytesMain",
    "__libc_start_call_main",
    "__libc_start_main_impl",
    "_start",
)


def py(*frames: tuple[tuple[int, int], bool], truncated: bool = False, cut: bool = False) -> PythonStack:
    return PythonStack(tuple(PyFrameRef(c, i, entry) for (c, i), entry in frames), truncated, cut)


def pf(key: tuple[int, int]) -> PythonFrame:
    return PythonFrame(PID, START, *key)


def names(frames: tuple[AnyFrame, ...]) -> list[str]:
    """Native frames by function, Python frames by which function of the recording they are."""
    which = {KEYFN[0]: "keyfn", RUN[0]: "run", MODULE[0]: "<module>"}
    return [which[f.code] if isinstance(f, PythonFrame) else f.function for f in frames]


def test_equal_counts_replace_each_eval_frame_in_place_and_keep_the_c_frames_between() -> None:
    # Given keyfn (its own eval call) and run, <module> (one eval call), leaf first
    stack = py((KEYFN, True), (RUN, False), (MODULE, True))
    # When spliced into the native stack with its two eval frames
    frames, kind = splice(SORTED_STACK, stack, PID, START)
    # Then each call took its eval frame's place, sorted()'s C frames between them
    assert names(frames)[:8] == [
        "keyfn",
        "_PyFunction_Vectorcall",
        "list_sort_impl",
        "builtin_sorted",
        "run",
        "<module>",
        "_PyEval_Vector",
        "PyEval_EvalCode",
    ]
    assert names(frames)[-1] == "_start" and len(frames) == len(SORTED_STACK) + 1
    assert kind == ""
    assert frames[0] == pf(KEYFN)


def test_a_truncated_stack_is_aligned_from_the_root_and_marked_at_its_leaf_end() -> None:
    # Given the walk kept the root-most frames only: keyfn was cut (truncated), run and <module> kept
    stack = py((RUN, False), (MODULE, True), truncated=True)
    # When spliced
    frames, kind = splice(SORTED_STACK, stack, PID, START)
    # Then the call pairs with the root-most eval frame, one [truncated] frame at its leaf end, and
    # the leaf-most eval frame, whose Python frames were cut, stays native
    assert names(frames)[:7] == [
        "_PyEval_EvalFrameDefault",
        "_PyFunction_Vectorcall",
        "list_sort_impl",
        "builtin_sorted",
        "[truncated]",
        "run",
        "<module>",
    ]
    assert frames[4] == TRUNCATED_FRAME
    assert kind == FEWER_CALLS


def test_a_stack_cut_at_its_root_is_aligned_from_the_leaf() -> None:
    # Given a walk that ended at a frame that failed validation after keyfn (cut: no root end)
    stack = py((KEYFN, True), cut=True)
    # When spliced
    frames, kind = splice(SORTED_STACK, stack, PID, START)
    # Then keyfn takes the leaf-most eval frame, the other stays native, and nothing says truncated
    assert names(frames)[:5] == [
        "keyfn",
        "_PyFunction_Vectorcall",
        "list_sort_impl",
        "builtin_sorted",
        "_PyEval_EvalFrameDefault",
    ]
    assert TRUNCATED_FRAME not in frames
    assert kind == FEWER_CALLS


def test_calls_with_no_eval_frame_left_go_at_the_root_end() -> None:
    # Given a native stack that lost its root (its unwinding stopped in sorted()'s C frames)
    cut_native = SORTED_STACK[:4]
    stack = py((KEYFN, True), (RUN, False), (MODULE, True))
    # When spliced
    frames, kind = splice(cut_native, stack, PID, START)
    # Then keyfn takes the one eval frame and the outer call goes past the native root, in order
    assert names(frames) == ["keyfn", "_PyFunction_Vectorcall", "list_sort_impl", "builtin_sorted", "run", "<module>"]
    assert kind == MORE_CALLS


def test_a_truncated_stack_with_more_calls_puts_the_extra_leaf_calls_beside_the_leafmost_pair() -> None:
    # Given the Python stack's leaf end cut, and a native stack with one eval frame named
    stack = py((KEYFN, True), (RUN, False), (MODULE, True), truncated=True)
    native_one = native("_PyEval_EvalFrameDefault", "Py_RunMain", "_start")
    # When spliced
    frames, kind = splice(native_one, stack, PID, START)
    # Then the root-most call pairs with it and the leaf-ward call goes just leaf-ward of it
    assert names(frames) == ["[truncated]", "keyfn", "run", "<module>", "Py_RunMain", "_start"]
    assert kind == MORE_CALLS


def test_without_any_eval_frame_the_python_frames_go_on_the_native_root_end() -> None:
    # Given a native stack in which no frame is named _PyEval_EvalFrameDefault (a stripped libpython)
    stripped = native("", "", "Py_BytesMain", "_start")
    stack = py((KEYFN, True), (RUN, False), (MODULE, True))
    # When spliced
    frames, kind = splice(stripped, stack, PID, START)
    # Then the native frames keep their place and the Python frames follow their root end, in order
    assert names(frames) == ["", "", "Py_BytesMain", "_start", "keyfn", "run", "<module>"]
    assert kind == NO_EVAL_FRAME
    # and a sample with no user stack at all gets its Python frames alone
    assert names(splice((), stack, PID, START)[0]) == ["keyfn", "run", "<module>"]


def test_a_cold_part_of_the_eval_loop_is_its_call() -> None:
    # Given the leaf in the compiler's cold split of the eval loop
    native_cold = native("_PyEval_EvalFrameDefault.cold", "Py_RunMain")
    # When spliced, then it is replaced like the function itself
    frames, kind = splice(native_cold, py((KEYFN, True)), PID, START)
    assert names(frames) == ["keyfn", "Py_RunMain"] and kind == ""


def test_the_profile_names_python_frames_and_shows_a_placeholder_for_the_unnamed() -> None:
    # Given a window with the spliced sample, and names for keyfn and run only
    frames, _ = splice(SORTED_STACK, py((KEYFN, True), (RUN, False), (MODULE, True)), PID, START)
    w = ServiceWindow()
    w.add((("service", "app"),), frames, 3, 30_000_000)
    known = {pf(KEYFN): ("keyfn", "/srv/app.py", 7), pf(RUN): ("run", "/srv/app.py", 12)}
    asked: list[PythonFrame] = []

    def name(f: PythonFrame) -> tuple[str, str, int] | None:
        asked.append(f)
        return known.get(f)

    # When its profile is built
    gz, n = profile_mod.build(ClosedWindow("cpu", "app", 0, 10**10, w), 10_101_010, name)
    sample = pprof.read(gz).samples[0]
    # Then the stack reads root first with the Python frames in place, file and line on each
    by_name = {f.function: f for f in sample.frames}
    assert sample.functions[-8:] == (
        "PyEval_EvalCode",
        "_PyEval_Vector",
        placeholder(pf(MODULE)),
        "run",
        "builtin_sorted",
        "list_sort_impl",
        "_PyFunction_Vectorcall",
        "keyfn",
    )
    assert (by_name["keyfn"].filename, by_name["keyfn"].line, by_name["keyfn"].module) == (
        "/srv/app.py",
        7,
        PYTHON_MODULE,
    )
    assert (by_name["run"].filename, by_name["run"].line) == ("/srv/app.py", 12)
    # and the unnamed frame says where it was: its code object and offset; each frame asked once
    assert placeholder(pf(MODULE)) == "[python 0x7f3a11e030+112]"
    assert placeholder(PythonFrame(PID, START, 0x7F3A11E030, -1)) == "[python 0x7f3a11e030]"
    assert sorted(asked, key=lambda f: f.code) == sorted([pf(KEYFN), pf(RUN), pf(MODULE)], key=lambda f: f.code)
    assert n == 1 and sample.values == (3, 30_000_000)


def test_the_truncated_mark_is_one_frame_under_the_python_mapping() -> None:
    # Given a truncated stack's sample in a window
    frames, _ = splice(SORTED_STACK, py((RUN, False), (MODULE, True), truncated=True), PID, START)
    w = ServiceWindow()
    w.add((), frames, 1, 1)
    # When built with no names at all
    gz, _ = profile_mod.build(ClosedWindow("cpu", "app", 0, 10**10, w), 1)
    sample = pprof.read(gz).samples[0]
    # Then [truncated] is one frame, under the same [python] mapping as the (placeholder-named) frames
    marked = [f for f in sample.frames if f.function == "[truncated]"]
    assert len(marked) == 1 and marked[0].module == PYTHON_MODULE
    assert sample.functions[-7:] == (
        placeholder(pf(MODULE)),
        placeholder(pf(RUN)),
        "[truncated]",
        "builtin_sorted",
        "list_sort_impl",
        "_PyFunction_Vectorcall",
        "_PyEval_EvalFrameDefault",
    )
