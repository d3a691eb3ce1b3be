"""The runtime-reader registry and what follows from it; the shared per-file cache; Ruby's line lookup.

The config's runtime_stacks values and the wire's profile types come from
shared/runtime_registry.py; every registered runtime's folder exports
runtime(cfg) and its detect (runtimes/runtime.py's contract). FileCache
computes once per key and fails again for a file that failed. RubyProcess's
succinct-index lookup gives, on a table recorded from a live Ruby 3.3 process
(Debian trixie's libruby-3.3, Work#cpu_a of tests/workloads/ruby_split.rb),
the entry Ruby's own iseq.c gives.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from runtimes.memory import ProcessMemory
from runtimes.ruby.layouts import LAYOUTS as RUBY_LAYOUTS
from runtimes.ruby.reader import RubyProcess
from runtimes.runtime import FileCache
from runtimes.targets import Targets
from shared import config, runtime_registry, wire


def write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "agent.yaml"
    path.write_text("modules:\n  ebpf_profiler:\n" + body)
    return str(path)


def test_config_keys_and_profile_types_follow_from_the_registry(tmp_path: Path) -> None:
    assert config.load(write(tmp_path, "    runtime_stacks: [php, ruby, python_legacy]\n")).runtime_stacks == (
        "php",
        "ruby",
        "python_legacy",
    )
    with pytest.raises(config.ConfigError) as e:
        config.load(write(tmp_path, "    runtime_stacks: [perl]\n"))
    for spec in runtime_registry.RUNTIMES:
        for name, _ in spec.opt_ins:
            assert name in str(e.value)
        assert not spec.profile_type or spec.profile_type in wire.PROFILE_TYPES  # "": .NET's names go to cpu
        assert not spec.cpu_profile_type or spec.cpu_profile_type in runtime_registry.CPU_PROFILE_TYPES
    assert {"python_wall", "php_wall", "ruby_wall", "jvm_wall", "jvm_cpu", "node_cpu"} <= set(wire.PROFILE_TYPES)
    assert len(set(wire.PROFILE_TYPES)) == len(wire.PROFILE_TYPES), wire.PROFILE_TYPES  # each once (--help)


def test_every_registered_runtime_is_a_plug_in_that_follows_its_opt_in() -> None:
    for spec in runtime_registry.RUNTIMES:
        plugin = importlib.import_module(spec.package)
        on = config.ProfilerConfig(runtime_stacks=tuple(n for n, _ in spec.opt_ins))
        off = config.ProfilerConfig(runtime_stacks=(), python_stacks=False)
        got = plugin.runtime(on)
        assert got is not None and got.spec is spec and callable(got.detect)
        assert plugin.runtime(off) is None


def test_file_cache_computes_once_and_remembers_failures() -> None:
    cache, calls = FileCache(capacity=2), []

    def compute(v: int) -> int:
        calls.append(v)
        if v < 0:
            raise ValueError("bad file")
        return v * 10

    assert cache.get("a", lambda: compute(1)) == 10
    assert cache.get("a", lambda: compute(1)) == 10
    for _ in range(2):
        with pytest.raises(ValueError):
            cache.get("bad", lambda: compute(-1))
    assert calls == [1, -1]
    cache.get("c", lambda: compute(3))  # over capacity: the least recently used goes
    assert cache.get("a", lambda: compute(1)) == 10 and calls == [1, -1, 3, 1]


class _Table(ProcessMemory):
    """A recorded succ_index_table, served as ProcessMemory serves reads."""

    BASE = 0x1000

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, address: int, size: int) -> bytes:
        return self.data[address - self.BASE : address - self.BASE + size]

    def u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")


# Work#cpu_a's table (16 entries: lines 10, 10, 11, 11, 12, 12, 12, 12, 11 ...) as read from the process.
RECORDED = bytes.fromhex(
    "01816030201008048582e170402012090ac562c160341a0e8e070402814020100000000000000000000000000000000000"
)


def test_ruby_succinct_index_lookup_matches_the_recorded_table() -> None:
    r = RubyProcess("3.3.8", RUBY_LAYOUTS[(3, 3)], 0)
    mem = _Table(RECORDED)
    got = [r.iseqs.succ_lookup(mem, _Table.BASE, x) for x in range(30)]  # the decoder under test
    # Ranks never fall, start at 1 (position 0 starts the first entry) and end at the entry count;
    # every position of cpu_a maps to one of its lines (10 to 12, the `end` at 14 last), and the
    # position the live reader sampled most (19) to the loop's line 11.
    assert got == [
        1,
        2,
        2,
        3,
        3,
        4,
        4,
        4,
        4,
        5,
        5,
        6,
        7,
        7,
        8,
        8,
        9,
        9,
        10,
        10,
        11,
        11,
        12,
        12,
        13,
        13,
        14,
        14,
        15,
        16,
    ], got
    lines = [10, 10, 11, 11, 12, 12, 12, 12, 11, 11, 11, 11, 11, 11, 11, 14]
    assert lines[got[19] - 1] == 11 and {lines[i - 1] for i in got} == {10, 11, 12, 14}


class _Walked:
    """A plug-in's reader that walks every on-CPU sample into one frame naming its thread (the test is of the
    reader stage's subsampling, not of a runtime)."""

    version = "1"
    dropped: dict[str, int] = {}  # noqa: RUF012

    def sample(self, mem: object) -> list:
        return []

    def sample_regs(self, mem: object, samples: list) -> list:
        from runtimes.jvm.reader import JvmFrame
        from runtimes.runtime import ThreadStack

        return [ThreadStack(r.tid, (JvmFrame(f"t{r.tid}", "", 0, "compiled"),)) for r in samples]


