"""The guest's disk for the kernel matrix: one Debian 12 root holding every kernel of the run.

Owns: the base root (a bookworm minbase from bench/assets/debroot.py's cached_root,
with bcc, the compilers and the test tools: bpftool, gcc, python3), a cached
copy of it with each kernel's modules and header trees unpacked
(/lib/modules/RELEASE/build pointing at that release's tree) and the
project's venv; at every run, the current working tree copied to GUEST_PROJECT
and the project's set-up run again there (idempotent), the guest's init placed
at GUEST_INIT, and an ext4 image of the whole root (mke2fs -d).

Must not: change the host outside CACHE, patch the agent's code, or change any
kernel setting of a guest (the guest init mounts file systems and runs the
smoke suite; sysctls and rlimits stay as the kernel gives them).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.assets.debroot import cached_root, run_killing_group
from tests.kernels.debs import KERNEL_CACHE, KernelDebs
from tests.kernels.guest_smoke import GUEST_PLAN

REPO = Path(__file__).resolve().parents[2]
# The base root's packages: what the lean set-up installs (bcc, python3-venv and what python-prctl
# builds with), so its apt step finds them, plus the smoke suite's tools (bpftool, gcc, procps).
BASE_PACKAGES = [
    "python3-bpfcc",
    "python3-venv",
    "python3-dev",
    "libcap-dev",
    "gcc",
    "libc6-dev",
    "make",
    "bpftool",
    "ca-certificates",
    "procps",
    "kmod",
]
# Bump when the base root's recipe changes (cached_root keys on it).
BASE_RECIPE = 1
# Bump when what prepare_root() adds to the base changes (the kernels' root is keyed on it).
KERNELS_RECIPE = 1
# The host's CA bundle (pip's, unless PIP_CERT names another), and where the root gets a copy for its pip.
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
GUEST_PIP_CERT = "/etc/ktest/host-ca.crt"
# Where the guest finds the project (the working tree as it is at each run), and its init.
GUEST_PROJECT = "/opt/ebpfprofiler"
GUEST_INIT = f"{GUEST_PROJECT}/tests/kernels/guest_init.sh"
# What is not copied into the guest: git's objects, the host's venv (the guest makes its own), results.
COPY_EXCLUDES = [".git", "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache", ".pytest_cache", "build", "tmp"]
# Top-level entries of GUEST_PROJECT that the guest's set-up owns (kept from run to run).
KEPT_IN_GUEST = {".venv"}

# The project's set-up in the chroot: apt steps find their packages installed, pip fetches the pinned
# requirements once (~1 min); 900 s bounds a slow registry.
SETUP_TIMEOUT_S = 900
# Copying the working tree (a few MB) and small chroot steps.
SMALL_STEP_TIMEOUT_S = 300
# mke2fs -d of a ~3 GB tree: ~1 min here.
MKFS_TIMEOUT_S = 900
# Guest roots kept in the cache (the one in use and the last used other: CI's subset and a full run).
KEEP_ROOTS = 2
# Free space left in the image beyond the root's size (pip caches, BPF objects, the smoke's files).
IMAGE_SLACK_MB = 1024


def base_root(log: Callable[[str], None] = print) -> Path:
    root, built = cached_root("bookworm", BASE_PACKAGES, BASE_RECIPE, name="kernels-base", log=log)
    if built:
        log(f"built the base root {root}")
    return root


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Only one run at a time prepares (and images) the kernels' root."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _unpack(deb: Path, root: Path) -> None:
    """A .deb's files into root, through root's /lib → usr/lib link (a merged-/usr root), not over it."""
    with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE) as src:
        subprocess.run(
            ["tar", "-x", "--keep-directory-symlink", "-C", str(root)],
            stdin=src.stdout,
            check=True,
            timeout=SMALL_STEP_TIMEOUT_S,
        )
        if src.wait(SMALL_STEP_TIMEOUT_S) != 0:
            raise AssertionError(f"dpkg-deb --fsys-tarfile {deb} failed")


def _kernels_key(base: Path, kernels: list[KernelDebs]) -> str:
    keyed = [KERNELS_RECIPE, base.name, sorted([str(d) for d in k.debs] for k in kernels)]  # as in k.to_json()
    return hashlib.sha256(json.dumps(keyed, default=str).encode()).hexdigest()[:16]


def kernels_root(kernels: list[KernelDebs], log: Callable[[str], None] = print) -> Path:
    """The base root with every kernel's modules and headers (cached; keyed by the base and the debs)."""
    base = base_root(log)
    root = KERNEL_CACHE / f"root-{_kernels_key(base, kernels)}"
    if (root / ".complete").exists():
        os.utime(root / ".complete")  # its last use, for _prune
        return root
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    log(f"building the guest root {root} (the base and {len(kernels)} kernels)")
    try:
        _add_kernels(base, partial, kernels)
    except BaseException:  # a failed or interrupted build leaves nothing half made behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(root)
    _prune(keep=root, log=log)
    return root


