"""One gzip python_wall pprof from one closed window of one service.

Owns: the python_wall profile type's sample types and period, and turning
aggregated (labels, Python frames) rows into pprof functions (qualified name
and file), locations (one per function and line) and samples.

Must not: decide windows or labels, or send anything.
"""

from __future__ import annotations

from ebpfprofiler.runtimes.cpython import PyFrame
from ebpfprofiler.shared.pprof import ProfileBuilder
from ebpfprofiler.symbolizer.window import TRUNCATED, ClosedWindow

PROFILE_TYPE = "python_wall"
SAMPLE_TYPES = (("samples", "count"), ("wall", "nanoseconds"))
PERIOD_TYPE = ("wall", "nanoseconds")


def build(window: ClosedWindow, period_ns: int) -> tuple[bytes, int]:
    """(gzip pprof, number of samples) of a closed window."""
    b = ProfileBuilder(SAMPLE_TYPES, PERIOD_TYPE, period_ns, window.start_ns, window.end_ns - window.start_ns)
    mapping = b.mapping("python", "[python]", has_functions=True)
    for (labels, frames), (count, value) in window.data.rows.items():
        locations = []
        if frames == TRUNCATED:
            locations.append(b.location("[truncated]", mapping, 0, [b.function("[truncated]")]))
        else:
            for f in frames:
                assert isinstance(f, PyFrame)
                locations.append(b.location(f, mapping, 0, [b.function(f.function, f.filename)], line=f.line))
        b.sample(locations, [count, value], dict(labels))
    return b.gzipped(), b.sample_count
