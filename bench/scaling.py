"""Symbolizer throughput with 1 and 2 workers, on a recorded stream of stack batches.

Recording: the real collector (999 Hz, on-CPU and off-CPU) runs for
RECORD_S while four copies of a CPU loop run, named so that two services go
to each of two workers; bench stands in for its one symbolizer worker and
keeps every batch it is sent. Only those four services are replayed: the
rest of the host (bench itself, kernel threads) is a few services whose hash
would decide the figure.

Replay: the workloads stay alive but stopped (so their files can still be
opened and they take no CPU), a
file broker serves their mappings as the collector's would, and N real
symbolizer workers (and an uploader in local mode) run. Bench routes each
recorded batch's services to the workers as the collector does (rendezvous
hashing), then pushes the stream REPEAT times as fast as the workers take
it (the sockets' queues are bounded: a full queue blocks bench, so the
workers are saturated). It then stops the workers, which drain what is
queued and close their windows; the throughput is the samples of the stream
divided by the time from the first batch to the last worker's exit. Runs
alternate 1, 2, 1, 2, … workers; median with min and max.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq

from bench import bpf, procs, stats
from bench.procs import BenchError
from collector.filebroker import FileBroker
from collector.routing import worker_for
from shared import config as config_mod
from shared import endpoints, privileges
from shared.wire import StackBatch, decode, encode

RECORD_S = 8.0
RECORD_HZ = 999
# The recorded stream is pushed this many times per run, so ELF parsing
# (once per file per worker) is a small part of the time.
REPEAT = 600
READY_TIMEOUT_S = 90.0
WORKLOADS = Path(__file__).parent / "workloads"


def _prepare_run_dir(path: Path) -> None:
    path.mkdir(parents=True)
    gid = privileges.ids("uploader")[1]
    os.chown(path, 0, gid)
    os.chmod(path, 0o2770)


def _config(path: Path, **changes: object) -> Path:
    cfg = config_mod.ProfilerConfig().replace(**changes)
    path.write_text(config_mod.dump(cfg))
    path.chmod(0o644)
    return path


def _prepare_state(tmp: Path, state: Path) -> None:
    """The replay's state directories and local profile directory, each owned as the pipeline owns it."""
    for d, owner in (
        (state, None),
        (state / "symbolizer", "symbolizer"),
        (state / "uploader", "uploader"),
        (tmp / "profiles", "uploader"),
    ):
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, privileges.ids(owner)[0] if owner else 0, privileges.ids("uploader")[1])
        os.chmod(d, 0o750 if owner is None or owner == "uploader" else 0o700)


def _stage_argv(stage: str, cfg: Path, run_dir: Path, state_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-P",  # the checkout must not shadow the code view a stage reads once it drops root
        "-m",
        f"{stage}.main",
        "--config",
        str(cfg),
        "--run-dir",
        str(run_dir),
        "--state-dir",
        str(state_dir),
        *extra,
    ]


def _push(
    stream: list[tuple[int, list[bytes]]],
    run_dir: Path,
    workers: list[subprocess.Popen[Any]],
) -> tuple[float, list[float], list[float]]:
    """Push the stream REPEAT times to the started workers once every stage is ready, and stop the workers
    once each has drained its queue: (seconds, the workers' CPU seconds before, after)."""
    ctx = zmq.Context()
    socks = []
    try:
        names = ["uploader"] + [f"symbolizer-{w}" for w in range(len(workers))]
        procs.wait_for(
            "the replay stages",
            lambda: all(os.path.exists(endpoints.ready_file(str(run_dir), n)) for n in names),
            READY_TIMEOUT_S,
        )
        for w in range(len(workers)):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 16)
            s.connect(endpoints.symbolizer(str(run_dir), w))
            socks.append(s)
        cpu0 = [procs.cpu_seconds(p.pid) for p in workers]
        t0 = time.monotonic()
        for _ in range(REPEAT):
            for w, frames in stream:
                socks[w].send_multipart(frames)  # blocks while the worker's queue is full
        for s in socks:
            s.close(linger=-1)  # every batch handed over
        socks = []
        cpu1 = [procs.cpu_seconds(p.pid) for p in workers]
        for p in workers:
            p.send_signal(signal.SIGTERM)  # all at once: each drains its queue,
        for p in workers:  # closes its windows and exits
            procs.stop(p)
        return time.monotonic() - t0, cpu0, cpu1
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


