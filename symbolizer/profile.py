"""One gzip pprof from one closed window of one service.

Owns: each profile type's sample types and period (as data), and the
translation of aggregated (labels, frames) rows into pprof mappings,
functions, locations and samples.

Must not: decide windows or labels, or send anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.pprof import ProfileBuilder
from shared.window import TRUNCATED, ClosedWindow
from symbolizer.frames import Frame


@dataclass(frozen=True)
class ProfileKind:
    sample_types: tuple[tuple[str, str], ...]  # values of a row: (count, value, *extra)
    period_type: tuple[str, str]


KINDS: dict[str, ProfileKind] = {
    "cpu": ProfileKind((("samples", "count"), ("cpu", "nanoseconds")), ("cpu", "nanoseconds")),
    "offcpu": ProfileKind((("samples", "count"), ("offcpu", "nanoseconds")), ("offcpu", "nanoseconds")),
    # Go's heap profile's names; inuse: sampled allocations not freed when the window ended.
    "alloc": ProfileKind(
        (("alloc_objects", "count"), ("alloc_space", "bytes"), ("inuse_objects", "count"), ("inuse_space", "bytes")),
        ("space", "bytes"),
    ),
    "lock": ProfileKind((("contentions", "count"), ("delay", "nanoseconds")), ("contentions", "count")),
}

# Module-relative addresses are file offsets; every mapping spans them all.
_MAPPING_LIMIT = 1 << 48


def build(window: ClosedWindow, period: int) -> tuple[bytes, int]:
    """(gzip pprof, number of samples) of a closed window."""
    kind = KINDS[window.profile_type]
    b = ProfileBuilder(kind.sample_types, kind.period_type, period, window.start_ns, window.end_ns - window.start_ns)
    width = len(kind.sample_types)
    for (labels, frames), row in window.data.rows.items():
        values = (row + [0] * width)[:width]
        locations = []
        if frames == TRUNCATED:
            m = b.mapping("[truncated]", "[truncated]")
            locations.append(b.location("[truncated]", m, 0, [b.function("[truncated]")]))
        else:
            for f in frames:
                assert isinstance(f, Frame)
                m = b.mapping(
                    (f.module, f.build_id),
                    f.module,
                    f.build_id,
                    memory_limit=_MAPPING_LIMIT,
                    has_functions=bool(f.function),
                )
                fids = [b.function(f.function)] if f.function else []
                locations.append(b.location(f, m, f.address, fids))
        b.sample(locations, values, dict(labels))
    return b.gzipped(), b.sample_count
