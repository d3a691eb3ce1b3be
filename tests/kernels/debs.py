"""Debian's kernel packages for the kernel matrix, fetched with a side apt state and cached.

Owns: the suites of the matrix and, per suite, an apt state of its own under
CACHE/kernels/apt-SUITE (its own sources list naming only that suite, marked
[trusted=yes], Valid-Until not checked: sid's Release files may be past it),
choosing the suite's newest kernel (the one its linux-image-amd64 depends on),
and downloading that kernel's image, its headers (-amd64 and -common) and the
linux-kbuild package they depend on into CACHE/kernels/debs-VERSION.

Must not: touch the host's apt sources or state, install anything on the host,
or name a mirror: the mirror is the host's own (bench/assets/debroot.py's
debian_mirror()).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.assets.debroot import CACHE, debian_mirror, run_killing_group

KERNEL_CACHE = CACHE / "kernels"
# suite name of the matrix → the Debian suite whose kernel it boots
SUITES: dict[str, str] = {
    "bullseye": "bullseye",
    "bookworm": "bookworm",
    "bookworm-backports": "bookworm-backports",
    "trixie": "trixie",
    "sid": "sid",
}
# `apt-get update` of one suite fetches ~10 MB of indexes; 600 s bounds a stuck mirror.
APT_UPDATE_TIMEOUT_S = 600
# Four debs, ~120 MB together; 900 s bounds a slow mirror.
DOWNLOAD_TIMEOUT_S = 900
# `apt-cache` reads local indexes only.
APT_CACHE_TIMEOUT_S = 60
# The indexes of a suite are fetched again when older than this (a new kernel may have landed).
INDEX_MAX_AGE_S = 24 * 3600


@dataclass(frozen=True)
class KernelDebs:
    """One suite's kernel: its release string (uname -r), the image package's version and the .deb
    files: the image (with the parts newer suites split it into: linux-binary-, linux-modules-,
    linux-base-RELEASE), the headers (-amd64 and -common) and linux-kbuild."""

    suite: str
    release: str  # e.g. 6.1.0-41-amd64
    version: str  # the image package's Debian version
    debs: tuple[Path, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "suite": self.suite,
            "release": self.release,
            "version": self.version,
            "debs": [str(d) for d in self.debs],
        }

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> KernelDebs:
        debs = doc["debs"]
        assert isinstance(debs, list), debs
        return cls(
            suite=str(doc["suite"]),
            release=str(doc["release"]),
            version=str(doc["version"]),
            debs=tuple(Path(str(d)) for d in debs),
        )


def apt_options(suite: str) -> list[str]:
    """apt-get/apt-cache options for the side state of `suite` (made if missing)."""
    state = KERNEL_CACHE / f"apt-{suite}"
    for d in ("state/lists/partial", "cache/archives/partial", "etc/sources.list.d", "etc/preferences.d"):
        (state / d).mkdir(parents=True, exist_ok=True)
    sources = state / "etc/sources.list"
    sources.write_text(f"deb [trusted=yes] {debian_mirror(suite)} {suite} main\n")
    return [
        "-o",
        f"Dir::State={state / 'state'}",
        "-o",
        f"Dir::State::status={state / 'state/status'}",
        "-o",
        f"Dir::Etc::SourceList={sources}",
        "-o",
        f"Dir::Etc::SourceParts={state / 'etc/sources.list.d'}",
        "-o",
        f"Dir::Etc::Preferences={state / 'etc/preferences'}",
        "-o",
        f"Dir::Etc::PreferencesParts={state / 'etc/preferences.d'}",
        "-o",
        f"Dir::Cache={state / 'cache'}",
        "-o",
        "Acquire::Check-Valid-Until=false",
        "-o",
        "Acquire::Retries=3",  # a mirror drops a download now and then
        "-o",
        "APT::Architecture=amd64",
        "-o",
        "APT::Architectures::=amd64",
        "-o",
        "Debug::NoLocking=1",
    ]


def _update(suite: str, log: Callable[[str], None]) -> None:
    state = KERNEL_CACHE / f"apt-{suite}"
    opts = apt_options(suite)
    (state / "state/status").touch()
    stamp = state / "updated"
    if stamp.exists() and time.time() - stamp.stat().st_mtime < INDEX_MAX_AGE_S:
        return
    log(f"apt-get update ({suite}, side state {state})")
    run_killing_group(["apt-get", *opts, "-q", "update"], APT_UPDATE_TIMEOUT_S, state / "update.log")
    stamp.touch()


def _show(suite: str, package: str) -> dict[str, str]:
    """The fields of the candidate version of `package` in `suite`'s side state."""
    out = subprocess.run(
        ["apt-cache", *apt_options(suite), "show", "--no-all-versions", package],
        capture_output=True,
        text=True,
        timeout=APT_CACHE_TIMEOUT_S,
    )
    if out.returncode != 0 or not out.stdout.strip():
        raise AssertionError(f"{suite}: no package {package}: {out.stderr.strip()[-500:]}")
    fields: dict[str, str] = {}
    key = ""
    for line in out.stdout.split("\n\n")[0].splitlines():
        if line[:1] in (" ", "\t") and key:
            fields[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _depends(fields: dict[str, str]) -> list[str]:
    """Package names of a Depends field (first alternative of each, version constraints dropped)."""
    names = []
    for item in fields.get("Depends", "").split(","):
        name = item.split("|")[0].strip().split(" ")[0].split(":")[0]
        if name:
            names.append(name)
    return names


def resolve(suite: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The package names and release of `suite`'s newest kernel: what its linux-image-amd64 and
    linux-headers-amd64 metapackages depend on (the kernel a user of that suite gets)."""
    _update(suite, log)
    image_meta = _depends(_show(suite, "linux-image-amd64"))
    image = next(n for n in image_meta if re.fullmatch(r"linux-image-[0-9].*-amd64(-unsigned)?", n))
    release = re.sub(r"^linux-image-|-unsigned$", "", image)
    headers = f"linux-headers-{release}"
    header_deps = _depends(_show(suite, headers))
    common = next(n for n in header_deps if n.startswith("linux-headers-") and n.endswith("-common"))
    kbuild = next(n for n in header_deps if n.startswith("linux-kbuild-"))
    image_fields = _show(suite, image)
    # sid splits the image into linux-binary-, linux-modules- and linux-base-RELEASE
    parts = [n for n in _depends(image_fields) if n.startswith("linux-") and n.endswith(f"-{release}")]
    return {
        "release": release,
        "version": image_fields["Version"],
        "packages": [image, *parts, headers, common, kbuild],
    }


def fetch(name: str, log: Callable[[str], None] = print) -> KernelDebs:
    """The debs of the matrix's kernel `name` (a key of SUITES), downloaded once and cached."""
    suite = SUITES[name]
    names = resolve(suite, log)
    out = KERNEL_CACHE / f"debs-{names['release']}-{names['version']}"
    manifest = out / "manifest.json"
    if manifest.exists():
        return KernelDebs.from_json(json.loads(manifest.read_text()))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    wanted: list[str] = names["packages"]
    log(f"downloading {suite}'s kernel {names['release']} ({names['version']}): {', '.join(wanted)}")
    # apt-get download writes into its working directory: env --chdir, under run_killing_group's timeout
    run_killing_group(
        ["env", f"--chdir={partial}", "apt-get", *apt_options(suite), "-q", "download", *wanted],
        DOWNLOAD_TIMEOUT_S,
        partial / "download.log",
    )
    debs = []
    for pkg in wanted:
        found = sorted(partial.glob(f"{pkg}_*.deb"))
        if len(found) != 1:
            raise AssertionError(f"{pkg}: expected one .deb in {partial}, found {[f.name for f in found]}")
        debs.append(out / found[0].name)
    kernel = KernelDebs(suite=suite, release=names["release"], version=names["version"], debs=tuple(debs))
    (partial / "manifest.json").write_text(json.dumps(kernel.to_json(), indent=1))
    partial.rename(out)
    return kernel


if __name__ == "__main__":
    import sys

    for n in sys.argv[1:] or list(SUITES):
        print(fetch(n))
