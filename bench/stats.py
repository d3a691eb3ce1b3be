"""Median with min and max: how every bench figure is reported."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """{"median", "min", "max", "n"} of `values` (None figures when there are none)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": round(statistics.median(vals), 6),
        "min": round(min(vals), 6),
        "max": round(max(vals), 6),
        "n": len(vals),
    }