def _add_kernels(base: Path, partial: Path, kernels: list[KernelDebs]) -> None:
    run_killing_group(
        ["cp", "-a", "--reflink=auto", str(base), str(partial)], SMALL_STEP_TIMEOUT_S, KERNEL_CACHE / "copy-base.log"
    )
    (partial / ".complete").unlink()
    for k in kernels:
        for deb in k.debs:
            _unpack(deb, partial)
        mods = partial / "usr/lib/modules" / k.release
        build = mods / "build"
        if not (build.is_symlink() or build.exists()):
            build.symlink_to(f"/usr/src/linux-headers-{k.release}")
        if not (partial / "usr/src" / f"linux-headers-{k.release}" / "Makefile").exists():
            raise AssertionError(f"{k.release}: no header tree at /usr/src/linux-headers-{k.release}")
        # the root's own depmod (kmod), as the image package's postinst would run it
        subprocess.run(["chroot", str(partial), "depmod", k.release], check=True, timeout=SMALL_STEP_TIMEOUT_S)
    (partial / ".complete").write_text(json.dumps([k.to_json() for k in kernels], indent=1))


def _prune(keep: Path, log: Callable[[str], None]) -> None:
    """Roots of older kernel sets (a new kernel in a suite, another --kernels choice): the KEEP_ROOTS
    most recently used stay, the others go (each is ~2 GB)."""
    roots = sorted(
        (r for r in KERNEL_CACHE.glob("root-*") if (r / ".complete").exists() and r != keep),
        key=lambda r: (r / ".complete").stat().st_mtime,
        reverse=True,
    )
    for old in roots[KEEP_ROOTS - 1 :]:
        log(
            f"removing the guest root {old} (not used since "
            f"{time.strftime('%Y-%m-%d', time.gmtime((old / '.complete').stat().st_mtime))})"
        )
        shutil.rmtree(old, ignore_errors=True)


def _copy_project(root: Path) -> None:
    """The working tree as it is now into the root's GUEST_PROJECT; what the guest's set-up made there
    (its venv, the editable install's metadata) stays."""
    dest = root / GUEST_PROJECT.lstrip("/")
    dest.mkdir(parents=True, exist_ok=True)
    for entry in dest.iterdir():
        if entry.name in KEPT_IN_GUEST or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    ignore = shutil.ignore_patterns(*COPY_EXCLUDES)
    for entry in REPO.iterdir():
        if entry.name in KEPT_IN_GUEST or ignore(str(REPO), [entry.name]):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(
                entry,
                dest / entry.name,
                symlinks=True,
                ignore=lambda d, names: ignore(d, names) | ({"results"} if Path(d) == REPO / "bench" else set()),
            )
        else:
            shutil.copy2(entry, dest / entry.name, follow_symlinks=False)


def setup_has_kernel_option() -> bool:
    """deploy/setup.sh takes --kernel VER (the lean set-up for another kernel than the running one)."""
    return "--kernel" in (REPO / "deploy/setup.sh").read_text()


def _host_pip_cert(root: Path) -> list[str]:
    """The host's CA bundle for pip (PIP_CERT, else the system's), copied into the root, as an env
    assignment: a host that reaches the package registry through a TLS proxy has that proxy's CA there,
    which the root's own bundle lacks."""
    host = Path(os.environ.get("PIP_CERT") or HOST_CA_BUNDLE)
    if not host.is_file():
        return []
    copy = root / GUEST_PIP_CERT.lstrip("/")
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(host, copy)
    return [f"PIP_CERT={GUEST_PIP_CERT}"]


