"""/proc parsing on recorded files: executable mappings, container and pod identity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from collector import procfs

FIXTURES = Path(__file__).parents[1] / "fixtures" / "proc"


def test_recorded_maps_keep_executable_mappings_only() -> None:
    maps = procfs.parse_maps((FIXTURES / "python3.11.maps").read_text())
    text = (FIXTURES / "python3.11.maps").read_text().splitlines()
    assert len(maps) == sum(1 for ln in text if ln.split()[1][2] == "x")
    exe = maps[0]
    assert (exe.start, exe.end, exe.offset, exe.path) == (0x41F000, 0x6D2000, 0x1F000, "/usr/bin/python3.11")
    assert exe.dev == "fe:00" and exe.inode == 260811
    assert [m.start for m in maps] == sorted(m.start for m in maps)
    assert any(m.path == "[vdso]" for m in maps)


def cgroup_cases() -> list[tuple[str, str, str]]:
    cases, cur = [], None
    for line in (FIXTURES / "cgroups.txt").read_text().splitlines():
        if line.startswith("## expect"):
            _, _, cid, pod = line.split()
            cur = [cid.strip("-"), pod.strip("-"), ""]
            cases.append(cur)
        elif cur is not None and not line.startswith("#"):
            cur[2] += line + "\n"
    return [(text, cid, pod) for cid, pod, text in cases]


@pytest.mark.parametrize("text, container, pod", cgroup_cases())
def test_container_and_pod_from_recorded_cgroups(text: str, container: str, pod: str) -> None:
    ident = procfs.parse_cgroup(text)
    assert (ident.container_id, ident.pod_uid) == (container, pod)


def test_stat_with_spaces_and_parens_in_comm() -> None:
    line = "42 (a b) c)) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 777 1000 10"
    assert procfs.parse_stat(line) == ("a b) c)", 777)


def test_this_process_is_read_whole() -> None:
    # given this very process, when read, then identity and mappings are right
    table = procfs.ProcessTable(with_cmdline=True)
    p = table.get(os.getpid())
    assert p is not None and p.pid == os.getpid() and p.uid == os.getuid()
    assert p.executable == os.path.realpath(f"/proc/{os.getpid()}/exe")
    assert p.service == (p.container_id or p.executable)
    assert p.cmdline and "python" in p.cmdline[0]
    assert any(m.path == p.executable for m in p.mappings)
    # a look with covered addresses does not re-read maps; an uncovered one does
    reads = table.stats["maps_read"]
    table.get(os.getpid(), [p.mappings[0].start])
    assert table.stats["maps_read"] == reads
    table.get(os.getpid(), [1])
    assert table.stats["maps_read"] == reads + 1


def write_process(proc: Path, pid: int, start: int, exe: str) -> None:
    """Process `pid` in a fake /proc, started at `start` (ticks), running `exe` (its name too)."""
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(f"{pid} ({Path(exe).name}) S 1 {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0")
    (d / "status").write_text(f"Uid:\t7\t7\t7\t7\nNSpid:\t{pid}\n")
    (d / "cgroup").write_text("0::/\n")
    (d / "maps").write_text(f"1000-2000 r-xp 00000000 fd:01 9 {exe}\n")
    link = d / "exe"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(exe)


def test_a_reused_pid_is_a_new_process(tmp_path: Path) -> None:
    # given a fake /proc where pid 5 is replaced by a process with another start time
    proc = tmp_path / "proc"

    def write(start: int, exe: str) -> None:
        write_process(proc, 5, start, exe)

    write(100, "/bin/one")
    table = procfs.ProcessTable(with_cmdline=False, proc=str(proc))
    first = table.get(5)
    write(200, "/bin/two")
    second = table.get(5)
    assert first and second and first.executable == "/bin/one" and second.executable == "/bin/two"
    assert second.start_ticks == 200 and second.mappings[0].path == "/bin/two"

    # and when it execs another program (the same start time, another name), it is read again
    write(200, "/bin/three")
    third = table.get(5, [0x1500])
    assert third and third.executable == "/bin/three" and third.comm == "three", third
    assert third.mappings[0].path == "/bin/three"


def test_an_exited_process_is_kept_for_one_more_drain_then_forgotten(tmp_path: Path) -> None:
    # given a fake /proc with two processes the table has read
    proc = tmp_path / "proc"
    for pid in (5, 6):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (p) S 1 {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0")
        (proc / str(pid) / "status").write_text("Uid:\t7\t7\t7\t7\n")
        (proc / str(pid) / "cgroup").write_text("0::/\n")
        (proc / str(pid) / "maps").write_text("1000-2000 r-xp 00000000 fd:01 9 /bin/p\n")
    table = procfs.ProcessTable(with_cmdline=False, proc=str(proc))
    assert table.get(5) and table.get(6) and len(table) == 2
    living = {5, 6}
    assert table.forget_exited(living.__contains__) == 0
    # when 6 exits, then the drain after still names its samples; the one after that forgets it
    living.discard(6)
    (proc / "6" / "stat").unlink()
    assert table.forget_exited(living.__contains__) == 0
    got = table.get(6)
    assert got is not None and got.pid == 6  # what was known: the best answer
    assert table.forget_exited(living.__contains__) == 1
    assert table.get(6) is None and len(table) == 1 and table.stats["forgotten"] == 1


def test_a_process_is_marked_for_registers_by_the_name_of_a_file_it_maps() -> None:
    from collector.regs import marked_by
    from shared import runtime_registry
    from shared.wire import Mapping, Process

    def process(*paths: str) -> Process:
        return Process(
            pid=1,
            start_ticks=1,
            uid=0,
            nspid=1,
            comm="java",
            executable="/usr/bin/java",
            service="s",
            mappings=tuple(Mapping(0x1000 * i, 0x1000 * i + 0x1000, 0, p) for i, p in enumerate(paths, 1)),
        )

    names = runtime_registry.regs_mappings(("jvm",))
    assert "libjvm.so" in names
    assert (
        marked_by(process("/usr/lib/x86_64-linux-gnu/libc.so.6", "/opt/jdk/lib/server/libjvm.so"), names)
        == "/opt/jdk/lib/server/libjvm.so"
    )
    assert marked_by(process("/opt/jdk/lib/server/libjvm.so.bak", "/tmp/libjvm.sox"), names) is None
    assert runtime_registry.regs_mappings(("php", "ruby")) == frozenset()  # nothing marked without the JVM


def test_node_processes_are_marked_by_the_node_executable_or_a_libnode_of_any_soname() -> None:
    from collector.regs import marked_by
    from shared import runtime_registry
    from shared.wire import Mapping, Process

    def process(*paths: str) -> Process:
        return Process(
            pid=1,
            start_ticks=1,
            uid=0,
            nspid=1,
            comm="node",
            executable=paths[0],
            service="s",
            mappings=tuple(Mapping(0x1000 * i, 0x1000 * i + 0x1000, 0, p) for i, p in enumerate(paths, 1)),
        )

    names = runtime_registry.regs_mappings(("node",))
    assert marked_by(process("/usr/local/bin/node"), names) == "/usr/local/bin/node"
    assert (
        marked_by(process("/usr/bin/nodejs", "/usr/lib/x86_64-linux-gnu/libnode.so.115"), names)
        == "/usr/lib/x86_64-linux-gnu/libnode.so.115"
    )
    assert marked_by(process("/usr/bin/nodejs", "/usr/lib/libnode.so.127"), names) == "/usr/lib/libnode.so.127"
    assert (
        marked_by(process("/usr/bin/python3", "/tmp/libnode.so", "/opt/node_modules/x.node", "/tmp/nodes"), names)
        is None
    )
    assert (
        "libjvm.so" not in names
        and marked_by(process("/usr/local/bin/node"), runtime_registry.regs_mappings(("jvm",))) is None
    )


def test_a_process_read_already_is_known_until_it_is_another(tmp_path: Path) -> None:
    # given a fake /proc with pid 5, read by the table (a new-process event for it needs no early drain)
    proc = tmp_path / "proc"

    def write(start: int, name: str) -> None:
        write_process(proc, 5, start, f"/bin/{name}")

    write(100, "one")
    table = procfs.ProcessTable(with_cmdline=False, proc=str(proc))
    assert not table.known(5) and not table.known(6)  # never read; no such process
    assert table.get(5) is not None
    assert table.known(5)
    # when it execs (same start time, another name), or its pid is reused, it is new again
    write(100, "two")
    assert not table.known(5)
    assert table.get(5) is not None and table.known(5)
    write(300, "two")
    assert not table.known(5)
    # and once it has exited, it is not known as a living process
    (proc / "5" / "stat").unlink()
    assert not table.known(5)
