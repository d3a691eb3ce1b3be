"""The collector's BatchSender (collector/sender.py): what a refusing worker and an oversize batch
cost, as its totals and the collector's losses count them."""

from __future__ import annotations

import pytest

from collector import sender as sender_mod
from collector.sender import BatchSender
from shared.wire import Process, Sample, StackBatch


class Links:
    """WorkerLinks' send(): refuses while `refusing`, and keeps what it took."""

    def __init__(self) -> None:
        self.refusing = False
        self.sent: list[tuple[int, list[bytes]]] = []

    def send(self, worker: int, frames: list[bytes]) -> bool:
        if self.refusing:
            return False
        self.sent.append((worker, frames))
        return True


def batch(counts: tuple[int, ...], pid: int = 7) -> StackBatch:
    proc = Process(pid=pid, start_ticks=1, uid=0, nspid=pid, comm="p", executable="/p", service="/p")
    return StackBatch(
        host="h",
        profile_type="cpu",
        sample_hz=19,
        time_ns=1,
        processes=(proc,),
        user_stacks=(),
        kernel_stacks=(),
        samples=tuple(Sample(pid=pid, tid=pid, user_stack=-1, kernel_stack=-1, count=n, value=n) for n in counts),
    )


def test_a_refusing_worker_drops_batches_and_the_count_starts_again_when_it_takes_them() -> None:
    # given a worker that refuses two batches, then takes one
    links = Links()
    s = BatchSender(links, {})
    links.refusing = True
    s.send(1, batch((2, 3)))
    s.send(1, batch((4,)))
    assert s.totals["batches_dropped"] == 2 and s.totals["batches"] == 0
    links.refusing = False
    s.send(1, batch((1,)))
    # then the episode's drops were counted and the next episode starts from none
    assert s.totals == {"batches": 1, "batches_dropped": 2, "batches_split": 0, "parts_unsendable": 0}
    assert [w for w, _ in links.sent] == [1]
    links.refusing = True
    s.send(1, batch((5,)))
    assert s.totals["batches_dropped"] == 3


def test_an_oversize_batch_goes_in_parts_and_a_part_that_cannot_fit_is_lost_by_its_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given a batch that encodes as one part that fits and one that cannot be made to fit
    fits, unfit = batch((2,)), batch((3, 4), pid=8)
    monkeypatch.setattr(sender_mod, "encode_within", lambda _b: ([(fits, [b"frame"])], [unfit]))
    links = Links()
    lost = {"cpu.counts_map_full": 1}
    s = BatchSender(links, lost)
    # when it is sent
    s.send(0, batch((2, 3, 4)))
    # then the part that fits is sent, and the other's samples are lost as cpu.oversize, beside the
    # losses the collector counted already
    assert links.sent == [(0, [b"frame"])]
    assert s.totals == {"batches": 1, "batches_dropped": 0, "batches_split": 1, "parts_unsendable": 1}
    assert lost == {"cpu.counts_map_full": 1, "cpu.oversize": 7}
