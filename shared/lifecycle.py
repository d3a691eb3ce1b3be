"""The steps every stage's main() takes around its own work: the prologue and the shutdown tail.

Each stage (collector, symbolizer, uploader, runtime reader) starts the same way: drop to its
own user (shared/privileges.py) before anything else is opened, load the config, hold the run
directory's lock for its name (shared/runlock.py) before any socket; and ends the same way: its
ready file withdrawn (shared/ready.py) before what it holds is closed. A failed step prints
`PROG: why` on stderr and exits with the stage's code for it (1: cannot run here, 2: bad
config), as SystemExit, which the console scripts and `ebpfprofiler SUBCOMMAND` turn into the
process's exit status.

Owns: those steps and their messages. Must not: know what a stage does between them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from shared import config as config_mod
from shared import endpoints, privileges, ready, runlock

# Exit statuses of a stage that cannot start.
EXIT_CANNOT_RUN = 1
EXIT_BAD_CONFIG = 2


def add_stage_arguments(
    p: argparse.ArgumentParser, *, config_required: bool = True, state_dir_holds: str | None = None
) -> None:
    """The arguments every stage takes: --config, --run-dir and, for a stage that keeps state,
    --state-dir (`state_dir_holds`: what it keeps there, for --help)."""
    p.add_argument(
        "--config",
        required=config_required,
        metavar="FILE",
        help="agent YAML file (modules.ebpf_profiler block)"
        + ("" if config_required else "; required unless --preflight"),
    )
    p.add_argument(
        "--run-dir",
        default=endpoints.DEFAULT_RUN_DIR,
        metavar="DIR",
        help="runtime directory holding the stages' sockets and ready files (default: %(default)s)",
    )
    if state_dir_holds is not None:
        p.add_argument(
            "--state-dir",
            default=endpoints.DEFAULT_STATE_DIR,
            metavar="DIR",
            help=f"state directory: {state_dir_holds} (default: %(default)s)",
        )


def refuse(prog: str, message: str, code: int) -> NoReturn:
    """Stop the stage before it started: `PROG: message` on stderr, exit status `code`."""
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(code)


def become(prog: str, stage: str, whose: str, extra: frozenset[int] = frozenset()) -> None:
    """Take the stage's identity (`whose`: "the collector's", for the message), or exit 1 saying why."""
    try:
        privileges.become(stage, extra)
    except privileges.PrivilegeError as e:
        refuse(prog, f"cannot run as {whose} user: {e}", EXIT_CANNOT_RUN)


def load_config(prog: str, path: str) -> config_mod.ProfilerConfig:
    """The agent config, or exit 2 naming the key, the value and what is allowed."""
    try:
        return config_mod.load(path)
    except config_mod.ConfigError as e:
        refuse(prog, str(e), EXIT_BAD_CONFIG)


def hold_run_dir(prog: str, run_dir: str, name: str) -> None:
    """The run directory's lock for `name`, held for the process's life; before any socket: a second
    one on this run dir exits 1, naming this one's pid."""
    try:
        runlock.hold(run_dir, name)
    except (runlock.RunDirInUse, OSError) as e:
        refuse(prog, str(e), EXIT_CANNOT_RUN)


def shut_down(run_dir: str, name: str, *close: Callable[[], object]) -> None:
    """The stage's last step however its loop ended: its ready file withdrawn first (whoever waits on
    it sees the stage go), then what it holds closed, in order."""
    ready.withdraw(run_dir, name)
    for c in close:
        c()
