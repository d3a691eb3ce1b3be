"""`ebpfprofiler run`: profile this host with every stage, in the foreground.

Owns: starting the stages (uploader, symbolizer workers, collector — in that
order, so each one's peer is listening), waiting until each says it is ready
(shared/ready.py's rule: no time limit while a stage's start-up step, such as
the collector's BPF compile, keeps its heartbeat fresh, with a line every
PROGRESS_LOG_S saying what it does and for how long; READY_TIMEOUT_S for a
stage that says nothing; a stale heartbeat or an exit is a failure),
restarting a stage that dies (with backoff), and stopping them in the order
that loses nothing: collector first (it drains once more), then the workers
(they close their open windows), then the uploader (it delivers what it holds).

Children run in their own process group, so a Ctrl-C reaches only this
supervisor, which then stops them in order; they die with it if it is killed.
SIGHUP is passed on to the collector (which reads overhead_budget_pct again).
Each stage drops to its own user and capabilities as it starts
(shared/privileges.py); the supervisor prepares what those users need: the
runtime directory (group-writable by the agent's group), a state
directory per stage, the config as validated here (STATE_DIR/agent.yaml, which
the stages read: the file given may sit where they cannot, such as root's
home; SIGHUP validates it again and replaces the copy before passing the
signal on), and their code where they can import it (shared/stage_code.py).
Anything they would still be unable to read is an error before any starts.

Before any stage starts, it runs the collector's preflight (as the collector, with its
capabilities): a host that cannot run it is told why, and nothing is started.

Must not: do any stage's work itself, or create, chown or chmod a directory
through a symlink (shared/files.py's ensure_dir).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared import config as config_mod
from shared import counters, endpoints, files, privileges, ready, runlock, stage_code, stopping
from shared import log as log_mod
from shared.stage_code import default_bpf_dir
from shared.stopping import stop_on_signals

# A starting stage that says nothing for this long (no ready file, no fresh heartbeat) is reported: the
# stages start in about a second; the collector's BPF compile and load (~2.5 s here, 1-1.5 minutes under
# qemu TCG) keeps a heartbeat (shared/ready.py), which suspends this limit while it is fresh.
READY_TIMEOUT_S = 60.0
# While a stage's start-up step works, a line saying what it does and for how long this often.
PROGRESS_LOG_S = 10.0
# How often the wait for a starting stage looks at its files.
READY_POLL_S = 0.05
# How long a stopping stage may take before it is killed.
STOP_TIMEOUT_S = 20.0
# Restart backoff for a stage that died: doubles from the first to the cap.
RESTART_BACKOFF_S = (1.0, 30.0)
# A stage that ran this long before dying starts again from the first backoff.
STABLE_RUN_S = 60.0

log = logging.getLogger("ebpfprofiler.run")


@dataclass
class Stage:
    name: str
    argv: list[str]
    proc: subprocess.Popen[Any] | None = None  # only its pid and exit status are used, in any pipe mode
    started: float = 0.0
    backoff: float = RESTART_BACKOFF_S[0]
    restart_at: float | None = None
    restarts: int = field(default=0)
    env: dict[str, str] | None = None


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the process that started it dies, even by SIGKILL, so
    nothing it started (BPF programs, perf events) outlives its owner."""
    try:
        import prctl

        prctl.set_pdeathsig(signal.SIGTERM)
    except ImportError:
        pass


def _child_setup() -> None:
    os.setpgid(0, 0)  # Ctrl-C goes to the supervisor only
    die_with_parent()


def parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Profile this host now: starts the collector, symbolizer_workers symbolizer "
        "workers and the uploader in the foreground, prints where profiles go, "
        "restarts a stage that dies, and stops them all cleanly on Ctrl-C or SIGTERM. "
        'With endpoint "" in the config, profiles are written under local_dir '
        "(one directory per service); open one with `go tool pprof -http=:8080 FILE`. "
        "SIGHUP (kill -HUP PID) is passed to the collector, which reads overhead_budget_pct "
        "from --config again: edit the file, then send it to change the overhead budget "
        "without a restart. `ebpfprofiler status` prints what the profiler costs.",
    )
    p.add_argument("--config", required=True, help="agent YAML file (modules.ebpf_profiler block)")
    p.add_argument(
        "--run-dir",
        default=endpoints.DEFAULT_RUN_DIR,
        help="runtime directory for the stages' sockets (default: %(default)s)",
    )
    p.add_argument("--state-dir", default=endpoints.DEFAULT_STATE_DIR, help="state directory (default: %(default)s)")
    p.add_argument("--bpf-dir", default=default_bpf_dir(), help="BPF programs (default: %(default)s)")
    return p.parse_args(argv)


