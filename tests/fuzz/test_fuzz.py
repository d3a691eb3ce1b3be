"""Bounded fuzzing of every parser of untrusted input, in `make test` (issue 15).

Each target (tests/fuzz/targets.py) runs for FUZZ_SECONDS in its own process
under tests/fuzz/run.py's caps, seeded from real inputs in tests/fuzz/seeds/,
after replaying the crashers kept in tests/fuzz/crashers/. The test fails on any
exception other than the parser's own error type, any input over 2 s, and any
over the memory cap; the input is kept for the fix and as a regression seed.
All targets together take under 60 s.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fuzz.targets import TARGETS
from tests.harness import ROOT

# 8 targets x 5 s, plus each process's start: under a minute in all.
FUZZ_SECONDS = 5.0


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz(name: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.run", name, str(FUZZ_SECONDS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=FUZZ_SECONDS + 60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["runs"] > 100, summary
    assert not summary["crashes"], json.dumps(summary["crashes"], indent=1)[:5000]
