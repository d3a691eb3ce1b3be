"""A stage's counters file (shared/counters.py), as `ebpfprofiler status` reads it.

Given a CounterFile, when counts change faster than WRITE_GAP_S, then the file is
written at once for the first change and once more when the gap ends, with no
further count or flush needed: a stage that then sleeps (the uploader waits up
to a minute for work) still shows its last counts.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.polling import wait_for
from shared import counters


def written(path: str) -> dict[str, int]:
    counts: dict[str, int] = json.loads(Path(path).read_text())["counters"]
    return counts


def test_a_change_held_back_by_the_gap_is_written_when_it_ends(tmp_path: Path) -> None:
    f = counters.CounterFile(str(tmp_path), "uploader")
    f.count("read_timeout")
    assert written(f.path) == {"read_timeout": 1}  # the first change: at once
    f.count("read_timeout")
    f.update({"spool_delivered": 3})
    assert written(f.path) == {"read_timeout": 1}  # within the gap: held back
    # then, with nothing more counted, the gap's end writes what changed
    wait_for(
        "the held-back counts",
        lambda: written(f.path) == {"read_timeout": 2, "spool_delivered": 3},
        timeout=counters.WRITE_GAP_S + 3,
        interval=0.1,
    )
    # and status reads them while the stage (here this process) runs
    assert counters.read_all(str(tmp_path)) == {"uploader": {"read_timeout": 2, "spool_delivered": 3}}
