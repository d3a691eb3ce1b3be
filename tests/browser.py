"""Headless Chromium (Debian's, installed by make test-setup) for the tests of our pages.

Owns: starting Chromium on a page with the options the report tests need, the frame clock the pages
are given, and running a page with a drive script of a test's own that writes what it saw into the DOM
(a <pre id="drive-result"> of JSON, read back from --dump-dom).

Must not: start anything but Chromium, or wait for anything but its exit (its --virtual-time-budget ends it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

BROWSER_TIMEOUT_S = 120
# Virtual time the page gets: a drive script polls at most 10 s each for a few steps (drawing, redraws).
VIRTUAL_TIME_MS = 50000

# Headless Chromium under a virtual time budget does not run animation frames dependably (a click's
# redraw, a d3 transition even of 0 ms, waited on a requestAnimationFrame that, in about one run of
# ten here, never came). The drive gives the page a frame clock of timers, as a display would tick it,
# before any of the report's scripts load.
FRAME_CLOCK = """<script>
window.requestAnimationFrame = function (cb) { return setTimeout(function () { cb(performance.now()); }, 16); };
window.cancelAnimationFrame = function (id) { clearTimeout(id); };
</script>
"""


def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    assert exe, "chromium is not installed: make test-setup installs it (deploy/setup.sh TEST_PACKAGES)"
    # Reduced motion: the report then draws without transitions, whose animation frames a loaded CI
    # host's headless Chromium stalled once mid-way (a zoom that never finished in 10 s of virtual time).
    return subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--force-prefers-reduced-motion",
            "--run-all-compositor-stages-before-draw",
            "--disable-extensions",
            f"--user-data-dir={cwd / 'chromium-profile'}",
            "--window-size=1400,900",
            f"--virtual-time-budget={VIRTUAL_TIME_MS}",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=BROWSER_TIMEOUT_S,
    )


def drive(page: str, script: str, directory: Path) -> tuple[Any, Path]:
    """`page` with the frame clock and `script` (a <script> that ends by appending <pre id="drive-result">
    of JSON) added, as driven.html in `directory`, run in Chromium: (the JSON, the driven page)."""
    driven = directory / "driven.html"
    first_script = page.index("<script")
    driven.write_text(page[:first_script] + FRAME_CLOCK + page[first_script:].replace("</body>", script + "</body>"))
    dom = chromium("--dump-dom", driven.as_uri(), cwd=directory)
    m = re.search(r'<pre id="drive-result">(.*?)</pre>', dom.stdout, re.S)
    assert m, f"the page did not run: {dom.stderr[-3000:]}"
    got = json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    return got, driven
