"""JIT perf maps: opened by the collector's file broker, checked and parsed by the symbolizer.

Most tests lay out a fake /proc in tmp_path: proc/<pid>/root/tmp/perf-<nspid>.map
and proc/<pid>/status, what the broker opens for a process whose /tmp is its
own (containers); the symbolizer side (perfmap.py) reads the descriptor.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest

from collector import filebroker
from shared.wire import FileRequest
from symbolizer import perfmap
from symbolizer.files import ProcessGone
from symbolizer.perfmap import PerfMapCache, PerfMapRefused, read_perf_map

PID, NSPID, START_TICKS = 4242, 7, 123456
UID = os.getuid()

MAP = (
    "7f0000001000 40 LazyCompile:~handler /app/server.js:12\n"  # bare hex, name with spaces
    "0x7f0000002000 0x20 Builtin:ArrayPush\n"  # 0x-prefixed
    "7F0000003000 10 Stub  with  double  spaces\n"  # upper case hex
)


def fake_process(proc: Path, pid: int = PID, nspid: int = NSPID) -> Path:
    """proc/<pid>/status naming the process's pid in its namespace; returns proc/<pid>/root."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "status").write_text(f"Name:\tjit\nUid:\t{UID}\t{UID}\t{UID}\t{UID}\nNSpid:\t{pid}\t{nspid}\n")
    return proc / str(pid) / "root"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    (fake_process(tmp_path / "proc") / "tmp").mkdir(parents=True)
    return tmp_path / "proc"


def opener(proc: Path) -> perfmap.Opener:
    """The broker's opening, as the symbolizer's cache sees it through the socket."""

    def open_fd(pid: int, start_ticks: int) -> int:
        try:
            return filebroker.open_perf_map(str(proc), FileRequest(pid, start_ticks, "perf_map"))
        except filebroker.Refused as e:
            raise PerfMapRefused(str(e)) from None

    return open_fd


def open_perf_map(pid: int, nspid: int, uid: int, proc_dir: str) -> perfmap.PerfMap:
    return read_perf_map(opener(Path(proc_dir))(pid, 0), nspid, uid)


def map_path(proc: Path) -> Path:
    return proc / str(PID) / "root" / "tmp" / f"perf-{NSPID}.map"


def write_map(proc: Path, text: str) -> Path:
    path = map_path(proc)
    path.write_text(text)
    return path


def read(proc: Path, uid: int = UID) -> perfmap.PerfMap:
    return open_perf_map(PID, NSPID, uid, proc_dir=str(proc))


# --- parsing and lookup -----------------------------------------------------------


def test_lookup_inside_and_outside_entries(proc: Path) -> None:
    # Given a map with bare hex, 0x-prefixed hex and names with spaces
    write_map(proc, MAP)
    # When it is read
    pm = read(proc)
    # Then every byte of an entry resolves to its full name, and bytes outside none do
    assert pm.bad_lines == 0
    assert pm.lookup(0x7F0000001000) == "LazyCompile:~handler /app/server.js:12"
    assert pm.lookup(0x7F000000103F) == "LazyCompile:~handler /app/server.js:12"
    assert pm.lookup(0x7F0000002010) == "Builtin:ArrayPush"
    assert pm.lookup(0x7F000000300F) == "Stub  with  double  spaces"
    for outside in (0, 0x7F0000000FFF, 0x7F0000001040, 0x7F0000002020, 0x7F0000003010, 1 << 63):
        assert pm.lookup(outside) is None, hex(outside)


def test_malformed_lines_are_skipped_and_counted(proc: Path) -> None:
    # Given a map in which good lines are mixed with 9 malformed ones and an unfinished last line
    bad = [
        "zz 10 not_hex\n",
        "1000 10\n",  # no name
        "1000 10    \n",  # blank name
        "-10 5 negative\n",
        "2000 0 zero_size\n",
        "ffffffffffffffff 2 wraps_past_2_64\n",
        "12345678901234567 1 seventeen_digits\n",
        "1_000 10 underscore\n",
        "3000 10 " + "x" * perfmap.PERF_MAP_MAX_LINE_BYTES + "\n",  # too long
    ]
    write_map(proc, "a000 10 first\n" + "".join(bad) + "b000 10 last\n" + "c000 10 still_being_writ")
    # When it is read
    pm = read(proc)
    # Then the good lines resolve, the bad ones are counted, the unfinished line is ignored
    assert pm.bad_lines == len(bad)
    assert pm.lookup(0xA000) == "first"
    assert pm.lookup(0xB00F) == "last"
    assert pm.lookup(0x3000) is None
    assert pm.lookup(0xC000) is None


