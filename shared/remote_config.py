"""Remote config: what the backend may change in a running agent, and how the stages learn it.

Owns: the keys the backend may set (REMOTE_KEYS: `enabled` and
`upload_interval_s`, as docs/remote-config.md says), parse(), which checks the backend's
agent config document against them and against shared.config's rules and says
what it refused and why, the overrides file in the runtime directory
(<run_dir>/remote-config.json: the accepted overrides only, written by the
uploader, the one stage on the network; read by the collector and the
symbolizer workers), Watcher (a cheap stat per check, a re-read only when the
file changed), and effective(): the local config with the overrides applied.
Remote `enabled` pauses and resumes a host whose local config has it on; a
local `enabled: false` is the operator's hard off switch, and remote config
cannot turn profiling on over it.

The file is read as untrusted input: the uploader talks to the network and the
runtime directory is writable by the whole agent group, while the collector
that reads it holds BPF capabilities. A reader takes it only if it is a regular
file (no symlink, no FIFO), at most MAX_OVERRIDES_BYTES, written by the
uploader's user (or root, or the reader's own user), and holding JSON that
passes the same checks again; anything else counts as no overrides, logged.

Must not: fetch anything (uploader/remote.py does), or let a key other than
REMOTE_KEYS reach a config.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared import config as config_mod
from shared import privileges, stopping
from shared.files import write_atomic
from shared.safestr import cut, quote
from shared.wire import json_object

# What the backend may change (docs/remote-config.md): only `enabled` and `upload_interval_s`;
# anything else it sends is refused.
REMOTE_KEYS = ("enabled", "upload_interval_s")
FILE_NAME = "remote-config.json"
# The overrides file: group-readable (collector and symbolizers are in the
# agent's group), writable by the uploader only.
FILE_MODE = 0o640
# Two keys are about 50 bytes of JSON; a larger file is not ours.
MAX_OVERRIDES_BYTES = 4096
# An agent config block has a dozen keys; one with more is not an agent config
# (and would make a log line per refused key).
MAX_BLOCK_KEYS = 64
# Values quoted in log lines are cut to this many characters.
MAX_VALUE_CHARS = 100
# How ConfigError texts name where a remote value came from.
SOURCE = "remote config"

log = logging.getLogger("ebpfprofiler.remote_config")


class AgentConfigError(ValueError):
    """A document that is not an agent config at all (wrong shape); nothing in it is used."""


@dataclass(frozen=True)
class Refusal:
    """One key of the backend's block that was not applied, and why."""

    key: str
    value: Any
    reason: str

    @property
    def value_text(self) -> str:
        return show(self.value)

    def describe(self, local: config_mod.ProfilerConfig) -> str:
        """The log line: key, value, why, and what stays in force."""
        head = f"remote config: refused modules.ebpf_profiler.{cut(self.key)} = {self.value_text}: {self.reason}"
        if hasattr(local, self.key):
            return f"{head}; the local value {show(getattr(local, self.key))} stays"
        return f"{head}; nothing changes"


def show(value: Any) -> str:
    """A value as log lines and ConfigError texts quote it (repr), cut to MAX_VALUE_CHARS."""
    return quote(value, MAX_VALUE_CHARS)


def path(run_dir: str) -> str:
    return os.path.join(run_dir, FILE_NAME)


# ------------------------------------------------------------ the backend's document


def block_of(doc: Any) -> Mapping[str, Any]:
    """The modules.ebpf_profiler block of an agent config document ({} when absent or null).

    AgentConfigError when the document has the wrong shape."""
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise AgentConfigError(f"the top level is {type(doc).__name__}, not an object with a 'modules' key")
    modules = doc.get(config_mod.MODULE_PATH[0])
    if modules is None:
        return {}
    if not isinstance(modules, Mapping):
        raise AgentConfigError(f"'modules' is {type(modules).__name__}, not an object")
    block = modules.get(config_mod.MODULE_PATH[1])
    if block is None:
        return {}
    if not isinstance(block, Mapping):
        raise AgentConfigError(f"'modules.ebpf_profiler' is {type(block).__name__}, not an object")
    if len(block) > MAX_BLOCK_KEYS:
        raise AgentConfigError(f"'modules.ebpf_profiler' has {len(block)} keys, more than {MAX_BLOCK_KEYS}")
    return block


def parse(doc: Any) -> tuple[dict[str, Any], list[Refusal]]:
    """(overrides, refusals) of a backend's agent config document.

    Overrides hold only REMOTE_KEYS with values that pass shared.config's
    rules. Every other key is refused, and so is a bad value of an allowed key
    (with the rule's words). Other modules' blocks are not ours and are ignored.
    AgentConfigError when the document has the wrong shape.
    """
    overrides: dict[str, Any] = {}
    refused: list[Refusal] = []
    only = f"remote config may set only {', '.join(REMOTE_KEYS)}"
    for raw_key, value in block_of(doc).items():
        key = str(raw_key)
        if key not in REMOTE_KEYS:
            known = key in config_mod.ProfilerConfig.__dataclass_fields__
            refused.append(Refusal(key, value, only if known else f"not a config key; {only}"))
            continue
        try:
            config_mod.check(key, value, SOURCE)
        except config_mod.ConfigError:
            refused.append(Refusal(key, value, f"not allowed; expected {config_mod.allowed(key)}"))
            continue
        overrides[key] = value
    return overrides, refused