@pytest.mark.parametrize("arriving", [100, 5000])
def test_on_cpu_samples_past_the_readers_cap_are_a_weighted_subsample(tmp_path: Path, arriving: int) -> None:
    """Given a JVM process being read and a RegsBatch of `arriving` samples of two threads at 3:1,
    when the reader takes it, then it walks at most MAX_REGS_PER_S of them and the jvm_cpu window still
    holds ~`arriving` samples (each worth the collector's period) at 3:1."""
    import os

    from runtimes import main as reader_main
    from runtimes.targets import Entry

    run = tmp_path / "run"
    run.mkdir()
    r = reader_main.Reader(config.ProfilerConfig(plain_pid=True, runtime_stacks=("jvm",)), str(run), str(tmp_path))
    r._rng.seed(1)  # the subsample is random; this test's figures are of one fixed draw
    try:
        pid = os.getpid()
        me = wire.Process(pid=pid, start_ticks=1, uid=0, nspid=pid, comm="t", executable="/bin/t", service="s")
        jvm = next(x for x in r.runtimes if x.spec.name == "jvm")
        r.targets.entries[pid] = Entry(me, state="reading", reader=_Walked(), runtime=jvm)
        period = 52_631_578
        samples = tuple(wire.RegsSample(pid, 1, pid if i % 4 else pid + 1, i, 1, 2, 3, b"") for i in range(arriving))
        r.regs(wire.RegsBatch("h", 1, period, samples), 10**18)
        walked = r.stats["regs_samples"]
        assert walked == min(arriving, reader_main.MAX_REGS_PER_S)
        (window,) = [w for w in r.windows.close_all() if w.profile_type == "jvm_cpu"]
        by_frame: dict[str, int] = {}
        for (_labels, frames), (n, ns) in window.data.rows.items():
            by_frame[frames[0].function] = by_frame.get(frames[0].function, 0) + n
            assert ns == n * period
        total = sum(by_frame.values())
        assert abs(total - arriving) <= 0.05 * arriving, by_frame
        assert 2.4 <= by_frame[f"t{pid}"] / by_frame[f"t{pid + 1}"] <= 3.8, by_frame
    finally:
        r.inbox.close()
        r.outbox.close()


def test_the_agents_own_processes_are_not_targets() -> None:
    # given the reader's targets, with the agent's stages running as uid 990
    targets = Targets([], own_uids=frozenset({990}))

    def process(pid: int, uid: int) -> wire.Process:
        return wire.Process(pid, 1, uid, pid, "python3", "/usr/bin/python3.11", "/usr/bin/python3.11")

    # when the collector announces a stage of the agent and a process of the host's
    targets.announce(wire.ProcessAnnouncement("h", 0, (process(10, 990), process(11, 1000))))
    # then only the host's process is one to read
    assert list(targets.entries) == [11]
