"""tests/harness.namespace_host_gaps on recorded mountinfo: what a host lacks for unshare and systemd-nspawn."""

from __future__ import annotations

from pathlib import Path

from tests.harness import namespace_host_gaps

# A VM like this one: / a mount point, a legacy cgroup layout with the named systemd hierarchy.
HOST = """\
22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
25 22 0:21 / /proc rw,nosuid - proc proc rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw
31 30 0:27 / /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,name=systemd
"""
# A debootstrap root entered with chroot: its / is no mount point; cgroup2 mounted read-only.
CHROOT = """\
25 22 0:21 / /proc rw,nosuid - proc proc rw
30 22 0:26 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw
"""
# A root with no cgroup hierarchy at all.
NO_CGROUP = """\
22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw
"""


def test_a_host_with_what_namespaces_need_lacks_nothing(tmp_path: Path) -> None:
    (tmp_path / "m").write_text(HOST)
    assert namespace_host_gaps(str(tmp_path / "m")) == ""


def test_a_chroot_is_told_its_root_is_no_mount_point_and_its_cgroups_are_read_only(tmp_path: Path) -> None:
    (tmp_path / "m").write_text(CHROOT)
    gaps = namespace_host_gaps(str(tmp_path / "m"))
    assert gaps.startswith("host lacks: / is not a mount point (a chroot?)")
    assert "mount --bind DIR DIR" in gaps
    assert "/sys/fs/cgroup is read-only" in gaps


def test_no_cgroup_hierarchy_is_named(tmp_path: Path) -> None:
    (tmp_path / "m").write_text(NO_CGROUP)
    assert "no cgroup hierarchy for systemd: /sys/fs/cgroup is tmpfs" in namespace_host_gaps(str(tmp_path / "m"))
    assert namespace_host_gaps(str(tmp_path / "absent")).startswith("host lacks: a readable")
