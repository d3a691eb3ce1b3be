"""The HTML report: one self-contained file with an interactive flame graph per profile type and service.

Owns: turning loaded profiles (report/profiles.py) into flame graph trees
(drawn root at the top; root → service → stacks for "all services", root → stacks for each
service), capping their size, and filling report/template.html with them
and the vendored d3-flame-graph and d3 (report/vendor/, with their
licences), inlined so the file needs no network. Function names come from
profiled processes: they go into the page as JSON with <, > and & escaped,
and the page sets them only as text.

Must not: read files other than its template and vendored scripts.
"""

from __future__ import annotations

import datetime
import json
from importlib import resources
from typing import Any, Sequence

from ebpfprofiler.report import profiles as profiles_mod

# Distinct stacks kept per flame graph (the heaviest): a host-wide report of a busy host stays a few MB.
MAX_STACKS_PER_GRAPH = 50_000
# A function name longer than this is cut (a flame graph cannot show more, and a hostile name stays small).
MAX_NAME_CHARS = 300
ALL_SERVICES = "(all services)"


def _tree(stacks: dict[tuple[str, ...], int], root: str) -> dict[str, Any]:
    top = sorted(stacks.items(), key=lambda kv: -kv[1])[:MAX_STACKS_PER_GRAPH]
    node: dict[str, Any] = {"name": root, "value": 0, "children": {}}
    for stack, v in top:
        node["value"] += v
        cur = node
        for name in stack:
            name = name[:MAX_NAME_CHARS]
            nxt = cur["children"].get(name)
            if nxt is None:
                nxt = cur["children"][name] = {"name": name, "value": 0, "children": {}}
            nxt["value"] += v
            cur = nxt

    def finish(n: dict[str, Any]) -> dict[str, Any]:
        out = {"name": n["name"], "value": n["value"]}
        if n["children"]:
            out["children"] = [finish(c) for c in n["children"].values()]
        return out

    return finish(node)


def model(loaded: Sequence[profiles_mod.Loaded]) -> dict[str, Any]:
    """The page's data: a list of {type, service, unit, total, samples, tree}."""
    out = []
    for ptype, items in profiles_mod.by_type(loaded).items():
        unit = items[0].profile.sample_types[-1][1]
        by_service: dict[str, list[profiles_mod.Loaded]] = {}
        for item in items:
            by_service.setdefault(item.service, []).append(item)
        per_service = {svc: profiles_mod.stacks(group) for svc, group in sorted(by_service.items())}
        counts = {svc: sum(s.values[0] for g in group for s in g.profile.samples)
                  for svc, group in by_service.items()}
        entries = []
        for svc, stacks in per_service.items():
            entries.append({"type": ptype, "service": svc, "unit": unit, "total": sum(stacks.values()),
                            "samples": counts[svc], "tree": _tree(stacks, svc)})
        if len(per_service) > 1:
            merged = {(svc,) + stack: v for svc, stacks in per_service.items() for stack, v in stacks.items()}
            entries.insert(0, {"type": ptype, "service": ALL_SERVICES, "unit": unit,
                               "total": sum(merged.values()), "samples": sum(counts.values()),
                               "tree": _tree(merged, "all")})
        out += entries
    return {"generated": datetime.datetime.now(datetime.timezone.utc).strftime("made %Y-%m-%d %H:%M UTC"),
            "profiles": out}


def _script_json(doc: dict[str, Any]) -> str:
    # inside <script>: no "</script>" or "<!--" can come out of a name
    return json.dumps(doc, separators=(",", ":")).replace("&", "\\u0026").replace("<", "\\u003c") \
        .replace(">", "\\u003e")


def _vendor(name: str) -> str:
    return resources.files("ebpfprofiler.report").joinpath("vendor", name).read_text(encoding="utf-8")


def render(loaded: Sequence[profiles_mod.Loaded], title: str = "ebpfprofiler flame graph") -> str:
    page = resources.files("ebpfprofiler.report").joinpath("template.html").read_text(encoding="utf-8")
    # the scripts go in last: a vendored file may contain any of the markers' text
    parts = {"@TITLE@": title.replace("&", "&amp;").replace("<", "&lt;"),
             "@DATA@": _script_json(model(loaded)),
             "@FLAMEGRAPH_CSS@": _vendor("d3-flamegraph.css")}
    for k, v in parts.items():
        page = page.replace(k, v)
    head, _, rest = page.partition("@D3_JS@")
    mid, _, tail = rest.partition("@FLAMEGRAPH_JS@")
    return head + _vendor("d3.min.js").replace("</script", "<\\/script") + mid + \
        _vendor("d3-flamegraph.min.js").replace("</script", "<\\/script") + tail
