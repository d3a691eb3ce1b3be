"""Preflight on Debian's kernels, replayed from trees recorded in their guests, each cause named with its fix.

The trees in tests/fixtures/kernels/SUITE/ were written by `ebpfprofiler-collector --preflight --record`
in `make test-kernels`' guests (stock settings, the collector started as root, as `ebpfprofiler run`
starts it): the files the checks read, and the kernel features probed there. Given such a tree, when
one cause is made to hold in a copy (a capability the collector would not get, a limit it cannot
raise, BTF or a header tree missing), then preflight names that cause, says what to do, and passes or
fails as the collector would start or not. Nothing here reads this host's /proc or /sys.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from collector import preflight
from collector.preflight import FAIL, OK, WARN, Host
from shared.privileges import CAP_SYS_ADMIN, CAP_SYS_RESOURCE

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kernels"
SUITES = ("bullseye", "bookworm", "bookworm-backports", "trixie", "sid")


def tree(suite: str, tmp_path: Path) -> Path:
    """A copy of `suite`'s recorded tree, to change one thing in."""
    dest = tmp_path / suite
    shutil.copytree(FIXTURES / suite, dest)
    return dest


def checks_of(root: Path) -> dict[str, preflight.Check]:
    return {c.name: c for c in preflight.run_checks(Host(str(root)))}


def set_caps(root: Path, drop: int = 0, add: int = 0) -> None:
    """Change CapEff and CapPrm of the recorded proc/self/status."""
    status = root / "proc/self/status"

    def change(m: re.Match[str]) -> str:
        value = (int(m.group(2), 16) & ~drop) | add
        return f"{m.group(1)}{value:016x}"

    status.write_text(re.sub(r"^(Cap(?:Eff|Prm):\s*)([0-9a-f]+)", change, status.read_text(), flags=re.M))


def set_memlock(root: Path, soft: str, hard: str) -> None:
    limits = root / "proc/self/limits"
    limits.write_text(
        re.sub(
            r"^Max locked memory\s+\S+\s+\S+",
            f"Max locked memory         {soft:<21}{hard:<21}",
            limits.read_text(),
            flags=re.M,
        )
    )


def release(root: Path) -> str:
    return (root / "proc/sys/kernel/osrelease").read_text().strip()


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.needs_root
def test_every_debian_kernel_at_stock_settings_is_ready(suite: str) -> None:
    # as recorded: paranoid 3, the collector holding CAP_SYS_ADMIN for its start, its own header tree
    checks = checks_of(FIXTURES / suite)
    assert preflight.passed(list(checks.values())), preflight.report(list(checks.values()))
    assert checks["perf_event_paranoid"].level == OK
    assert checks["perf_event_paranoid"].detail.startswith("3: opening perf events takes CAP_SYS_ADMIN")
    assert checks["kernel headers"].detail.endswith(f"has {release(FIXTURES / suite)}'s header tree")


@pytest.mark.needs_root
def test_paranoid_3_without_cap_sys_admin_is_named_with_its_fix(tmp_path: Path) -> None:
    # given Debian 12's 6.1 at stock, when the collector would not hold CAP_SYS_ADMIN (a unit without it)
    root = tree("bookworm", tmp_path)
    set_caps(root, drop=1 << CAP_SYS_ADMIN)
    checks = checks_of(root)
    # then that is the one failure, and it says what to do, and that the sysctl is not ours to change
    failed = [c for c in checks.values() if c.level == FAIL]
    assert [c.name for c in failed] == ["perf_event_paranoid"]
    assert "3 (Debian's and Ubuntu's default): perf_event_open(2) needs CAP_SYS_ADMIN" in failed[0].detail
    assert "AmbientCapabilities=" in failed[0].fix and "CapabilityBoundingSet=" in failed[0].fix
    assert "preflight: 1 problem(s): perf_event_paranoid" in preflight.report(list(checks.values()))