def test_a_nul_ends_an_entry_as_dotnet_8_writes_some(proc: Path) -> None:
    # Given lines as .NET 8.0.4 wrote them when asked for a map over its diagnostics socket (recorded
    # from one: 12 of its 1,384 lines held two entries, the first ended by a NUL)
    write_map(
        proc,
        "0x7f3aa44275b0 2a instance native int [Python.Runtime] Python.Runtime.Platform.LinuxLibDL2::"
        "Python.Runtime.Platform.ILibDL.dlsym(native int,string)[QuickJitted]\0"
        "0x7f3aa44275f0 1da native int [Python.Runtime] dynamicClass::IL_STUB_PInvoke(native int,string)"
        "[Optimized]\n"
        "0x7f3aa51406a0 27 int64 [Anonymously Hosted DynamicMethods Assembly] "
        "dynamicClass::HotLoopEbpfTest(int64)[Optimized]\0\n",
    )
    # When it is read / Then each entry resolves to its own name, none is counted malformed
    pm = read(proc)
    assert pm.bad_lines == 0
    dlsym = pm.lookup(0x7F3AA44275B0 + 0x29)
    assert dlsym is not None and dlsym.endswith("ILibDL.dlsym(native int,string)[QuickJitted]")
    assert pm.lookup(0x7F3AA44275F0) == (
        "native int [Python.Runtime] dynamicClass::IL_STUB_PInvoke(native int,string)[Optimized]"
    )
    hot = pm.lookup(0x7F3AA51406A0 + 0x26)
    assert hot is not None and hot.endswith("dynamicClass::HotLoopEbpfTest(int64)[Optimized]")


def test_later_line_wins_for_the_same_start(proc: Path) -> None:
    # Given JIT code at one address written twice (code was freed and the address reused)
    write_map(proc, "5000 40 old_function\n6000 10 other\n5000 20 new_function\n")
    # When it is looked up / Then the later line's entry is used, with its size
    pm = read(proc)
    assert pm.lookup(0x5010) == "new_function"
    assert pm.lookup(0x5030) is None
    assert pm.lookup(0x6000) == "other"


def test_more_entries_than_the_cap_is_refused(proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an entry cap of 3 and a map with 4 entries
    monkeypatch.setattr(perfmap, "PERF_MAP_MAX_ENTRIES", 3)
    write_map(proc, "".join(f"{0x1000 * i:x} 10 f{i}\n" for i in range(1, 5)))
    # When it is read / Then it is refused
    with pytest.raises(PerfMapRefused, match="more than 3 entries"):
        read(proc)


# --- refusals ---------------------------------------------------------------------


def test_symlinked_map_is_refused(proc: Path, tmp_path: Path) -> None:
    # Given /tmp/perf-<nspid>.map is a symlink to a file of well-formed lines
    target = tmp_path / "secret"
    target.write_text(MAP)
    map_path(proc).symlink_to(target)
    # When it is opened / Then it is refused as a symlink
    with pytest.raises(PerfMapRefused, match="is a symlink"):
        read(proc)


def test_symlinked_tmp_is_refused(tmp_path: Path) -> None:
    # Given a process whose /tmp is a symlink to another directory holding a map
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"perf-{NSPID}.map").write_text(MAP)
    root = fake_process(tmp_path / "proc")
    root.mkdir(parents=True)
    (root / "tmp").symlink_to(elsewhere)
    # When the map is opened / Then it is refused, naming /tmp
    with pytest.raises(PerfMapRefused, match="/tmp is a symlink or not a directory"):
        read(tmp_path / "proc")


@pytest.mark.needs_root  # chown to another uid needs root
def test_map_owned_by_another_uid_is_refused(proc: Path) -> None:
    # Given a map owned by uid 65534 while the process runs as UID
    path = write_map(proc, MAP)
    os.chown(path, 65534, 65534)
    # When it is opened for the process / Then it is refused with both uids in the reason
    with pytest.raises(PerfMapRefused) as refused:
        read(proc, uid=UID)
    assert str(refused.value) == f"perf-{NSPID}.map is owned by uid 65534, not the process's uid {UID}"


