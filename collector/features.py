"""What the running kernel offers the collector: each feature probed once at start, each one it lacks
refused alone, with its reason.

Users run the kernels their distribution ships (Debian 11's 5.10 to the newest). A kernel that
lacks a feature costs the agent that feature only, never the whole agent: the log, preflight and
`ebpfprofiler status` name what is missing, since which Linux version it exists, and what the agent
does without it (docs/kernels.md has the table per Debian kernel).

Owns: the table of kernel features the BPF programs and the stages use (FEATURES: each with the
Linux version that brought it and what is lost without it), probing each (libbpf's helper and map
probes, the kernel's BTF; collector/btfprog.py makes the calls), the record of a probe as JSON
(preflight and status show it; the unit tests replay recorded ones), and the environment variable
EBPFPROFILER_DISABLE_FEATURES (comma-separated names), which turns features off as if the kernel
lacked them: a way around a kernel bug in one, and how the tests prove each fallback on a kernel
that has the feature.

Also RUN_DIR/kernel.json (write_status): what the collector found and refused, for `ebpfprofiler status`.

Must not: import bcc, load the agent's programs, or act on a missing feature (collector/main.py
and the families choose their fallbacks from has()).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared import files

DISABLE_ENV = "EBPFPROFILER_DISABLE_FEATURES"

# include/uapi/linux/bpf.h: program and map types, helper ids (stable kernel ABI).
_PROG_TYPE_SOCKET_FILTER = 1
_PROG_TYPE_PERF_EVENT = 7
_MAP_TYPE_RINGBUF = 27
_MAP_TYPE_TASK_STORAGE = 29
_FUNC_GET_TASK_STACK = 141
_FUNC_GET_CURRENT_TASK_BTF = 158
_FUNC_KTIME_GET_COARSE_NS = 160
_FUNC_TASK_PT_REGS = 175


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    since: str  # where it came from: "Linux 5.11"
    what: str  # what it is
    without: str  # what the agent does on a kernel without it
    requires: tuple[str, ...] = ()  # features it cannot be used without


FEATURES: tuple[FeatureSpec, ...] = (
    FeatureSpec(
        "btf",
        "CONFIG_DEBUG_INFO_BTF=y",
        "the kernel's type information (/sys/kernel/btf/vmlinux)",
        "no off-CPU profiles (their programs are BTF-typed tracepoints), and user stacks of samples "
        "taken in the kernel use frame pointers",
    ),
    FeatureSpec(
        "ringbuf",
        "Linux 5.8",
        "BPF ring buffers",
        "a new process is read at the next regular drain (up to 60 s later) rather than soon after "
        "it starts, and JVM register samples (jvm_cpu) are off",
    ),
    FeatureSpec("get_task_stack", "Linux 5.9", "bpf_get_task_stack", "off-CPU stacks have no kernel frames"),
    FeatureSpec(
        "task_storage",
        "Linux 5.11",
        "BPF task local storage and bpf_get_current_task_btf",
        "off-CPU keeps its per-thread records in an LRU hash map by thread id instead",
        ("btf",),
    ),
    FeatureSpec(
        "memcg_accounting",
        "Linux 5.11",
        "BPF maps charged to the memory cgroup",
        "BPF maps are charged to RLIMIT_MEMLOCK: the collector raises its limit at start (as root, "
        "or under a systemd unit with LimitMEMLOCK=infinity)",
    ),
    FeatureSpec(
        "task_pt_regs",
        "Linux 5.15",
        "bpf_task_pt_regs (user registers of a task in the kernel)",
        "user stacks of on-CPU samples taken in the kernel, and every off-CPU user stack, are walked "
        "with frame pointers only (DWARF unwinding needs the user registers)",
        ("btf", "task_storage"),
    ),
    FeatureSpec(
        "switch_prev_state",
        "Linux 5.18",
        "sched_switch's prev_state argument",
        "off-CPU reads the blocking task's state from its task_struct (the field BTF names), as the "
        "classic tracepoint did",
        ("btf",),
    ),
    FeatureSpec(
        "uprobe_multi", "Linux 6.6", "uprobe_multi links", "no allocation profiles (alloc_targets is refused)", ("btf",)
    ),
)
SPECS: dict[str, FeatureSpec] = {f.name: f for f in FEATURES}


@dataclass(frozen=True)
class Feature:
    spec: FeatureSpec
    available: bool
    why: str = ""  # when not available: "the kernel lacks it", "turned off by ...", "not probed: ..."

    def describe(self) -> str:
        if self.available:
            return f"{self.spec.name}: yes"
        return f"{self.spec.name}: no ({self.why}; {self.spec.since}): {self.spec.without}"


@dataclass(frozen=True)
class KernelFeatures:
    release: str
    probes: Mapping[str, bool | None]  # as probed: True, False, or None (could not tell)
    disabled: frozenset[str] = frozenset()  # turned off by DISABLE_ENV
    features: Mapping[str, Feature] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return self.features[name].available

    def missing(self) -> list[Feature]:
        return [f for f in self.features.values() if not f.available]

    def to_json(self) -> dict[str, object]:
        return {
            "release": self.release,
            "probes": dict(self.probes),
            "disabled": sorted(self.disabled),
            "features": {
                n: {"available": f.available, "why": f.why, "since": f.spec.since, "without": f.spec.without}
                for n, f in self.features.items()
            },
        }


def resolve(release: str, probes: Mapping[str, bool | None], disabled: frozenset[str] = frozenset()) -> KernelFeatures:
    """The features from what was probed: a feature is available when its probe said yes, the features it
    requires are available, and it was not turned off. A probe that could not tell (None: no privilege to load a program) counts as missing,
    with that reason, so that nothing is used on a guess."""
    out: dict[str, Feature] = {}
    for spec in FEATURES:  # in an order where every feature comes after those it requires
        found = probes.get(spec.name)
        lacking = [r for r in spec.requires if not out[r].available]
        if spec.name in disabled:
            out[spec.name] = Feature(spec, False, f"turned off by {DISABLE_ENV}")
        elif lacking:
            out[spec.name] = Feature(spec, False, f"needs {' and '.join(lacking)}, which is not available")
        elif found is None:
            out[spec.name] = Feature(spec, False, "not probed: loading a probe program needs CAP_BPF")
        elif not found:
            out[spec.name] = Feature(spec, False, f"Linux {release} lacks it")
        else:
            out[spec.name] = Feature(spec, True)
    return KernelFeatures(release, dict(probes), disabled, out)


def bpf_defines(kernel: KernelFeatures) -> dict[str, int]:
    """The -D flags of the features every program family tests for (bpf/common.h, bpf/unwind.h,
    bpf/offcpu.c, bpf/oncpu.c); a family's own fallbacks (offcpu.py's records) are that family's."""
    flags = {"ringbuf": "HAVE_RINGBUF", "get_task_stack": "HAVE_GET_TASK_STACK", "task_pt_regs": "HAVE_TASK_PT_REGS"}
    return {define: 1 for name, define in flags.items() if kernel.has(name)}