def stages(
    args: argparse.Namespace, cfg: config_mod.ProfilerConfig, code: stage_code.StageCode | None = None
) -> list[Stage]:
    code = code or stage_code.StageCode(bpf_dir=args.bpf_dir)
    py = [sys.executable, "-P", "-m"]  # -P: no working directory shadows the code the stage may read
    common = ["--config", stage_config(args.state_dir), "--run-dir", args.run_dir]
    out = [
        Stage("uploader", [*py, "uploader.main", *common, "--state-dir", stage_state_dir(args.state_dir, "uploader")])
    ]
    for w in range(cfg.symbolizer_workers):
        out.append(
            Stage(
                f"symbolizer-{w}",
                [
                    *py,
                    "symbolizer.main",
                    *common,
                    "--worker",
                    str(w),
                    "--state-dir",
                    stage_state_dir(args.state_dir, "symbolizer"),
                ],
            )
        )
    if cfg.runtime_reader_wanted:  # before the collector: subscribed before the first announcement
        out.append(
            Stage("runtime", [*py, "runtimes.main", *common, "--state-dir", stage_state_dir(args.state_dir, "runtime")])
        )
    out.append(Stage("collector", [*py, "collector.main", *common, "--bpf-dir", code.bpf_dir]))
    env = code.env()
    for stage in out:
        stage.env = env
    return out


def stage_config(state_dir: str) -> str:
    """The validated config the stages read: root's, readable by the agent's group only."""
    return os.path.join(state_dir, "agent.yaml")


def hand_config(state_dir: str, cfg: config_mod.ProfilerConfig) -> None:
    gid = privileges.ids("uploader")[1]
    files.write_atomic(stage_config(state_dir), config_mod.dump(cfg).encode(), mode=0o640, gid=gid)


def stage_state_dir(state_dir: str, stage: str) -> str:
    """Each stage user owns its own part of the state directory."""
    return os.path.join(state_dir, stage)


def prepare_dirs(args: argparse.Namespace, cfg: config_mod.ProfilerConfig) -> None:
    """The directories the stage users need, owned and moded as the systemd units have them; created
    and chowned without following a symlink. files.UnsafePath (nothing changed) for a symlink in one's
    path or one owned by someone other than root or its stage's user."""
    gid = privileges.ids("uploader")[1]  # the agent's group

    def ensure(path: str, owner: str | None, mode: int) -> None:
        # never through a symlink, and never someone else's directory (files.ensure_dir): root would
        # chown and chmod whatever it points to
        files.ensure_dir(path, privileges.ids(owner)[0] if owner else 0, gid, mode)

    uploader = privileges.STAGES["uploader"].user
    # the token is a secret only the uploader reads (uploader/http.py warns when group or others may read
    # it); a CA certificate is not secret, and the agent's group may read it
    advice = {
        "token_file": f"chown {uploader} it and chmod 600",
        "ca_file": f"chgrp {privileges.AGENT_GROUP} it and chmod 640",
    }
    for key in ("token_file", "ca_file"):
        path = getattr(cfg, key)
        if path and stage_code.unreadable_by_agent([path]):
            raise privileges.PrivilegeError(
                f"modules.ebpf_profiler.{key}: {path} is not readable by {uploader}: "
                f"{advice[key]}, in a directory {uploader} can enter"
            )
    # every stage binds its sockets here; sticky: a member of the group cannot unlink another's socket
    ensure(args.run_dir, None, 0o3770)
    ensure(args.state_dir, None, 0o750)
    ensure(stage_state_dir(args.state_dir, "symbolizer"), "symbolizer", 0o700)
    ensure(stage_state_dir(args.state_dir, "uploader"), "uploader", 0o700)
    if cfg.runtime_reader_wanted:
        ensure(stage_state_dir(args.state_dir, "runtime"), "runtime", 0o700)
    if cfg.uploads_locally:
        ensure(cfg.local_dir, "uploader", 0o750)
    for d in (args.run_dir, args.state_dir) + ((cfg.local_dir,) if cfg.uploads_locally else ()):
        if stage_code.unreadable_by_agent([d]):
            raise privileges.PrivilegeError(
                f"{d}: the agent's users cannot reach it (a directory above it is closed to group "
                f"{privileges.AGENT_GROUP}, e.g. root's 0700 home); choose one they can reach"
            )