def test_paranoid_2_needs_no_cap_sys_admin(tmp_path: Path) -> None:
    root = tree("bookworm", tmp_path)
    set_caps(root, drop=1 << CAP_SYS_ADMIN)
    (root / "proc/sys/kernel/perf_event_paranoid").write_text("2\n")
    checks = checks_of(root)
    assert checks["perf_event_paranoid"].level == OK and "CAP_PERFMON" in checks["perf_event_paranoid"].detail


def test_debian_11s_memlock_limit_is_named_when_it_cannot_be_raised(tmp_path: Path) -> None:
    # given Debian 11's 5.10, which charges BPF maps to RLIMIT_MEMLOCK, with its init's 64 KiB limit
    root = tree("bullseye", tmp_path)
    set_memlock(root, "65536", "65536")
    set_caps(root, drop=1 << CAP_SYS_RESOURCE)
    check = checks_of(root)["memlock limit"]
    # then the limit fails, saying how to give the collector an unlimited one
    assert check.level == FAIL
    assert "65536 bytes (hard limit 65536)" in check.detail and "before Linux 5.11" in check.detail
    assert "LimitMEMLOCK=infinity" in check.fix and "ulimit -l unlimited" in check.fix
    # and when the hard limit is unlimited, the collector raises it itself
    set_memlock(root, "65536", "unlimited")
    assert checks_of(root)["memlock limit"].level == OK
    # and on a kernel with memcg accounting the limit does not matter
    modern = tree("bookworm-backports", tmp_path)
    set_memlock(modern, "65536", "65536")
    assert checks_of(modern)["memlock limit"].level == OK


def test_debian_11_names_each_kernel_feature_it_does_without() -> None:
    checks = checks_of(FIXTURES / "bullseye")
    missing = {
        name.removeprefix("kernel feature "): c for name, c in checks.items() if name.startswith("kernel feature ")
    }
    assert {"task_storage", "memcg_accounting", "task_pt_regs", "switch_prev_state", "uprobe_multi"} <= set(missing)
    assert all(c.level == WARN for c in missing.values())
    assert "LRU hash map by thread id" in missing["task_storage"].detail
    assert "Linux 5.15" in missing["task_pt_regs"].detail


@pytest.mark.needs_root
def test_a_kernel_without_btf_runs_without_off_cpu_and_says_so(tmp_path: Path) -> None:
    root = tree("bookworm", tmp_path)
    (root / "sys/kernel/btf/vmlinux").unlink()
    features = root / "features.json"
    features.write_text(features.read_text().replace('"btf": true', '"btf": false'))
    checks = checks_of(root)
    assert checks["BTF"].level == WARN and "no off-CPU profiles" in checks["BTF"].detail
    assert "CONFIG_DEBUG_INFO_BTF=y" in checks["BTF"].fix
    assert checks["kernel feature btf"].level == WARN
    assert preflight.passed(list(checks.values()))  # the rest of the agent runs


def test_a_missing_header_tree_is_named_with_the_package_to_install(tmp_path: Path) -> None:
    root = tree("trixie", tmp_path)
    shutil.rmtree(root / "lib/modules")
    check = checks_of(root)["kernel headers"]
    assert check.level == FAIL
    assert f"apt-get install linux-headers-{release(root)}" in check.fix


def test_another_kernels_header_tree_is_named_as_such(tmp_path: Path) -> None:
    # as set-up links Debian's newest tree where the running kernel has none of its own
    root = tree("sid", tmp_path)
    for uts in root.glob("lib/modules/*/*/include/generated/utsrelease.h"):
        uts.write_text('#define UTS_RELEASE "6.1.0-50-amd64"\n')
    check = checks_of(root)["kernel headers"]
    assert check.level == WARN and "is the header tree of 6.1.0-50-amd64, not of" in check.detail
    assert f"install linux-headers-{release(root)}" in check.fix