STATUS_FILE = "kernel.json"
# A status file is a few KiB; `ebpfprofiler status` reads at most this much of it.
MAX_STATUS_BYTES = 1 << 16


def status_path(run_dir: str) -> str:
    return os.path.join(run_dir, STATUS_FILE)


def write_status(
    run_dir: str, kernel: KernelFeatures, refused: list[tuple[str, str]], extra: Mapping[str, object]
) -> None:
    """RUN_DIR/kernel.json, which `ebpfprofiler status` prints: the features, what the config asked for and
    the kernel refused, and `extra` (how the collector holds its privileges, the CPUs it samples)."""
    doc = {"pid": os.getpid(), **kernel.to_json(), "refused": [{"what": w, "why": y} for w, y in refused], **extra}
    files.write_atomic(status_path(run_dir), json.dumps(doc, sort_keys=True).encode() + b"\n", mode=0o644)


def remove_status(run_dir: str) -> None:
    Path(status_path(run_dir)).unlink(missing_ok=True)


def disabled_by_env(env: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The names in DISABLE_ENV; an unknown name is an error naming the known ones."""
    names = frozenset(n.strip() for n in env.get(DISABLE_ENV, "").split(",") if n.strip())
    unknown = names - set(SPECS)
    if unknown:
        raise ValueError(f"{DISABLE_ENV}: unknown feature(s) {', '.join(sorted(unknown))}; known: {', '.join(SPECS)}")
    return names


def _both(a: bool | None, b: bool | None) -> bool | None:
    if a is False or b is False:
        return False
    return None if a is None or b is None else True


def probe(sys_dir: str = "/sys", env: Mapping[str, str] = os.environ) -> KernelFeatures:
    """Probe the running kernel (needs CAP_BPF for the program and map probes)."""
    from collector import btfprog

    btf = os.path.exists(f"{sys_dir}/kernel/btf/vmlinux")

    def helper(fn: int) -> Callable[[], bool | None]:
        return lambda: btfprog.probe_helper(_PROG_TYPE_PERF_EVENT, fn)

    calls: dict[str, Callable[[], bool | None]] = {
        "btf": lambda: btf,
        "ringbuf": lambda: btfprog.probe_map_type(_MAP_TYPE_RINGBUF),
        "get_task_stack": helper(_FUNC_GET_TASK_STACK),
        "task_storage": lambda: _both(
            btfprog.probe_map_type(_MAP_TYPE_TASK_STORAGE),
            btfprog.probe_helper(_PROG_TYPE_PERF_EVENT, _FUNC_GET_CURRENT_TASK_BTF),
        ),
        # bpf_get_current_task_btf, which the programs call for the task's registers, came in 5.11
        "task_pt_regs": lambda: _both(
            btfprog.probe_helper(_PROG_TYPE_PERF_EVENT, _FUNC_TASK_PT_REGS),
            btfprog.probe_helper(_PROG_TYPE_PERF_EVENT, _FUNC_GET_CURRENT_TASK_BTF),
        ),
        # as libbpf tells (its FEAT_MEMCG_ACCOUNT): bpf_ktime_get_coarse_ns came in the same release, and
        # a socket filter may call it (6.1's tracing programs may not)
        "memcg_accounting": lambda: btfprog.probe_helper(_PROG_TYPE_SOCKET_FILTER, _FUNC_KTIME_GET_COARSE_NS),
        "switch_prev_state": lambda: (btfprog.tracepoint_arity("sched_switch") or 0) >= 4 if btf else False,
        "uprobe_multi": lambda: btfprog.enum_has("bpf_attach_type", "BPF_TRACE_UPROBE_MULTI") if btf else False,
    }
    probes: dict[str, bool | None] = {}
    for name, call in calls.items():
        try:
            probes[name] = call()
        except OSError:  # libbpf missing or unloadable: nothing can be told
            probes[name] = None
    return resolve(os.uname().release, probes, disabled_by_env(env))
