"""The systemd units really run: systemd boots in a container, `make install`, the target starts.

Given a Debian bookworm root (debootstrap, cached between runs) booted with
systemd-nspawn, with a copy of this working tree inside and a config that
keeps every default but a 2 s window (and reads CPython 3.11 stacks too),
when `make install` runs there and ebpfprofiler.target is started, then
every stage reports ready (Type=notify) as its own user with its own
capabilities, a JIT workload run by an ordinary user from its home directory
is profiled into the default local_dir with names from its ELF symbols and
from its perf map (so ProtectHome= and the collector's PrivateTmp= hide
neither), a Python workload of that user is read by the runtime reader as
its hardened unit runs it, and stopping the target ends every stage cleanly
and leaves no BPF program behind.

Every process the test starts ends, by pid, even when it fails: the container
is powered off (SIGTERM to systemd-nspawn, SIGKILL to the container's init
if that does not do it) and its overlay unmounted.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.assets import debroot
from shared import pprof
from shared.privileges import OPTIONAL_CAPS, STAGES, mask
from tests.harness import (
    FRAME_POINTER_FLAGS,
    PY,
    ROOT,
    bpf_holdings,
    bpftool,
    namespace_host_gaps,
    require_root,
    wait_for,
)

CACHE = Path("/var/cache/ebpfprofiler-test")
SUITE = "bookworm"
# Booting systemd, and what pip needs to reach the index over TLS; the rest of the
# root's packages come from deploy/setup.sh's SYSTEM_PACKAGES (what make install
# needs). linux-headers-amd64 is the fallback header tree setup.sh links for a
# kernel Debian has no headers for (it would apt-get it inside, more slowly).
BOOT_PACKAGES = ("systemd", "systemd-sysv", "dbus", "ca-certificates", "linux-headers-amd64")
# Bump when the way the root is built changes: a new cache key.
ROOT_RECIPE = 1

UNITS = (
    "ebpfprofiler-uploader.service",
    "ebpfprofiler-symbolizer@0.service",
    "ebpfprofiler-collector.service",
    "ebpfprofiler-runtime.service",
)
READY_FILES = ("uploader.ready", "symbolizer-0.ready", "collector.ready", "runtime.ready")
STAGE_OF_UNIT = {UNITS[0]: "uploader", UNITS[1]: "symbolizer", UNITS[2]: "collector", UNITS[3]: "runtime"}
RUN_DIR = "/run/ebpfprofiler"
PROFILES = "/var/lib/ebpfprofiler/profiles"
# Every default but the window, so a profile is written within seconds, and CPython 3.11
# (bookworm's) read by the runtime reader too.
TEST_CONFIG = "modules:\n  ebpf_profiler:\n    upload_interval_s: 2\n    runtime_stacks: [python_legacy]\n"
WORKLOAD_USER = "profiled"
WORKLOAD = f"/home/{WORKLOAD_USER}/jit"
WORKLOAD_SERVICE_DIR = "home_profiled_jit"  # uploader/local.py's safe_name of WORKLOAD
# A Python workload of the ordinary user, for the runtime reader: spin_here() for up to 120 s.
PY_WORKLOAD = f"/home/{WORKLOAD_USER}/spin.py"
PY_WORKLOAD_TEXT = """import time

def spin_here(end):
    while time.monotonic() < end:
        pass

