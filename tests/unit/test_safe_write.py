"""Files and directories root writes for a user: shared/files.py's write_atomic and ensure_dir, as
`ebpfprofiler report`, report/profiles.py's write_outputs (what `record` writes) and `run`'s
prepare_dirs use them.

A symlink at an output's name is replaced, its target (a file root cares about) never opened; outputs
are 0600 unless --mode says otherwise; a missing directory is an error that names it before any work;
`run` never creates, chowns or chmods a directory through a symlink, and refuses one owned by someone
else, changing nothing.
"""

from __future__ import annotations

import argparse
import grp
import logging
import os
import pwd
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli import run as run_mod
from report import profiles
from shared import config as config_mod
from shared import files, privileges
from tests.harness import PY, open_dir
from tests.unit.test_report import cpu_profile, local_dir

CLI_TIMEOUT_S = 60  # `report` on a few small files: about a second
SECRET = b"root:$6$precious:19000:0:99999:7:::\n"


as_root = pytest.mark.needs_root  # chown to other users needs root
with_agent_users = pytest.mark.needs_root  # the agent's users (make setup, as root)


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A file root cares about (a stand-in for /etc/shadow), mode 0640."""
    p = tmp_path / "precious"
    p.write_bytes(SECRET)
    p.chmod(0o640)
    return p


def unchanged(p: Path) -> None:
    st = p.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)
    assert p.read_bytes() == SECRET


def regular_private(p: Path, mode: int = 0o600) -> None:
    st = p.lstat()
    assert stat.S_ISREG(st.st_mode), f"{p} is not a regular file: {oct(st.st_mode)}"
    assert stat.S_IMODE(st.st_mode) == mode, oct(st.st_mode)


def report(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "cli.main", "report", *args], cwd=cwd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )


# --- report -o (a real `ebpfprofiler report`)


def test_report_o_at_a_symlink_replaces_the_link_and_never_touches_its_target(tmp_path: Path, precious: Path) -> None:
    profiles_dir = local_dir(tmp_path)
    link = tmp_path / "out.html"
    link.symlink_to(precious)
    r = report(str(profiles_dir), "-o", str(link), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    unchanged(precious)
    regular_private(link)  # 0600: it holds other users' stacks
    assert "/usr/bin/a" in link.read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_report_mode_is_asked_for_and_checked(tmp_path: Path) -> None:
    profiles_dir = local_dir(tmp_path)
    r = report(str(profiles_dir), "-o", "shared.html", "--mode", "0644", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    regular_private(tmp_path / "shared.html", 0o644)
    for bad in ("4755", "0999", "rw-r--r--"):
        r = report(str(profiles_dir), "-o", "bad.html", "--mode", bad, cwd=tmp_path)
        assert r.returncode == 2 and "--mode" in r.stderr and bad in r.stderr, r.stderr
        assert not (tmp_path / "bad.html").exists()
    assert "--mode OCTAL" in report("--help", cwd=tmp_path).stdout


def test_report_into_a_missing_directory_names_it_and_writes_nothing(tmp_path: Path) -> None:
    profiles_dir = local_dir(tmp_path)
    r = report(str(profiles_dir), "-o", "out/profile.html", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the directory out does not exist" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


# --- what `record` writes (report/profiles.py's write_outputs)


@pytest.mark.parametrize("ext", [".folded", ".pb.gz", ".html"])
def test_every_output_of_record_replaces_a_symlink_and_is_0600(tmp_path: Path, precious: Path, ext: str) -> None:
    d = local_dir(tmp_path)
    (d / "usr_bin_a" / "offcpu-20261201T000000Z-5.pb.gz").write_bytes(  # a second type: out.offcpu.EXT
        cpu_profile("/usr/bin/a", {("main", "wait"): 3}, pid=1)
    )
    loaded = profiles.load([str(d)])
    out = tmp_path / f"out{ext}"
    other = tmp_path / f"out.offcpu{ext}"
    out.symlink_to(precious)
    if ext != ".html":  # the report is one file with every type
        other.symlink_to(precious)
    written = profiles.write_outputs(loaded, str(out))
    assert written == [str(out)] + ([str(other)] if ext != ".html" else [])
    unchanged(precious)
    for p in written:
        regular_private(Path(p))
    profiles.write_outputs(loaded, str(out), mode=0o644)
    regular_private(out, 0o644)


# --- the helper itself


def test_write_atomic_leaves_no_temporary_file_when_the_rename_fails(tmp_path: Path) -> None:
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(IsADirectoryError):
        files.write_atomic(str(tmp_path / "a_dir"), b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir"]


def test_write_atomic_sets_the_mode_exactly_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        files.write_atomic(str(tmp_path / "f"), b"x", mode=0o644)
    finally:
        os.umask(old)
    regular_private(tmp_path / "f", 0o644)


def test_output_dir_problem_names_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert files.output_dir_problem(str(tmp_path / "x.html")) is None
    assert "does not exist" in (files.output_dir_problem(str(tmp_path / "no" / "x.html")) or "")
    assert "is not a directory" in (files.output_dir_problem(str(tmp_path / "file" / "x.html")) or "")
    assert "is a directory" in (files.output_dir_problem(str(tmp_path)) or "")


# --- `run`'s directories (cli/run.py's prepare_dirs, the function `run` calls before any stage)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A 0755 directory under /tmp (the agent's users must reach what prepare_dirs makes)."""
    path = open_dir("dirs")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def nobodys(reachable: Path) -> Path:
    """A directory owned by another user (nobody), 0700."""
    d = reachable / "nobodys"
    d.mkdir()
    os.chown(d, pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid)
    d.chmod(0o700)
    return d