class ScalingBench:
    def __init__(self, rounds: int, log: Callable[[str], None], keep: bool) -> None:
        self.rounds = rounds
        self.log = log
        self.keep = keep
        self.our_prog_ids: set[int] = set()

    # ------------------------------------------------------------ recording

    def _workloads(self, tmp: str) -> list[subprocess.Popen[Any]]:
        loop = os.path.join(tmp, "cpu_loop")
        subprocess.run(
            ["gcc", "-O2", "-fno-omit-frame-pointer", "-pthread", "-o", loop, str(WORKLOADS / "cpu_loop.c")], check=True
        )
        # Four copies of the loop, the hot services, named so that two go to each of
        # two workers: the figure is then the workers' capacity, not the luck of
        # the hash (one worker per service: a skewed mix cannot scale).
        names = [f"{loop}_{i}" for i in range(64)]
        picked = [n for n in names if worker_for(n, [0, 1]) == 0][:2] + [
            n for n in names if worker_for(n, [0, 1]) == 1
        ][:2]
        loops = []
        for copy in picked:
            shutil.copy(loop, copy)
            loops.append(procs.start([copy, "100000000", "1", "0"]))
        return loops

    def _record(self, tmp: Path) -> list[StackBatch]:
        run_dir = tmp / "record-run"
        _prepare_run_dir(run_dir)
        cfg = _config(tmp / "record.yaml", sample_hz=RECORD_HZ, symbolizer_workers=1)
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        old = os.umask(0o007)
        try:
            pull.bind(endpoints.symbolizer(str(run_dir), 0))
        finally:
            os.umask(old)
        collector = procs.start(
            [sys.executable, "-m", "collector.main", "--config", str(cfg), "--run-dir", str(run_dir)],
            stderr=open(tmp / "record-collector.log", "w"),  # noqa: SIM115
        )
        batches: list[StackBatch] = []
        try:
            procs.wait_for(
                "the recording collector",
                lambda: collector.poll() is not None or os.path.exists(endpoints.ready_file(str(run_dir), "collector")),
                READY_TIMEOUT_S,
            )
            if collector.poll() is not None:
                raise BenchError(
                    f"the recording collector exited: {(tmp / 'record-collector.log').read_text()[-2000:]}"
                )
            self.our_prog_ids |= bpf.held_by(collector.pid)[0]
            deadline = time.monotonic() + RECORD_S
            while time.monotonic() < deadline:
                if pull.poll(200):
                    msg = decode(pull.recv_multipart())
                    if isinstance(msg, StackBatch) and msg.samples:
                        # Without its unwind requests: the replay measures symbolization, and
                        # with no collector to take the answers, every replay would build the
                        # tables again.
                        batches.append(replace(msg, unwind_requests=()))
        finally:
            procs.stop(collector)
            pull.close(linger=0)
            ctx.term()
        if not batches:
            raise BenchError("the collector sent no batches while recording")
        return batches

    # ------------------------------------------------------------ replay

    @staticmethod
    def _split(batches: list[StackBatch], workers: int, services: set[str]) -> list[tuple[int, list[bytes]]]:
        """Each batch cut per worker, as the collector routes services, encoded once.

        Only the workloads' services are kept: the rest of the host (bench itself,
        kernel threads) is a few services whose hash would decide the figure."""
        out = []
        live = list(range(workers))
        for b in batches:
            owner = {p.pid: worker_for(p.service, live) for p in b.processes if p.service in services}
            for w in live:
                samples = tuple(s for s in b.samples if owner.get(s.pid) == w)
                if samples:
                    part = replace(b, samples=samples, processes=tuple(p for p in b.processes if owner.get(p.pid) == w))
                    out.append((w, encode(part)))
        return out

    def _replay(self, tmp: Path, stream: list[tuple[int, list[bytes]]], workers: int, samples: int) -> dict[str, Any]:
        run_dir, state = tmp / "run", tmp / "state"
        _prepare_run_dir(run_dir)
        _prepare_state(tmp, state)
        cfg = _config(
            tmp / "replay.yaml", symbolizer_workers=workers, upload_interval_s=3600, local_dir=str(tmp / "profiles")
        )
        old = os.umask(0o007)
        try:
            broker = FileBroker(str(run_dir), allowed_uids={privileges.ids("symbolizer")[0]})
        finally:
            os.umask(old)
        stages = [procs.start(_stage_argv("uploader", cfg, run_dir, state / "uploader"))]
        stages += [
            procs.start(_stage_argv("symbolizer", cfg, run_dir, state / "symbolizer", "--worker", str(w)))
            for w in range(workers)
        ]
        try:
            elapsed, cpu0, cpu1 = _push(stream, run_dir, stages[1:])
        finally:
            for p in reversed(stages):
                procs.stop(p)
            broker.close()
        total = samples * REPEAT
        return {
            "workers": workers,
            "samples": total,
            "seconds": round(elapsed, 3),
            "samples_per_s": round(total / elapsed, 1),
            "worker_cpu_s": [round(b - a, 3) for a, b in zip(cpu0, cpu1)],
        }

    def run(self) -> dict[str, Any]:
        tmp = Path(tempfile.mkdtemp(prefix="ebpfprofiler-bench-scaling-"))
        tmp.chmod(0o755)
        t_start = time.monotonic()
        loads = []
        try:
            build_dir = tmp / "bin"
            build_dir.mkdir()
            build_dir.chmod(0o755)
            loads = self._workloads(str(build_dir))
            batches = self._record(tmp)
            for p in loads:  # alive, so their files can be opened, but not competing for CPU
                os.kill(p.pid, signal.SIGSTOP)
            services = {os.path.realpath(procs.argv_of(p)[0]) for p in loads}
            samples = sum(
                s.count
                for b in batches
                for s in b.samples
                if next((p.service for p in b.processes if p.pid == s.pid), "") in services
            )
            self.log(
                f"scaling: recorded {len(batches)} batches, {samples} samples, "
                f"{len({p.service for b in batches for p in b.processes})} services"
            )
            streams = {n: self._split(batches, n, services) for n in (1, 2)}
            runs = []
            for r in range(self.rounds):
                for n in (1, 2):
                    res = self._replay(tmp / f"r{r}-w{n}", streams[n], n, samples)
                    self.log(
                        f"scaling round {r + 1}/{self.rounds}, {n} worker(s): {res['samples_per_s']:,.0f} samples/s"
                    )
                    runs.append(res)
        finally:
            for p in loads:
                procs.stop(p, sig=signal.SIGKILL)
            if not self.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        one = [r["samples_per_s"] for r in runs if r["workers"] == 1]
        two = [r["samples_per_s"] for r in runs if r["workers"] == 2]
        return {
            "recorded": {
                "batches": len(batches),
                "samples": samples,
                "seconds": RECORD_S,
                "sample_hz": RECORD_HZ,
                "repeat": REPEAT,
            },
            "rounds": self.rounds,
            "runs": runs,
            "summary": {
                "1 worker": stats.summary(one),
                "2 workers": stats.summary(two),
                "speedup": stats.summary([b / a for a, b in zip(one, two)]),
            },
            "seconds": round(time.monotonic() - t_start, 1),
        }