spin_here(time.monotonic() + 120)
"""
PY_SERVICE_DIR = "usr_bin_python3.11"
# Program names of bpf/*.c as `bpftool prog` shows them (the kernel keeps 15 characters).
OUR_PROGRAMS = re.compile(r"^(on_cpu_sample|offcpu_switch|offcpu_resume|oncpu_unwind_st|offcpu_unwind_)")
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def log(msg: str) -> None:
    print(f"test_systemd: {msg}", flush=True)


# ------------------------------------------------------------------ the cached root


def system_packages() -> list[str]:
    """SYSTEM_PACKAGES of deploy/setup.sh: what `make install` installs on a host."""
    m = re.search(r'^SYSTEM_PACKAGES="([^"]*)"', (ROOT / "deploy" / "setup.sh").read_text(), re.MULTILINE)
    assert m, "deploy/setup.sh has no SYSTEM_PACKAGES line"
    return m.group(1).split()


def cached_root() -> tuple[Path, bool]:
    """(the root directory, whether it was built now). Built once per package list and mirror."""
    return debroot.cached_root(SUITE, [*BOOT_PACKAGES, *system_packages()], ROOT_RECIPE, name="root", log=log)


# ------------------------------------------------------------------ pip as on this host


def host_pip() -> tuple[dict[str, str], list[str]]:
    """This host's pip settings as PIP_* variables, and the local paths they name (bound read-only).

    `make install` in the container must reach the same package indexes, with
    the same certificates, as `make setup` did here.
    """
    settings: dict[str, str] = {}
    out = subprocess.run([PY, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if "." in key and value:
            settings[key.split(".", 1)[1]] = ast.literal_eval(value)
    for k, v in os.environ.items():
        if k.startswith("PIP_"):
            settings[k[4:].lower().replace("_", "-")] = v
    env = {"PIP_" + k.upper().replace("-", "_"): v for k, v in settings.items()}
    binds: set[str] = set()
    for value in settings.values():
        for token in value.split():
            if token.startswith("file://"):
                # A PEP 503 index links to its files relative to itself (../../files/…):
                # bind the directory that holds the index.
                path = os.path.dirname(token[len("file://") :].rstrip("/"))
            elif token.startswith("/"):
                path = token
            else:
                continue
            if os.path.exists(path):
                binds.add(os.path.realpath(path))
    return env, sorted(binds)


# ------------------------------------------------------------------ the container


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out += kids
                todo += kids
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _nspid(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except FileNotFoundError:
        pass
    return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Container:
    """An overlay on the cached root, booted with systemd-nspawn until poweroff()."""

    def __init__(self, lower: Path, workdir: Path, binds: list[str], env: dict[str, str]) -> None:
        self.workdir = workdir
        self.root = workdir / "merged"
        self.env = env
        self.nspawn: subprocess.Popen | None = None
        self.init_pid = 0
        for d in ("upper", "work", "merged"):
            (workdir / d).mkdir(parents=True)
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={lower},upperdir={workdir / 'upper'},workdir={workdir / 'work'}",
                str(self.root),
            ],
            check=True,
            timeout=30,
        )
        self.mounted = True
        self.binds = binds
        self.console_path = workdir / "console.log"
        self.root_note = ""

    def boot(self) -> None:
        (self.root / "etc/hostname").write_text("ebpfprofiler-ct\n")
        argv = [
            "systemd-nspawn",
            "--register=no",
            "--keep-unit",
            "--boot",
            "--directory",
            str(self.root),
            "--machine=ebpfprofiler-ct",
            "--console=read-only",
            "--capability=all",
            "--system-call-filter=bpf perf_event_open",
            f"--bind={CACHE / 'pip'}:/root/.cache/pip",
        ]
        argv += [f"--bind-ro={b}" for b in self.binds]
        (CACHE / "pip").mkdir(parents=True, exist_ok=True)
        self._console = open(self.console_path, "w")  # noqa: SIM115
        self.nspawn = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._console, stderr=subprocess.STDOUT)

        def init() -> int:
            if self.nspawn is None or self.nspawn.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited:\n{self.console()}\n{namespace_host_gaps()}")
            return next((p for p in _descendants(self.nspawn.pid) if _nspid(p)[-1:] == [1]), 0)

        self.init_pid = wait_for("the container's init", init, timeout=30)
        # "offline" until the manager answers; --wait then waits for the boot to finish.
        wait_for(
            "systemd in the container to answer",
            lambda: (
                self.run(["systemctl", "is-system-running"], check=False, timeout=10).stdout.strip()
                not in ("", "offline")
            ),
            timeout=60,
            interval=0.2,
        )
        state = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=120).stdout.strip()
        assert state in ("running", "degraded"), (
            f"the container did not boot: {state}\n{self.console()}\n{namespace_host_gaps()}"
        )

    def run(
        self, argv: list[str], check: bool = True, timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """argv inside the container (every namespace of its init), as root, with a clean environment."""
        assert self.init_pid
        base = {"PATH": CONTAINER_PATH, "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
        out = subprocess.run(
            [
                "nsenter",
                "--target",
                str(self.init_pid),
                "--all",
                "env",
                "-i",
                *(f"{k}={v}" for k, v in base.items()),
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {out.returncode} in the container:\n"
                f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
            )
        return out

    def path(self, path: str) -> Path:
        """`path` as the container's init sees it (its /run and /proc are its own mounts)."""
        return Path(f"/proc/{self.init_pid}/root") / path.lstrip("/")

    def host_pid(self, container_pid: int) -> int:
        """The host pid of a process of this container."""
        ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        for p in _descendants(self.init_pid):
            try:
                if _nspid(p)[-1:] == [container_pid] and os.readlink(f"/proc/{p}/ns/pid") == ns:
                    return p
            except FileNotFoundError:
                continue
        raise AssertionError(f"no process {container_pid} in the container")

    def console(self) -> str:
        try:
            return self.console_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def poweroff(self) -> None:
        """Shut the container down (SIGTERM to nspawn: an orderly poweroff), else kill its init."""
        p = self.nspawn
        if p is not None:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    log("the container did not power off within 60 s: killing its init")
                    if self.init_pid and _alive(self.init_pid):
                        os.kill(self.init_pid, signal.SIGKILL)  # ends every process of its pid namespace
                    try:
                        p.wait(15)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            self._console.close()
        if self.mounted:
            subprocess.run(["umount", str(self.root)], check=True, timeout=30)
            self.mounted = False


