"""Booting one Debian kernel under qemu on the guest disk, with a deadline, keeping its serial log.

Owns: the initrd (a busybox cpio that loads the kernel's own virtio and ext4
modules, found through its modules.dep, mounts the disk and switches to the
guest init), choosing the accelerator (KVM only when a stock kernel is seen to
boot with it; TCG otherwise), the qemu command line, the host-side deadline
that kills qemu, and reading what the guest reported: the console log
(ttyS0, kept whole) and the results port (ttyS1: one marked JSON line per
result).

Must not: pass the kernel anything that changes what the agent meets (no
sysctl, no rlimit, no kernel option beyond the console, the root disk, `quiet`
as Debian's boot loader sets it, and rebooting at once on a panic so a panic
ends the run), or write to the guest disk (qemu's -snapshot discards writes).
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.kernels.guest_smoke import RESULT_MARK
from tests.kernels.guestroot import GUEST_INIT

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static: runs in the initrd without libraries
# What the initrd loads (with their dependencies from modules.dep): the disk and its file system.
REQUIRED_MODULES = ["virtio_pci", "virtio_blk", "ext4"]
# Loaded when the kernel has them as modules: ext4's checksums and a guest entropy source.
OPTIONAL_MODULES = ["crc32c_generic", "crc32c_intel", "virtio_rng"]
# Guest size, as the measurements were taken.
GUEST_MEMORY = "4G"
GUEST_CPUS = "2"
# The KVM probe: a stock kernel that boots prints its banner within this; TCG is used if not.
KVM_PROBE_TIMEOUT_S = 60
# How often the host reads the serial logs while a guest runs (progress lines, the end marker).
POLL_S = 2.0
# Lines of a panic or oops kept in the results (the whole log is kept beside them).
PANIC_CONTEXT_LINES = 40
# A guest whose serial logs stay unchanged this long has hung (one was seen to stop for good in
# `record`'s start-up, with no panic): every step in it ends by its own deadline (the longest,
# `record`'s, 510 s), and the agent's start-up says a line every 10 s: no working guest is this silent.
SILENT_S = 600.0


@dataclass
class BootResult:
    release: str
    accel: str
    seconds: float
    timed_out: bool
    exit_code: int | None
    console_log: Path
    results: list[dict] = field(default_factory=list)
    panics: list[str] = field(default_factory=list)
    qemu_said: str = ""  # the last of qemu's own output (why it would not start)
    silent: bool = False  # killed after SILENT_S with nothing new on either serial port


def _module_paths(moddir: Path) -> tuple[dict[str, str], dict[str, list[str]], set[str]]:
    """(module name → relative path, relative path → dependencies, names built in) of one kernel."""
    deps: dict[str, list[str]] = {}
    names: dict[str, str] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
        names[_name(mod)] = mod
    builtin = {_name(line) for line in (moddir / "modules.builtin").read_text().split()}
    return names, deps, builtin


def _name(path: str) -> str:
    base = os.path.basename(path)
    return re.sub(r"\.ko(\.(xz|zst|gz))?$", "", base).replace("-", "_")


def _load_order(moddir: Path) -> list[str]:
    names, deps, builtin = _module_paths(moddir)
    order: list[str] = []

    def visit(mod: str) -> None:
        if mod in order:
            return
        for d in deps.get(mod, []):
            visit(d)
        order.append(mod)

    for n in REQUIRED_MODULES:
        if n in names:
            visit(names[n])
        elif n not in builtin:
            raise AssertionError(f"{moddir.name}: {n} is neither a module nor built in")
    for n in OPTIONAL_MODULES:
        if n in names:
            visit(names[n])
    return order


def _decompressed(path: Path) -> bytes:
    if path.suffix == ".xz":
        return lzma.decompress(path.read_bytes())
    if path.suffix == ".zst":
        return subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True, timeout=60).stdout
    if path.suffix == ".gz":
        import gzip

        return gzip.decompress(path.read_bytes())
    return path.read_bytes()


INIT_SCRIPT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "initrd: loading $(wc -l < /modules/order) modules"
while read m; do insmod "/modules/$m" || echo "initrd: insmod $m failed"; done < /modules/order
# the disk appears once virtio_blk has probed it: poll, 30 s at most
i=0
while [ ! -b /dev/vda ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /newroot
if ! mount -t ext4 /dev/vda /newroot; then
    echo "initrd: cannot mount /dev/vda"; ls /dev; cat /proc/modules
    echo o > /proc/sysrq-trigger
fi
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot @INIT@
"""


