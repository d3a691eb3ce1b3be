"""Agent configuration: the `modules.ebpf_profiler` block of the YAML file.

Owns: the schema (one frozen dataclass), its defaults, and validation. A config
is validated once, when it is loaded; every stage then trusts the object it got.
A bad key or value raises ConfigError naming the key, the value and what is
allowed.

Must not: read anything but the one file it is given, or know about stages.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import yaml

from shared import runtime_registry
from shared.safestr import quote

# Where the block lives in the agent's YAML file.
MODULE_PATH = ("modules", "ebpf_profiler")
# A config file is a few hundred bytes; anything near this is not a config file.
MAX_CONFIG_BYTES = 1 << 20

# Our backend's agent config document, under its endpoint (docs/upload-api.md).
AGENT_CONFIG_PATH = "/v1/agent-config"
DEFAULT_LOCAL_DIR = "/var/lib/ebpfprofiler/profiles"
# Profiles kept on disk while the backend is unreachable: 256 MiB is hours of a
# busy host's profiles; the oldest are dropped (counted, logged) beyond it.
DEFAULT_SPOOL_MAX_MB = 256
# Seconds to wait for the backend's reply to one upload (requests' read timeout).
DEFAULT_UPLOAD_TIMEOUT_S = 30
# How often the uploader asks the backend for remote config: a minute is soon
# enough for an operator's toggle, and one small GET a minute per host is cheap.
DEFAULT_REMOTE_CONFIG_INTERVAL_S = 60
# Runtime stacks that need an opt-in, one or more per runtime in the registry (CPython 3.11 and
# 3.12 are read from layouts kept as data, with no debug offsets in the target to check them against).
RUNTIME_STACKS = runtime_registry.OPT_INS
# Percent of one CPU the runtime reader may spend; 2% at 19 Hz reads a few
# dozen Python processes. A window over it halves the reader's per-tick caps.
DEFAULT_CPU_BUDGET = 2.0
# Percent of one CPU the whole profiler (every stage's CPU plus its BPF run
# time) may use per upload window; over it the collector halves sample_hz.
DEFAULT_OVERHEAD_BUDGET_PCT = 1.0
# Allocation profiling samples one allocation per this many bytes on average.
# Go's 512 KiB is for profiles that accumulate from the process's start; ours
# are per window: a process allocating 10 MB/s gives ~9,000 samples a minute
# at 64 KiB (a 3:1 split within ~3%), ~1,100 at 512 KiB (~9%). A sample costs
# ~1 us of BPF (stack walk, two map updates). 0 records every allocation.
DEFAULT_ALLOC_SAMPLE_BYTES = 64 * 1024
# Percent of the time the allocation uprobes are attached to a target (bursts
# with a random phase, collector/alloc.py). Each probed call traps into the
# kernel (a malloc/free pair ~8 us here against ~20 ns unprobed), so it is the
# slowdown of a program that does nothing but allocate; 100: always attached.
DEFAULT_ALLOC_DUTY_PCT = 3.0
# Each alloc target process costs seven uprobes; each lock target a map entry.
MAX_TARGETS = 64
# A target: an executable name or path, a container id, or cgroup:/path.
MAX_TARGET_CHARS = 4096
# How the uploader speaks to the backend (uploader/formats/): our /v1/profiles, OTLP/HTTP
# profiles to an OpenTelemetry Collector, or Pyroscope's /ingest.
UPLOAD_FORMATS = ("pprof", "otlp", "pyroscope")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names key, value and what is allowed."""