def test_oversized_map_is_refused(proc: Path) -> None:
    # Given a (sparse) map one byte over PERF_MAP_MAX_BYTES
    with open(map_path(proc), "wb") as f:
        f.truncate(perfmap.PERF_MAP_MAX_BYTES + 1)
    # When it is opened / Then it is refused by size, before reading
    with pytest.raises(PerfMapRefused, match="more than"):
        read(proc)


def test_fifo_is_refused_without_blocking(proc: Path) -> None:
    # Given a FIFO where the map should be (opening it for reading would block without a writer)
    os.mkfifo(map_path(proc))
    result: list[BaseException] = []
    t = threading.Thread(target=lambda: result.append(pytest.raises(PerfMapRefused, read, proc).value), daemon=True)  # noqa: RUF061
    # When it is opened / Then it is refused at once as not a regular file
    t.start()
    t.join(5.0)
    assert not t.is_alive()
    assert "not a regular file" in str(result[0])


def test_missing_map_raises_file_not_found(proc: Path, tmp_path: Path) -> None:
    # Given no map, and a pid with no /proc entry / When opened / Then FileNotFoundError
    with pytest.raises(FileNotFoundError):
        read(proc)
    with pytest.raises(FileNotFoundError):
        open_perf_map(PID + 1, NSPID, UID, proc_dir=str(proc))


def test_real_proc_self_root_tmp() -> None:
    # Given a map for this process in the real /tmp
    pid = os.getpid()
    path = Path(f"/tmp/perf-{pid}.map")
    path.write_text("401000 80 jit_entry for test\n")
    try:
        # When it is read through /proc/<pid>/root/tmp
        pm = open_perf_map(pid, pid, os.getuid(), "/proc")
        # Then its entry resolves
        assert pm.lookup(0x401040) == "jit_entry for test"
    finally:
        path.unlink()


# --- PerfMapCache -----------------------------------------------------------------


def test_cache_rereads_a_changed_map_at_most_once_per_recheck_interval(proc: Path) -> None:
    # Given a cached map
    cache = PerfMapCache(opener(proc))
    write_map(proc, "1000 10 v1\n")
    first = cache.get(PID, START_TICKS, NSPID, UID, now=100.0)
    assert first is not None and first.lookup(0x1000) == "v1"
    # When the file changes
    write_map(proc, "1000 10 v2_longer\n")
    # Then within PERF_MAP_RECHECK_S the cached map is returned without a stat
    assert cache.get(PID, START_TICKS, NSPID, UID, now=100.0 + perfmap.PERF_MAP_RECHECK_S / 2) is first
    # And after it the new content is read
    second = cache.get(PID, START_TICKS, NSPID, UID, now=100.0 + perfmap.PERF_MAP_RECHECK_S * 1.5)
    assert second is not None and second.lookup(0x1000) == "v2_longer"
    # And an unchanged file is not read again
    assert cache.get(PID, START_TICKS, NSPID, UID, now=200.0) is second
    assert cache.stats["loaded"] == 2 and cache.stats["hits"] == 2


