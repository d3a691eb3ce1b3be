"""One gzip pprof from one closed window of one service.

Owns: each profile type's sample types and period (as data), and the
translation of aggregated (labels, frames) rows into pprof mappings,
functions, locations and samples; a Python frame of a mixed stack
(symbolizer/pystacks.py PythonFrame) becomes a function with its qualified name
and file and a location with its line, under the one PYTHON_MODULE mapping,
named by the `python_name` it is given (a placeholder when that has none).

Must not: decide windows or labels, or send anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.pprof import ProfileBuilder
from shared.window import TRUNCATED, ClosedWindow
from symbolizer.frames import Frame
from symbolizer.pystacks import PYTHON_MODULE, PythonFrame, placeholder

# A Python frame's (function, file, line), or None when it has no name (symbolizer/pynames.py).
PythonName = Callable[[PythonFrame], tuple[str, str, int] | None]


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


def build(window: ClosedWindow, period: int, python_name: PythonName | None = None) -> tuple[bytes, int]:
    """(gzip pprof, number of samples) of a closed window; `python_name` names its Python frames."""
    kind = KINDS[window.profile_type]
    b = ProfileBuilder(kind.sample_types, kind.period_type, period, window.start_ns, window.end_ns - window.start_ns)
    width = len(kind.sample_types)
    python: dict[PythonFrame, int] = {}  # each Python frame's location, named once per profile
    for (labels, frames), row in window.data.rows.items():
        values = (row + [0] * width)[:width]
        locations = []
        if frames == TRUNCATED:
            m = b.mapping("[truncated]", "[truncated]")
            locations.append(b.location("[truncated]", m, 0, [b.function("[truncated]")]))
        else:
            for f in frames:
                if isinstance(f, PythonFrame):
                    lid = python.get(f)
                    if lid is None:
                        lid = python[f] = _python_location(b, f, python_name)
                    locations.append(lid)
                    continue
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


def _python_location(b: ProfileBuilder, f: PythonFrame, python_name: PythonName | None) -> int:
    """The location of a Python frame: one per (function, file, line), so processes share them."""
    named = python_name(f) if python_name is not None else None
    function, file, line = named if named is not None else (placeholder(f), "", 0)
    m = b.mapping((PYTHON_MODULE, ""), PYTHON_MODULE, memory_limit=_MAPPING_LIMIT, has_functions=True)
    return b.location((PYTHON_MODULE, function, file, line), m, 0, [b.function(function, file)], line=line)