@dataclass(frozen=True)
class ProfilerConfig:
    enabled: bool = True
    sample_hz: int = 19
    upload_interval_s: int = 60
    offcpu: bool = True
    offcpu_min_ms: int = 1
    offcpu_sample_ms: int = 50  # one charge per 50 ms blocked: the resolution 19 Hz gives CPU time
    strip_process_args: bool = True
    plain_pid: bool = False
    endpoint: str = ""
    local_dir: str = DEFAULT_LOCAL_DIR
    symbolizer_workers: int = 1
    spool_max_mb: int = DEFAULT_SPOOL_MAX_MB
    upload_timeout_s: int = DEFAULT_UPLOAD_TIMEOUT_S
    ca_file: str = ""
    token_file: str = ""
    remote_config_interval_s: int = DEFAULT_REMOTE_CONFIG_INTERVAL_S
    dwarf_unwind: bool = True
    offcpu_dwarf: bool = True
    python_stacks: bool = True
    runtime_stacks: tuple[str, ...] = ()
    cpu_budget: float = DEFAULT_CPU_BUDGET
    overhead_budget_pct: float = DEFAULT_OVERHEAD_BUDGET_PCT
    alloc_targets: tuple[str, ...] = ()
    lock_targets: tuple[str, ...] = ()
    alloc_sample_bytes: int = DEFAULT_ALLOC_SAMPLE_BYTES
    upload_format: str = "pprof"
    remote_config_url: str = ""
    alloc_duty_pct: float = DEFAULT_ALLOC_DUTY_PCT

    def replace(self, **changes: Any) -> ProfilerConfig:
        """A copy with `changes` applied, validated like a loaded file."""
        return from_mapping({**dataclasses.asdict(self), **changes}, source="<override>")

    @property
    def uploads_locally(self) -> bool:
        return self.endpoint == ""

    @property
    def runtime_reader_wanted(self) -> bool:
        """The runtime reader runs when some runtime's stacks are asked for."""
        return self.python_stacks or bool(self.runtime_stacks)

    @property
    def agent_config_url(self) -> str:
        """Where the uploader fetches remote config; "" when it is off.

        remote_config_url when set; else, with upload_format pprof, our backend's
        {endpoint}/v1/agent-config; else (an OpenTelemetry Collector or Pyroscope,
        which serve no agent config of ours) off."""
        if self.uploads_locally:
            return ""
        if self.remote_config_url:
            return self.remote_config_url
        if self.upload_format == "pprof":
            return self.endpoint.rstrip("/") + AGENT_CONFIG_PATH
        return ""


@dataclass(frozen=True)
class _Rule:
    kind: type[Any]
    allowed: str
    low: float | None = None
    high: float | None = None


_TARGETS = (
    f"a list of at most {MAX_TARGETS} targets, each an executable name (matched against the "
    "executable's file name and the process name) or absolute path, a container id (12 to 64 hex "
    "digits, a prefix of the full id) or cgroup:/path (the process's cgroup v2 path or one under it)"
)

# One rule per key: the type it must have and, for numbers, the range.
_RULES: dict[str, _Rule] = {
    "enabled": _Rule(bool, "true or false"),
    "sample_hz": _Rule(int, "an integer from 1 to 10000 (samples per second per CPU)", 1, 10000),
    "upload_interval_s": _Rule(int, "an integer from 1 to 3600 (seconds)", 1, 3600),
    "offcpu": _Rule(bool, "true or false"),
    "offcpu_min_ms": _Rule(int, "an integer from 0 to 60000 (milliseconds)", 0, 60000),
    # At most ~4.29 s: bpf/offcpu.c draws the chance from a 32-bit random number of nanoseconds.
    "offcpu_sample_ms": _Rule(int, "an integer from 0 to 4000 (milliseconds; 0: every block in full)", 0, 4000),
    "strip_process_args": _Rule(bool, "true or false"),
    "plain_pid": _Rule(bool, "true or false"),
    "endpoint": _Rule(str, '"" (write profiles to local_dir) or an http:// or https:// base URL'),
    "local_dir": _Rule(str, "an absolute directory path"),
    "symbolizer_workers": _Rule(int, "an integer from 1 to 64", 1, 64),
    "spool_max_mb": _Rule(int, "an integer from 1 to 102400 (MiB of profiles kept on disk for the backend)", 1, 102400),
    "upload_timeout_s": _Rule(int, "an integer from 1 to 600 (seconds to wait for the backend's reply)", 1, 600),
    "ca_file": _Rule(str, '"" (the system CA certificates) or an absolute path to a PEM file of CA certificates'),
    "token_file": _Rule(str, '"" (no Authorization header) or an absolute path to a file holding a bearer token'),
    # At least 5 s: a fleet of agents polling faster would load the backend for nothing.
    "remote_config_interval_s": _Rule(
        int, "an integer from 5 to 3600 (seconds between fetches of remote config)", 5, 3600
    ),
    "dwarf_unwind": _Rule(
        bool, "true (unwind user stacks with .eh_frame tables in BPF, x86-64) or false (frame pointers only)"
    ),
    "offcpu_dwarf": _Rule(bool, "true (off-CPU stacks unwound with the same tables; needs dwarf_unwind) or false"),
    "python_stacks": _Rule(bool, "true (python_wall profiles of CPython 3.13 and newer) or false"),
    "runtime_stacks": _Rule(tuple, f"a list of names from {list(RUNTIME_STACKS)} ({runtime_registry.opt_in_help()})"),
    "cpu_budget": _Rule(float, "a number from 0.1 to 100 (percent of one CPU the runtime reader may use)", 0.1, 100),
    # From 0.001: a budget a test can exceed on purpose; 100: all of one CPU.
    "overhead_budget_pct": _Rule(
        float,
        "a number from 0.001 to 100 (percent of one CPU the whole profiler, "
        "its BPF programs included, may use per upload window)",
        0.001,
        100,
    ),
    "alloc_targets": _Rule(list, _TARGETS),
    "lock_targets": _Rule(list, _TARGETS),
    "alloc_sample_bytes": _Rule(
        int,
        "an integer from 0 (every allocation) to 1073741824 (bytes between sampled allocations, on average)",
        0,
        1 << 30,
    ),
    "upload_format": _Rule(
        str,
        f"one of {list(UPLOAD_FORMATS)} (pprof: our POST /v1/profiles; otlp: OTLP/HTTP "
        "profiles to an OpenTelemetry Collector; pyroscope: Pyroscope's POST /ingest)",
    ),
    "remote_config_url": _Rule(
        str,
        '"" (pprof: {endpoint}/v1/agent-config; otlp and pyroscope: no remote config) '
        "or the http:// or https:// URL of an agent config document",
    ),
    # From 1: a 10-ms burst a second (shorter bursts are mostly attach and detach); 100: always attached.
    "alloc_duty_pct": _Rule(
        float,
        "a number from 1 to 100 (percent of the time allocation uprobes are attached to "
        "a target; the worst-case slowdown of a target that only allocates)",
        1,
        100,
    ),
}
assert set(_RULES) == {f.name for f in dataclasses.fields(ProfilerConfig)}


