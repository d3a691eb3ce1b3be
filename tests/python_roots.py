"""The CPython interpreters the Python tests run: the host's 3.11, and 3.13, 3.14 and 3.15 from Debian sid
in a debootstrap root (a container stand-in: chrooted, its files found through /proc/<pid>/root).

Owns: the sid root (built once, cached by bench/assets/debroot.py), each interpreter's argv with the
path a copied script has as that interpreter sees it, reading the Python tests' received profiles, and
checking a sampled cpu_a:cpu_b split against the one tests/workloads/py_threads.py measured itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.assets.debroot import cached_root
from receiver.store import list_profiles
from shared import pprof

SID_VERSIONS = ("3.13", "3.14", "3.15")
SID_PACKAGES = [f"python{v}" for v in SID_VERSIONS]
# Bump when the way the sid root is built changes.
SID_RECIPE = 1
VERSIONS = ("3.11", *SID_VERSIONS)


def samples_by_pid(directory: Path, profile_type: str) -> dict[int, list[pprof.ReadSample]]:
    """The samples of every `profile_type` profile the reference receiver stored in `directory`, by pid."""
    by_pid: dict[int, list[pprof.ReadSample]] = {}
    for meta in list_profiles(str(directory)):
        if meta["type"] != profile_type:
            continue
        for s in pprof.read(Path(meta["path"]).read_bytes()).samples:
            by_pid.setdefault(int(s.labels.get("pid", 0)), []).append(s)
    return by_pid


def assert_split_is_the_workloads(version: str, a: int, b: int, output: str) -> None:
    """The samples' cpu_a:cpu_b split is the one py_threads.py measured in its own thread CPU time
    (its last line of `output`) ±10%. The loops are 3:1 by work; a host that runs them at unequal speeds
    per iteration moves the true split (CI saw 2.5 once on 3.15), and the profile must follow it."""
    spent = json.loads(output.strip().splitlines()[-1])["spent_ns"]
    measured = spent["cpu_a"] / max(spent["cpu_b"], 1)
    sampled = a / max(b, 1)
    said = f"{version}: cpu_a {a} / cpu_b {b} = {sampled:.2f} sampled, {measured:.2f} by the workload's clock"
    print(said)
    assert 0.9 * measured <= sampled <= 1.1 * measured, said


def sid_root() -> Path:
    root, _ = cached_root(
        "sid", SID_PACKAGES, SID_RECIPE, name="sid-python", log=lambda m: print(f"python roots: {m}", flush=True)
    )
    return root


def interpreters(script: Path, work: Path, root: Path, inside: Path) -> dict[str, tuple[list[str], str]]:
    """version → (the interpreter's argv, `script` as it sees it): 3.11 on the host with the script copied
    to `work`, 3.13, 3.14 and 3.15 chrooted in the sid root with the script in `inside` there (the caller
    removes `inside` when done)."""
    (root / inside.relative_to("/")).mkdir(parents=True, exist_ok=True)
    shutil.copy(script, root / inside.relative_to("/") / script.name)
    host_copy = work / script.name
    shutil.copy(script, host_copy)
    argvs = {"3.11": (["/usr/bin/python3.11"], str(host_copy))}
    for v in SID_VERSIONS:
        argvs[v] = (["chroot", str(root), f"/usr/bin/python{v}"], str(inside / script.name))
    return argvs
