"""The stages' code where their users can read it, wherever root keeps the checkout.

Owns: finding out whether the agent's users can read what a stage imports
after it drops privileges (this project's packages, the BPF sources, the
non-standard sys.path entries such as a venv's site-packages), and when they
cannot (a clone under root's 0700 home), a view of that code in a root-owned
directory they can read: the packages copied (they are small), each
unreadable sys.path entry hard-linked file by file (copied across file
systems). A stage is then started with PYTHONPATH pointing into the view, so
Python's path finder finds the packages there before the editable
install's path entry points it back at the checkout.

Used by the root launchers only (`ebpfprofiler run`, `ebpfprofiler record`,
the test harness), before any stage starts.

Must not: change the mode of anything outside the view, or make the view
writable by the agent's users (a stage could then plant code for another).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field

from shared import privileges


def default_bpf_dir() -> str:
    """bpf/ beside the packages when run from a checkout (or from a view of one), else the installed
    copy. Here, not in the collector, so that the launchers need not import the collector."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bpf")
    return os.environ.get("EBPFPROFILER_BPF_DIR") or (
        here if os.path.isfile(os.path.join(here, "oncpu.c")) else "/usr/lib/ebpfprofiler/bpf"
    )


# The top-level packages of pyproject.toml ([tool.setuptools] packages).
PACKAGES = ("cli", "collector", "symbolizer", "uploader", "receiver", "runtimes", "shared", "report")
# Copied with neither bytecode caches nor editor leftovers.
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
# How long the access check as the agent's user may take (one sh running `test`).
ACCESS_CHECK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class StageCode:
    """How to start a stage so that it can import its code after dropping privileges."""

    bpf_dir: str
    pythonpath: tuple[str, ...] = field(default=())  # empty: the launcher's own sys.path is readable

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(self.pythonpath)
        return env


def package_dirs() -> dict[str, str]:
    """<name> → the directory the package is imported from."""
    out = {}
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"package {name} is not importable: run `make setup`")
        out[name] = os.path.realpath(next(iter(spec.submodule_search_locations)))
    return out


def import_path_entries() -> list[str]:
    """The sys.path directories beyond the standard library (a venv's site-packages, dist-packages)."""
    base = {
        "base": sys.base_prefix,
        "platbase": sys.base_exec_prefix,
        "installed_base": sys.base_prefix,
        "installed_platbase": sys.base_exec_prefix,
    }
    # The interpreter's own library (not a venv's lib/, which holds its site-packages).
    stdlib = {os.path.realpath(sysconfig.get_paths(vars=base)[k]) for k in ("stdlib", "platstdlib")}
    out = []
    script_dir = os.path.dirname(os.path.realpath(sys.argv[0])) if sys.argv and sys.argv[0] else None
    for entry in sys.path:
        # the launcher's script directory (a venv's bin/) is not what a stage started with -m imports
        if not entry or not os.path.isdir(entry) or os.path.realpath(entry) == script_dir:
            continue
        real = os.path.realpath(entry)
        if real in stdlib or any(real.startswith(s + os.sep) for s in stdlib) or real in out:
            continue
        out.append(real)
    return out


def unreadable_by_agent(paths: list[str], stage: str = "uploader") -> list[str]:
    """The paths of `paths` that `stage`'s user (in the agent's group) cannot read and enter.

    Asked of the kernel: a shell runs `test -r` as that user, so ancestors' modes and ACLs count."""
    if os.geteuid() != 0 or not paths:
        return []
    uid, gid = privileges.ids(stage)
    script = 'for p do [ -r "$p" ] && { [ ! -d "$p" ] || [ -x "$p" ]; } || printf "%s\\0" "$p"; done'
    r = subprocess.run(
        ["/bin/sh", "-c", script, "sh", *paths],
        check=False,  # its output names the unreadable paths; its status says nothing more
        user=uid,
        group=gid,
        extra_groups=[gid],
        capture_output=True,
        timeout=ACCESS_CHECK_TIMEOUT_S,
        cwd="/",
    )
    return [p for p in r.stdout.decode(errors="replace").split("\0") if p]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def prepare(view_dir: str, bpf_dir: str) -> StageCode:
    """A StageCode whose code the agent's users can import, building a view under `view_dir` if needed.

    `view_dir` is replaced whole; its parent must be root's and not writable by the agent's users."""
    packages = package_dirs()
    entries = import_path_entries()
    bpf_dir = os.path.realpath(bpf_dir)
    blocked = set(unreadable_by_agent(sorted(set(packages.values()) | set(entries) | {bpf_dir})))
    if not blocked:
        return StageCode(bpf_dir=bpf_dir)
    gid = privileges.ids("uploader")[1]
    new = f"{view_dir}.new-{os.getpid()}"
    shutil.rmtree(new, ignore_errors=True)
    os.makedirs(new, mode=0o750)
    for name, src in packages.items():
        shutil.copytree(src, os.path.join(new, name), ignore=_IGNORE, symlinks=True)
    # where default_bpf_dir() looks beside the packages, as in a checkout
    shutil.copytree(bpf_dir, os.path.join(new, "bpf"), ignore=_IGNORE)
    path = [new]
    for i, entry in enumerate(e for e in entries if e in blocked):
        dst = os.path.join(new, f"path{i}")
        # The editable install's finder would send imports back to the checkout.
        shutil.copytree(
            entry,
            dst,
            copy_function=_link_or_copy,
            symlinks=True,
            ignore=shutil.ignore_patterns("__editable__*", "__pycache__"),
        )
        path.append(dst)
    for root, _dirs, files in os.walk(new):
        os.chown(root, 0, gid)
        os.chmod(root, 0o750)
        if not root.startswith(os.path.join(new, "path")):  # copies, not links: theirs to set
            for f in files:
                os.chown(os.path.join(root, f), 0, gid)
                os.chmod(os.path.join(root, f), 0o640)
    shutil.rmtree(view_dir, ignore_errors=True)
    os.rename(new, view_dir)
    renamed = [view_dir + p[len(new) :] for p in path]
    still = unreadable_by_agent(renamed)
    if still:
        raise privileges.PrivilegeError(
            f"the stages' users cannot read {still[0]} even in the code view; "
            f"is {os.path.dirname(view_dir)} readable by group {privileges.AGENT_GROUP}?"
        )
    return StageCode(bpf_dir=os.path.join(view_dir, "bpf"), pythonpath=tuple(renamed))