def test_cache_logs_a_refusal_once_and_reads_the_map_once_fixed(
    proc: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a process whose map is a symlink
    target = tmp_path / "target"
    target.write_text(MAP)
    map_path(proc).symlink_to(target)
    cache = PerfMapCache(opener(proc))
    # When it is asked for repeatedly, across recheck intervals
    with caplog.at_level(logging.WARNING, logger=perfmap.__name__):
        results = [cache.get(PID, START_TICKS, NSPID, UID, now=float(t)) for t in range(5)]
    # Then it is None each time, asked for once per recheck interval, logged once with pid and reason
    assert results == [None] * 5
    assert cache.stats["refused"] == 5
    logged = [r.getMessage() for r in caplog.records if r.name == perfmap.__name__]
    # the log line is the feature: a refused map is logged once, naming the process and why (the count is above)
    assert len(logged) == 1 and str(PID) in logged[0] and "is a symlink" in logged[0]
    # When the symlink is replaced by a proper file / Then it is read at the next check
    map_path(proc).unlink()
    write_map(proc, MAP)
    pm = cache.get(PID, START_TICKS, NSPID, UID, now=10.0)
    assert pm is not None and pm.lookup(0x7F0000002000) == "Builtin:ArrayPush"


def test_cache_missing_map_is_none_until_it_appears(proc: Path) -> None:
    # Given a process without a map
    cache = PerfMapCache(opener(proc))
    assert cache.get(PID, START_TICKS, NSPID, UID, now=0.0) is None
    assert cache.stats["missing"] == 1
    # When the process writes one / Then it is picked up after the recheck interval
    write_map(proc, MAP)
    assert cache.get(PID, START_TICKS, NSPID, UID, now=0.5) is None
    pm = cache.get(PID, START_TICKS, NSPID, UID, now=2.0)
    assert pm is not None and pm.lookup(0x7F0000001000) is not None


def test_cache_treats_a_reused_pid_as_a_new_process(proc: Path) -> None:
    # Given a cached map of a process
    cache = PerfMapCache(opener(proc))
    write_map(proc, "1000 10 old_process\n")
    pm = cache.get(PID, START_TICKS, NSPID, UID, now=0.0)
    assert pm is not None and pm.lookup(0x1000) == "old_process"
    # When a new process with the same pid (other start time) writes its map
    write_map(proc, "1000 10 new_process_\n")
    # Then it is read at once, despite the recheck interval
    pm = cache.get(PID, START_TICKS + 1, NSPID, UID, now=0.1)
    assert pm is not None and pm.lookup(0x1000) == "new_process_"


def test_cache_is_a_bounded_lru(proc: Path) -> None:
    # Given a cache of two processes
    cache = PerfMapCache(opener(proc), max_entries=2)
    write_map(proc, MAP)
    for ticks in (1, 2, 1, 3):  # 2 is least recently used when 3 arrives
        cache.get(PID, ticks, NSPID, UID, now=0.0)
    # Then one was evicted, and asking for 1 again is a hit while 2 is read anew
    assert cache.stats["evicted"] == 1 and cache.stats["loaded"] == 3
    cache.get(PID, 1, NSPID, UID, now=0.0)
    assert cache.stats["hits"] == 2
    cache.get(PID, 2, NSPID, UID, now=0.0)
    assert cache.stats["loaded"] == 4


def test_a_costly_map_rewritten_every_second_is_read_a_bounded_share_of_the_time(proc: Path) -> None:
    # Given a map near the entry cap (its read costs tens of ms or more here)
    cache = PerfMapCache(opener(proc))
    lines = "".join(f"{0x100000 + i * 16:x} 10 jit_fn_{i}\n" for i in range(perfmap.PERF_MAP_MAX_ENTRIES - 1))
    write_map(proc, lines)
    cache.get(PID, START_TICKS, NSPID, UID, now=100.0)
    # When it changes every second
    read_at = [100.0]
    backoff = [cache._entries[(PID, START_TICKS)].interval]  # what the cache set after each read
    for second in range(1, 61):
        write_map(proc, lines + f"{0x100:x} 10 tick_{second}\n")
        before = cache.stats["loaded"]
        cache.get(PID, START_TICKS, NSPID, UID, now=100.0 + second)
        if cache.stats["loaded"] > before:
            read_at.append(100.0 + second)
            backoff.append(cache._entries[(PID, START_TICKS)].interval)
    # Then every read waited out the back-off its previous read set (PERF_MAP_REREAD_FACTOR times its
    # cost, judged by the cache's own clock, so a loaded machine changes the figures, not the rule),
    # and a map this costly was not read every second
    for i in range(1, len(read_at)):
        assert read_at[i] - read_at[i - 1] >= backoff[i - 1], (read_at, backoff)
    assert all(b > perfmap.PERF_MAP_RECHECK_S for b in backoff), backoff
    assert len(read_at) - 1 < 60


def test_a_process_gone_keeps_the_map_last_read_from_it(proc: Path) -> None:
    # Given a cached map of a process, opened as the file client does (ProcessGone once it exited)
    inner = opener(proc)

    def open_fd(pid: int, start_ticks: int) -> int:
        if not (proc / str(pid)).exists():
            raise ProcessGone(f"pid {pid} exited")
        return inner(pid, start_ticks)

    cache = PerfMapCache(open_fd)
    write_map(proc, "1000 10 jitted\n")
    pm = cache.get(PID, START_TICKS, NSPID, UID, now=100.0)
    assert pm is not None and pm.lookup(0x1000) == "jitted"
    # When the process exits and its samples drained after that are named
    shutil.rmtree(proc / str(PID))
    again = cache.get(PID, START_TICKS, NSPID, UID, now=100.0 + perfmap.PERF_MAP_RECHECK_S * 2)
    # Then the map last read still names them (it can change no more)
    assert again is not None and again.lookup(0x1000) == "jitted"
    assert cache.stats["gone"] == 1
