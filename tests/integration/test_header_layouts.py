"""Every BPF program passes the verifier whichever Debian kernel's header tree bcc compiles it against.

bcc compiles against /lib/modules/RELEASE/build, and a struct's layout there decides the code: since
6.12 (FRED) the headers declare pt_regs.cs as a 16-bit member of a union, so reading it as a field
became a 2-byte read of a perf event's context, which the verifier refuses ("invalid bpf_context
access off=136 size=2": the agent did not start on bookworm-backports' 6.12); sid's 7.x headers
need -fms-extensions (collector/programs.py kernel_cflags).

Given the header trees of Debian 12's 6.1, bookworm-backports' 6.12 and sid's newest kernel (Debian's
packages, tests/kernels/debs.py), when the collector's whole plan (collector/plan.py: on-CPU with
DWARF and registers, off-CPU with DWARF, lock, alloc) is compiled against each, as bcc finds it (the
tree bind-mounted over /lib/modules/RELEASE/build and source in a private mount namespace), then
every program loads on this kernel's verifier. `make test-kernels` boots those kernels too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import PY, require_root
from tests.kernels import debs

# Compiling the whole plan and loading every program: ~10 s here; bcc is slower on a loaded host.
LOAD_TIMEOUT_S = 300
# Unpacking two header packages (~70 MB).
UNPACK_TIMEOUT_S = 300

# Run in the private mount namespace: compile the collector's plan for a config that turns everything
# on, load every program the collector would load, and print the kernel version the headers declared.
LOAD_EVERYTHING = r"""
import ctypes, sys
from bcc import BPF
from bcc.libbcc import lib
from collector import alloc, features, offcpu, plan, programs, unwind
from collector.btfprog import BtfProgram
from shared.config import ProfilerConfig
from shared.stage_code import default_bpf_dir

cfg = ProfilerConfig(offcpu=True, dwarf_unwind=True, offcpu_dwarf=True, runtime_stacks=("jvm",),
                     lock_targets=("nothing-matches",), alloc_targets=("nothing-matches",))
p = plan.plan(cfg, features.probe())
assert not p.refused, p.refused
with programs.capture_stderr() as said:
    try:
        progs = programs.Programs(default_bpf_dir(), p.families, p.defines)   # lock's tracepoints load here
        bpf = progs.bpf
        loaded = ["lock: " + ", ".join(sorted(f.decode() for f in bpf.funcs))]
        for name in ("on_cpu_sample", "oncpu_unwind_step"):
            bpf.load_func(name.encode(), BPF.PERF_EVENT)
            loaded.append(name)
        bpf.load_func(b"lock_unwind_step", BPF.TRACEPOINT)
        held = [BtfProgram(bpf, fn, tp) for fn, tp in offcpu.PROGRAMS + offcpu.STEP_PROGRAMS]
        loaded += [h.name for h in held]
        loaded += [name for name in alloc.PROGRAMS if alloc.load_uprobe_multi(bpf, name) >= 0]
    except Exception as e:
        sys.exit(programs.explain(e, said))
print("loaded:", "; ".join(loaded))
print("headers of kernel version", hex(lib.bpf_module_kern_version(bpf.module)))
print("cflags:", progs.kernel_cflags)
for h in held:
    h.close()
progs.close()
"""


def header_tree(name: str) -> tuple[str, Path, Path]:
    """(release, build tree, source tree) of suite `name`'s kernel headers, unpacked once beside its debs."""
    kernel = debs.fetch(name)
    out = debs.KERNEL_CACHE / f"headers-{kernel.release}"
    build = out / "usr" / "src" / f"linux-headers-{kernel.release}"
    common = [d for d in kernel.debs if d.name.startswith("linux-headers-") and "-common" in d.name]
    source = out / "usr" / "src" / common[0].name.split("_")[0]
    if not (out / ".complete").exists():
        for deb in kernel.debs:
            if deb.name.startswith("linux-headers-"):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(out)], check=True, timeout=UNPACK_TIMEOUT_S)
        (out / ".complete").write_text(kernel.release)
    assert (build / "include" / "generated" / "utsrelease.h").exists() and (source / "include" / "linux").is_dir()
    return kernel.release, build, source


@pytest.mark.parametrize("suite, version", [("bookworm", "0x601"), ("bookworm-backports", "0x60c"), ("sid", None)])
def test_every_program_loads_when_compiled_against_the_kernels_headers(suite: str, version: str | None) -> None:
    require_root()
    release, build, source = header_tree(suite)
    here = f"/lib/modules/{os.uname().release}"
    script = f'mount --bind {build} {here}/build && mount --bind {source} {here}/source && exec {PY} -c "$0"'
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, LOAD_EVERYTHING],
        capture_output=True,
        text=True,
        timeout=LOAD_TIMEOUT_S,
    )
    assert out.returncode == 0, f"{release}: {out.stdout}{out.stderr[-4000:]}"
    print(out.stdout, file=sys.stderr)
    # it was these headers bcc compiled against, and every family's programs loaded
    declared = out.stdout.split("headers of kernel version ")[1].split()[0]
    if version is not None:
        assert declared.startswith(version), (release, declared)
    for name in (
        "on_cpu_sample",
        "oncpu_unwind_step",
        "offcpu_switch",
        "offcpu_resume",
        "offcpu_unwind_step",
        "tracepoint__syscalls__sys_enter_futex",
        "alloc_malloc_enter",
    ):
        assert name in out.stdout, (name, out.stdout)
    if suite == "sid":
        assert "-fms-extensions" in out.stdout  # its header tree was built with it
