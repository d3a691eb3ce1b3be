"""report/speedscope.py on profiles built here (the pprof format is the agent's; tests/unit/test_report.py's).

Given cpu windows of two processes and a python_wall window of two threads, when written as one
speedscope file, then: one profile per type, process and thread, cpu first, named by executable,
pid and thread; stacks root first over shared frames (with file and line where known); weights in
the profile's default value and unit; the windows' samples in time order; and names kept exactly,
hostile ones too (JSON carries them; speedscope draws them as text).
"""

from __future__ import annotations

import json
from pathlib import Path

from report import profiles, speedscope
from shared import pprof
from tests.unit.test_report import HOSTILE, PERIOD, cpu_profile


def wall_profile(pid: int, threads: dict[str, tuple[str, ...]]) -> bytes:
    """A python_wall pprof as the runtime reader writes it: one stack per thread (name → root-first
    functions, each at line 10 + its depth of app.py), 3 samples each."""
    b = pprof.ProfileBuilder(
        [("samples", "count"), ("wall", "nanoseconds")], ("wall", "nanoseconds"), PERIOD, 1_700_000_000, 2_000_000_000
    )
    m = b.mapping("py", "python", "")
    for tid, (name, stack) in enumerate(threads.items(), start=pid + 1):
        locs = [b.location((f, i), m, 0, [b.function(f, "/srv/app.py")], 10 + i) for i, f in enumerate(stack)]
        labels = {
            "process.executable": "/usr/bin/python3.11",
            "pid": str(pid),
            "thread.id": str(tid),
            "thread.name": name,
        }
        b.sample(list(reversed(locs)), [3, 3 * PERIOD], labels)
    return b.gzipped()


def written(tmp_path: Path) -> dict:
    d = tmp_path / "profiles"
    d.mkdir()
    (d / "cpu-20261201T000002Z-2.pb.gz").write_bytes(cpu_profile("/usr/bin/a", {("main", "late"): 4}, pid=1, window=1))
    (d / "cpu-20261201T000000Z-1.pb.gz").write_bytes(
        cpu_profile("/usr/bin/a", {("main", "heavy"): 30, ("main", "light"): 10}, pid=1)
    )
    (d / "cpu-20261201T000000Z-3.pb.gz").write_bytes(cpu_profile("/usr/bin/b", {("main", HOSTILE): 5}, pid=2))
    (d / "python_wall-20261201T000000Z-4.pb.gz").write_bytes(
        wall_profile(40, {"worker": ("<module>", "run", "cpu_a"), "waiter": ("<module>", "wait_here")})
    )
    out = tmp_path / "x.speedscope.json"
    assert profiles.write_outputs(profiles.load([str(d)]), str(out)) == [str(out)]
    doc: dict = json.loads(out.read_text())
    return doc


def stacks(doc: dict, profile: dict) -> list[tuple[tuple[str, ...], int]]:
    names = [f["name"] for f in doc["shared"]["frames"]]
    return [(tuple(names[i] for i in s), w) for s, w in zip(profile["samples"], profile["weights"])]


def test_one_profile_per_type_process_and_thread_cpu_first(tmp_path: Path) -> None:
    doc = written(tmp_path)
    assert doc["$schema"] == speedscope.SCHEMA and doc["exporter"] == "ebpfprofiler" and doc["name"] == "x"
    assert [p["name"] for p in doc["profiles"]] == [
        "cpu /usr/bin/a pid 1",
        "cpu /usr/bin/b pid 2",
        "python_wall /usr/bin/python3.11 pid 40 thread 41 (worker)",
        "python_wall /usr/bin/python3.11 pid 40 thread 42 (waiter)",
    ]
    assert all(p["type"] == "sampled" and p["startValue"] == 0 for p in doc["profiles"])
    assert all(p["endValue"] == sum(p["weights"]) for p in doc["profiles"])


def test_stacks_are_root_first_weighted_in_the_default_unit_and_in_time_order(tmp_path: Path) -> None:
    doc = written(tmp_path)
    a = doc["profiles"][0]
    assert a["unit"] == "nanoseconds"  # the cpu profile's default value: cpu nanoseconds
    # window 0 (heaviest first), then window 1, whatever the order of the files
    assert stacks(doc, a) == [
        (("main", "heavy"), 30 * PERIOD),
        (("main", "light"), 10 * PERIOD),
        (("main", "late"), 4 * PERIOD),
    ]
    worker = doc["profiles"][2]
    assert stacks(doc, worker) == [(("<module>", "run", "cpu_a"), 3 * PERIOD)]


def test_frames_are_shared_with_file_and_line_and_names_kept_exactly(tmp_path: Path) -> None:
    doc = written(tmp_path)
    frames = doc["shared"]["frames"]
    assert [f["name"] for f in frames].count("main") == 1  # one frame, shared by both processes
    assert {"name": "cpu_a", "file": "/srv/app.py", "line": 12} in frames
    assert {"name": "main"} in frames  # no file or line: none given
    assert stacks(doc, doc["profiles"][1]) == [(("main", HOSTILE), 5 * PERIOD)]
