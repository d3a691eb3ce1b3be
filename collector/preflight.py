"""Preflight: can this host run the collector? Each cause named, with what to do about it.

Owns: the checks the collector makes before it loads anything — operating system, kernel version
(>= 5.8), the capabilities it holds, kernel.perf_event_paranoid against them, the memlock limit on
kernels that charge BPF maps to it, BTF, tracefs, the kernel header tree bcc compiles against
(missing, or another kernel's), bcc itself — and the kernel features it will do without
(collector/features.py), and their report. `ebpfprofiler run` runs them (as the collector, with
its capabilities) before it starts any stage; the collector runs them again at every start and
refuses to start with this report instead of a traceback.

Every check reads a file tree (`Host`), by default the running host's /proc, /sys and
/lib/modules; the unit tests give it trees recorded on Debian's kernels (tests/fixtures/kernels/).

Must not: change the host (no mounts, no installs, no sysctl) or import bcc (it only checks that
bcc can be found: importing it costs ~100 MB).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
from dataclasses import dataclass

from collector.features import KernelFeatures
from shared.privileges import (
    CAP_BPF,
    CAP_CHECKPOINT_RESTORE,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    CAP_SYS_RESOURCE,
    CAPABILITY_NAMES,
    COLLECTOR_CAPS,
)

MIN_KERNEL = (5, 8)
# kernel.perf_event_paranoid above this (Debian's and Ubuntu's kernels ship 3 and 4) refuses perf_event_open(2)
# to a process without CAP_SYS_ADMIN: their patch, not upstream's levels (-1 to 2).
PARANOID_MAX_WITHOUT_SYS_ADMIN = 2
RLIM_INFINITY = "unlimited"  # as /proc/PID/limits writes it

# What the collector needs each capability for: shared/privileges.py's table, which the stage's
# privilege drop keeps.
REQUIRED_CAPS: dict[int, tuple[str, str]] = {bit: (CAPABILITY_NAMES[bit], why) for bit, why in COLLECTOR_CAPS.items()}

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # OK, WARN (the agent runs without something), FAIL (it cannot start)
    detail: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.level != FAIL


@dataclass(frozen=True)
class Host:
    """Where the checks read: a root directory holding proc/, sys/ and lib/modules/ (the host's is "/")."""

    root: str = "/"

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel.lstrip("/"))

    def read(self, rel: str) -> str | None:
        try:
            with open(self.path(rel), errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def release(self) -> str:
        text = self.read("proc/sys/kernel/osrelease")
        return text.strip() if text else platform.release()

    def paranoid(self) -> int | None:
        text = self.read("proc/sys/kernel/perf_event_paranoid")
        try:
            return int(text) if text is not None else None
        except ValueError:
            return None

    def status_field(self, key: str) -> int:
        """A hexadecimal capability set of proc/self/status (CapEff, CapPrm), 0 if absent."""
        for line in (self.read("proc/self/status") or "").splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1], 16)
        return 0

    def memlock(self) -> tuple[str, str]:
        """(soft, hard) of "Max locked memory" in proc/self/limits: bytes, or "unlimited"."""
        for line in (self.read("proc/self/limits") or "").splitlines():
            if line.startswith("Max locked memory"):
                soft, hard = line[len("Max locked memory") :].split()[:2]
                return soft, hard
        return RLIM_INFINITY, RLIM_INFINITY

    def features(self) -> KernelFeatures | None:
        """Probe results recorded beside a tree (features.json), for the tests; None on a live host."""
        text = self.read("features.json")
        if text is None:
            return None
        from collector.features import resolve

        doc = json.loads(text)
        return resolve(doc["release"], doc["probes"], frozenset(doc.get("disabled", ())))