def make_initrd(root: Path, release: str, out: Path) -> list[str]:
    """A cpio initrd for `release` at `out`; the modules it loads, in order."""
    moddir = root / "usr/lib/modules" / release
    order = _load_order(moddir)
    with tempfile.TemporaryDirectory(prefix="ktest-initrd-") as tmp:
        t = Path(tmp)
        for d in ("bin", "proc", "sys", "dev", "modules", "newroot"):
            (t / d).mkdir()
        shutil.copy2(BUSYBOX, t / "bin/busybox")
        names = []
        for i, mod in enumerate(order):
            name = f"{i:02d}-{_name(mod)}.ko"
            (t / "modules" / name).write_bytes(_decompressed(moddir / mod))
            names.append(name)
        (t / "modules/order").write_text("".join(n + "\n" for n in names))
        init = t / "init"
        init.write_text(INIT_SCRIPT.replace("@INIT@", GUEST_INIT))
        init.chmod(0o755)
        files = subprocess.run(["find", "."], cwd=t, capture_output=True, text=True, check=True).stdout
        with open(out, "wb") as f:
            subprocess.run(
                ["cpio", "-o", "-H", "newc", "--quiet"], cwd=t, input=files.encode(), stdout=f, check=True, timeout=60
            )
    return [_name(m) for m in order]


def qemu_argv(
    kernel: Path, initrd: Path, image: Path, console: Path, results: Path, accel: str, append: str = ""
) -> list[str]:
    cmdline = f"console=ttyS0 root=/dev/vda rw quiet panic=-1 {append}".strip()
    return [
        "qemu-system-x86_64",
        "-nodefaults",
        "-no-user-config",
        "-accel",
        accel,
        "-cpu",
        "host" if accel == "kvm" else "max",
        "-m",
        GUEST_MEMORY,
        "-smp",
        GUEST_CPUS,
        "-no-reboot",
        "-display",
        "none",
        "-monitor",
        "none",
        "-serial",
        f"file:{console}",
        "-serial",
        f"file:{results}",
        "-kernel",
        str(kernel),
        "-initrd",
        str(initrd),
        "-append",
        cmdline,
        "-drive",
        f"file={image},format=raw,if=virtio,snapshot=on",
        "-device",
        "virtio-rng-pci",
    ]


def panics(text: str) -> list[str]:
    """Each panic, oops or BUG of a console log: its first line and what followed (capped)."""
    lines = text.splitlines()
    found: list[str] = []
    i = 0
    while i < len(lines):
        if re.search(r"Kernel panic|Oops:|BUG: |general protection fault", lines[i]):
            found.append("\n".join(lines[i : i + PANIC_CONTEXT_LINES]))
            i += PANIC_CONTEXT_LINES
        else:
            i += 1
    return found


def read_results(path: Path, final: bool = True) -> list[dict]:
    """The result lines the guest wrote to its results port; while it runs (final False), without a
    last line it has not finished writing."""
    out: list[dict] = []
    if not path.exists():
        return out
    text = path.read_text(errors="replace")
    if not final:
        text = text[: text.rfind("\n") + 1]
    for line in text.splitlines():
        at = line.find(RESULT_MARK)
        if at < 0:
            continue
        try:
            out.append(json.loads(line[at + len(RESULT_MARK) :]))
        except ValueError:
            out.append({"step": "garbled", "line": line[:500]})
    return out


