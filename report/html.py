"""The HTML report: one self-contained file with an interactive flame graph per profile type and service.

Owns: turning loaded profiles (report/profiles.py) into flame graph trees
(drawn root at the top; root → service → stacks for "all services", root → stacks for each
service), capping their size, and filling report/template.html with them
and the vendored d3-flame-graph and d3 (report/vendor/, with their
licences), inlined so the file needs no network. The differential page (`report --diff`) is the
same page: each tree node carries BASE's value beside NEW's, each graph its movers table
(report/diff.py computes both), and the template's script colours frames by the change in share.

Function and service names come from profiled processes (or from any pprof a user hands in):
- they never pass through the template's text: the template is split at its @MARKER@s once, and
  each part is written as it is, so a name holding a marker's text is only that name;
- they go into the page only as JSON, in the data block (<script type="application/json">), with
  every non-ASCII character, <, > and & written as \\uXXXX (no "</script>", "<!--" or U+2028 can come
  out of a name), and the page sets them only as text;
- the page has a byte cap (MAX_HTML_BYTES): the trees are built against it, frame by frame, and the
  frames of the lightest stacks that do not fit are merged into "(other)" at the deepest frame
  they share with a heavier stack, with a note in the page. The page is never built whole first
  to be measured.

Must not: read files other than its template and vendored scripts.
"""

from __future__ import annotations

import datetime
import heapq
import html as html_mod
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from report import diff as diff_mod
from report import profiles as profiles_mod

# Bytes of a whole page at most: what a browser opens and draws in a few seconds. A busy host's real
# report is a few MB; a hostile 191 KB pprof once made a 455 MB page (issue 40).
MAX_HTML_BYTES = 32 << 20
# Distinct stacks kept per flame graph (the heaviest): a host-wide report of a busy host stays a few MB.
MAX_STACKS_PER_GRAPH = 50_000
# A function name longer than this is cut (a flame graph cannot show more, and a hostile name stays small).
MAX_NAME_CHARS = 300
ALL_SERVICES = profiles_mod.ALL_SERVICES
# The frame that stands for what the byte cap merged under a frame.
OTHER = "(other)"
# Bytes kept for the note and the data block's own keys (a few hundred in fact).
_NOTE_RESERVE = 4096
# Digits of a value allowed for: the sums of a hostile pprof's int64 values can pass 20 digits.
_VALUE_DIGITS = 40
# A tree node's bytes besides its name: {"name":…,"value":…,"children":[…]}, and a comma.
_NODE_BYTES = len('{"name":,"value":,"children":[]},') + _VALUE_DIGITS
# Bytes a diff's node adds for BASE's value: ,"base":N.
_BASE_BYTES = len(',"base":') + _VALUE_DIGITS
# Decimal places of a share in the movers table: a millionth is finer than any flame graph shows.
SHARE_DIGITS = 6
# A change in share that gets the full colour at least: the largest change of a diff of two recordings of
# the same code (a percent or so of noise) stays pale.
FULL_COLOUR_SHARE = 0.05
DIFF_TITLE = "ebpfprofiler differential flame graph"
_MARKER = re.compile(r"@([A-Z0-9_]+)@")


def _json(value: Any) -> str:
    """JSON that is safe inside <script>: ASCII only, and no <, > or & (so no "</script>" or "<!--")."""
    return (
        json.dumps(value, separators=(",", ":"), ensure_ascii=True)
        .replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
    )


class _Node:
    __slots__ = ("base", "children", "name", "other", "other_base", "value")

    def __init__(self, name: str) -> None:
        self.name = name
        self.value = 0
        self.base = 0  # a diff's BASE value (value is NEW's)
        self.children: dict[str, _Node] | None = None
        self.other = 0  # value merged under this frame by the byte cap, drawn as a child OTHER
        self.other_base = 0


_OTHER_BYTES = _NODE_BYTES + len(_json(OTHER))


def _node_bytes(name: str, diff: bool = False) -> int:
    # its own bytes, and those of the OTHER child it may get: an OTHER is paid for in advance
    return _NODE_BYTES + len(_json(name)) + _OTHER_BYTES + (2 * _BASE_BYTES if diff else 0)


@dataclass
class _Graph:
    type: str
    service: str
    unit: str
    total: int
    samples: int
    stacks: dict[tuple[str, ...], int]
    base: profiles_mod.Group | None = None  # a diff's BASE side (stacks is NEW's)
    movers: tuple[diff_mod.Mover, ...] = ()
    tree: _Node | None = None
    merged_frames: int = 0

    def header(self) -> str:
        """Its JSON object up to its tree: `{…,"tree":`."""
        fields = {
            "type": self.type[:MAX_NAME_CHARS],
            "service": self.service[:MAX_NAME_CHARS],
            "unit": self.unit[:MAX_NAME_CHARS],
            "total": self.total,
            "samples": self.samples,
            "merged_frames": self.merged_frames,
        }
        if self.base is not None:
            fields["base_total"] = self.base.total
            fields["base_samples"] = self.base.samples
            fields["movers"] = [_mover(m) for m in self.movers]
        return _json(fields)[:-1] + ',"tree":'


