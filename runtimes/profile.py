"""One gzip pprof of a runtime's profile type (python_wall, php_wall ...) from one closed window of one service.

Owns: the runtime profile types' sample types and period (wall-clock
samples: a count and nanoseconds; the on-CPU types, jvm_cpu and node_cpu:
a count and cpu nanoseconds, as the cpu profile), and turning aggregated (labels, frames)
rows into pprof functions (qualified name and file; every runtime's frames
have function, filename, line: runtimes/runtime.py), locations (one per
function and line), one mapping named for the runtime, and samples.

Must not: decide windows or labels, or send anything.
"""

from __future__ import annotations

from shared.runtime_registry import BY_PROFILE_TYPE, CPU_PROFILE_TYPES
from shared.window import TRUNCATED, ClosedWindow

SAMPLE_TYPES = (("samples", "count"), ("wall", "nanoseconds"))
PERIOD_TYPE = ("wall", "nanoseconds")
CPU_SAMPLE_TYPES = (("samples", "count"), ("cpu", "nanoseconds"))
CPU_PERIOD_TYPE = ("cpu", "nanoseconds")


def build(window: ClosedWindow, period_ns: int) -> tuple[bytes, int]:
    """(gzip pprof, number of samples) of a closed window."""
    # imported at the first profile: protobuf is ~3 MB of the reader's memory, and a host with no
    # process the reader can read (the shipped defaults, most hosts) never builds one
    from shared.pprof import ProfileBuilder

    cpu = window.profile_type in CPU_PROFILE_TYPES
    b = ProfileBuilder(
        CPU_SAMPLE_TYPES if cpu else SAMPLE_TYPES,
        CPU_PERIOD_TYPE if cpu else PERIOD_TYPE,
        period_ns,
        window.start_ns,
        window.end_ns - window.start_ns,
    )
    name = BY_PROFILE_TYPE[window.profile_type].name
    mapping = b.mapping(name, f"[{name}]", has_functions=True)
    for (labels, frames), (count, value) in window.data.rows.items():
        locations = []
        if frames == TRUNCATED:
            locations.append(b.location("[truncated]", mapping, 0, [b.function("[truncated]")]))
        else:
            for f in frames:
                locations.append(b.location(f, mapping, 0, [b.function(f.function, f.filename)], line=f.line))
        b.sample(locations, [count, value], dict(labels))
    return b.gzipped(), b.sample_count
