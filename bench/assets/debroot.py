"""Minimal Debian roots for the tests and bench, built with debootstrap once and cached.

Owns: the cache directory, the mirror (the host's own apt sources), and
building a root for a suite and package list into a directory named by a hash
of both, so a second run finds it and a changed list builds a new one.

Must not: start anything inside a root; the tests that use one do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

CACHE = Path("/var/cache/ebpfprofiler-test")
# debootstrap of a minbase root with a few packages takes ~40 s here; 600 s
# bounds a stuck mirror.
DEBOOTSTRAP_TIMEOUT_S = 600
# A mirror drops a download now and then ("Couldn't download packages: findutils"
# ended a CI run); three tries make that a retry instead of a failed run.
DEBOOTSTRAP_ATTEMPTS = 3


def debian_mirror(suite: str = "bookworm") -> str:
    """The first URI of the host's apt sources that serves `suite`, else the first Debian one
    (sid and trixie live on the same mirror as bookworm)."""
    fallback = ""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.MULTILINE))
            uris, suites = fields.get("URIs", "").split(), fields.get("Suites", "").split()
            if not uris:
                continue
            if suite in suites:
                return uris[0]
            if not fallback and "bookworm" in suites and uris[0].rstrip("/").endswith("/debian"):
                fallback = uris[0]
    if not fallback:
        raise AssertionError("no Debian mirror in /etc/apt/sources.list.d")
    return fallback


def run_killing_group(argv: list[str], timeout: float, log_path: Path) -> None:
    """Run argv in its own process group; on timeout kill that group (by its id) and fail."""
    with open(log_path, "w") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise AssertionError(f"{argv[0]} took over {timeout:.0f} s; log: {log_path}") from None
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert rc == 0, f"{' '.join(argv[:3])} … failed ({rc}):\n{log_path.read_text()[-3000:]}"


def _install_extra(root: Path, mirror: str, suite: str, packages: list[str], log_path: Path) -> None:
    (root / "etc/apt/sources.list.d").mkdir(parents=True, exist_ok=True)
    (root / f"etc/apt/sources.list.d/{suite}.list").write_text(f"deb {mirror} {suite} main\n")
    apt = ["chroot", str(root), "apt-get", "-o", "Acquire::Check-Valid-Until=false", "-o", "Acquire::Retries=3", "-y"]
    run_killing_group([*apt, "update"], DEBOOTSTRAP_TIMEOUT_S, log_path)
    run_killing_group(
        [*apt, "--no-install-recommends", "-t", suite, "install", *packages],
        DEBOOTSTRAP_TIMEOUT_S,
        log_path.with_suffix(".install.log"),
    )


def cached_root(
    suite: str,
    packages: list[str],
    recipe: int,
    name: str = "root",
    log: Callable[[str], None] = print,
    extra: tuple[str, list[str]] | None = None,
) -> tuple[Path, bool]:
    """(the root directory, whether it was built now). Built once per suite, package list and mirror.
    `extra` (suite, packages): then installed with apt inside the root from that suite (experimental is
    not a suite debootstrap can build; its Release file may be past Valid-Until, which apt is told
    to accept)."""
    packages = sorted(set(packages))
    mirror = debian_mirror(suite)
    keyed: list[object] = [recipe, suite, mirror, packages]
    if extra is not None:
        keyed.append([extra[0], sorted(set(extra[1]))])
    key = hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]
    root = CACHE / f"{name}-{key}"
    if (root / ".complete").exists():
        return root, False
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = CACHE / f"{name}-{key}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    log(f"building a {suite} root ({len(packages)} packages from {mirror}) into {root}")
    try:
        for attempt in range(1, DEBOOTSTRAP_ATTEMPTS + 1):
            try:
                run_killing_group(
                    [
                        "debootstrap",
                        "--variant=minbase",
                        f"--include={','.join(packages)}",
                        suite,
                        str(partial),
                        mirror,
                    ],
                    DEBOOTSTRAP_TIMEOUT_S,
                    CACHE / f"debootstrap-{name}-{key}.log",
                )
                if extra is not None:
                    _install_extra(partial, mirror, extra[0], sorted(set(extra[1])), CACHE / f"apt-{name}-{key}.log")
                break
            except AssertionError as e:
                if attempt == DEBOOTSTRAP_ATTEMPTS:
                    raise
                last = str(e).strip().splitlines()[-1] if str(e).strip() else "no output"
                log(f"{suite} root: try {attempt} of {DEBOOTSTRAP_ATTEMPTS} failed ({last}); building it again")
                shutil.rmtree(partial, ignore_errors=True)
        for deb in (partial / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        (partial / ".complete").write_text(json.dumps({"suite": suite, "mirror": mirror, "packages": packages}))
        try:
            partial.rename(root)
        except OSError:  # another run finished the same root first
            if not (root / ".complete").exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return root, True
