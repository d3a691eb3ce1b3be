"""Preflight: can this host run the collector? Each missing thing named, with its fix.

Owns: the checks the collector makes before it loads anything — operating
system, kernel version (>= 5.8), BTF, the capabilities it holds, tracefs, a
kernel header tree for bcc, bcc itself — and their report. The collector runs
them at start and refuses to start with this report instead of a traceback.

Must not: change the host (no mounts, no installs) or import bcc (it only
checks that bcc can be found: importing it costs ~100 MB).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
from dataclasses import dataclass

from ebpfprofiler.shared.privileges import (CAP_BPF, CAP_CHECKPOINT_RESTORE, CAPABILITY_NAMES, CAP_PERFMON,
                                            CAP_SYS_ADMIN, COLLECTOR_CAPS)

MIN_KERNEL = (5, 8)

# What the collector needs each capability for: shared/privileges.py's table, which the stage's
# privilege drop keeps.
REQUIRED_CAPS: dict[int, tuple[str, str]] = {bit: (CAPABILITY_NAMES[bit], why) for bit, why in COLLECTOR_CAPS.items()}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


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
        out.append(Check(f"capability {name}", held, f"needed to {why}",
                         "" if held else f"run the collector as root, or grant {name} "
                                         f"(systemd: AmbientCapabilities={name})"))
    return out


def run_checks(proc: str = "/proc", sys_dir: str = "/sys") -> list[Check]:
    system = platform.system()
    if system != "Linux":
        return [Check("operating system", False, f"{system} is unsupported",
                      "ebpfprofiler runs on Linux 5.8 or newer")]
    release = platform.release()
    version = _kernel_version(release)
    checks = [Check("kernel version", version >= MIN_KERNEL, f"{release} (need {MIN_KERNEL[0]}.{MIN_KERNEL[1]} or newer)",
                    "" if version >= MIN_KERNEL else "upgrade the kernel to 5.8 or newer")]
    btf = os.path.exists(f"{sys_dir}/kernel/btf/vmlinux")
    checks.append(Check("BTF", btf, f"{sys_dir}/kernel/btf/vmlinux " + ("present" if btf else "missing"),
                        "" if btf else "use a kernel built with CONFIG_DEBUG_INFO_BTF=y"))
    checks += check_caps(effective_caps(f"{proc}/self/status"))
    tracefs = next((p for p in (f"{sys_dir}/kernel/tracing", f"{sys_dir}/kernel/debug/tracing")
                    if os.path.exists(f"{p}/events")), None)
    checks.append(Check("tracefs", tracefs is not None, f"mounted at {tracefs}" if tracefs else "not mounted",
                        "" if tracefs else "mount -t tracefs tracefs /sys/kernel/tracing (make setup does)"))
    build = f"/lib/modules/{release}/build"
    headers = any(os.path.exists(os.path.join(d, "include/linux/kconfig.h"))
                  for d in (build, f"/lib/modules/{release}/source"))
    checks.append(Check("kernel headers", headers, f"{build} " + ("has a header tree" if headers else "has none"),
                        "" if headers else f"apt-get install linux-headers-{release}, or run make setup "
                                           "(it links Debian's newest header tree in its place)"))
    bcc = importlib.util.find_spec("bcc") is not None
    checks.append(Check("bcc", bcc, "python module bcc " + ("found" if bcc else "not found"),
                        "" if bcc else "apt-get install python3-bpfcc and use a venv with "
                                       "--system-site-packages (make setup does)"))
    return checks


def report(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" + ("" if c.ok else f"\n     fix: {c.fix}"))
    failed = [c.name for c in checks if not c.ok]
    lines.append("preflight: " + ("ready" if not failed else f"{len(failed)} problem(s): {', '.join(failed)}"))
    return "\n".join(lines)


def passed(checks: list[Check]) -> bool:
    return all(c.ok for c in checks)
