"""The systemd units, sysusers.d and tmpfiles.d files of deploy/, checked by systemd's own tools.

- `systemd-analyze verify` passes for every unit, in a scratch root that holds
  this host's system units, ours, and a stub at each ExecStart= path (verify
  checks that the executable exists): no output at all is accepted, so an
  unknown or misspelt setting (which verify only warns about) fails too.
- `systemd-analyze security --offline=yes` rates each service's exposure at
  the figure docs/hardening.md shows, or better.
- The units run each stage as the user, with the capabilities, that
  shared/privileges.py gives it, and with the command line make install sets up.
- systemd-sysusers and systemd-tmpfiles, applied to a scratch root, create the
  users and directories the units expect.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from shared import privileges
from shared.privileges import AGENT_GROUP, STAGES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT_SRC = DEPLOY / "systemd"
SERVICES = {
    "collector": "ebpfprofiler-collector.service",
    "symbolizer": "ebpfprofiler-symbolizer@.service",
    "uploader": "ebpfprofiler-uploader.service",
    "runtime": "ebpfprofiler-runtime.service",
}
TARGET = "ebpfprofiler.target"
VENV_BIN = "/usr/lib/ebpfprofiler/venv/bin"
# The exposure `systemd-analyze security --offline=yes` gives each service, as docs/hardening.md
# shows it: a change that loosens a unit fails here until the notes say so too.
EXPOSURE = {"collector": 2.3, "symbolizer": 0.5, "uploader": 1.2, "runtime": 1.1}
# "OK" or better: systemd's levels are PERFECT (0.0), SAFE (< 1), OK (< 5), MEDIUM, EXPOSED, UNSAFE, DANGEROUS.
GOOD_LEVELS = ("PERFECT", "SAFE", "OK")
# Where this host's own unit files live (Debian: /lib is /usr/lib with merged /usr).
HOST_UNITS = next(
    p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if (p / "sysinit.target").exists()
)


def systemd_analyze(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.fail("systemd-analyze is missing: install Debian's systemd package (make test-setup does)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def read_unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file of deploy/systemd as {section: {key: [every value given, in order]}}."""
    unit: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in (UNIT_SRC / name).read_text().splitlines():
        line = line.strip()  # noqa: PLW2901
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            unit.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        unit[section].setdefault(key, []).append(value)
    return unit


@pytest.fixture(scope="module")
def scratch_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This host's system units plus ours, and a stub executable at every ExecStart= path."""
    root = tmp_path_factory.mktemp("root")
    units = root / "usr/lib/systemd/system"
    shutil.copytree(HOST_UNITS, units, symlinks=True)
    for f in UNIT_SRC.iterdir():
        shutil.copy(f, units / f.name)
    for stage in SERVICES:
        stub = root / VENV_BIN.lstrip("/") / f"ebpfprofiler-{stage}"
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return root


def test_deploy_holds_exactly_the_target_and_a_unit_per_stage() -> None:
    assert sorted(p.name for p in UNIT_SRC.iterdir()) == sorted([TARGET, *SERVICES.values()])


def test_systemd_analyze_verify_passes_silently(scratch_root: Path) -> None:
    units = scratch_root / "usr/lib/systemd/system"
    # Every file, and two instances of the template (named: verify finds them under --root).
    out = systemd_analyze(
        "verify",
        f"--root={scratch_root}",
        *(str(units / n) for n in (TARGET, *SERVICES.values())),
        "ebpfprofiler-symbolizer@0.service",
        "ebpfprofiler-symbolizer@1.service",
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_verify_reports_a_misspelt_setting(scratch_root: Path, tmp_path: Path) -> None:
    """Positive control for the test above: verify's warnings are output, so they fail it."""
    bad = scratch_root / "usr/lib/systemd/system/ebpfprofiler-probe.service"
    bad.write_text((UNIT_SRC / SERVICES["uploader"]).read_text().replace("ProtectSystem=", "ProtectSytem="))
    try:
        out = systemd_analyze("verify", f"--root={scratch_root}", str(bad))
    finally:
        bad.unlink()
    assert "Unknown key 'ProtectSytem'" in out.stdout + out.stderr


@pytest.mark.parametrize("stage", sorted(SERVICES))
def test_security_exposure(stage: str) -> None:
    out = systemd_analyze("security", "--offline=yes", "--no-pager", str(UNIT_SRC / SERVICES[stage]))
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d) (\w+)", out.stdout)
    assert m, out.stdout + out.stderr
    exposure, level = float(m.group(1)), m.group(2)
    assert level in GOOD_LEVELS, (stage, exposure, level)
    assert exposure <= EXPOSURE[stage], (
        f"{SERVICES[stage]}: exposure {exposure} {level}, docs/hardening.md shows "
        f"{EXPOSURE[stage]}: tighten the unit or update both"
    )