def boot(  # noqa: PLR0913, PLR0917 - one boot's every input, named at its one caller
    release: str,
    kernel: Path,
    initrd: Path,
    image: Path,
    outdir: Path,
    accel: str,
    timeout_s: float,
    log: Callable[[str], None] = print,
    name: str = "",
) -> BootResult:
    """Boot once and wait for the guest to power off, or kill qemu at `timeout_s`."""
    tag = name or release
    console, results = outdir / f"{tag}.console.log", outdir / f"{tag}.results.log"
    argv = qemu_argv(kernel, initrd, image, console, results, accel)
    (outdir / f"{tag}.qemu.argv").write_text(" ".join(argv) + "\n")
    started = time.monotonic()
    with open(outdir / f"{tag}.qemu.log", "w") as qlog:
        p = subprocess.Popen(
            argv, stdout=qlog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            timed_out, silent = watch(p, tag, console, results, started + timeout_s, log)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = console.read_text(errors="replace") if console.exists() else ""
    said = (outdir / f"{tag}.qemu.log").read_text(errors="replace").strip().splitlines()
    return BootResult(
        release=release,
        accel=accel,
        seconds=round(time.monotonic() - started, 1),
        timed_out=timed_out,
        exit_code=None if timed_out else p.returncode,
        console_log=console,
        results=read_results(results),
        panics=panics(text),
        qemu_said=said[-1][:300] if said else "",
        silent=silent,
    )


def watch(
    p: subprocess.Popen[bytes], tag: str, console: Path, results: Path, deadline: float, log: Callable[[str], None]
) -> tuple[bool, bool]:
    """Until qemu exits: its results said as they come; (timed out, silent) when it had to be stopped at
    the deadline, or after SILENT_S with neither log growing."""
    started, seen = time.monotonic(), 0
    grown = (-1, -1, started)  # the serial logs' sizes, and when they last changed
    while True:
        try:
            p.wait(POLL_S)
            return False, False
        except subprocess.TimeoutExpired:
            pass
        got = read_results(results, final=False)
        for r in got[seen:]:
            said = (
                r.get("message", "")
                if r.get("step") == "progress"
                else f"{r.get('step')}: {r.get('status', '')} {r.get('reason', '')}"
            )
            log(f"  [{tag} {time.monotonic() - started:4.0f} s] {said}".rstrip())
        seen = len(got)
        grown = logs_grown(grown, console, results)
        if time.monotonic() - grown[2] > SILENT_S:
            return True, True
        if time.monotonic() > deadline:
            return True, False


def logs_grown(last: tuple[int, int, float], *logs: Path) -> tuple[int, int, float]:
    """(console size, results size, when either last changed), after one more look at them."""
    sizes = [f.stat().st_size if f.exists() else 0 for f in logs]
    now = (sizes[0], sizes[1])
    return (*now, time.monotonic()) if now != last[:2] else last


def kvm_boots(kernel: Path, initrd: Path, image: Path, outdir: Path, log: Callable[[str], None] = print) -> bool:
    """Whether this host's KVM boots a stock kernel: its banner and the initrd's first line within
    KVM_PROBE_TIMEOUT_S (here a paravirtual KVM that stock kernels hang or die on: then TCG)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    console, results = outdir / "kvm-probe.console.log", outdir / "kvm-probe.results.log"
    argv = qemu_argv(kernel, initrd, image, console, results, "kvm", append="ktest.probe=1")
    started = time.monotonic()
    qemu_log = outdir / "kvm-probe.qemu.log"
    with open(qemu_log, "w") as qlog:
        p = subprocess.Popen(
            argv, stdout=qlog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    ok = False
    try:
        while time.monotonic() - started < KVM_PROBE_TIMEOUT_S and p.poll() is None:
            if console.exists() and "initrd: loading" in console.read_text(errors="replace"):
                ok = True
                break
            time.sleep(0.5)  # polling the console file with the deadline above
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    said = " ".join(qemu_log.read_text(errors="replace").split())[-300:]
    log(
        f"KVM probe: {'a stock kernel boots with KVM' if ok else 'a stock kernel does not boot with KVM: TCG'}"
        f" ({time.monotonic() - started:.0f} s{'; qemu: ' + said if said and not ok else ''}; log {console})"
    )
    return ok