@pytest.fixture
def container(tmp_path: Path) -> Iterator[Container]:
    ct: Container | None = None
    try:
        env, binds = host_pip()
        started = time.monotonic()
        root, built = cached_root()
        ct = Container(root, tmp_path / "ct", binds, env)
        ct.root_note = f"root {'built' if built else 'cached'} {time.monotonic() - started:.1f} s"
        yield ct
    finally:
        if ct is not None:
            init, nspawn = ct.init_pid, (ct.nspawn.pid if ct.nspawn else 0)
            ct.poweroff()
            left = [p for p in (init, nspawn) if p and _alive(p)]
            assert not left, f"processes left running after poweroff: {left}"


# ------------------------------------------------------------------ helpers


def copy_tree(dest: Path) -> None:
    """The working tree's files (tracked and new, not ignored): what a fresh clone would hold, plus edits."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    for name in filter(None, map(os.fsdecode, files)):
        src = ROOT / name
        if src.is_file() or src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)


def status_of(ct: Container, pid: int) -> dict[str, str]:
    return dict(re.findall(r"^(\w+):\s*(.*)$", ct.path(f"/proc/{pid}/status").read_text(), re.MULTILINE))


def unit_show(ct: Container, unit: str, *props: str) -> dict[str, str]:
    out = ct.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def unit_states(ct: Container) -> dict[str, str]:
    return {u: ct.run(["systemctl", "is-active", u], check=False).stdout.strip() for u in UNITS}


def journal(ct: Container) -> str:
    return ct.run(
        [
            "journalctl",
            "--no-pager",
            "-o",
            "short-monotonic",
            "-u",
            "ebpfprofiler*",
            "-u",
            "ebpfprofiler-test-workload",
            "-u",
            "ebpfprofiler-test-python",
        ],
        check=False,
        timeout=30,
    ).stdout[-15000:]


def wait_ready(ct: Container, what: str) -> None:
    """Every unit active (after READY=1: Type=notify) and every stage's ready file written."""

    def ready() -> bool:
        states = unit_states(ct)
        failed = [u for u, st in states.items() if st == "failed"]
        assert not failed, f"units failed: {failed}"
        return all(st == "active" for st in states.values()) and all(
            ct.path(f"{RUN_DIR}/{f}").exists() for f in READY_FILES
        )

    wait_for(what, ready, timeout=120, interval=0.25)


# ------------------------------------------------------------------ the test's steps


def put_tree_and_config(ct: Container) -> None:
    """This working tree in /root/ebpfprofiler, and a config that exists before install."""
    copy_tree(ct.root / "root/ebpfprofiler")
    # A config that exists before install: make install must keep it (and the test's window).
    (ct.root / "etc/wt-agent").mkdir()
    (ct.root / "etc/wt-agent/agent.yaml").write_text(TEST_CONFIG)


def make_install(ct: Container) -> None:
    """`make install` keeps the config and makes the shared runtime directory."""
    install = ct.run(["make", "-C", "/root/ebpfprofiler", "install"], timeout=420, env=ct.env)
    log("make install:\n" + install.stdout[-1500:] + install.stderr[-1500:])
    assert ct.path("/etc/wt-agent/agent.yaml").read_text() == TEST_CONFIG, "make install replaced the config"
    assert ct.run(["stat", "-c", "%a %U %G", RUN_DIR]).stdout.split() == ["3770", "root", "ebpfprofiler"]