def owner_and_mode(p: Path) -> tuple[int, int, int]:
    st = p.lstat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def prepare(run_dir: Path, state_dir: Path, local: Path | None = None) -> None:
    args = argparse.Namespace(run_dir=str(run_dir), state_dir=str(state_dir))
    cfg = config_mod.ProfilerConfig(
        endpoint="" if local else "http://127.0.0.1:1",
        local_dir=str(local) if local else config_mod.ProfilerConfig().local_dir,
    )
    run_mod.prepare_dirs(args, cfg)


@as_root
@with_agent_users
def test_run_dirs_are_made_with_their_owners_and_modes(reachable: Path) -> None:
    prepare(reachable / "a" / "run", reachable / "state", reachable / "profiles")
    gid = privileges.ids("uploader")[1]
    assert owner_and_mode(reachable / "a") == (0, 0, 0o755)  # a parent made on the way
    assert owner_and_mode(reachable / "a" / "run") == (0, gid, 0o3770)
    assert owner_and_mode(reachable / "state") == (0, gid, 0o750)
    assert owner_and_mode(reachable / "state" / "uploader") == (privileges.ids("uploader")[0], gid, 0o700)
    assert owner_and_mode(reachable / "profiles") == (privileges.ids("uploader")[0], gid, 0o750)
    prepare(reachable / "a" / "run", reachable / "state", reachable / "profiles")  # again: the same


@as_root
@with_agent_users
@pytest.mark.parametrize("which", ["run_dir", "state_dir", "local_dir"])
def test_run_refuses_a_symlink_to_someone_elses_directory_and_changes_nothing(
    reachable: Path, nobodys: Path, which: str
) -> None:
    link = reachable / "link"
    link.symlink_to(nobodys)
    dirs = {
        "run_dir": reachable / "run",
        "state_dir": reachable / "state",
        "local_dir": reachable / "profiles",
        which: link,
    }
    before = owner_and_mode(nobodys)
    with pytest.raises(files.UnsafePath, match=f"{link} is a symbolic link"):
        prepare(dirs["run_dir"], dirs["state_dir"], dirs["local_dir"])
    assert owner_and_mode(nobodys) == before
    assert link.is_symlink() and list(nobodys.iterdir()) == []


@as_root
@with_agent_users
def test_run_refuses_a_path_whose_parent_is_a_symlink_and_creates_nothing_there(reachable: Path, nobodys: Path) -> None:
    link = reachable / "link"
    link.symlink_to(nobodys)
    before = owner_and_mode(nobodys)
    with pytest.raises(files.UnsafePath, match=f"{link} is a symbolic link"):
        prepare(link / "run", reachable / "state")
    assert owner_and_mode(nobodys) == before and list(nobodys.iterdir()) == []


@as_root
@with_agent_users
def test_run_refuses_a_directory_owned_by_someone_else(reachable: Path, nobodys: Path) -> None:
    before = owner_and_mode(nobodys)
    with pytest.raises(files.UnsafePath, match="owned by uid .* only root or ebpfprofiler-uploader"):  # noqa: RUF043
        prepare(reachable / "run", reachable / "state", nobodys)
    assert owner_and_mode(nobodys) == before


@as_root
def test_ensure_dir_refuses_a_file_in_the_path(reachable: Path) -> None:
    (reachable / "file").write_text("")
    with pytest.raises(files.UnsafePath, match="is not a directory"):
        files.ensure_dir(str(reachable / "file" / "d"), 0, 0, 0o700)


# --- the token file's mode: what `run` advises is what the uploader accepts without a warning


@as_root
@with_agent_users
def test_runs_advice_for_an_unreadable_token_file_gives_one_the_uploader_reads_without_warning(
    reachable: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from uploader.http import read_token

    token = reachable / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)  # root's: the uploader cannot read it
    args = argparse.Namespace(run_dir=str(reachable / "run"), state_dir=str(reachable / "state"))
    cfg = config_mod.ProfilerConfig(endpoint="http://127.0.0.1:1", token_file=str(token))
    with pytest.raises(privileges.PrivilegeError) as refused:
        run_mod.prepare_dirs(args, cfg)
    # follow the advice as given: "chown USER it" / "chgrp GROUP it", "chmod MODE"
    advice = str(refused.value)
    owner = re.search(r"chown (\S+) it", advice)
    group = re.search(r"chgrp (\S+) it", advice)
    mode = re.search(r"chmod (\d+)", advice)
    assert mode and (owner or group), advice
    os.chown(
        token,
        pwd.getpwnam(owner.group(1)).pw_uid if owner else -1,
        grp.getgrnam(group.group(1)).gr_gid if group else -1,
    )
    token.chmod(int(mode.group(1), 8))
    run_mod.prepare_dirs(args, cfg)  # now readable by the uploader
    with caplog.at_level(logging.WARNING, logger="uploader.http"):
        assert read_token(str(token)) == "s3cret"
    # the log line is the feature: the advice, once followed, leaves no warning about the token file
    assert not [r for r in caplog.records if "token file" in r.getMessage()], caplog.text