def _chroot_setup(root: Path, releases: list[str], log: Callable[[str], None]) -> str:
    """The project's set-up inside the root; the command run."""
    mounts = []
    try:
        for fs, target in (("proc", "proc"), ("sysfs", "sys"), ("devtmpfs", "dev")):
            mounted = root / target
            subprocess.run(["mount", "-t", fs, fs, str(mounted)], check=True, timeout=SMALL_STEP_TIMEOUT_S)
            mounts.append(mounted)
        if setup_has_kernel_option():
            script = f"cd {GUEST_PROJECT} && bash deploy/setup.sh --kernel {','.join(releases)}"
        else:  # until deploy/setup.sh has --kernel: what the lean set-up would do, by hand
            script = (
                f"cd {GUEST_PROJECT} && bash deploy/users.sh && "
                "{ [ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv; } && "
                ".venv/bin/pip install -q -r requirements.txt && .venv/bin/pip install -q --no-deps -e . && "
                ".venv/bin/python -c 'import bcc, zmq, prctl, yaml, cli.main'"
            )
        log(f"setting up the project in the guest root: {script}")
        env_cmd = [
            "env",
            "-i",
            "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME=/root",
            "LANG=C.UTF-8",
            "DEBIAN_FRONTEND=noninteractive",
            "PIP_DISABLE_PIP_VERSION_CHECK=1",
            *_host_pip_cert(root),
        ]
        run_killing_group(
            [*env_cmd, "chroot", str(root), "bash", "-c", script], SETUP_TIMEOUT_S, KERNEL_CACHE / "setup.log"
        )
        return script
    finally:
        for m in reversed(mounts):
            subprocess.run(["umount", "-l", str(m)], timeout=SMALL_STEP_TIMEOUT_S)


def make_image(
    kernels: list[KernelDebs], image: Path, plan: dict[str, object], log: Callable[[str], None] = print
) -> dict[str, object]:
    """The guest disk at `image` with the current working tree installed and `plan` at GUEST_PLAN;
    what was done, for the results."""
    root = kernels_root(kernels, log)
    started = time.monotonic()
    with _locked(KERNEL_CACHE / "root.lock"):
        _copy_project(root)
        if not (root / GUEST_INIT.lstrip("/")).exists():
            raise AssertionError(f"{GUEST_INIT} missing in the guest root")
        setup = _chroot_setup(root, [k.release for k in kernels], log)
        (root / GUEST_PLAN.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / GUEST_PLAN.lstrip("/")).write_text(json.dumps(plan, indent=1))
        used = subprocess.run(
            ["du", "-sxm", str(root)], capture_output=True, text=True, check=True, timeout=SMALL_STEP_TIMEOUT_S
        ).stdout.split()[0]
        size_mb = int(used) * 11 // 10 + IMAGE_SLACK_MB
        log(f"making the guest disk {image} ({size_mb} MB, ext4) from {root}")
        image.unlink(missing_ok=True)
        run_killing_group(
            ["mke2fs", "-q", "-F", "-t", "ext4", "-L", "ktest-root", "-d", str(root), str(image), f"{size_mb}M"],
            MKFS_TIMEOUT_S,
            image.with_suffix(".mkfs.log"),
        )
    return {"root": str(root), "setup": setup, "image_mb": size_mb, "prepare_s": round(time.monotonic() - started, 1)}


def vmlinuz(root: Path, release: str) -> Path:
    """The kernel image: /boot/vmlinuz-RELEASE, or where sid's split packages put it (linux-binary-RELEASE:
    /usr/lib/modules/RELEASE/vmlinuz)."""
    for path in (root / "boot" / f"vmlinuz-{release}", root / "usr/lib/modules" / release / "vmlinuz"):
        if path.exists():
            return path
    raise AssertionError(f"no kernel image of {release} in {root}/boot or {root}/usr/lib/modules/{release}")


if __name__ == "__main__":
    print(base_root())
    os.sync()