def check_stage_identities(ct: Container) -> dict[str, int]:
    """Each stage as its own user, with exactly its capabilities, and no_new_privs: its main pid by stage."""
    main_pids = {}
    for unit, stage in STAGE_OF_UNIT.items():
        show = unit_show(ct, unit, "MainPID", "Type")
        assert show["Type"] == "notify", show
        pid = int(show["MainPID"])
        st = status_of(ct, pid)
        user = ct.run(["id", "-un", st["Uid"].split()[0]]).stdout.strip()
        group = ct.run(["getent", "group", st["Gid"].split()[0]]).stdout.split(":")[0]
        assert (user, group) == (STAGES[stage].user, "ebpfprofiler"), (unit, user, group)
        for key in ("CapEff", "CapPrm"):
            assert int(st[key], 16) == mask(STAGES[stage].caps), (unit, key, st[key])
        # The collector's unit grants CAP_SYS_ADMIN for start-up (kernel.perf_event_paranoid=3); the stage
        # drops it from its effective and permitted sets, and the bounding set, which it cannot change
        # without CAP_SETPCAP, gives nothing back under no_new_privs.
        start_up = OPTIONAL_CAPS["collector"] if stage == "collector" else frozenset()
        assert int(st["CapBnd"], 16) == mask(STAGES[stage].caps | start_up), (unit, st["CapBnd"])
        assert int(st["CapAmb"], 16) == 0 and st["NoNewPrivs"] == "1", (unit, st["CapAmb"], st["NoNewPrivs"])
        main_pids[stage] = pid
    return main_pids


def collector_programs(ct: Container, collector_pid: int) -> set[int]:
    """Positive control for the end: the collector's programs are loaded, and it holds them (their ids)."""
    prog_ids, perf_events = bpf_holdings(ct.host_pid(collector_pid))
    names = {p.get("name", "") for p in bpftool("prog", "show") if p["id"] in prog_ids}
    assert perf_events > 0
    assert "on_cpu_sample" in names and all(OUR_PROGRAMS.match(n) for n in names), names
    return prog_ids


def kill_a_worker(ct: Container) -> None:
    """Restart on failure, and the shared runtime directory outlives a unit's restart."""
    ct.run(["systemctl", "kill", "--signal=SIGKILL", "ebpfprofiler-symbolizer@0.service"])
    wait_for(
        "symbolizer worker 0 restarted by systemd",
        lambda: unit_show(ct, UNITS[1], "NRestarts")["NRestarts"] == "1",
        timeout=30,
        interval=0.25,
    )
    wait_ready(ct, "every unit ready again after the worker's restart")
    for sock in ("uploader.sock", "files.sock", "symbolizer-0.sock"):
        assert ct.path(f"{RUN_DIR}/{sock}").exists(), sock


def start_jit_workload(ct: Container, collector_pid: int) -> int:
    """An ordinary user's JIT, run from its home directory, its perf map in /tmp: its pid in the container."""
    ct.run(["useradd", "--create-home", WORKLOAD_USER])
    ct.run(["gcc", *FRAME_POINTER_FLAGS, "-o", WORKLOAD, "/root/ebpfprofiler/tests/workloads/jit.c"])
    ct.run(
        [
            "systemd-run",
            "--unit=ebpfprofiler-test-workload",
            f"--uid={WORKLOAD_USER}",
            "--property=PrivateTmp=no",
            WORKLOAD,
            "120",
            "own",
        ]
    )
    wpid = wait_for(
        "the workload's pid",
        lambda: int(unit_show(ct, "ebpfprofiler-test-workload.service", "MainPID")["MainPID"]),
        timeout=15,
    )
    perf_map = f"/tmp/perf-{wpid}.map"
    wait_for(f"{perf_map} in the container", lambda: ct.path(perf_map).exists(), timeout=15)
    # The collector's /tmp is its own (PrivateTmp=) and does not have the map.
    assert not ct.path(f"/proc/{collector_pid}/root{perf_map}").exists()
    return wpid


def check_named_profile(ct: Container, wpid: int) -> None:
    """A cpu profile of the JIT in the default local_dir, named from its ELF symbols and its perf map."""
    service_dir = ct.path(f"{PROFILES}/{WORKLOAD_SERVICE_DIR}")

    def named_profile() -> pprof.ReadProfile | None:
        for f in sorted(service_dir.glob("cpu-*.pb.gz")):
            prof = pprof.read(f.read_bytes())
            # main: ELF symbols of a file under /home (ProtectHome=); jit_spin_loop: the perf map
            # in /tmp (the collector's PrivateTmp=).
            if {"jit_spin_loop", "main"} <= {fn for smp in prof.samples for fn in smp.functions}:
                return prof
        return None

    try:
        prof = wait_for(
            f"a cpu profile of {WORKLOAD} with names from its ELF symbols and its perf map",
            named_profile,
            timeout=60,
            interval=0.25,
        )
    except AssertionError as e:
        present = sorted(p.name for p in ct.path(PROFILES).iterdir())
        host_pid = ct.host_pid(wpid)
        raise AssertionError(
            f"{e}; service directories under {PROFILES}: {present}. The workload is pid {wpid} in the "
            f"container's pid namespace and pid {host_pid} in the host's, where BPF sees it; the collector "
            f"reads /proc of the container's namespace"
        ) from None
    assert {smp.labels.get("process.executable") for smp in prof.samples} == {WORKLOAD}
    owner = ct.run(["stat", "-c", "%U %G %a", f"{PROFILES}/{WORKLOAD_SERVICE_DIR}"]).stdout.split()
    assert owner == ["ebpfprofiler-uploader", "ebpfprofiler", "750"], owner


