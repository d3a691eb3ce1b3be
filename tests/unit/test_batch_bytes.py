"""Batches bounded by bytes (issue 40, case 9): a mapping table capped per process, a message over the cap
split into messages that fit, never dropped whole.

On constructed data: a process that maps one long-named file 15,000 times (its maps as /proc gives
them, in a fake /proc), beside an ordinary one; batches and announcements built from them, split at a
small cap so that every way of splitting is taken.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest

from collector import procfs
from shared import wire
from shared.wire import Mapping, Process, ProcessAnnouncement, Sample, StackBatch, UnwindRequest

# A path of 960 bytes of "é": a JSON row of ~2.8 KB once the wire escapes it (\u00e9).
LONG_DIR = "/tmp/many/" + "/".join(["é" * 120] * 4)
MANY = 15_000


def write_process(proc: Path, pid: int, maps: str) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} (p{pid}) S 1 {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0")
    (d / "status").write_text("Uid:\t7\t7\t7\t7\n")
    (d / "cgroup").write_text("0::/\n")
    (d / "maps").write_text(maps)
    (d / "exe").symlink_to(f"/bin/p{pid}")


def many_mappings_maps() -> str:
    """The maps of a process with its executable and libc, and a long-named file mapped MANY times."""
    lines = [
        "555555554000-555555556000 r-xp 00001000 fd:01 11 /bin/p1",
        "7ffff7c00000-7ffff7d80000 r-xp 00028000 fd:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6",
    ]
    for i in range(MANY):
        start = 0x7F0000000000 + i * 0x2000
        lines.append(f"{start:x}-{start + 0x1000:x} r-xp 00000000 fd:01 13 {LONG_DIR}/file")
    return "\n".join(lines) + "\n"


def test_a_mapping_table_is_capped_by_bytes_the_rest_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # given a process mapping a long-named file 15,000 times (its table: ~42 MB on the wire)
    proc = tmp_path / "proc"
    write_process(proc, 1, many_mappings_maps())
    table = procfs.ProcessTable(with_cmdline=False, proc=str(proc))
    caplog.set_level(logging.WARNING)
    # when the collector reads it
    p = table.get(1)
    # then its table takes at most MAX_MAPPING_TABLE_BYTES on the wire, its executable and libc kept
    assert p is not None
    assert sum(wire.mapping_bytes(m) for m in p.mappings) <= procfs.MAX_MAPPING_TABLE_BYTES
    assert {"/bin/p1", "/usr/lib/x86_64-linux-gnu/libc.so.6"} <= {m.path for m in p.mappings}
    assert [m.start for m in p.mappings] == sorted(m.start for m in p.mappings)
    # and what was left out is counted
    assert table.stats["mappings_cut"] == MANY + 2 - len(p.mappings) > 10_000
    assert table.stats["tables_cut"] == 1
    # and an address in a mapping left out still counts as known: the maps are not read again
    reads = table.stats["maps_read"]
    assert table.get(1, [0x7F0000000000 + (MANY - 1) * 0x2000 + 8]) is not None
    assert table.stats["maps_read"] == reads
    # and a new mapping (an address outside all of them) reads them again, logged once for the process
    assert table.get(1, [0x10]) is not None
    assert table.stats["maps_read"] == reads + 1 and table.stats["tables_cut"] == 2
    said = [r for r in caplog.records if "left out" in r.getMessage()]
    # the log line is the feature: a cut table is logged once per process, naming it (the counts are above)
    assert len(said) == 1 and "pid 1 " in said[0].getMessage()


def test_a_table_under_the_cap_is_whole() -> None:
    maps = procfs.parse_maps("1000-2000 r-xp 00000000 fd:01 9 /bin/a\n3000-4000 r-xp 00000000 fd:01 9 /bin/b\n")
    assert procfs.cap_table(maps) == (maps, 0)


# ---------------------------------------------------------------- splitting


def process(pid: int, mappings: int = 1, path: str = "/bin/x") -> Process:
    return Process(
        pid=pid,
        start_ticks=pid * 10,
        uid=0,
        nspid=pid,
        comm=f"p{pid}",
        executable=f"/bin/p{pid}",
        service=f"/bin/p{pid}",
        mappings=tuple(
            Mapping(0x1000 * (i + 1), 0x1000 * (i + 1) + 0x800, 0, path, "fd:01", 9) for i in range(mappings)
        ),
    )


def batch(processes: list[Process], samples_per_pid: int = 3) -> StackBatch:
    user = [(0x1000 + i, 0x2000 + i) for i in range(len(processes) * samples_per_pid)]
    kernel = [(0xFFFF0000 + i,) for i in range(len(user))]
    samples = []
    for n, p in enumerate(processes):
        for k in range(samples_per_pid):
            i = n * samples_per_pid + k
            samples.append(Sample(pid=p.pid, tid=p.pid, user_stack=i, kernel_stack=i, count=i + 1, value=10 * (i + 1)))
    return StackBatch(
        host="h",
        profile_type="cpu",
        sample_hz=99,
        time_ns=1,
        processes=tuple(processes),
        user_stacks=tuple(user),
        kernel_stacks=tuple(kernel),
        samples=tuple(samples),
        kernel_symbols={a: f"k{a:x}" for st in kernel for a in st},
        lost={"map_full": 4},
        unwind_requests=tuple(UnwindRequest(p.pid, p.start_ticks, 0x1000, 0x1800, "fd:01", 9) for p in processes),
    )


def resolved(b: StackBatch) -> Counter:
    """Each sample with its stacks and kernel names spelt out: what a symbolizer makes of the batch."""
    pids = {p.pid for p in b.processes}
    out: Counter = Counter()
    for s in b.samples:
        assert s.pid in pids
        k = b.kernel_stacks[s.kernel_stack] if s.kernel_stack >= 0 else ()
        out[
            (
                s.pid,
                s.tid,
                b.user_stacks[s.user_stack] if s.user_stack >= 0 else (),
                tuple(b.kernel_symbols[a] for a in k),
                s.count,
                s.value,
            )
        ] += 1
    return out


def split(b: StackBatch, cap: int) -> list[StackBatch]:
    fit, unfit = wire.encode_within(b, cap)
    assert not unfit
    parts = []
    for part, frames in fit:
        assert len(frames[0]) <= cap
        decoded = wire.decode(frames)
        assert decoded == part
        parts.append(decoded)
    return parts


def decoded_announcement(frames: list[bytes]) -> ProcessAnnouncement:
    msg = wire.decode(frames)
    assert isinstance(msg, ProcessAnnouncement)
    return msg


def test_a_batch_that_fits_is_one_message() -> None:
    b = batch([process(1), process(2)])
    assert wire.encode_within(b) == ([(b, wire.encode(b))], [])


def test_a_batch_over_the_cap_is_split_by_process_and_nothing_is_lost() -> None:
    # given a batch of an ordinary process and three with 1,000 long-named mappings each
    ordinary = process(1)
    b = batch([ordinary] + [process(pid, 1000, LONG_DIR) for pid in (2, 3, 4)])
    whole = len(wire.encode(b)[0])
    # when it is split at a cap a third of its size
    parts = split(b, whole // 3)
    # then each part fits and decodes, and together they carry every sample, stack and kernel name once
    assert len(parts) >= 3
    total: Counter = Counter()
    for part in parts:
        total += resolved(part)
    assert total == resolved(b)
    # and the ordinary process's samples are all there, the loss counts once, each unwind request once
    assert sum(s.count for p in parts for s in p.samples if s.pid == ordinary.pid) == 1 + 2 + 3
    assert [p.lost for p in parts if p.lost] == [{"map_full": 4}]
    assert sorted(r.pid for p in parts for r in p.unwind_requests) == [1, 2, 3, 4]
    # and a part's kernel names are those of its own stacks only
    for part in parts:
        assert set(part.kernel_symbols) == {a for st in part.kernel_stacks for a in st}


def test_a_table_over_the_cap_costs_only_its_own_process() -> None:
    # given the 15,000 long mappings uncapped (~42 MB) in a batch beside an ordinary process
    ordinary, big = process(1), process(2, MANY, LONG_DIR)
    b = batch([ordinary, big])
    # when it is split at a cap under that table's size
    fit, unfit = wire.encode_within(b, 20 << 20)
    # then the ordinary process's samples are sent whole, and only the big one's are handed back
    assert [s.count for part, _ in fit for s in part.samples if s.pid == ordinary.pid] == [1, 2, 3]
    assert {s.pid for part in unfit for s in part.samples} == {big.pid}
    assert sum(len(part.samples) for part in unfit) == 3


def test_one_process_with_many_samples_is_split_by_sample() -> None:
    b = batch([process(1, 200)], samples_per_pid=400)
    parts = split(b, len(wire.encode(b)[0]) // 4)
    assert len(parts) >= 4
    assert all(p.processes == b.processes for p in parts)
    total: Counter = Counter()
    for part in parts:
        total += resolved(part)
    assert total == resolved(b)


def test_what_cannot_fit_is_handed_back_not_dropped_silently() -> None:
    # given one sample with a process whose table alone is over the cap
    b = batch([process(1, 1000, LONG_DIR)], samples_per_pid=1)
    fit, unfit = wire.encode_within(b, 10_000)
    assert fit == [] and unfit == [b]


def test_an_announcement_over_the_cap_is_split() -> None:
    procs = tuple(
        Process(
            pid=i,
            start_ticks=i,
            uid=0,
            nspid=i,
            comm="c",
            executable="/bin/c",
            service="/bin/c",
            cmdline=("é" * 1000,) * 20,
        )
        for i in range(1, 41)
    )
    a = ProcessAnnouncement(host="h", time_ns=1, processes=procs, exited=((99, 1), (98, 2)), full=True)
    cap = len(wire.encode(a)[0]) // 5
    fit, unfit = wire.encode_within(a, cap)
    assert not unfit and len(fit) >= 5
    got = [decoded_announcement(frames) for _, frames in fit]
    assert all(len(frames[0]) <= cap for _, frames in fit)
    assert [p for g in got for p in g.processes] == list(procs)
    assert sorted(e for g in got for e in g.exited) == [(98, 2), (99, 1)]
    assert all(g.full for g in got)


def test_the_receivers_take_what_the_senders_send() -> None:
    assert wire.MAX_BATCH_BYTES < wire.RECEIVE_LIMIT_BYTES
    # the largest table the collector sends leaves room for many in a batch
    assert procfs.MAX_MAPPING_TABLE_BYTES * 16 <= wire.MAX_BATCH_BYTES