def _mover(m: diff_mod.Mover) -> dict[str, Any]:
    return {
        "function": m.function[:MAX_NAME_CHARS],
        "status": m.status,
        **{k: round(getattr(m, k), SHARE_DIGITS) for k in ("base_self", "new_self", "base_total", "new_total")},
    }


def _heaviest(
    stacks: dict[tuple[str, ...], int], base: dict[tuple[str, ...], int] | None
) -> list[tuple[tuple[str, ...], int, int]]:
    """The MAX_STACKS_PER_GRAPH heaviest stacks, (stack, value, BASE's value); of a diff, by the larger of
    their two shares, so that both sides keep their heavy stacks."""
    if base is None:
        return [(k, v, 0) for k, v in heapq.nlargest(MAX_STACKS_PER_GRAPH, stacks.items(), key=lambda kv: kv[1])]
    total, base_total = sum(stacks.values()) or 1, sum(base.values()) or 1
    keys = heapq.nlargest(
        MAX_STACKS_PER_GRAPH,
        stacks.keys() | base.keys(),
        key=lambda k: max(stacks.get(k, 0) / total, base.get(k, 0) / base_total),
    )
    return [(k, stacks.get(k, 0), base.get(k, 0)) for k in keys]


def _tree(
    stacks: dict[tuple[str, ...], int], root: str, budget: int, base: dict[tuple[str, ...], int] | None = None
) -> tuple[_Node, int, int]:
    """The flame graph of `stacks` (and of a diff's `base` in the same nodes) in at most `budget` bytes of
    JSON, how many frames the cap merged into OTHER, and the bytes it may take. Heaviest stacks first: a
    frame that would pass the budget, and the rest of its stack, go into its parent's OTHER."""
    diff = base is not None
    node = _Node(root)
    used = _node_bytes(root, diff)
    merged = 0
    for stack, v, bv in _heaviest(stacks, base):
        node.value += v
        node.base += bv
        cur = node
        for depth, frame in enumerate(stack):
            name = frame[:MAX_NAME_CHARS]
            nxt = cur.children.get(name) if cur.children is not None else None
            if nxt is None:
                cost = _node_bytes(name, diff)
                if used + cost > budget:
                    cur.other += v
                    cur.other_base += bv
                    merged += len(stack) - depth
                    break
                used += cost
                if cur.children is None:
                    cur.children = {}
                nxt = cur.children[name] = _Node(name)
            nxt.value += v
            nxt.base += bv
            cur = nxt
    return node, merged, used


def _tree_json(root: _Node, diff: bool = False) -> Iterator[str]:
    """`root` as d3-flame-graph's JSON ({name, value, children}; a diff's nodes with BASE's value as base),
    in pieces; no recursion (a stack may be deeper than Python's recursion limit)."""
    todo: list[_Node | str] = [root]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            yield item
            continue
        head = f'{{"name":{_json(item.name)},"value":{int(item.value)}'
        if diff:
            head += f',"base":{int(item.base)}'
        kids: list[_Node | str] = list(item.children.values()) if item.children else []
        if item.other or item.other_base:
            other = _Node(OTHER)
            other.value, other.base = item.other, item.other_base
            kids.append(other)
        if not kids:
            yield head + "}"
            continue
        yield head + ',"children":['
        todo.append("]}")
        for i in range(len(kids) - 1, -1, -1):
            todo.append(kids[i])
            if i:
                todo.append(",")


def _graphs(loaded: Sequence[profiles_mod.Loaded]) -> list[_Graph]:
    return [
        _Graph(g.profile_type, g.service, g.unit, g.total, g.samples, g.stacks) for g in profiles_mod.groups(loaded)
    ]


def _diff_graphs(pairs: Sequence[diff_mod.Pair]) -> list[_Graph]:
    return [
        _Graph(p.profile_type, p.service, p.new.unit, p.new.total, p.new.samples, p.new.stacks, p.base, p.movers)
        for p in pairs
    ]


def _build(graphs: list[_Graph], budget: int) -> tuple[list[_Graph], str]:
    """Builds each graph's tree within its share of `budget` bytes; the graphs kept and the page's note."""
    # The graphs' own fields first: past half the budget, the graphs with the least total are left out.
    kept, headers = [], 0
    for g in sorted(graphs, key=lambda g: -g.total):
        cost = len(g.header()) + 2 * _VALUE_DIGITS + _node_bytes(g.service[:MAX_NAME_CHARS], g.base is not None)
        if headers + cost > budget // 2:
            continue
        kept.append(g)
        headers += cost
    left_out = len(graphs) - len(kept)
    keep = {id(g) for g in kept}
    kept = [g for g in graphs if id(g) in keep]
    free = budget - headers
    for i, g in enumerate(kept):
        share = free // (len(kept) - i)  # what an earlier graph did not use goes to the later ones
        root = "all" if g.service == ALL_SERVICES else g.service[:MAX_NAME_CHARS]
        g.tree, g.merged_frames, used = _tree(g.stacks, root, share, g.base.stacks if g.base is not None else None)
        free -= used
    merged = sum(g.merged_frames for g in kept)
    note = ""
    if merged or left_out:
        note = (
            f"This report is cut to stay under {MAX_HTML_BYTES >> 20} MiB: "
            + (f"{merged:,} frames of the lightest stacks are merged into “{OTHER}”" if merged else "")
            + ("; " if merged and left_out else "")
            + (f"{left_out:,} of the smallest graphs are left out" if left_out else "")
            + "."
        )
    return kept, note


