"""The registry of runtime readers: one line per runtime, as data.

Owns: RUNTIMES, one RuntimeSpec per runtime the runtime reader reads: its
name and folder (runtimes/<name>/, the plug-in), the runtime_stacks names
that opt into it (with what each turns on), its profile type and the fields
of its frames. The config's runtime_stacks values (shared/config.py), the
wire's profile types (shared/wire.py), the reader's plug-ins and the names in
its log lines (runtimes/targets.py) all follow from this table; adding a
runtime is a folder and a line here.

Must not: import a plug-in (config and wire read this table in every stage;
the runtime reader imports the plug-ins, by RuntimeSpec.package).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeSpec:
    name: str  # the folder under runtimes/ and the pprof mapping's name
    title: str  # as log lines name it: "CPython", "PHP"
    opt_ins: tuple[tuple[str, str], ...]  # (runtime_stacks name, what it turns on)
    profile_type: str  # one pprof of this type per service per window; "": none of its own
    frame_fields: tuple[str, ...]  # what each frame of a stack says
    default_on: bool = False  # read without any opt-in (CPython 3.13+, under python_stacks)
    # Its plug-in forks a helper at load that keeps the runtime stage's OPTIONAL_CAPS (shared/privileges.py);
    # the reader drops them once the plug-ins are loaded.
    helper_caps: bool = False
    # Its on-CPU profile: the collector's cpu samples of its processes, each carrying the thread's user
    # registers and the top of its stack (collector/regs.py), walked by its plug-in's sample_regs; "": none.
    cpu_profile_type: str = ""
    # A process mapping a file of one of these names is marked for those registers (by the collector, which
    # sees mapping names only); a name ending in "*" is a prefix ("libnode.so.*": libnode.so.115).
    regs_mappings: tuple[str, ...] = ()

    @property
    def package(self) -> str:
        return f"runtimes.{self.name}"


RUNTIMES: tuple[RuntimeSpec, ...] = (
    RuntimeSpec(
        "cpython",
        "CPython",
        (("python_legacy", "CPython 3.11 and 3.12 too"),),
        "python_wall",
        ("function", "filename", "line"),
        default_on=True,
    ),
    RuntimeSpec(
        "php",
        "PHP",
        (("php", "PHP 8.2 to 8.5, NTS builds"),),
        "php_wall",
        ("function", "class_name", "filename", "line"),
    ),
    RuntimeSpec(
        "ruby", "Ruby", (("ruby", "Ruby 3.3 and 3.4"),), "ruby_wall", ("function", "class_name", "filename", "line")
    ),
    RuntimeSpec(
        "jvm",
        "JVM",
        (("jvm", "HotSpot JDK 11 and newer"),),
        "jvm_wall",
        ("function", "filename", "line", "kind"),
        cpu_profile_type="jvm_cpu",
        regs_mappings=("libjvm.so",),
    ),
    # No stacks of its own: it asks each .NET process for a perf map, whose names the cpu profiles then show.
    RuntimeSpec(
        "dotnet",
        ".NET",
        (
            (
                "dotnet",
                ".NET 8 and newer: JIT frame names in cpu profiles, from perf "
                "maps asked for over each process's diagnostics socket",
            ),
        ),
        "",
        (),
        helper_caps=True,
    ),
    RuntimeSpec(
        "node",
        "Node.js",
        (("node", "Node.js 20 to 26 (V8 11.3 to 14), builds without pointer compression"),),
        "node_cpu",
        ("function", "filename", "line", "kind"),
        cpu_profile_type="node_cpu",
        regs_mappings=("node", "libnode.so.*"),
    ),  # node_cpu: the timer's samples and these (runtimes/node)
)

# Every runtime_stacks name the config accepts.
OPT_INS: tuple[str, ...] = tuple(name for spec in RUNTIMES for name, _ in spec.opt_ins)
# (a runtime whose timer and register samples make one profile, Node's node_cpu, names it twice: once here)
PROFILE_TYPES: tuple[str, ...] = tuple(
    dict.fromkeys(t for spec in RUNTIMES for t in (spec.profile_type, spec.cpu_profile_type) if t)
)
BY_PROFILE_TYPE = {t: spec for spec in RUNTIMES for t in (spec.profile_type, spec.cpu_profile_type) if t}
# The runtimes' on-CPU profile types: cpu time (the collector's samples), not wall time.
CPU_PROFILE_TYPES = frozenset(spec.cpu_profile_type for spec in RUNTIMES if spec.cpu_profile_type)


def regs_mappings(runtime_stacks: tuple[str, ...]) -> frozenset[str]:
    """The mapping names that mark a process for registers with its cpu samples, for the runtimes
    runtime_stacks turns on."""
    return frozenset(
        name for spec in RUNTIMES if any(o in runtime_stacks for o, _ in spec.opt_ins) for name in spec.regs_mappings
    )


def opt_in_help() -> str:
    """The runtime_stacks names and what each turns on, for the config's error messages."""
    return ", ".join(f"{name}: {what}" for spec in RUNTIMES for name, what in spec.opt_ins)


def spec_of(name: str) -> RuntimeSpec:
    for spec in RUNTIMES:
        if spec.name == name:
            return spec
    raise KeyError(name)
