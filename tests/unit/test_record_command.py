"""`record -- COMMAND`'s parts that need no root: the command line, --runtime, the exit status, who the
command runs as, and the process tree followed in a /proc built by the test."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest

from cli import record, record_command
from shared import config as config_mod


def parse(*argv: str) -> argparse.Namespace:
    return record.parse_args(list(argv), "ebpfprofiler record")


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_the_command_is_everything_after_the_first_double_dash() -> None:
    args = parse("-o", "x.folded", "--", "python3", "-c", "print(1)", "--", "-d")
    assert args.command == ["python3", "-c", "print(1)", "--", "-d"]
    assert args.output == "x.folded" and args.duration is None
    plain = parse("-p", "1")
    assert plain.command is None and plain.duration == record.DEFAULT_DURATION_S


def test_d_and_p_with_a_command_and_an_empty_command_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "-d cannot be given with a command" in refused(capsys, "-d", "5", "--", "true")
    assert "-p and --all cannot be given with a command" in refused(capsys, "-p", "1", "--", "true")
    assert "no command after --" in refused(capsys, "--")


def test_runtime_names_map_to_the_configs_values() -> None:
    assert parse("--runtime", "node,jvm").runtimes == record_command.Runtimes(False, ("node", "jvm"))  # as given
    python = parse("--runtime", "python").runtimes
    assert python == record_command.Runtimes(True, ("python_legacy",))
    assert parse("--python").runtimes == python  # the old flag is an alias
    assert parse().runtimes == record_command.Runtimes(False, ())
    every = parse("--runtime", "all").runtimes
    assert every.python_stacks and set(every.runtime_stacks) == set(config_mod.RUNTIME_STACKS)
    assert parse("--runtime", "PHP", "--runtime", "ruby, php").runtimes.runtime_stacks == ("php", "ruby")
    # and the config they make is a valid one, with the runtime reader on
    cfg = record.make_config(parse("--runtime", "all"), "/tmp/x")
    assert cfg.runtime_reader_wanted and cfg.runtime_stacks == every.runtime_stacks


def test_a_bad_runtime_name_is_refused_with_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--runtime", "python,per\x1bl")
    assert "unknown runtime 'per\\x1bl'" in err, err
    assert "valid: python, php, ruby, jvm, dotnet, node (comma-separated), or all" in err, err
    assert "\x1b" not in err


def test_exit_status_is_a_shells() -> None:
    assert record_command.exit_status(0) == 0
    assert record_command.exit_status(3) == 3
    assert record_command.exit_status(-signal.SIGTERM) == 143
    assert record_command.exit_status(-signal.SIGKILL) == 137
    assert record_command.describe(3) == "exit 3"
    assert record_command.describe(130) == "killed by SIGINT, exit 130"


def test_the_command_runs_as_sudos_user_else_as_root() -> None:
    assert record_command.run_as({}).popen_kwargs() == {}
    assert record_command.run_as({"SUDO_UID": "0", "SUDO_GID": "0"}).uid is None
    assert record_command.run_as({"SUDO_UID": "x", "SUDO_GID": "1"}).uid is None
    who = record_command.run_as({"SUDO_UID": "65534", "SUDO_GID": "65534"})
    kwargs = who.popen_kwargs()
    assert kwargs["user"] == 65534 and kwargs["group"] == 65534
    assert 65534 in kwargs["extra_groups"]  # type: ignore[operator]


def _proc(root: Path, pid: int, ppid: int, sid: int, comm: str = "x") -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {sid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {pid * 10} 0 0\n")


def test_the_tree_is_the_command_and_its_descendants_as_they_appear(tmp_path: Path) -> None:
    me, run, command = 100, 200, 300
    _proc(tmp_path, 1, 0, 1)
    _proc(tmp_path, me, 1, me)
    _proc(tmp_path, run, me, run)  # the agent: record's child in a session of its own
    _proc(tmp_path, 201, run, run)  # a stage
    _proc(tmp_path, command, me, me)
    _proc(tmp_path, 50, 1, 50, "unrelated (x) S 300")  # a hostile name cannot pose as a child
    tree = record_command.ProcessTree(command, me, other_session=run, proc=str(tmp_path))
    tree.scan()
    assert tree.members == {command}
    # a child and its child appear between two scans; a stage re-parented to record is not the tree's
    _proc(tmp_path, 302, 301, me)
    _proc(tmp_path, 301, command, me)
    _proc(tmp_path, 202, me, run)
    # an orphan of the tree (its parent gone before it was seen) comes back to record, the subreaper
    _proc(tmp_path, 303, me, me)
    tree.scan()
    assert tree.members == {command, 301, 302, 303}
    # a later process whose parent is not the tree's is left out
    _proc(tmp_path, 60, 50, 50)
    tree.scan()
    assert tree.members == {command, 301, 302, 303}
