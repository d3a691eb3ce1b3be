"""A property-based fuzz of what the report writes (issue 40): the HTML page, the folded stacks and
the top table `record` prints, on function and service names of random bytes, every template marker
and every control character.

Names reach a pprof two ways, both drawn: through the symbolizer's rule (safestr.process_string on
the bytes), and as any pprof may hold them (the bytes as Latin-1, so each byte is one character,
C1 controls included; or as UTF-8 with errors replaced). Then:
- the page parses (html.parser), has one data block whose JSON loads, holds every name (cut to
  html.MAX_NAME_CHARS) and every sample's value, and its scripts and style sheet are whole;
- the folded stacks and the table hold no raw control character, and one line per stack or row.

Bounded: about 15 s in all here (max_examples below); no deadline per example (a loaded CI host).
Hypothesis's example database is off: nothing is written into the checkout.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from report import html, profiles
from shared import pprof
from shared.safestr import printable, process_string

PERIOD = 10_000_000
TEMPLATE = (Path(html.__file__).parent / "template.html").read_text()
MARKERS = sorted(set(re.findall(r"@[A-Z0-9_]+@", TEMPLATE)))
# Every character a terminal acts on or that breaks a line: C0, DEL, C1, the Unicode line and paragraph
# separators, the bidirectional embeddings, overrides and isolates.
CONTROLS = [
    chr(c) for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
]
HTML_PIECES = ["</script>", "<!--", "<script>", "&amp;", "\\u2028", '"', "\\", ";", " ", "(other)", "all"]


def bounded(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )


piece = st.one_of(
    st.binary(max_size=12).map(process_string),
    st.binary(max_size=12).map(lambda b: b.decode("latin-1")),
    st.binary(max_size=12).map(lambda b: b.decode("utf-8", "replace")),
    st.sampled_from(MARKERS + CONTROLS + HTML_PIECES),
)
name = st.lists(piece, min_size=1, max_size=4).map("".join)
stacks = st.dictionaries(
    st.lists(name, min_size=1, max_size=5).map(tuple), st.integers(1, 10_000), min_size=1, max_size=6
)
services = st.dictionaries(name, stacks, min_size=1, max_size=3)


def load(by_service: dict[str, dict[tuple[str, ...], int]]) -> list[profiles.Loaded]:
    """One agent-shaped cpu pprof per service, read back as the report reads a file."""
    out = []
    for i, (service, stacks_) in enumerate(by_service.items()):
        b = pprof.ProfileBuilder(
            [("samples", "count"), ("cpu", "nanoseconds")],
            ("cpu", "nanoseconds"),
            PERIOD,
            1_700_000_000_000_000_000,
            2_000_000_000,
        )
        m = b.mapping("exe", "/usr/bin/x", "")
        for stack, n in stacks_.items():
            locs = [b.location((f,), m, 0x1000 + j, [b.function(f)]) for j, f in enumerate(stack)]
            b.sample(list(reversed(locs)), [n, n * PERIOD], {"process.executable": service, "pid": str(i)})
        prof = pprof.read(b.gzipped())
        out.append(profiles.Loaded(f"cpu-{i}.pb.gz", "cpu", profiles.service_of(prof), prof))
    return out


def raw_controls(text: str) -> set[str]:
    return set(text) & set(CONTROLS) - {"\n"}


class Page(HTMLParser):
    """The page's elements as html.parser sees them: the text of each <script> and <style>, by id."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.styles: list[str] = []
        self._in: tuple[str, dict[str, str | None]] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._in, self._text = (tag, dict(attrs)), []

    def handle_data(self, data: str) -> None:
        if self._in:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._in and tag == self._in[0]:
            text = "".join(self._text)
            if tag == "script":
                self.scripts.append((self._in[1], text))
            else:
                self.styles.append(text)
            self._in = None


def tree_names(node: dict) -> set[str]:
    out, todo = set(), list(node.get("children", []))
    while todo:
        n = todo.pop()
        out.add(n["name"])
        todo += n.get("children", [])
    return out


@bounded(300)
@given(services)
def test_the_page_parses_and_holds_every_name(by_service: dict[str, dict[tuple[str, ...], int]]) -> None:
    loaded = load(by_service)
    page = html.render(loaded)
    parsed = Page()
    parsed.feed(page)
    parsed.close()
    # the page's own elements, each whole: the data block, d3, the flame graph, the page's script
    data = [text for attrs, text in parsed.scripts if attrs.get("id") == "data"]
    assert len(data) == 1 and len(parsed.scripts) == 4
    vendor = Path(html.__file__).parent / "vendor"
    assert parsed.scripts[1][1] == (vendor / "d3.min.js").read_text().replace("</script", "<\\/script")
    assert parsed.styles[0] == (vendor / "d3-flamegraph.css").read_text()
    doc = json.loads(data[0])
    graphs = {p["service"]: p for p in doc["profiles"]}
    assert doc["note"] == "" and len(graphs) == len(by_service) + (len(by_service) > 1)
    for item, stacks_ in zip(loaded, by_service.values()):  # a service of "" is "unknown"
        got = graphs[item.service[: html.MAX_NAME_CHARS]]
        assert got["total"] == got["tree"]["value"] == sum(stacks_.values()) * PERIOD
        want = {profiles.frame_name(f)[: html.MAX_NAME_CHARS] for s in item.profile.samples for f in s.frames}
        assert tree_names(got["tree"]) == want


@bounded(1000)
@given(stacks)
def test_folded_stacks_and_the_top_table_hold_no_control_character(stacks_: dict[tuple[str, ...], int]) -> None:
    loaded = load({"/usr/bin/x": stacks_})
    folded = profiles.folded(loaded)
    assert not raw_controls(folded)
    lines = folded.split("\n")
    assert lines[-1] == "" and lines[:-1] == folded.splitlines()  # no line break but "\n"
    want = {tuple(printable(f).replace(";", ":") for f in stack) for stack in stacks_}
    assert len(lines) - 1 == len(want)
    assert all(re.fullmatch(r".* \d+", line) for line in lines[:-1])
    table = profiles.top_table(loaded)
    assert not raw_controls(table)
    rows = table.split("\n")
    assert rows == table.splitlines() and len(rows) == 1 + min(15, len({f for s in stacks_ for f in s}))
    assert all(re.match(r"\s+\S+\s+[\d.]+% \s*\S+\s+[\d.]+%  ", row) for row in rows[1:])
