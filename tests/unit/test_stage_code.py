"""shared/stage_code.py: what a stage imports is found, and the list of packages is pyproject.toml's."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from shared import stage_code

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_packages_copied_for_the_stages_are_those_pyproject_installs() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    # top-level packages: a subpackage (runtimes.php) is copied with its parent's folder
    assert set(stage_code.PACKAGES) == {p for p in packages if "." not in p}


def test_package_dirs_are_this_checkouts_and_the_stdlib_is_never_copied() -> None:
    dirs = stage_code.package_dirs()
    assert dirs["collector"] == str(ROOT / "collector")
    entries = stage_code.import_path_entries()
    assert all(not e.startswith(os.path.realpath(os.__file__).rsplit("/", 1)[0] + "/") for e in entries)
    assert any(e.endswith("site-packages") or e.endswith("dist-packages") for e in entries)


def test_a_pythonpath_is_set_only_when_there_is_a_view() -> None:
    assert "PYTHONPATH" not in stage_code.StageCode(bpf_dir="/b").env({"X": "1"})
    assert stage_code.StageCode(bpf_dir="/b", pythonpath=("/v", "/v/path0")).env({})["PYTHONPATH"] == "/v:/v/path0"