def effective(local: config_mod.ProfilerConfig, overrides: Mapping[str, Any]) -> config_mod.ProfilerConfig:
    """The local config with the (validated) overrides applied; only REMOTE_KEYS are taken.

    A local `enabled: false` stays: remote config may pause profiling, never start it on a host
    whose operator turned it off."""
    changes = {k: overrides[k] for k in REMOTE_KEYS if k in overrides}
    if not local.enabled:
        changes.pop("enabled", None)
    return local.replace(**changes) if changes else local


def without_effect(local: config_mod.ProfilerConfig, overrides: Mapping[str, Any]) -> list[str]:
    """Why accepted overrides change nothing (for the log): remote enabled over a local enabled: false."""
    if not local.enabled and overrides.get("enabled") is True:
        return [
            (
                "remote config: enabled = True has no effect: the local config says enabled: false, which "
                "remote config cannot turn on; profiling stays off"
            )
        ]
    return []


def changes(before: config_mod.ProfilerConfig, after: config_mod.ProfilerConfig) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for each remote key whose effective value differs."""
    return [(k, getattr(before, k), getattr(after, k)) for k in REMOTE_KEYS if getattr(before, k) != getattr(after, k)]


# ------------------------------------------------------------ the overrides file


def encode(overrides: Mapping[str, Any]) -> bytes:
    return json.dumps({k: overrides[k] for k in REMOTE_KEYS if k in overrides}, sort_keys=True).encode() + b"\n"


def write_overrides(run_dir: str, overrides: Mapping[str, Any]) -> None:
    """Make the overrides file say `overrides` ({}: remove it). Atomic: readers see old or new, whole."""
    target = path(run_dir)
    if not overrides:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        return
    write_atomic(target, encode(overrides), mode=FILE_MODE)


def trusted_writers() -> set[int]:
    """Users whose overrides file a reader believes: the uploader's user, root, and the reader's own."""
    return privileges.uids_with("uploader")


class OverridesFileError(ValueError):
    """An overrides file that is not used; the message says why."""


def load_overrides(run_dir: str, writers: set[int] | None = None) -> dict[str, Any]:
    """The overrides in the file ({} when there is none); OverridesFileError when it cannot be used."""
    writers = trusted_writers() if writers is None else writers
    name = path(run_dir)
    try:
        # O_NOFOLLOW: no symlink to elsewhere; O_NONBLOCK: a FIFO cannot hang the reader.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as e:
        what = "a symlink" if e.errno == errno.ELOOP else e.strerror
        raise OverridesFileError(f"cannot open {name}: {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OverridesFileError(f"{name} is not a regular file")
        if st.st_uid not in writers:
            raise OverridesFileError(f"{name} belongs to uid {st.st_uid}, not to the uploader's user")
        raw = os.read(fd, MAX_OVERRIDES_BYTES + 1)
    except OSError as e:
        raise OverridesFileError(f"cannot read {name}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_OVERRIDES_BYTES:
        raise OverridesFileError(f"{name} is larger than {MAX_OVERRIDES_BYTES} bytes")
    # json_object: RecursionError (nesting past the interpreter's limit) too is a refusal, not a crash.
    doc = json_object(raw, MAX_OVERRIDES_BYTES, name, OverridesFileError)
    overrides, refused = parse({"modules": {"ebpf_profiler": doc}})
    if refused:
        r = refused[0]
        raise OverridesFileError(f"{name}: {cut(r.key)} = {r.value_text}: {r.reason}")
    return overrides


def read_overrides(
    run_dir: str, logger: logging.Logger | None = None, writers: set[int] | None = None
) -> dict[str, Any]:
    """The overrides in force: the file's, or {} (the local config) if there is none or it is bad (logged)."""
    try:
        return load_overrides(run_dir, writers)
    except OverridesFileError as e:
        (logger or log).warning("remote config: ignoring the overrides file: %s; the local config is in force", e)
        return {}


class Watcher:
    """The overrides file of a runtime directory, re-read only when it changed (inode, size, mtime, owner).

    follows=False (the config turns remote config off: ProfilerConfig.agent_config_url is ""): the
    file is never read (the uploader removes one an earlier run left) and the stage need not wake
    to check it."""

    def __init__(self, run_dir: str, logger: logging.Logger | None = None, follows: bool = True) -> None:
        self.run_dir = run_dir
        self.log = logger or log
        self.follows = follows
        self.overrides: dict[str, Any] = {}
        self._seen: tuple[int, ...] | None = None
        self._writers = trusted_writers()

    def _stamp(self) -> tuple[int, ...] | None:
        try:
            st = os.lstat(path(self.run_dir))
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid, st.st_mode)

    @classmethod
    def for_config(cls, run_dir: str, cfg: config_mod.ProfilerConfig, logger: logging.Logger | None = None) -> Watcher:
        """A stage's watcher: it follows the file only where the uploader fetches remote config."""
        return cls(run_dir, logger, follows=bool(cfg.agent_config_url))

    @property
    def wake_s(self) -> float:
        """How long a stage with nothing else to do may sleep between checks."""
        return stopping.IDLE_WAKE_S if self.follows else stopping.QUIET_WAKE_S

    def check(self) -> bool:
        """Re-read the file if it changed since the last check; True if the overrides in force changed."""
        if not self.follows:
            return False
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        new = read_overrides(self.run_dir, self.log, self._writers) if stamp is not None else {}
        if new == self.overrides:
            return False
        self.overrides = new
        return True
