"""Wire format: one encode, one decode; anything malformed is a WireError, never another exception."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from shared import wire
from shared.wire import (
    FileRequest,
    Mapping,
    Process,
    ProfileUpload,
    PyFrameRef,
    PythonLayout,
    PythonNameRequest,
    PythonNames,
    PythonProcess,
    PythonStack,
    Sample,
    StackBatch,
    WireError,
)


def batch() -> StackBatch:
    proc = Process(
        pid=10,
        start_ticks=99,
        uid=1000,
        nspid=1,
        comm="app",
        executable="/usr/bin/app",
        service="/usr/bin/app",
        container_id="c" * 64,
        pod_uid="p",
        cmdline=("app", "-x"),
        mappings=(Mapping(0x1000, 0x2000, 0, "/usr/bin/app", "fd:01", 42),),
    )
    return StackBatch(
        host="h",
        profile_type="cpu",
        sample_hz=19,
        time_ns=123,
        processes=(proc,),
        user_stacks=((0x1010, 0x1020),),
        kernel_stacks=((0xFFFFFFFF81000000,),),
        samples=(Sample(10, 11, 0, 0, 3, 300), Sample(10, 12, -1, -1, 1, 100)),
        kernel_symbols={0xFFFFFFFF81000000: "schedule"},
        lost={"counts_map_full": 2},
    )


def test_round_trip_of_both_messages() -> None:
    b = batch()
    assert wire.decode(wire.encode(b)) == b
    up = ProfileUpload("id-1", "h", "svc", "cpu", 1, 2, 5, b"\x1f\x8b data")
    assert wire.decode(wire.encode(up)) == up


def test_alloc_samples_carry_their_inuse_values() -> None:
    # given an alloc batch with (objects, bytes) allocated and (objects, bytes) in use, when it
    # travels, then the extra values arrive in order, and a cpu sample still has none
    b = batch()
    alloc = StackBatch(
        **{
            **{f: getattr(b, f) for f in b.__slots__},
            "profile_type": "alloc",
            "samples": (Sample(10, 11, 0, -1, 4, 4096, (1, 1024)),),
        }
    )
    assert wire.decode(wire.encode(alloc)) == alloc
    plain = wire.decode(wire.encode(b))
    assert isinstance(plain, StackBatch) and plain.samples[0].extra == ()


def mutate(frames: list[bytes], path: list, value: object) -> list[bytes]:
    doc = json.loads(frames[0])
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return [json.dumps(doc).encode(), *frames[1:]]


@pytest.mark.parametrize(
    "path, value",
    [
        (["v"], 2),
        (["kind"], "other"),
        (["body", "profile_type"], "gpu"),
        (["body", "samples", 0, 2], 5),  # user stack index out of range
        (["body", "samples", 0, 4], -1),  # negative count
        (["body", "samples", 0], [1, 2, 3]),
        (["body", "processes", 0, "mappings", 0, 1], 0),  # end before start
        (["body", "processes", 0, "pid"], "10"),
        (["body", "user_stacks", 0], list(range(600))),  # deeper than any real stack
        (["body", "kernel_symbols"], {"a": 1}),
        (["body", "lost"], []),
        (["body", "samples", 0], [10, 11, 0, 0, 3, 300, 1, 2, 3]),  # more extra values than any profile has
        (["body", "samples", 0], [10, 11, 0, 0, 3, 300, -1]),  # a negative extra value
    ],
)
def test_malformed_batches_are_wire_errors(path: list, value: object) -> None:
    with pytest.raises(WireError):
        wire.decode(mutate(wire.encode(batch()), path, value))


def test_garbage_never_raises_anything_but_wire_error() -> None:
    # given random and truncated inputs, when decoded, then only WireError comes out
    rng = random.Random(7)
    good = wire.encode(batch())[0]
    cases = [[b""], [], [b"x"] * 3, [b"[1,2]"], [b"{}"], [b'{"v":1,"kind":"stack_batch","body":{}}']]
    cases += [[good[: rng.randrange(len(good))]] for _ in range(200)]
    cases += [[bytes(rng.randrange(256) for _ in range(64))] for _ in range(100)]
    for frames in cases:
        with pytest.raises(WireError):
            wire.decode(frames)


def test_oversized_profile_is_refused() -> None:
    up = ProfileUpload("id", "h", "svc", "cpu", 1, 2, 5, b"x")
    frames = wire.encode(up)
    frames[1] = b"x" * (wire.MAX_PROFILE_BYTES + 1)
    with pytest.raises(WireError, match="over the cap"):
        wire.decode(frames)


def test_a_debug_file_request_round_trips_with_its_build_id() -> None:
    # given a request for the debug file of a SHA-1 build id / when encoded and decoded / then equal
    req = FileRequest(10, 99, "debug", build_id="93ac61ec5a8eb1396f9fbd350e3169a558528a40")
    assert wire.decode(wire.encode(req)) == req


@pytest.mark.parametrize(
    "kind, build_id",
    [
        ("debug", ""),  # a debug request names a build id
        ("debug", "a"),  # shorter than a byte
        ("debug", "ab" * 33),  # over MAX_BUILD_ID_HEX
        ("debug", "93AC61EC"),  # not lowercase
        ("debug", "../../etc/passwd"),  # not hex: it becomes a path in the broker
        ("debug", 1234),
        ("perf_map", "abcd"),  # only debug requests carry one
    ],
)
def test_a_bad_build_id_in_a_file_request_is_a_wire_error(kind: str, build_id: object) -> None:
    frames = wire.encode(FileRequest(10, 99, kind, build_id="ab"))
    with pytest.raises(WireError):
        wire.decode(mutate(frames, ["body", "build_id"], build_id))


def test_integer_of_more_digits_than_int_takes_is_a_wire_error() -> None:
    # json raises a plain ValueError past sys.get_int_max_str_digits (4,300): it must be a WireError.
    for frame in (
        b'{"v": 1, "kind": "stack_batch", "body": {"time_ns": ' + b"9" * 5000 + b"}}",
        b'{"v": ' + b"1" * 4301 + b"}",
    ):
        with pytest.raises(WireError, match="not JSON"):
            wire.decode([frame])


def test_errors_quote_the_offending_value_cut() -> None:
    # A 3 MB value must not become a 3 MB log line.
    huge = json.dumps({"v": 1, "kind": "x" * 3_000_000, "body": {}}).encode()
    with pytest.raises(WireError) as e:
        wire.decode([huge])
    assert len(str(e.value)) < 400
    body = {"v": 1, "kind": "file_reply", "body": {"ok": False, "error": "e" * 4000, "reason": ""}}
    with pytest.raises(WireError) as e:
        wire.decode([json.dumps(body).encode()])
    assert len(str(e.value)) < 400
    samples = json.dumps(
        {
            "v": 1,
            "kind": "stack_batch",
            "body": {"host": "h", "profile_type": "cpu", "sample_hz": [0] * 1_000_000, "time_ns": 0},
        }
    ).encode()
    with pytest.raises(WireError) as e:
        wire.decode([samples])
    assert len(str(e.value)) < 400


def regs_batch() -> wire.RegsBatch:
    return wire.RegsBatch(
        host="h",
        time_ns=5,
        period_ns=52_631_578,
        samples=(
            wire.RegsSample(
                pid=10,
                start_ticks=7,
                tid=11,
                time_ns=3,
                ip=0x7F0000001000,
                sp=0x7FFF0000,
                fp=0x7FFF0040,
                stack=bytes(range(256)) * 4,
            ),
            wire.RegsSample(pid=10, start_ticks=7, tid=12, time_ns=4, ip=1, sp=2, fp=3, stack=b""),
            wire.RegsSample(pid=20, start_ticks=9, tid=20, time_ns=4, ip=1, sp=2, fp=3, stack=b"\x01" * 256),
        ),
    )


def test_regs_batches_round_trip_with_each_sample_its_own_stack_bytes() -> None:
    msg = regs_batch()
    assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.parametrize(
    "change",
    [
        "stack bytes no sample names",
        "a sample naming more bytes than sent",
        "a stack over the cap",
        "one frame",
        "a short row",
    ],
)
def test_malformed_regs_batches_are_wire_errors(change: str) -> None:
    head, stacks = wire.encode(regs_batch())
    doc = json.loads(head)
    rows = doc["body"]["samples"]
    if change == "stack bytes no sample names":
        stacks += b"\0" * 8
    elif change == "a sample naming more bytes than sent":
        rows[1][7] = 8
    elif change == "a stack over the cap":
        rows[0][7] = wire.MAX_REGS_STACK_BYTES + 1
    elif change == "a short row":
        rows[2] = rows[2][:7]
    frames = [json.dumps(doc).encode()] + ([] if change == "one frame" else [stacks])
    with pytest.raises(WireError):
        wire.decode(frames)


# ---------------------------------------------------------------- the Python walker's messages

LAYOUT = PythonLayout(
    runtime_interpreters_head=40,
    interp_threads_head=16,
    tstate_next=8,
    tstate_thread_id=152,
    tstate_current_frame=56,
    cframe_current_frame=8,
    frame_previous=48,
    frame_executable=32,
    frame_instr_ptr=56,
    frame_owner=69,
    frame_is_entry=68,
    code_adaptive=184,
    skip_owners=frozenset(),
    tag_mask=0,
)
STACK = PythonStack((PyFrameRef(0x7F0010, 24, False), PyFrameRef(0x7F0020, None, True)), truncated=True)


def with_python() -> wire.StackBatch:
    b = batch()
    samples = (replace(b.samples[0], python_stack=0), b.samples[1], Sample(10, 13, 0, -1, 2, 20, (), 1))
    return replace(b, samples=samples, python_stacks=(STACK, PythonStack((PyFrameRef(0x7F0030, 0, True),), cut=True)))


def test_a_batch_carries_each_samples_python_stack() -> None:
    b = with_python()
    assert wire.decode(wire.encode(b)) == b
    assert "python_stacks" not in json.loads(wire.encode(batch())[0])["body"]  # none: nothing on the wire


def test_a_split_batch_keeps_each_sample_with_its_python_stack() -> None:
    b = with_python()
    parts, unfit = wire.encode_within(b, len(wire.encode(b)[0]) - 1)
    assert not unfit and len(parts) > 1
    got = [
        (s.tid, part.python_stacks[s.python_stack] if s.python_stack >= 0 else None)
        for part, _ in parts
        for s in part.samples
    ]
    want = [(s.tid, b.python_stacks[s.python_stack] if s.python_stack >= 0 else None) for s in b.samples]
    assert sorted(got, key=lambda t: t[0]) == sorted(want, key=lambda t: t[0])


@pytest.mark.parametrize(
    "change",
    [
        lambda body: body["python_samples"].append([0, 5]),  # no such stack
        lambda body: body["python_samples"].append([9, 0]),  # no such sample
        lambda body: body["python_stacks"][0][0].append([0, 1, 0]),  # code 0
        lambda body: body["python_stacks"][0][0].append([8, -2, 0]),  # instr below -1
        lambda body: body["python_stacks"][0].append(1),  # three fields
        lambda body: body.pop("python_samples"),
    ],
)
def test_malformed_python_stacks_are_wire_errors(change) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(wire.encode(with_python())[0])
    change(doc["body"])
    with pytest.raises(WireError):
        wire.decode([json.dumps(doc).encode()])


def test_a_python_process_round_trips_with_its_optional_offsets() -> None:
    for lay in (
        LAYOUT,
        replace(LAYOUT, cframe_current_frame=None, frame_is_entry=None, skip_owners=frozenset({3, 4}), tag_mask=3),
    ):
        msg = PythonProcess(pid=42, start_ticks=7, version="3.11.2", runtime=0x7F00001000, layout=lay)
        assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.parametrize(
    "change",
    [
        lambda body: body["layout"].update(frame_owner=1 << 16),
        lambda body: body["layout"].update(surprise=1),
        lambda body: body["layout"].pop("frame_previous"),
        lambda body: body.update(skip_owners=[8]),
        lambda body: body.update(tag_mask=8),
        lambda body: body.update(runtime=0),
    ],
)
def test_a_malformed_python_process_is_a_wire_error(change) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(wire.encode(PythonProcess(42, 7, "3.11.2", 0x1000, LAYOUT))[0])
    change(doc["body"])
    with pytest.raises(WireError):
        wire.decode([json.dumps(doc).encode()])


def test_name_requests_and_answers_round_trip() -> None:
    req = PythonNameRequest(request_id=3, pid=42, start_ticks=7, frames=((0x7F0010, 24), (0x7F0020, -1)))
    assert wire.decode(wire.encode(req)) == req
    names = PythonNames(request_id=3, pid=42, start_ticks=7, names=((0x7F0010, 24, "Handler.get", "app.py", 31),))
    assert wire.decode(wire.encode(names)) == names
    doc = json.loads(wire.encode(req)[0])
    doc["body"]["frames"] = [[1, 0]] * (wire.MAX_PYTHON_NAMES + 1)
    with pytest.raises(WireError):
        wire.decode([json.dumps(doc).encode()])
