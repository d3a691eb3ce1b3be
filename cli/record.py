"""`ebpfprofiler record`: profile this host (or some processes) now, in the foreground, into one file.

Owns: the recording's command line, a private workspace (config, runtime,
state and profile directories under /tmp, reachable by the agent's users and
removed at the end), running the agent itself (`ebpfprofiler run` as a child,
so the stages, privileges and code paths are the agent's) with profiles
written locally in short windows and plain pid labels, the progress line,
and at the end: merging what was written, keeping the processes asked for,
writing -o by its extension (report/profiles.py; 0600 unless --mode, never
through a symlink: shared/files.py's write_atomic) and printing the top
functions. -o's directory is checked before the recording starts.

With `-- COMMAND ARGS...` (cli/record_command.py) it starts the command once
the agent is ready, keeps the samples of the command's process tree, stops
when the command exits and exits with the command's status; its own lines
then go to stderr (stdout is the command's), the progress line only to a
terminal.

Must not: do any stage's work itself, or leave anything behind (the child
`run` stops every stage in order on Ctrl-C, SIGTERM or the end).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from cli import record_command, status
from cli.record_command import ProcessTree
from cli.run import PROGRESS_LOG_S, READY_TIMEOUT_S, die_with_parent
from report import profiles as profiles_mod
from shared import config as config_mod
from shared import files, privileges, procstat, ready
from shared import log as log_mod
from shared.safestr import printable
from shared.stopping import stop_on_signals

DEFAULT_DURATION_S = 30.0
# Windows this long: profiles (and the progress line's figures) arrive every few seconds.
WINDOW_S = 2
# `run` judges each stage's start (shared/ready.py: no limit while a heartbeat is fresh, READY_TIMEOUT_S
# for a stage that says nothing) and exits when one fails; this is only for a `run` that cannot: a start
# in which nothing at all happened (no stage became ready, no heartbeat was renewed) for this long.
START_QUIET_S = READY_TIMEOUT_S + 30.0
# `run` drains once more and every window is written before it exits; then it is killed.
STOP_TIMEOUT_S = 90.0
# With a command: the progress line is redrawn this often (on a terminal only), the tree looked at this often.
COMMAND_PROGRESS_S = 1.0
TREE_POLL_S = 0.1
# A plain progress line this often when stdout is not a terminal.
PLAIN_PROGRESS_S = 3.0
# How often the progress line is redrawn on a terminal.
TTY_PROGRESS_S = 0.5
# How often the start is looked at when stdout is not a terminal (the stages' files: a few reads).
START_POLL_S = 0.1
# Functions printed at the end.
TOP_N = 15
# Run log lines shown when `run` fails.
LOG_TAIL_LINES = 40


DESCRIPTION = (
    "Profile this host now, without a config file or a backend: runs the agent's stages in the foreground "
    "for -d seconds (Ctrl-C ends it early and still writes the result), then writes -o and prints the top "
    "functions. Run as root, like `ebpfprofiler run`."
)
COMMAND_HELP = """\
With -- COMMAND ARGS...: the agent starts first; once it is ready (a few seconds), the command
is started and profiled, it and every process it starts, from its first instruction; the
recording stops when the command exits (the last windows are written), and record exits with
the command's status (killed by signal N: 128+N, as a shell says it). Only the samples of the
command's process tree are kept: a process whose parent chain leads to the command when record
sees it (record is the tree's subreaper, so a daemonizing child stays in it). A child that
lives under about a second may be sampled before the collector reads its /proc, and its
samples then go to [unknown], which is left out. The command runs as the user who ran sudo
(SUDO_UID, SUDO_GID and that user's groups) when record runs under sudo, else as root, with
record's environment, working directory and standard streams: record's own lines go to stderr,
the progress line (elapsed time, cpu samples, processes, samples lost; redrawn once a second)
only when stderr is a terminal. A Ctrl-C on the terminal reaches the command directly; SIGINT
or SIGTERM sent to record alone is passed on to the command; the third kills it (SIGKILL).
-d and -p cannot be given with a command (it is recorded for as long as it runs).

examples:
  ebpfprofiler record -o out.html -- python3 app.py --port 8080
  sudo ebpfprofiler record --runtime python,node -o out.speedscope.json -- make test
"""


def parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    options, command = record_command.split_command(sys.argv[1:] if argv is None else argv)
    p = _parser(prog)
    args = p.parse_args(options)
    args.command = command
    _check_duration_and_targets(p, args)
    try:
        args.runtimes = record_command.parse_runtimes(args.runtime + (["python"] if args.python else []))
    except ValueError as e:
        p.error(str(e))
    if profiles_mod.output_extension(args.output) is None:
        p.error(f"-o {args.output}: the extension must be one of {', '.join(profiles_mod.OUTPUT_EXTENSIONS)}")
    return args


def _parser(prog: str) -> argparse.ArgumentParser:
    """record's options, in the order --help lists them: what and how long, what is sampled, the result."""
    p = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [options] [-- COMMAND ARGS...]",
        description=DESCRIPTION,
        epilog=COMMAND_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_options(p)
    add_sampling_options(p)
    _add_output_options(p)
    return p


def _add_target_options(p: argparse.ArgumentParser) -> None:
    """-d, and -p or --all: how long and which processes (a command's recording has neither)."""
    p.add_argument(
        "-d",
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"how long to record (default: {DEFAULT_DURATION_S:g}; not with a command)",
    )
    who = p.add_mutually_exclusive_group()
    add_pid_option(who, "keep only the samples of these processes (recording stops early when all have exited)")
    who.add_argument("--all", action="store_true", help="every process of the host (the default)")


def add_pid_option(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, help_: str) -> None:
    """-p PID...: repeatable, each taking one or more pids."""
    p.add_argument("-p", "--pid", type=int, nargs="+", action="extend", default=[], metavar="PID", help=help_)


def add_sampling_options(p: argparse.ArgumentParser, offcpu: bool = True) -> None:
    """--hz, --offcpu (unless not `offcpu`: then False), --runtime and --python: what the agent samples."""
    p.add_argument("--hz", type=int, default=99, help="samples per second per CPU (default: %(default)s)")
    if offcpu:
        p.add_argument("--offcpu", action="store_true", help="off-CPU profiles too (time blocked, with stacks)")
    else:
        p.set_defaults(offcpu=False)
    names = ",".join(record_command.runtime_names())
    p.add_argument(
        "--runtime",
        action="append",
        default=[],
        metavar="NAMES",
        help=f"read these runtimes' stacks too: a comma-separated list of {names}, or all "
        "(python: python_wall of CPython 3.11 and newer; node: node_cpu; jvm: jvm_wall and jvm_cpu; "
        "php, ruby: their _wall profiles; dotnet: JIT names in cpu); may be repeated",
    )
    p.add_argument("--python", action="store_true", help="the same as --runtime python")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """-o and --mode: the file written and its permissions."""
    p.add_argument(
        "-o",
        "--output",
        default="profile.html",
        help="result by extension: .html (the report), .pb.gz (pprof: the cpu profile; other "
        "types beside it as NAME.TYPE.pb.gz), .folded (folded stacks, likewise), .speedscope.json "
        "(speedscope's viewer: one profile per type, process and thread, in time order) "
        "(default: %(default)s); written beside its name, then renamed into place (a "
        "symlink there is replaced, never followed); its directory must exist",
    )
    p.add_argument(
        "--mode",
        type=files.parse_mode,
        default=files.PRIVATE_MODE,
        metavar="OCTAL",
        help="permissions of the files written, such as 0644 (default: 0600, root's alone: the "
        "stacks recorded may be other users')",
    )


def _check_duration_and_targets(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """With a command: a command after --, and no -d, -p or --all. Without: -d defaults. -d above 0 either way.
    (p.error exits on the first wrong one.)"""
    if args.command is not None:
        if not args.command:
            p.error("no command after --")
        if args.duration is not None:
            p.error("-d cannot be given with a command: it is recorded for as long as it runs")
        if args.pid or args.all:
            p.error("-p and --all cannot be given with a command: its own processes are recorded")
    elif args.duration is None:
        args.duration = DEFAULT_DURATION_S
    if args.duration is not None and args.duration <= 0:
        p.error("-d must be more than 0 seconds")


def make_config(args: argparse.Namespace, local_dir: str, window_s: int = WINDOW_S) -> config_mod.ProfilerConfig:
    """The recording's config, validated as a config file is (config_mod.ConfigError: --hz out of range)."""
    runtimes: record_command.Runtimes = args.runtimes
    return config_mod.ProfilerConfig().replace(
        sample_hz=args.hz,
        upload_interval_s=window_s,
        offcpu=args.offcpu,
        python_stacks=runtimes.python_stacks,
        runtime_stacks=runtimes.runtime_stacks,
        plain_pid=True,
        endpoint="",
        local_dir=local_dir,
        # the rate asked for is the rate recorded: a short foreground recording is not held to the
        # agent's budget (which would halve the rate while start-up builds unwind tables)
        overhead_budget_pct=100.0,
    )


WORKSPACE_PREFIX = "ebpfprofiler-record-"
OWNER_FILE = "owner"  # "PID START_TICKS" of the record that made the workspace


def workspace() -> str:
    """/tmp/ebpfprofiler-record-XXXX: root's, enterable by the agent's group (pytest's and home dirs are not).
    Workspaces of recordings killed outright (their owner gone) are removed first."""
    sweep_stale_workspaces()
    gid = privileges.ids("uploader")[1]
    path = tempfile.mkdtemp(prefix=WORKSPACE_PREFIX, dir="/tmp")
    os.chown(path, 0, gid)
    os.chmod(path, 0o750)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(f"{os.getpid()} {procstat.start_ticks(os.getpid())}\n")
    return path


def sweep_stale_workspaces(tmp: str = "/tmp") -> list[str]:
    """Remove the workspaces whose recording is gone: root's own directories only (/tmp is everyone's),
    with an owner file naming a (pid, start time) that no longer runs. The paths removed."""
    removed = []
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
            if not name.startswith(WORKSPACE_PREFIX) or not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid, ticks = (int(x) for x in f.read(64).split())
        except (OSError, ValueError):
            continue
        if procstat.start_ticks(pid) != ticks:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class Progress:
    """What has been recorded so far, from the profiles written and the collector's status file."""

    def __init__(self, local_dir: str, run_dir: str, pids: set[int], consume: bool = False) -> None:
        self.local_dir, self.run_dir, self.pids = local_dir, run_dir, pids
        self.consume = consume  # remove each file once read (top: a recording with no end)
        self.seen: set[str] = set()
        self.samples = 0
        self.processes: set[str] = set()
        self.lost = 0
        self._status_time = 0

    def update(self) -> list[profiles_mod.Loaded]:
        """Read the profiles written since the last call: their samples of the processes asked for."""
        new = [p for p in profiles_mod.profile_files([self.local_dir]) if p not in self.seen]
        loaded = profiles_mod.load(new, profiles_mod.Skipped())
        if self.consume:  # the agent writes each file whole (files.write_atomic): none is read again
            for path in new:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        else:
            self.seen.update(x.path for x in loaded)  # a file still being written is read again next time
        if self.pids:
            loaded = profiles_mod.keep_pids(loaded, self.pids)
        for item in loaded:
            if item.profile_type == "cpu":
                self.samples += sum(s.values[0] for s in item.profile.samples)
            self.processes.update(str(s.labels.get("pid")) for s in item.profile.samples)
        try:  # the collector's figures of its last window (`ebpfprofiler status` reads the same file)
            doc = status.load(self.run_dir) or {}
            if doc.get("time_ns", 0) != self._status_time:
                self._status_time = doc.get("time_ns", 0)
                self.lost += sum(int(v) for v in doc.get("lost", {}).values())
        except (OSError, ValueError, TypeError, AttributeError):
            pass  # being replaced, or not written yet
        return loaded

    def line(self, left_s: float) -> str:
        return (
            f"recording: {max(0.0, left_s):4.0f} s left, {self.samples} cpu samples, "
            f"{len(self.processes)} processes, {self.lost} samples lost"
        )


class StartProgress:
    """The agent's start as `run` goes through it, read from the stages' ready and progress files."""

    def __init__(self, run_dir: str, names: list[str]) -> None:
        self.started = time.monotonic()
        self.watches = {n: ready.StartWatch(run_dir, n) for n in names}
        self.looks: dict[str, ready.Start] = {}

    def check(self) -> None:
        self.looks = {n: w.check() for n, w in self.watches.items()}

    def ready(self) -> bool:
        return all(s.state is ready.State.READY for s in self.looks.values())

    def stuck(self) -> str | None:
        """Why the start will not finish (a stale heartbeat; nothing happened for START_QUIET_S), or None."""
        for name, s in self.looks.items():
            if s.state is ready.State.STALE:
                return f"{name}'s heartbeat stopped {s.quiet_s:.0f} s ago, {s.elapsed_s:.0f} s into {s.doing}"
        quiet = time.monotonic() - max(w.last_sign for w in self.watches.values())
        if quiet > START_QUIET_S:
            return f"nothing happened for {quiet:.0f} s"
        return None

    def line(self) -> str:
        working = [
            f"; {n} {s.doing} ({s.elapsed_s:.0f} s so far)"
            for n, s in self.looks.items()
            if s.state is ready.State.WORKING
        ]
        done = sum(s.state is ready.State.READY for s in self.looks.values())
        return f"starting: {done} of {len(self.looks)} stages ready" + "".join(working)


def tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler record") -> int:
    args = parse_args(argv, prog)
    log_mod.setup("record")
    refused = refusal(args, prog)
    if refused is not None:
        return refused
    recording = open_recording(args, prog, "stopping the recording")
    if isinstance(recording, int):
        return recording
    try:
        recording.start_agent()
        failed = recording.wait_started()
        if failed is not None:
            return failed
        if args.command is not None:
            progress, status_ = recording.record_command()
            if recording.command is None:  # it could not be started (said): nothing of it to write
                return status_
            return recording.finish(progress, status_)
        progress = recording.record()
        return recording.finish(progress)
    finally:
        recording.close()
        if recording.command is not None and record_command.exit_of(recording.command) is not None:
            recording.command.wait()  # exited, left a zombie until the agent's last drain: reaped


def open_recording(
    args: argparse.Namespace, prog: str, stopping: str, cls: type[Recording] | None = None
) -> Recording | int:
    """A `cls` (Recording) in a new workspace, SIGINT and SIGTERM setting its stop (logged as
    `stopping`); or the exit code, said, when no workspace can be made."""
    try:
        ws = workspace()
    except (privileges.PrivilegeError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    stop = stop_on_signals(logging.getLogger("ebpfprofiler.record"), stopping)
    return (cls or Recording)(args, prog, ws, stop)


def agent_refusal(args: argparse.Namespace, prog: str) -> int | None:
    """The exit code (said on stderr) of an agent that cannot start for `prog`: not root, a bad option
    value, a process asked for (-p) that is gone; None when it can."""
    if os.geteuid() != 0:
        print(
            f"{prog}: run as root (the collector loads BPF programs; every stage then drops to its own user)",
            file=sys.stderr,
        )
        return 1
    try:
        make_config(args, "/")
    except config_mod.ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    gone = sorted(p for p in set(args.pid) if not procstat.alive(p))
    if gone:
        print(f"{prog}: no process {', '.join(map(str, gone))}", file=sys.stderr)
        return 2
    return None


def refusal(args: argparse.Namespace, prog: str) -> int | None:
    """The exit code (said on stderr) of a recording that cannot start: agent_refusal's, a command not
    found, -o's directory; None when it can."""
    refused = agent_refusal(args, prog)
    if refused is not None:
        return refused
    if args.command is not None:
        why = record_command.find_command(args.command)
        if why:
            print(f"{prog}: {why}; nothing was recorded", file=sys.stderr)
            return 127
    problem = files.output_dir_problem(args.output)
    if problem:  # before recording, not after: the recording would be lost
        print(f"{prog}: -o {problem}; nothing was recorded", file=sys.stderr)
        return 2
    return None


class Recording:
    """One recording in its workspace: the agent (`run` as a child), the start, the recording loop with
    its progress line, and the result."""

    window_s = WINDOW_S  # the agent's windows: how often profiles are written

    def __init__(self, args: argparse.Namespace, prog: str, ws: str, stop: threading.Event) -> None:
        self.args, self.prog, self.ws, self.stop = args, prog, ws, stop
        self.pids = set(args.pid)
        self.target = f"processes {' '.join(map(str, sorted(self.pids)))}" if self.pids else "every process"
        # with a command, stdout is the command's: record's own lines go to stderr
        self.out: TextIO = sys.stdout if args.command is None else sys.stderr
        self.tty = self.out.isatty()
        self.child: subprocess.Popen[bytes] | None = None
        self.command: subprocess.Popen[bytes] | None = None
        self.run_log = os.path.join(ws, "run.log")
        self.local_dir, self.run_dir, self.state_dir = (os.path.join(ws, d) for d in ("profiles", "run", "state"))
        self.stages: list[str] = []

    def close(self) -> None:
        """Stop the agent (its last windows are written) and remove the workspace."""
        if self.child is not None:
            stop_child(self.child)
        shutil.rmtree(self.ws, ignore_errors=True)

    def start_agent(self) -> None:
        """Write the recording's config and start `run` on it."""
        cfg = make_config(self.args, self.local_dir, self.window_s)
        config = os.path.join(self.ws, "agent.yaml")
        with open(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(config_mod.dump(cfg))
        self.stages = (
            ["uploader", "collector"]
            + [f"symbolizer-{w}" for w in range(cfg.symbolizer_workers)]
            + (["runtime"] if cfg.runtime_reader_wanted else [])
        )
        with open(self.run_log, "wb") as logf:
            # its own session: Ctrl-C reaches this process, which stops `run`, which stops the stages in
            # order; and a SIGTERM to `run` if this process is killed outright (else the agent, its BPF
            # programs and its perf events would run on with nobody to stop them)
            self.child = subprocess.Popen(
                [
                    sys.executable,
                    "-P",  # the user's working directory must not shadow the installed code
                    "-m",
                    "cli.main",
                    "run",
                    "--config",
                    config,
                    "--run-dir",
                    self.run_dir,
                    "--state-dir",
                    self.state_dir,
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - prctl(PR_SET_PDEATHSIG) must run in the child
            )
        print(
            f"{self.prog}: starting the profiler (the collector compiles and loads its BPF programs) ...",
            file=self.out,
            flush=True,
        )

    def wait_started(self) -> int | None:
        """Show the start until every stage is ready (None), or the exit code: 1 when it will not finish
        (said with the run log), 130 on a stop."""
        child, out, tty = self.child, self.out, self.tty
        assert child is not None
        starting = StartProgress(self.run_dir, self.stages)
        last_plain = time.monotonic()
        while True:
            starting.check()
            if starting.ready():
                break
            stuck = f"exit {child.returncode}" if child.poll() is not None else starting.stuck()
            if stuck:
                if tty:
                    print(file=out)
                print(
                    f"{self.prog}: the profiler did not start ({stuck}); its log:\n{tail(self.run_log)}",
                    file=sys.stderr,
                )
                return 1
            now = time.monotonic()
            if tty:
                print("\r\033[K" + starting.line(), end="", file=out, flush=True)
            elif now - last_plain >= PROGRESS_LOG_S:
                print(starting.line(), file=out, flush=True)
                last_plain = now
            if self.stop.wait(TTY_PROGRESS_S if tty else START_POLL_S):
                if tty:
                    print(file=out)
                return 130
        if tty:
            print("\r\033[K", end="", file=out, flush=True)
        took = f"the profiler started in {time.monotonic() - starting.started:.1f} s"
        print(self.started_line(took), file=out, flush=True)
        return None

    def started_line(self, took: str) -> str:
        """What is said once every stage is ready (`took`: how long that took)."""
        if self.args.command is not None:
            return f"{self.prog}: recording the command at {self.args.hz} Hz ({took})"
        return (
            f"{self.prog}: recording {self.target} for {self.args.duration:g} s at {self.args.hz} Hz "
            f"({took}; Ctrl-C ends it early)"
        )

    def record(self) -> Progress:
        """Record until -d ends, a stop, `run` exits or every process asked for is gone, with the progress
        line; then stop `run` (the last windows are written)."""
        child, out, tty, pids = self.child, self.out, self.tty, self.pids
        assert child is not None
        progress = Progress(self.local_dir, self.run_dir, pids)
        end = time.monotonic() + self.args.duration
        last_plain = time.monotonic()
        while not self.stop.wait(TTY_PROGRESS_S):
            now = time.monotonic()
            targets_gone = bool(pids) and not any(procstat.alive(p) for p in pids)
            if now >= end or child.poll() is not None or targets_gone:
                break
            progress.update()
            if tty:
                print("\r\033[K" + progress.line(end - now), end="", file=out, flush=True)
            elif now - last_plain >= PLAIN_PROGRESS_S:
                print(progress.line(end - now), file=out, flush=True)
                last_plain = now
        if tty:
            print(file=out)
        if child.poll() is not None:
            print(
                f"{self.prog}: the profiler stopped early (exit {child.returncode}); its log:\n{tail(self.run_log)}",
                file=sys.stderr,
            )
        print(f"{self.prog}: stopping (the last windows are written) ...", file=out, flush=True)
        stop_child(child)
        return progress

    def record_command(self) -> tuple[Progress, int]:
        """Start the command (the agent is ready), follow its process tree until it exits, with the progress
        line on a terminal; then stop `run` (the last windows are written). (progress, the command's exit
        status as a shell gives it.)"""
        child, out, tty = self.child, self.out, self.tty
        assert child is not None and self.args.command is not None
        who = record_command.run_as(os.environ)
        record_command.become_subreaper()
        try:
            proc = self.command = record_command.start(self.args.command, who)
        except OSError as e:
            print(f"{self.prog}: cannot start {printable(self.args.command[0])}: {e.strerror or e}", file=sys.stderr)
            return Progress(self.local_dir, self.run_dir, set()), 126 if isinstance(e, PermissionError) else 127
        forward_signals_to(proc)
        tree = record_command.ProcessTree(proc.pid, os.getpid(), other_session=child.pid)
        self.pids = tree.members  # grows as the tree does: Progress and finish keep its samples
        self.target = "the command's processes"
        progress = Progress(self.local_dir, self.run_dir, tree.members)
        name = printable(os.path.basename(self.args.command[0]))[:40]
        began = time.monotonic()
        status_ = self.follow_command(proc, tree, progress, name, began)
        tree.scan()
        if tty:
            print(file=out)
        print(
            f"{self.prog}: {name} exited ({record_command.describe(status_)}) after {time.monotonic() - began:.1f} s; "
            "stopping (the last windows are written) ...",
            file=out,
            flush=True,
        )
        stop_child(child)
        return progress, status_

    def follow_command(
        self,
        proc: subprocess.Popen[bytes],
        tree: ProcessTree,  # record_command here would be the method
        progress: Progress,
        name: str,
        began: float,
    ) -> int:
        """Scan the command's tree every TREE_POLL_S until the command exits (its status as a shell gives it),
        redrawing the progress line on a terminal; said once (with the run log) if `run` stops first, the
        command then running on unrecorded."""
        child, out, tty = self.child, self.out, self.tty
        assert child is not None
        drawn = float("-inf")
        said_stopped = False
        status_ = None
        while status_ is None:
            tree.scan()
            if child.poll() is not None and not said_stopped:
                if tty:
                    print(file=out)
                print(
                    f"{self.prog}: the profiler stopped early (exit {child.returncode}); the command runs on, "
                    f"unrecorded; its log:\n{tail(self.run_log)}",
                    file=sys.stderr,
                )
                said_stopped = True
            now = time.monotonic()
            if tty and now - drawn >= COMMAND_PROGRESS_S:
                progress.update()
                print(
                    "\r\033[K" + command_line(name, now - began, progress, len(tree.members)),
                    end="",
                    file=out,
                    flush=True,
                )
                drawn = now
            status_ = record_command.exit_of(proc)
            if status_ is None:
                time.sleep(TREE_POLL_S)
        return status_

    def finish(self, progress: Progress, command_status: int | None = None) -> int:
        """Write -o from what was recorded and print the top functions: the exit code (with a command, its
        status; 1 in its place when it exited 0 but nothing could be written)."""
        prog, out, pids = self.prog, self.out, self.pids
        failed = command_status or 1
        loaded = profiles_mod.load([self.local_dir])
        if pids:
            loaded = profiles_mod.keep_pids(loaded, pids)
        if not loaded:
            print(
                f"{prog}: no samples were recorded{' of ' + self.target if pids else ''}; the profiler's log:\n"
                f"{tail(self.run_log)}",
                file=sys.stderr,
            )
            return failed
        progress.update()  # the last windows, and the collector's last figures
        print(
            f"recorded: {progress.samples} cpu samples, {len(progress.processes)} processes, "
            f"{progress.lost} samples lost",
            file=out,
            flush=True,
        )
        try:
            written = profiles_mod.write_outputs(loaded, self.args.output, self.args.mode)
        except OSError as e:  # its directory was checked at the start; changed since
            print(f"{prog}: cannot write {self.args.output}: {e.strerror or e}", file=sys.stderr)
            return failed
        groups = profiles_mod.by_type(loaded)
        for ptype, items in groups.items():
            print(f"\ntop {TOP_N} functions, {ptype} ({items[0].profile.sample_types[-1][0]}):", file=out)
            print(profiles_mod.top_table(items, TOP_N), file=out)
        print(f"\n{prog}: wrote {', '.join(written)}", file=out, flush=True)
        return command_status or 0


def forward_signals_to(proc: subprocess.Popen[bytes]) -> None:
    """From now on the SIGINT and SIGTERM record receives go to record_command.forward (passed on to the
    command, the third as SIGKILL); the recording itself goes on until the command exits."""
    signals: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        record_command.forward(proc, signum, len(signals))

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def command_line(name: str, elapsed_s: float, progress: Progress, processes: int) -> str:
    """The progress line of a command's recording (`name` already printable)."""
    return (
        f"recording {name}: {elapsed_s:4.0f} s, {progress.samples} cpu samples, {processes} processes, "
        f"{progress.lost} samples lost"
    )


def stop_child(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is not None:
        return
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # its session: run and every stage it started
        child.wait()


if __name__ == "__main__":
    sys.exit(main())