def start(stage: Stage) -> None:
    ready.forget(run_dir_of(stage), stage.name)
    # cwd /: the directory `run` was started in may be one the stage's user cannot enter
    stage.proc = subprocess.Popen(stage.argv, preexec_fn=_child_setup, env=stage.env, cwd="/")  # noqa: PLW1509 - the child's own set-up (parent-death signal, process group)
    stage.started = time.monotonic()
    stage.restart_at = None
    log.info("started %s (pid %d)", stage.name, stage.proc.pid)


def run_dir_of(stage: Stage) -> str:
    return stage.argv[stage.argv.index("--run-dir") + 1]


def wait_ready(stage: Stage, stop: threading.Event, quiet_timeout_s: float = READY_TIMEOUT_S) -> str | None:
    """Wait until `stage` is ready (None) or why it will not be: it exited, its heartbeat went stale,
    or it said nothing for `quiet_timeout_s`; "" when `stop` was set first. While a start-up step
    works, logs what it does every PROGRESS_LOG_S."""
    assert stage.proc is not None
    watch = ready.StartWatch(run_dir_of(stage), stage.name, stage.proc.pid)
    said_at: float | None = None
    while not stop.is_set():
        got = watch.check()
        if got.state is ready.State.READY:
            if said_at is not None:
                log.info("%s ready after %.1f s", stage.name, time.monotonic() - stage.started)
            return None
        if stage.proc.poll() is not None:
            return f"exited with {stage.proc.returncode} before it was ready"
        if got.state is ready.State.STALE:
            return (
                f"its heartbeat stopped {got.quiet_s:.0f} s ago, {got.elapsed_s:.0f} s into "
                f"{got.doing} (not renewed for {ready.STALE_BEATS} beats)"
            )
        if got.state is ready.State.QUIET and got.quiet_s > quiet_timeout_s:
            return f"said nothing for {quiet_timeout_s:g} s and is not ready"
        if got.state is ready.State.WORKING:
            now = time.monotonic()
            if said_at is None:
                log.info("%s: %s", stage.name, got.doing)
                said_at = now
            elif now - said_at >= PROGRESS_LOG_S:
                log.info("%s: %s (%.0f s so far)", stage.name, got.doing, got.elapsed_s)
                said_at = now
        stop.wait(READY_POLL_S)
    return ""


def stop_stage(stage: Stage) -> None:
    p = stage.proc
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop within %.0f s: killing it", stage.name, STOP_TIMEOUT_S)
        p.kill()
        p.wait()
    log.info("stopped %s (exit %s)", stage.name, p.returncode)


# The collector's preflight probes the kernel (a few tiny programs) and reads /proc: a second or two;
# a host where it takes this long has a problem preflight would not name.
PREFLIGHT_TIMEOUT_S = 120.0


def preflight(collector: Stage, prog: str) -> bool:
    """The collector's preflight (collector/preflight.py), run as the collector will run, before any stage
    starts: a host that cannot run it is told each cause and what to do, and nothing is started. What the
    kernel lacks that the agent does without is logged."""
    try:
        out = subprocess.run(
            [*collector.argv, "--preflight"],
            env=collector.env,
            capture_output=True,
            text=True,
            timeout=PREFLIGHT_TIMEOUT_S,
            check=False,  # its exit status is read below
        )
    except subprocess.TimeoutExpired:
        print(f"{prog}: the collector's preflight took over {PREFLIGHT_TIMEOUT_S:.0f} s", file=sys.stderr)
        return False
    if out.returncode != 0:
        print(f"{prog}: this host cannot run the collector:\n{out.stdout}{out.stderr}", file=sys.stderr, end="")
        return False
    for line in out.stdout.splitlines():
        if line.startswith("warn "):
            log.warning("preflight: %s", line[len("warn ") :])
    return True


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler run") -> int:
    args = parse_args(argv, prog)
    log_mod.setup("run")
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    args.config = os.path.abspath(args.config)
    try:
        code = prepare(args, cfg)
    except (privileges.PrivilegeError, OSError, subprocess.SubprocessError, runlock.RunDirInUse) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1

    # The supervision loop sleeps until a stage exits (SIGCHLD), a stop signal, or a restart is due.
    wake = threading.Event()
    stop = stop_on_signals(log, "stopping every stage", also=wake)
    signal.signal(signal.SIGCHLD, lambda _s, _f: wake.set())

    where = profiles_go(cfg)
    print(f"ebpfprofiler: {where}", flush=True)

    all_stages = stages(args, cfg, code)
    if not preflight(all_stages[-1], prog):
        return 1
    signal.signal(signal.SIGHUP, hup_forwarder(args, all_stages))
    try:
        failed = start_all(all_stages, stop)
        if failed is not None:
            return failed
        log.info("all stages ready: %s", ", ".join(s.name for s in all_stages))
        supervise(all_stages, stop, wake, counters.CounterFile(args.run_dir, "run"))
        return 0
    finally:
        for stage in reversed(all_stages):  # collector, workers, uploader
            stop_stage(stage)
        print(f"ebpfprofiler: stopped; {where}", flush=True)