def _check(key: str, value: Any, source: str) -> Any:
    rule = _RULES[key]
    where = f"{source}: modules.ebpf_profiler.{key}"
    bad = ConfigError(f"{where} = {quote(value)} is not allowed; expected {rule.allowed}")
    if rule.kind is tuple:  # a YAML list of known names, kept as a tuple (the config is frozen)
        if not isinstance(value, (list, tuple)) or any(v not in RUNTIME_STACKS for v in value):
            raise bad
        return tuple(dict.fromkeys(value))
    if rule.kind is list:  # target specs (collector/targets.py matches them)
        if (
            not isinstance(value, (list, tuple))
            or len(value) > MAX_TARGETS
            or not all(isinstance(v, str) and _valid_target(v) for v in value)
        ):
            raise bad
        return tuple(dict.fromkeys(value))
    if rule.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    # bool is a subclass of int: `sample_hz: true` must not pass as 1.
    if rule.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad
    if not isinstance(value, rule.kind):
        raise bad
    if rule.low is not None and value < rule.low:
        raise bad
    if rule.high is not None and value > rule.high:
        raise bad
    if key == "upload_format" and value not in UPLOAD_FORMATS:
        raise bad
    if key in ("endpoint", "remote_config_url") and value:
        url = urlparse(value)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise bad
    if key == "local_dir" and not os.path.isabs(value):
        raise bad
    if key in ("ca_file", "token_file") and value and not os.path.isabs(value):
        raise bad
    return value


def _valid_target(spec: str) -> bool:
    if not spec or len(spec) > MAX_TARGET_CHARS or any(c.isspace() or c == "\0" for c in spec):
        return False
    if spec.startswith("cgroup:"):
        return spec[len("cgroup:") :].startswith("/")
    return not spec.startswith("/") or os.path.isabs(spec)


def check(key: str, value: Any, source: str = "<config>") -> Any:
    """Validate one value of the block by its key's rule (ConfigError naming key, value and what is allowed)."""
    if key not in _RULES:
        raise ConfigError(f"{source}: unknown key modules.ebpf_profiler.{key}; allowed keys: {', '.join(_RULES)}")
    return _check(key, value, source)


def allowed(key: str) -> str:
    """What a key accepts, in words (as the ConfigError of a bad value says it)."""
    return _RULES[key].allowed


def from_mapping(block: Mapping[str, Any] | None, source: str = "<config>") -> ProfilerConfig:
    """Validate the `modules.ebpf_profiler` block and return the config."""
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"{source}: modules.ebpf_profiler must be a mapping, not {type(block).__name__}")
    unknown = sorted(str(k) for k in block if k not in _RULES)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key modules.ebpf_profiler.{unknown[0]}; allowed keys: {', '.join(_RULES)}"
        )
    values = {key: _check(key, value, source) for key, value in block.items()}
    return ProfilerConfig(**values)


def load(path: str) -> ProfilerConfig:
    """Read and validate a YAML config file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a config file")
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping with a 'modules' key")
    node: Any = doc
    for i, part in enumerate(MODULE_PATH):
        node = node.get(part) if isinstance(node, Mapping) else None
        if node is None:
            raise ConfigError(f"{path}: missing {'.'.join(MODULE_PATH[: i + 1])}")
    return from_mapping(node, source=path)


def dump(cfg: ProfilerConfig) -> str:
    """The YAML text of a config (for writing test and default files)."""
    block = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    return yaml.safe_dump({"modules": {"ebpf_profiler": block}}, sort_keys=False)
