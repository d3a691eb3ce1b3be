"""The defaults bpf/common.h falls back to are the values the collector compiles it with."""

from __future__ import annotations

import re
from pathlib import Path

from collector import bpftime, drains
from tests.harness import ROOT

COMMON_H = Path(ROOT) / "bpf" / "common.h"


def test_common_h_defaults_are_the_collectors_values() -> None:
    # The collector imports bcc only when it runs: read its constants from the source.
    main = (Path(ROOT) / "collector" / "plan.py").read_text()
    header = COMMON_H.read_text()
    for name in ("NEW_PID_NOTIFY_NS", "SEEN_PIDS"):
        py = re.search(rf"^{name} = ([\d_]+)$", main, re.MULTILINE)
        c = re.search(rf"^#define {name} (\d+)$", header, re.MULTILINE)
        assert py and c, name
        assert int(py.group(1).replace("_", "")) == int(c.group(1)), name
    for name, seconds in (("NEW_PID_ALIVE_NS", drains.EARLY_ALIVE_S), ("NEW_PID_STALE_NS", drains.EARLY_STALE_S)):
        c = re.search(rf"^#define {name} (\d+)$", header, re.MULTILINE)
        assert c and int(c.group(1)) == round(seconds * 1e9), name


def test_common_h_timing_period_is_the_collectors() -> None:
    # bpf/common.h's self-timing falls back to the period collector/bpftime.py compiles it with
    c = re.search(r"^#define TIMING_PERIOD (\d+)$", COMMON_H.read_text(), re.MULTILINE)
    assert c and int(c.group(1)) == bpftime.TIMING_PERIOD == bpftime.bpf_defines()["TIMING_PERIOD"]