def prepare(args: argparse.Namespace, cfg: config_mod.ProfilerConfig) -> stage_code.StageCode:
    """Everything the stages need before any starts: their directories, this run directory held, the
    validated config handed to them, their code where they can import it."""
    prepare_dirs(args, cfg)
    runlock.hold(args.run_dir, "run")  # a second `ebpfprofiler run` here refuses, naming this one's pid
    hand_config(args.state_dir, cfg)
    return stage_code.prepare(os.path.join(args.state_dir, "code"), args.bpf_dir)


def profiles_go(cfg: config_mod.ProfilerConfig) -> str:
    """Where profiles go, as the start and stop lines say it."""
    if cfg.uploads_locally:
        return (
            f"profiles go to {cfg.local_dir}/<service>/ every {cfg.upload_interval_s} s; "
            f"look at one with: go tool pprof -http=:8080 FILE"
        )
    return f"profiles go to {cfg.endpoint.rstrip('/')}/v1/profiles every {cfg.upload_interval_s} s"


def hup_forwarder(args: argparse.Namespace, all_stages: list[Stage]) -> Callable[[int, object], None]:
    """The SIGHUP handler: the config validated again and handed to the stages, then the signal to the collector."""

    def forward_hup(_signum: int, _frame: object) -> None:
        try:  # the stages read the copy: validate the file again and replace the copy first
            hand_config(args.state_dir, config_mod.load(args.config))
        except (config_mod.ConfigError, OSError) as e:
            log.error("SIGHUP: %s; the stages keep the config they have", e)
            return
        for stage in all_stages:
            if stage.name == "collector" and stage.proc is not None and stage.proc.poll() is None:
                log.info("received SIGHUP: passing it to the collector (pid %d)", stage.proc.pid)
                stage.proc.send_signal(signal.SIGHUP)
                return
        log.warning("received SIGHUP, but the collector is not running: nothing to reload")

    return forward_hup


def start_all(all_stages: list[Stage], stop: threading.Event) -> int | None:
    """Start the stages in order, each once the one before is ready: None when all are, else the exit
    code: 0 when `stop` was set first, 1 when one did not become ready (logged)."""
    for stage in all_stages:
        start(stage)
        why = wait_ready(stage, stop)
        if why is not None:
            if stop.is_set():
                return 0
            log.error(
                "%s did not become ready: %s; see its log lines above%s",
                stage.name,
                why,
                ""
                if stage.proc is None or stage.proc.poll() is not None
                else "; stopping it (what it says as it stops is about this stop)",
            )
            return 1
    return None


def supervise(
    all_stages: list[Stage], stop: threading.Event, wake: threading.Event, exits: counters.CounterFile
) -> None:
    """Until `stop`: restart each stage that exits, after its backoff (reset when it had run STABLE_RUN_S).
    Each exit is counted (`<stage>_exits` in RUN_DIR/run.counters.json, shown by `status`)."""
    while not stop.is_set():
        due = [s.restart_at for s in all_stages if s.restart_at is not None]
        wake.wait(min([stopping.QUIET_WAKE_S] + [max(0.0, t - time.monotonic()) for t in due]))
        wake.clear()
        if stop.is_set():
            break
        now = time.monotonic()
        for stage in all_stages:
            p = stage.proc
            if stage.restart_at is not None:
                if now >= stage.restart_at:
                    stage.restarts += 1
                    start(stage)
            elif p is not None and p.poll() is not None:
                if now - stage.started > STABLE_RUN_S:
                    stage.backoff = RESTART_BACKOFF_S[0]
                log.error("%s exited with %s; restarting in %.0f s", stage.name, p.returncode, stage.backoff)
                key = f"{stage.name}_exits"
                exits.update({key: exits.get(key) + 1}, force=True)  # rare: written at once
                stage.restart_at = now + stage.backoff
                stage.backoff = min(stage.backoff * 2, RESTART_BACKOFF_S[1])


if __name__ == "__main__":
    sys.exit(main())