def check_python_stacks(ct: Container) -> None:
    """The runtime reader, as its unit runs it (CAP_SYS_PTRACE, hardened), reads another user's Python stacks."""
    ct.path(PY_WORKLOAD).write_text(PY_WORKLOAD_TEXT)
    ct.run(
        [
            "systemd-run",
            "--unit=ebpfprofiler-test-python",
            f"--uid={WORKLOAD_USER}",
            "/usr/bin/python3.11",
            PY_WORKLOAD,
        ]
    )
    py_dir = ct.path(f"{PROFILES}/{PY_SERVICE_DIR}")

    def python_profile() -> bool:
        return any(
            "spin_here" in {fn for smp in pprof.read(f.read_bytes()).samples for fn in smp.functions}
            for f in sorted(py_dir.glob("python_wall-*.pb.gz"))
        )

    try:
        wait_for(f"a python_wall profile of {PY_WORKLOAD} in spin_here()", python_profile, timeout=60, interval=0.25)
    except AssertionError as e:  # the reader's own journal, which the agent's busier units crowd out of the tail
        runtime = ct.run(["journalctl", "--no-pager", "-u", "ebpfprofiler-runtime"], check=False, timeout=30).stdout
        raise AssertionError(f"{e}; the runtime reader's journal:\n{runtime[-6000:]}") from None
    ct.run(["systemctl", "stop", "ebpfprofiler-test-python.service"], timeout=30)


def stop_target(ct: Container) -> None:
    """Stop the target and wait for its units (its own stop job ends at once: it stops before them)."""
    ct.run(["systemctl", "stop", "ebpfprofiler.target"], timeout=60)
    wait_for(
        "every unit stopped",
        lambda: all(st in ("inactive", "failed") for st in unit_states(ct).values()),
        timeout=90,
        interval=0.25,
    )


def check_clean_stop(ct: Container, prog_ids: set[int]) -> None:
    """A clean exit (0) of each stage on SIGTERM, no ready file left, and no BPF program of the collector."""
    for unit in UNITS:
        show = unit_show(ct, unit, "ActiveState", "Result", "ExecMainStatus")
        assert show == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, (unit, show)
    left = [f for f in READY_FILES if ct.path(f"{RUN_DIR}/{f}").exists()]
    assert not left, f"ready files left behind: {left}"
    remaining = {p["id"]: p.get("name") for p in bpftool("prog", "show") if p["id"] in prog_ids}
    assert not remaining, f"BPF programs left after stopping the target: {remaining}"


# ------------------------------------------------------------------ the test


def test_units_run_in_a_booted_container(container: Container) -> None:
    require_root()
    ct = container
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        timings[name] = time.monotonic() - t0 - sum(timings.values())

    put_tree_and_config(ct)
    lap("tree copied")
    ct.boot()
    lap("boot")
    try:
        make_install(ct)
        lap("make install")
        ct.run(["systemctl", "start", "ebpfprofiler.target"], timeout=180)
        wait_ready(ct, "every unit active and every ready file")
        lap("target started")
        main_pids = check_stage_identities(ct)
        prog_ids = collector_programs(ct, main_pids["collector"])
        kill_a_worker(ct)
        lap("worker restarted")
        wpid = start_jit_workload(ct, main_pids["collector"])
        lap("workload started")
        check_named_profile(ct, wpid)
        lap("profile written")
        ct.run(["systemctl", "stop", "ebpfprofiler-test-workload.service"], timeout=30)
        check_python_stacks(ct)
        lap("python stacks read")
        stop_target(ct)
        lap("target stopped")
        check_clean_stop(ct, prog_ids)
    except BaseException:
        log("journal of the agent's units:\n" + journal(ct))
        raise
    finally:
        lap("checks")
        log(
            f"timings: {ct.root_note}; "
            + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
            + f"; total {time.monotonic() - t0:.1f} s"
        )
