"""Reading an OTLP ExportProfilesServiceRequest back into pprof's terms, to compare the two value for value.

otlp_samples() turns a request decoded by opentelemetry-proto's classes into
the same sorted rows that pprof_samples() makes of a shared.pprof.read()
profile: (labels, frames root first, values per sample type). Resource
attributes map back to our label names (host.name → host, …); the checks that
the OpenTelemetry names are the ones the semantic conventions give are the
tests' own.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shared import pprof

# Resource attribute → our label; service.name and process.executable.name are checked apart.
LABEL_OF = {
    "host.name": "host",
    "container.id": "container",
    "k8s.pod.uid": "k8s.pod",
    "process.executable.path": "process.executable",
    "process.command_line": "process.command_line",
    "process.pid": "pid",
    "ebpfprofiler.pid_hash": "pid",
}

# (labels, frames root first as (function, filename, module, build id, address, line), values)
Row = tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str, str, str, int, int], ...], tuple[int, ...]]


def _frames(frames: tuple[pprof.Frame, ...]) -> tuple[tuple[str, str, str, str, int, int], ...]:
    return tuple(dataclasses.astuple(f) for f in frames)


def _value(v: Any) -> str | int:
    return v.int_value if v.WhichOneof("value") == "int_value" else v.string_value


def pprof_samples(profile: pprof.ReadProfile) -> list[Row]:
    return sorted(
        (tuple(sorted((k, str(v)) for k, v in s.labels.items())), _frames(s.frames), s.values) for s in profile.samples
    )


def otlp_samples(req: Any) -> tuple[list[Row], list[tuple[str, str]], list[dict[str, Any]]]:
    """(rows, sample types, resource attributes of each resource) of a request."""
    d = req.dictionary
    st = d.string_table

    def attr(i: int) -> tuple[str, str | int]:
        a = d.attribute_table[i]
        return st[a.key_strindex], _value(a.value)

    def frames(stack_index: int) -> tuple[pprof.Frame, ...]:
        out: list[pprof.Frame] = []
        for li in reversed(d.stack_table[stack_index].location_indices):
            loc = d.location_table[li]
            m = d.mapping_table[loc.mapping_index]
            build_id = dict(attr(i) for i in m.attribute_indices).get("process.executable.build_id.gnu", "")
            module = st[m.filename_strindex]
            here = [
                pprof.Frame(
                    st[d.function_table[ln.function_index].name_strindex],
                    st[d.function_table[ln.function_index].filename_strindex],
                    module,
                    str(build_id),
                    loc.address,
                    ln.line,
                )
                for ln in loc.lines
            ]
            out.extend(reversed(here) if here else [pprof.Frame("", "", module, str(build_id), loc.address)])
        return tuple(out)

    rows: list[Row] = []
    types: list[tuple[str, str]] = []
    resources = []
    for rp in req.resource_profiles:
        res = {kv.key: _value(kv.value) for kv in rp.resource.attributes}
        resources.append(res)
        labels = tuple(sorted((LABEL_OF[k], str(v)) for k, v in res.items() if k in LABEL_OF))
        profiles = [p for sp in rp.scope_profiles for p in sp.profiles]
        here = [(st[p.sample_type.type_strindex], st[p.sample_type.unit_strindex]) for p in profiles]
        if not types:
            types = here
        assert here == types, f"a resource's profiles have sample types {here}, another's {types}"
        n = {len(p.samples) for p in profiles}
        assert len(n) == 1, f"the profiles of one resource have different sample counts {n}"
        for j in range(n.pop()):
            first = profiles[0].samples[j]
            for p in profiles[1:]:
                assert (p.samples[j].stack_index, list(p.samples[j].attribute_indices)) == (
                    first.stack_index,
                    list(first.attribute_indices),
                )
            extra = tuple((k, str(v)) for k, v in (attr(i) for i in first.attribute_indices))
            values = tuple(v for p in profiles for v in p.samples[j].values)
            rows.append((tuple(sorted(labels + extra)), _frames(frames(first.stack_index)), values))
        if "process.executable.path" in res:
            path = res["process.executable.path"]
            assert isinstance(path, str), path
            assert res["process.executable.name"] == os.path.basename(path)
    return sorted(rows), types, resources
