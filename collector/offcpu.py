"""Off-CPU profiling: bpf/offcpu.c on the sched:sched_switch and sched:sched_wakeup tracepoints.

Owns: the family's name, tracepoints and start-up log line; draining and the
stack map's lifetime are collector/intervals.py's, shared with lock waits.

Must not: read /proc or talk to other stages.
"""

from __future__ import annotations

import logging
from typing import Any

from ebpfprofiler.collector.intervals import START_ENTRIES, IntervalTracer

__all__ = ["OffCpuTracer", "START_ENTRIES", "PROFILE_TYPE", "TRACEPOINTS"]

log = logging.getLogger(__name__)

PROFILE_TYPE = "offcpu"
TRACEPOINTS = (b"sched:sched_switch", b"sched:sched_wakeup")


class OffCpuTracer(IntervalTracer):
    def __init__(self, bpf: Any, min_ms: int, dwarf: bool = False) -> None:
        super().__init__(bpf, "offcpu", PROFILE_TYPE, TRACEPOINTS, "off-CPU", dwarf)
        self.min_ms = min_ms
        log.info("off-CPU profiling attached to %s: blocked intervals of %d ms and more",
                 " and ".join(t.decode() for t in TRACEPOINTS), min_ms)
