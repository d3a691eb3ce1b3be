"""The uploader's spool on a real directory: durable before the ack, oldest first across restarts,
bounded by spool_max_mb (oldest dropped, counted and logged), dead letters with their reason."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from shared.handoff import REFUSED, STORED
from shared.wire import ProfileUpload
from tests.harness import END_NS, START_NS, make_upload
from uploader import spool as spool_mod
from uploader.spool import Entry, Spool, decode_file, encode_file

LOGGER = "test.spool"


def open_spool(tmp_path: Path, max_bytes: int = 1 << 20, **kwargs: int) -> Spool:
    s = Spool(str(tmp_path / "spool"), str(tmp_path / "dead-letter"), max_bytes, logging.getLogger(LOGGER), **kwargs)
    s.open()
    return s


def take(s: Spool, now: float) -> tuple[Entry, ProfileUpload]:
    """The next due profile, where the test has one waiting."""
    item = s.take(now)
    assert item is not None
    return item


def take_all(s: Spool) -> list[str]:
    """Deliver everything, oldest first, as the sender would; the ids in the order taken."""
    out = []
    while (item := s.take(0.0)) is not None:
        entry, upload = item
        out.append(upload.profile_id)
        s.delivered(entry)
    return out


def test_a_spooled_profile_is_a_whole_file_that_reads_back_exactly(tmp_path: Path) -> None:
    s = open_spool(tmp_path)
    upload = make_upload("/usr/bin/python3.11")
    assert s.accept(upload) == (STORED, "")
    [name] = os.listdir(tmp_path / "spool")  # no temporary file left beside it
    assert name.endswith(f"-{upload.profile_id}.prof")
    assert decode_file((tmp_path / "spool" / name).read_bytes()) == upload
    entry, back = take(s, 0.0)
    assert back == upload and entry.in_flight
    assert s.take(0.0) is None  # in flight: not taken twice
    s.delivered(entry)
    assert os.listdir(tmp_path / "spool") == [] and len(s) == 0 and s.bytes == 0


def test_order_is_arrival_and_survives_a_restart(tmp_path: Path) -> None:
    s = open_spool(tmp_path)
    uploads = [make_upload(f"/bin/s{i}") for i in range(5)]
    for u in uploads:
        s.accept(u)
    # a new Spool on the same directory (the next start) takes them oldest first
    again = open_spool(tmp_path)
    assert len(again) == 5
    assert take_all(again) == [u.profile_id for u in uploads]


def test_the_same_id_is_spooled_once(tmp_path: Path) -> None:
    s = open_spool(tmp_path)
    u = make_upload()
    assert s.accept(u) == (STORED, "")
    assert s.accept(u) == (STORED, "already spooled")
    assert len(os.listdir(tmp_path / "spool")) == 1 and s.counts["duplicates"] == 1


def test_a_late_copy_of_a_profile_that_left_the_spool_is_not_spooled_again(tmp_path: Path) -> None:
    # given a spool that holds two profiles of this size, one delivered and one dropped for room
    uploads = [make_upload(f"/bin/late{i}") for i in range(4)]
    s = open_spool(tmp_path, max_bytes=2 * len(encode_file(uploads[0])) + 100)
    s.accept(uploads[0])
    entry, _ = take(s, 0.0)
    s.delivered(entry)
    for u in uploads[1:]:
        s.accept(u)  # the third drops uploads[1]
    # when the worker's resent copies of both arrive (their acks were late)
    assert s.accept(uploads[0]) == (STORED, "already spooled")
    assert s.accept(uploads[1]) == (STORED, "already spooled")
    # then neither is spooled again, and the newer ones stay
    assert take_all(s) == [uploads[2].profile_id, uploads[3].profile_id]
    assert s.counts["duplicates"] == 2


def test_over_the_cap_the_oldest_are_dropped_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # given a spool that holds three profiles of this size
    uploads = [make_upload(f"/bin/svc{i}", start_ns=START_NS + i * 60_000_000_000) for i in range(5)]
    size = len(encode_file(uploads[0]))
    s = open_spool(tmp_path, max_bytes=3 * size + size // 2)
    # when five arrive
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for u in uploads:
            assert s.accept(u)[0] == STORED
    # then the two oldest were dropped, each logged with its service and window
    assert s.counts["dropped"] == 2 and len(s) == 3 and s.bytes <= s.max_bytes
    drops = [r.getMessage() for r in caplog.records if "dropped the oldest" in r.getMessage()]
    # the log line is the feature: a dropped profile is lost data, and only its line tells the operator whose and when
    assert len(drops) == 2
    assert "service='/bin/svc0'" in drops[0] and "window=2023-11-14T22:13:20Z+60s" in drops[0]
    assert "service='/bin/svc1'" in drops[1] and "window=2023-11-14T22:14:20Z+60s" in drops[1]
    assert "spool full" in drops[0] and "(2 dropped so far)" in drops[1]
    assert take_all(s) == [u.profile_id for u in uploads[2:]]


def test_the_profile_being_sent_is_not_dropped(tmp_path: Path) -> None:
    uploads = [make_upload(f"/bin/s{i}") for i in range(3)]
    size = len(encode_file(uploads[0]))
    s = open_spool(tmp_path, max_bytes=2 * size + size // 2)
    s.accept(uploads[0])
    s.accept(uploads[1])
    entry, _ = take(s, 0.0)  # uploads[0] is being posted
    s.accept(uploads[2])  # room is made from the next oldest
    assert sorted(s.ids()) == sorted([uploads[0].profile_id, uploads[2].profile_id])
    s.delivered(entry)


def test_the_file_count_is_bounded_too(tmp_path: Path) -> None:
    s = open_spool(tmp_path, max_files=4)
    uploads = [make_upload() for _ in range(6)]
    for u in uploads:
        s.accept(u)
    assert len(s) == 4 and s.counts["dropped"] == 2
    assert take_all(s) == [u.profile_id for u in uploads[2:]]


def test_a_profile_larger_than_the_whole_spool_is_refused(tmp_path: Path) -> None:
    s = open_spool(tmp_path, max_bytes=100)
    status, reason = s.accept(make_upload())
    assert status == REFUSED and "larger than the whole spool" in reason
    assert len(s) == 0 and s.counts["refused_too_large"] == 1


def test_a_lower_cap_at_start_drops_the_oldest(tmp_path: Path) -> None:
    s = open_spool(tmp_path)
    uploads = [make_upload() for _ in range(4)]
    for u in uploads:
        s.accept(u)
    size = len(encode_file(uploads[0]))
    again = open_spool(tmp_path, max_bytes=2 * size)
    assert again.counts["dropped"] == 2
    assert take_all(again) == [u.profile_id for u in uploads[2:]]


def test_leftovers_of_a_crash_are_cleaned_and_strangers_left_alone(tmp_path: Path) -> None:
    s = open_spool(tmp_path)
    u = make_upload()
    s.accept(u)
    spool_dir = tmp_path / "spool"
    (spool_dir / ".tmpabc123.tmp").write_bytes(b"half a profile")  # write_atomic cut short by a crash
    (spool_dir / "README").write_text("not ours")
    again = open_spool(tmp_path)
    assert sorted(os.listdir(spool_dir)) == sorted(["README", f"{again._by_id[u.profile_id]}"])
    assert (again.counts["partial_removed"], again.counts["strangers"]) == (1, 1)
    assert take_all(again) == [u.profile_id]


def test_an_unreadable_spool_file_goes_to_the_dead_letters_with_the_reason(tmp_path: Path) -> None:
    s = open_spool(tmp_path)
    good, bad = make_upload(), make_upload()
    s.accept(bad)
    s.accept(good)
    [bad_name] = [n for n in os.listdir(tmp_path / "spool") if bad.profile_id in n]
    (tmp_path / "spool" / bad_name).write_bytes(b"garbage")
    # the sender skips it to the next one, and the file is kept with the reason
    assert take_all(s) == [good.profile_id]
    record = json.loads((tmp_path / "dead-letter" / f"{bad_name}.json").read_text())
    assert record["id"] == bad.profile_id and "unreadable spool file" in record["reason"]
    assert (tmp_path / "dead-letter" / bad_name).read_bytes() == b"garbage"


def test_dead_letters_keep_the_profile_and_its_reason(tmp_path: Path) -> None:
    s = open_spool(tmp_path)
    u = make_upload("/bin/refused")
    s.accept(u)
    entry, upload = take(s, 0.0)
    entry.attempts = 1
    s.dead_letter(entry, upload, 400, "HTTP 400 'bad profile'")
    assert len(s) == 0 and os.listdir(tmp_path / "spool") == []
    [record] = (tmp_path / "dead-letter").glob("*.json")
    meta = json.loads(record.read_text())
    assert {
        k: meta[k]
        for k in ("id", "service", "type", "status", "reason", "attempts", "window_start_ns", "window_end_ns")
    } == {
        "id": u.profile_id,
        "service": "/bin/refused",
        "type": "cpu",
        "status": 400,
        "reason": "HTTP 400 'bad profile'",
        "attempts": 1,
        "window_start_ns": START_NS,
        "window_end_ns": END_NS,
    }
    assert record.with_suffix(".pb.gz").read_bytes() == u.pprof_gz


def test_dead_letters_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_mod, "MAX_DEAD_LETTERS", 3)
    s = open_spool(tmp_path)
    uploads = [make_upload() for _ in range(5)]
    for u in uploads:
        s.accept(u)
    while (item := s.take(0.0)) is not None:
        s.dead_letter(item[0], item[1], 400, "no")
    kept = sorted(json.loads(p.read_text())["id"] for p in (tmp_path / "dead-letter").glob("*.json"))
    assert kept == sorted(u.profile_id for u in uploads[2:])
    assert len(list((tmp_path / "dead-letter").glob("*.pb.gz"))) == 3


def test_retry_times_order_attempts(tmp_path: Path) -> None:
    s = open_spool(tmp_path)
    a, b = make_upload(), make_upload()
    s.accept(a)
    s.accept(b)
    entry, _ = take(s, 10.0)
    s.retry_later(entry, 20.0)  # a waits; b is due first
    nxt, up = take(s, 10.0)
    assert up.profile_id == b.profile_id
    s.delivered(nxt)
    assert s.take(10.0) is None and s.next_due_in(10.0) == pytest.approx(10.0)
    s.make_all_due()  # the final attempt at stop
    assert take(s, 10.0)[1].profile_id == a.profile_id
