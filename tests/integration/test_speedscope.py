"""A recording in speedscope's own viewer: its npm package's app, in headless Chromium (Debian's).

Given the 3:1 workload (main → work → heavy takes three times main → work → light), when
`ebpfprofiler record -p PID -o out.speedscope.json` records it and speedscope's app (the npm
package's dist/release, fetched by make test-assets) opens the file the way speedscope's own
command line does (a script calling speedscope.loadFileFromBase64, named in the page's
#localProfilePath) in its Sandwich view, then the page is titled with the file's name, the profile is
named by its type, executable and pid, and the table speedscope built from the file lists every
function the file gives 5% or more of the total (main, heavy and light among them), each at that
share (to the table's rounding): the viewer read every stack.
"""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import subprocess
from pathlib import Path

from tests.browser import chromium
from tests.harness import PY, RECORD_TIMEOUT_S, require_root
from tests.node_builds import speedscope_app

OUT = "out.speedscope.json"
# A row of speedscope's Sandwich table: total, self (each a value and its percent), the symbol.
ROW = re.compile(r"(\S+) \(([\d.]+|&lt;[\d.]+|<[\d.]+)%\) (\S+) \(([\d.]+|<[\d.]+)%\) (\S+)")


def table_text(dom: str) -> str:
    """The text of speedscope's Sandwich table in `dom`, from its header on."""
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))
    return text.split("Symbol Name", 1)[1] if "Symbol Name" in text else ""


def sandwich_rows(dom: str) -> dict[str, float]:
    """Symbol → its total percent, from the text of speedscope's Sandwich table in `dom`."""
    return {m.group(5): float(m.group(2).lstrip("<")) for m in ROW.finditer(table_text(dom))}


def test_a_recording_opens_in_speedscope_with_its_functions(
    tmp_path: Path, ratio_workload: subprocess.Popen[bytes]
) -> None:
    require_root()
    r = subprocess.run(
        [PY, "-m", "cli.main", "record", "-d", "5", "--hz", "199", "-p", str(ratio_workload.pid), "-o", OUT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RECORD_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = (tmp_path / OUT).read_bytes()
    doc = json.loads(data)
    names = [p["name"] for p in doc["profiles"]]
    assert names and names[0].startswith("cpu ") and names[0].endswith(f" pid {ratio_workload.pid}"), names

    app = tmp_path / "app"
    shutil.copytree(speedscope_app(), app)
    (app / "profile.js").write_text(
        f"speedscope.loadFileFromBase64({json.dumps(OUT)}, {json.dumps(base64.b64encode(data).decode())})\n"
    )
    page = f"file://{app}/index.html#localProfilePath={app}/profile.js&view=sandwich"
    dom = chromium("--dump-dom", page, cwd=tmp_path).stdout
    assert "<title>out - speedscope</title>" in dom, dom[:2000]  # the file's own name, "out"
    assert names[0] in html.unescape(dom)
    rows = sandwich_rows(dom)
    # Every function the file gives 5% or more of the total is in speedscope's table, at that share
    # where its row is read (the table shows 2-3 digits): the viewer read every stack.
    functions = {f["name"] for f in doc["shared"]["frames"]}
    ours = {name: 100 * share(doc, name) for name in functions}
    big = {name: pct for name, pct in ours.items() if pct >= 5.0}
    print(f"speedscope's table: {[(n, rows.get(n)) for n in big]}; the file's shares: {big}")
    assert {"main", "heavy", "light"} <= set(big), big
    table = table_text(dom)
    for name, pct in big.items():
        assert re.search(rf"(^| ){re.escape(name)}( |$)", table), (name, pct, table[:2000])
        if name in rows:  # a row the regular expression reads (the selected row is drawn otherwise)
            assert abs(rows[name] - pct) <= max(1.0, pct * 0.02), (name, rows[name], pct)
    assert {"heavy", "light"} <= set(rows), rows


def share(doc: dict, name: str) -> float:
    """The share of the first profile's weight in stacks through the frame `name`."""
    prof = doc["profiles"][0]
    ids = {i for i, f in enumerate(doc["shared"]["frames"]) if f["name"] == name}
    through = sum(w for s, w in zip(prof["samples"], prof["weights"]) if ids & set(s))
    return through / sum(prof["weights"])