def _data_json(graphs: list[_Graph], note: str, diff: dict[str, Any] | None = None) -> Iterator[str]:
    generated = datetime.datetime.now(datetime.UTC).strftime("made %Y-%m-%d %H:%M UTC")
    yield f'{{"generated":{_json(generated)},"note":{_json(note)},'
    if diff is not None:
        yield f'"diff":{_json(diff)},'
    yield '"profiles":['
    for i, g in enumerate(graphs):
        assert g.tree is not None
        yield ("," if i else "") + g.header()
        yield from _tree_json(g.tree, g.base is not None)
        yield "}"
    yield "]}"


def _vendor(name: str) -> str:
    return resources.files("report").joinpath("vendor", name).read_text(encoding="utf-8")


def _script(text: str) -> str:
    return text.replace("</script", "<\\/script")


def chunks(
    loaded: Sequence[profiles_mod.Loaded], title: str = "ebpfprofiler flame graph", max_bytes: int = MAX_HTML_BYTES
) -> Iterator[str]:
    """The page, in pieces (at most `max_bytes` in all, UTF-8)."""
    return _page(_graphs(loaded), title, max_bytes)


def _diff_info(base_label: str, new_label: str) -> dict[str, Any]:
    return {"base": base_label[:MAX_NAME_CHARS], "new": new_label[:MAX_NAME_CHARS], "full_colour": FULL_COLOUR_SHARE}


def diff_chunks(
    pairs: Sequence[diff_mod.Pair],
    base_label: str,
    new_label: str,
    title: str = DIFF_TITLE,
    max_bytes: int = MAX_HTML_BYTES,
) -> Iterator[str]:
    """The differential page (report/diff.py's pairs), in pieces (at most `max_bytes` in all, UTF-8)."""
    return _page(_diff_graphs(pairs), title, max_bytes, _diff_info(base_label, new_label))


def _page(graphs: list[_Graph], title: str, max_bytes: int, diff: dict[str, Any] | None = None) -> Iterator[str]:
    template = resources.files("report").joinpath("template.html").read_text(encoding="utf-8")
    pieces = _MARKER.split(template)  # literal text, marker name, literal text, …
    fixed = {
        "TITLE": html_mod.escape(title),
        "FLAMEGRAPH_CSS": _vendor("d3-flamegraph.css"),
        "D3_JS": _script(_vendor("d3.min.js")),
        "FLAMEGRAPH_JS": _script(_vendor("d3-flamegraph.min.js")),
    }
    markers = pieces[1::2]
    unknown = set(markers) - set(fixed) - {"DATA", "NOTE"}
    if unknown:
        raise ValueError(f"template.html has markers this writer does not fill: {sorted(unknown)}")
    used = sum(len(p.encode()) for p in pieces[0::2]) + sum(len(fixed[m].encode()) for m in markers if m in fixed)
    used += len(_json(diff).encode()) if diff is not None else 0
    kept, note = _build(graphs, max_bytes - used - markers.count("NOTE") * _NOTE_RESERVE - _NOTE_RESERVE)
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            yield piece
        elif piece == "DATA":
            yield from _data_json(kept, note, diff)
        elif piece == "NOTE":
            yield html_mod.escape(note)
        else:
            yield fixed[piece]


def render(loaded: Sequence[profiles_mod.Loaded], title: str = "ebpfprofiler flame graph") -> str:
    """The whole page (at most MAX_HTML_BYTES)."""
    return "".join(chunks(loaded, title))


def model(loaded: Sequence[profiles_mod.Loaded]) -> dict[str, Any]:
    """The page's data, as the page reads it: {generated, note, profiles: [{type, service, unit, total,
    samples, merged_frames, tree}]}."""
    graphs, note = _build(_graphs(loaded), MAX_HTML_BYTES)
    return dict(json.loads("".join(_data_json(graphs, note))))


def render_diff(pairs: Sequence[diff_mod.Pair], base_label: str, new_label: str, title: str = DIFF_TITLE) -> str:
    """The whole differential page (at most MAX_HTML_BYTES)."""
    return "".join(diff_chunks(pairs, base_label, new_label, title))


def diff_model(pairs: Sequence[diff_mod.Pair], base_label: str = "BASE", new_label: str = "NEW") -> dict[str, Any]:
    """The differential page's data, as the page reads it: model()'s, with {diff: {base, new, full_colour}}
    and, per profile, base_total, base_samples, movers and each tree node's base."""
    graphs, note = _build(_diff_graphs(pairs), MAX_HTML_BYTES)
    return dict(json.loads("".join(_data_json(graphs, note, _diff_info(base_label, new_label)))))