def test_the_hardening_notes_show_the_exposure_figures() -> None:
    notes = (ROOT / "docs" / "hardening.md").read_text()
    for stage, figure in EXPOSURE.items():
        assert re.search(rf"\|\s*`{re.escape(SERVICES[stage])}`\s*\|\s*{figure}\b", notes), (stage, figure)


@pytest.mark.parametrize("stage", sorted(SERVICES))
def test_unit_runs_the_stage_as_its_user_with_its_capabilities(stage: str) -> None:
    unit = read_unit(SERVICES[stage])
    svc = unit["Service"]
    assert svc["User"] == [STAGES[stage].user]
    assert svc["Group"] == [AGENT_GROUP]
    assert svc["NoNewPrivileges"] == ["yes"]
    assert svc["Type"] == ["notify"]
    assert svc["Restart"] == ["on-failure"]
    cap_numbers = {name: getattr(privileges, name) for name in dir(privileges) if name.startswith("CAP_")}
    # the collector's unit grants CAP_SYS_ADMIN too: under kernel.perf_event_paranoid=3 it opens its
    # perf events with it at start, then drops it (collector/main.py start_caps)
    caps = STAGES[stage].caps | (privileges.OPTIONAL_CAPS["collector"] if stage == "collector" else frozenset())
    want = {name for name, number in cap_numbers.items() if number in caps}
    assert len(want) == len(caps)
    assert set(" ".join(svc["CapabilityBoundingSet"]).split()) == want
    assert set(" ".join(svc.get("AmbientCapabilities", [])).split()) == want
    assert unit["Install"]["WantedBy"] == [TARGET]
    assert unit["Unit"]["PartOf"] == [TARGET]


@pytest.mark.parametrize("stage", sorted(SERVICES))
def test_exec_start_is_the_installed_console_script(stage: str) -> None:
    argv = read_unit(SERVICES[stage])["Service"]["ExecStart"][0].split()
    assert argv[0] == f"{VENV_BIN}/ebpfprofiler-{stage}"
    assert f"ebpfprofiler-{stage} = " in (ROOT / "pyproject.toml").read_text()
    opts = dict(zip(argv[1::2], argv[2::2]))
    assert opts["--config"] == "/etc/wt-agent/agent.yaml"
    assert opts["--run-dir"] == "/run/ebpfprofiler"
    if stage == "collector":
        assert opts["--bpf-dir"] == "/usr/lib/ebpfprofiler/bpf"
    else:
        assert opts["--state-dir"] == f"/var/lib/ebpfprofiler/{stage}"
    if stage == "symbolizer":
        assert opts["--worker"] == "%i"
    install = (DEPLOY / "install.sh").read_text()
    assert "VENV=$LIB/venv" in install and "LIB=/usr/lib/ebpfprofiler" in install


def test_target_wants_every_stage_and_worker_zero() -> None:
    wants = " ".join(read_unit(TARGET)["Unit"]["Wants"]).split()
    assert sorted(wants) == sorted(
        [
            "ebpfprofiler-collector.service",
            "ebpfprofiler-symbolizer@0.service",
            "ebpfprofiler-runtime.service",
            "ebpfprofiler-uploader.service",
        ]
    )


def test_sysusers_creates_each_stage_user_in_the_agent_group(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    for f in ("passwd", "group", "shadow", "gshadow"):
        (etc / f).touch()
    out = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(DEPLOY / "sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    groups = {line.split(":")[0]: line.split(":")[2] for line in (etc / "group").read_text().splitlines()}
    users = {f[0]: f for f in (line.split(":") for line in (etc / "passwd").read_text().splitlines())}
    assert set(groups) == {AGENT_GROUP}
    assert set(users) == {p.user for p in STAGES.values()}
    for name, (_, _, uid, gid, _, home, shell) in users.items():
        assert int(uid) < 1000, (name, uid)  # a system user
        assert (gid, home, shell) == (groups[AGENT_GROUP], "/nonexistent", "/usr/sbin/nologin"), name


@pytest.mark.needs_root
def test_tmpfiles_creates_the_shared_directories(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "group").write_text(f"root:x:0:\n{AGENT_GROUP}:x:990:\n")
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    out = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(DEPLOY / "tmpfiles.conf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    run, state = (tmp_path / "run/ebpfprofiler").stat(), (tmp_path / "var/lib/ebpfprofiler").stat()
    assert (oct(run.st_mode & 0o7777), run.st_uid, run.st_gid) == (oct(0o3770), 0, 990)
    assert (oct(state.st_mode & 0o7777), state.st_uid, state.st_gid) == (oct(0o750), 0, 990)