def _kernel_version(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def effective_caps(status_path: str = "/proc/self/status") -> int:
    with open(status_path) as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def check_caps(caps: int) -> list[Check]:
    out = []
    for bit, (name, why) in REQUIRED_CAPS.items():
        held = bool(caps >> bit & 1)
        # Before 5.8 CAP_SYS_ADMIN stood in for CAP_BPF and CAP_PERFMON, and
        # before 5.9 for CAP_CHECKPOINT_RESTORE.
        if not held and bit in (CAP_BPF, CAP_PERFMON, CAP_CHECKPOINT_RESTORE) and caps >> CAP_SYS_ADMIN & 1:
            held = True
        out.append(
            Check(
                f"capability {name}",
                OK if held else FAIL,
                f"needed to {why}",
                "" if held else f"run the collector as root, or grant {name} (systemd: AmbientCapabilities={name})",
            )
        )
    return out


def check_paranoid(paranoid: int | None, caps: int) -> Check:
    """kernel.perf_event_paranoid against the capabilities held: above 2 (Debian's and Ubuntu's default)
    perf_event_open(2) takes CAP_SYS_ADMIN, which the collector holds while it opens its perf events at
    start only (collector/perfevents.py)."""
    if paranoid is None:
        return Check("perf_event_paranoid", WARN, "kernel.perf_event_paranoid could not be read")
    if paranoid <= PARANOID_MAX_WITHOUT_SYS_ADMIN:
        return Check("perf_event_paranoid", OK, f"{paranoid}: CAP_PERFMON opens the perf events")
    if caps >> CAP_SYS_ADMIN & 1:
        return Check(
            "perf_event_paranoid",
            OK,
            f"{paranoid}: opening perf events takes CAP_SYS_ADMIN; the collector "
            "holds it while it opens them at start, then drops it",
        )
    return Check(
        "perf_event_paranoid",
        FAIL,
        f"{paranoid} (Debian's and Ubuntu's default): perf_event_open(2) needs CAP_SYS_ADMIN, and the "
        f"collector does not hold it",
        "run the collector as root (`ebpfprofiler run` does), or grant CAP_SYS_ADMIN to its unit "
        "(AmbientCapabilities= and CapabilityBoundingSet=, as deploy/systemd's unit does): it holds it "
        "only while it opens its perf events at start. Lowering the sysctl to 2 also works, for the "
        "whole host",
    )


def check_memlock(kernel: KernelFeatures | None, soft: str, hard: str, caps: int) -> Check:
    """Before 5.11 BPF maps are charged to RLIMIT_MEMLOCK: the collector raises it to unlimited at start
    (collector/main.py), which needs the hard limit unlimited or CAP_SYS_RESOURCE."""
    if kernel is not None and kernel.has("memcg_accounting"):
        return Check("memlock limit", OK, "BPF maps are charged to the memory cgroup, not to RLIMIT_MEMLOCK")
    if soft == RLIM_INFINITY:
        return Check("memlock limit", OK, "unlimited (this kernel charges BPF maps to RLIMIT_MEMLOCK)")
    if hard == RLIM_INFINITY or caps >> CAP_SYS_RESOURCE & 1:
        return Check(
            "memlock limit",
            OK,
            f"{soft} bytes; this kernel charges BPF maps to it, and the collector raises it to unlimited at start",
        )
    return Check(
        "memlock limit",
        FAIL,
        f"{soft} bytes (hard limit {hard}): this kernel charges BPF maps to RLIMIT_MEMLOCK (before Linux "
        "5.11), and the collector cannot raise it",
        "run the collector as root, or with LimitMEMLOCK=infinity (systemd; deploy/systemd's unit sets "
        "it), or `ulimit -l unlimited` before starting it",
    )


def check_headers(host: Host, release: str) -> Check:
    """The header tree bcc compiles against: /lib/modules/RELEASE/build, which must exist, and should be
    this kernel's (include/generated/utsrelease.h names its release)."""
    build = f"/lib/modules/{release}/build"
    trees = [d for d in (build, f"/lib/modules/{release}/source") if host.exists(f"{d}/include/linux/kconfig.h")]
    if not trees:
        return Check(
            "kernel headers",
            FAIL,
            f"{build} has no header tree",
            f"apt-get install linux-headers-{release}, or run `deploy/setup.sh` (it installs them, or "
            "links Debian's newest header tree in their place)",
        )
    # Debian splits a tree in two: build (generated files, utsrelease.h) and source (kconfig.h and the rest)
    uts = next(
        (
            t
            for t in (
                host.read(f"{d}/include/generated/utsrelease.h") for d in (build, f"/lib/modules/{release}/source")
            )
            if t
        ),
        "",
    )
    m = re.search(r'UTS_RELEASE\s+"([^"]+)"', uts)
    if m and m.group(1) != release:
        return Check(
            "kernel headers",
            WARN,
            f"{build} is the header tree of {m.group(1)}, not of {release}: bcc compiles against it; the "
            "programs read kernel structures through the running kernel's BTF, but a struct whose "
            "layout changed between the two is read wrong",
            f"install linux-headers-{release} if your distribution has it",
        )
    return Check("kernel headers", OK, f"{build} has {release}'s header tree" if m else f"{build} has a header tree")


def check_features(kernel: KernelFeatures | None) -> list[Check]:
    """One line per kernel feature the agent will do without (it runs, without that one)."""
    if kernel is None:
        return []
    return [
        Check(f"kernel feature {f.spec.name}", WARN, f"missing ({f.why}; {f.spec.since}): {f.spec.without}")
        for f in kernel.missing()
    ]


def run_checks(host: Host | None = None, kernel: KernelFeatures | None = None) -> list[Check]:
    """Every check, on `host` (the running one by default) with the kernel features probed there (`kernel`;
    a recorded tree carries its own)."""
    host = host or Host()
    system = platform.system()
    if system != "Linux":
        return [Check("operating system", FAIL, f"{system} is unsupported", "ebpfprofiler runs on Linux 5.8 or newer")]
    kernel = host.features() or kernel
    release = host.release()
    version = _kernel_version(release)
    new_enough = version >= MIN_KERNEL
    checks = [
        Check(
            "kernel version",
            OK if new_enough else FAIL,
            f"{release} (need {MIN_KERNEL[0]}.{MIN_KERNEL[1]} or newer)",
            "" if new_enough else "upgrade the kernel to 5.8 or newer",
        )
    ]
    btf = host.exists("sys/kernel/btf/vmlinux")
    checks.append(
        Check(
            "BTF",
            OK if btf else WARN,
            "/sys/kernel/btf/vmlinux "
            + ("present" if btf else "missing: no off-CPU profiles (their programs need BTF)"),
            "" if btf else "use a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        )
    )
    caps = host.status_field("CapEff")
    checks += check_caps(caps)
    checks.append(check_paranoid(host.paranoid(), caps))
    checks.append(check_memlock(kernel, *host.memlock(), caps))
    tracefs = next((p for p in ("sys/kernel/tracing", "sys/kernel/debug/tracing") if host.exists(f"{p}/events")), None)
    checks.append(
        Check(
            "tracefs",
            OK if tracefs else FAIL,
            f"mounted at /{tracefs}" if tracefs else "not mounted",
            "" if tracefs else "mount -t tracefs tracefs /sys/kernel/tracing (deploy/setup.sh does)",
        )
    )
    checks.append(check_headers(host, release))
    bcc = importlib.util.find_spec("bcc") is not None
    checks.append(
        Check(
            "bcc",
            OK if bcc else FAIL,
            "python module bcc " + ("found" if bcc else "not found"),
            ""
            if bcc
            else "apt-get install python3-bpfcc and use a venv with --system-site-packages (deploy/setup.sh does)",
        )
    )
    checks += check_features(kernel)
    return checks


# What record() copies of a host: every file the checks read, as it is (the capability sets and limits are
# the reading process's: the collector's, after its privilege drop).
RECORDED_FILES = (
    "proc/sys/kernel/osrelease",
    "proc/sys/kernel/perf_event_paranoid",
    "proc/self/status",
    "proc/self/limits",
)


def record(dest: str, kernel: KernelFeatures | None, host: Host | None = None) -> None:
    """Write into `dest` the tree run_checks() reads on `host` (its files; empty stand-ins for the BTF, tracefs
    and header-tree files whose presence it checks, with the header tree's utsrelease.h), and the features
    probed (features.json): a host's preflight, replayable elsewhere (tests/fixtures/kernels/)."""
    host = host or Host()
    release = host.release()
    for rel in RECORDED_FILES:
        text = host.read(rel)
        if text is not None:
            _write(dest, rel, text)
    marks = ["sys/kernel/btf/vmlinux", "sys/kernel/tracing/events", "sys/kernel/debug/tracing/events"]
    for tree in (f"lib/modules/{release}/build", f"lib/modules/{release}/source"):
        marks.append(f"{tree}/include/linux/kconfig.h")
        uts = host.read(f"{tree}/include/generated/utsrelease.h")
        if uts is not None:
            _write(dest, f"{tree}/include/generated/utsrelease.h", uts)
    for rel in marks:
        if host.exists(rel):
            _write(dest, rel, "")
    if kernel is not None:
        _write(dest, "features.json", json.dumps(kernel.to_json(), indent=1, sort_keys=True) + "\n")


def _write(dest: str, rel: str, text: str) -> None:
    path = os.path.join(dest, rel)
    if rel.endswith("/events"):  # a directory on the host: kept with a file in it (git keeps no empty one)
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, ".present"), "w").close()
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def report(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        tag = {OK: "ok  ", WARN: "warn", FAIL: "FAIL"}[c.level]
        lines.append(f"{tag} {c.name}: {c.detail}" + (f"\n     fix: {c.fix}" if c.fix and c.level != OK else ""))
    failed = [c.name for c in checks if c.level == FAIL]
    lines.append("preflight: " + ("ready" if not failed else f"{len(failed)} problem(s): {', '.join(failed)}"))
    return "\n".join(lines)


def passed(checks: list[Check]) -> bool:
    return all(c.ok for c in checks)
