"""bench/python_walk.py's figures: the added cost is with minus without within a round, per frame over the
frames walked, and the issue-42 target is judged on the 30-frame stack's median."""

from __future__ import annotations

from typing import Any

from bench import python_walk


def window(ns: float, frames: float, walked: int) -> dict[str, Any]:
    return {
        "own_ns_per_run": ns,
        "kernel_ns_per_run": ns + 100,
        "frames_walked_per_walk": frames,
        "samples": 1000,
        "walked": walked,
        "frames_kept": int(min(frames, 64)) * walked,
        "truncated": walked if frames > 64 else 0,
    }


def rounds(added_30: float) -> list[dict[str, dict[str, Any]]]:
    return [
        {
            str(d): {"without": window(3000 + r, 0, 0), "with": window(3000 + r + (added_30 * d / 30), d, 1000)}
            for d in python_walk.DEPTHS
        }
        for r in range(3)
    ]


def test_the_added_cost_is_taken_within_each_round_and_per_frame_walked() -> None:
    got = python_walk.summarize(rounds(2400.0))
    assert got["30"]["own"]["added"]["median"] == 2400.0
    assert got["30"]["kernel"]["added"]["median"] == 2400.0
    assert got["100"]["own"]["added_per_frame"]["median"] == 80.0
    assert got["100"]["frames_kept"]["median"] == 64 and got["100"]["truncated_share"]["median"] == 1.0
    assert got["10"]["walked_share"]["median"] == 1.0
    assert got["30"]["target_pass"] is True and "target_pass" not in got["10"]


def test_the_target_fails_past_5_us_and_the_table_says_so() -> None:
    summary = python_walk.summarize(rounds(5200.0))
    assert summary["30"]["target_pass"] is False
    result = {
        "summary": summary,
        "workload": "w",
        "sample_hz": 999,
        "measure_s": 3.0,
        "rounds": 3,
        "limits": {"PY_MAX_FRAMES": 64, "PY_WALK_FRAMES": 512},
        "seconds": 1.0,
    }
    _, head, rows, _ = python_walk.section(result)
    assert len(rows) == len(python_walk.DEPTHS) and all(len(r) == len(head) for r in rows)
    assert [r[-1] for r in rows] == ["", "FAIL", ""]
    assert rows[2][1] == "100 / 64"
