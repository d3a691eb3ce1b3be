"""The kernel matrix's host-side reading, on made-up guest output: no qemu, no BPF.

What a guest reports must reach the table as it was: a panic in the serial
log, a result line the guest had not finished writing, the stage error behind
the supervisor's, a module order the kernel can load, a guest that timed out or went silent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernels import boot
from tests.kernels.__main__ import GUEST_TIMEOUT_S, hung_guest, row_of
from tests.kernels.guest_smoke import RESULT_MARK, cause

PANIC_LOG = """initrd: loading 12 modules
[  201.5] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI
[  201.5] RIP: 0010:exit_to_user_mode_loop+0x1/0x100
[  201.6] Kernel panic - not syncing: Fatal exception in interrupt
"""


def test_a_panic_and_its_context_are_found() -> None:
    found = boot.panics(PANIC_LOG)
    assert len(found) == 1, found  # the oops and the panic after it are one event (its context)
    assert found[0].startswith("[  201.5] Oops: int3") and "Kernel panic" in found[0]


def test_a_result_line_still_being_written_is_left_for_later(tmp_path: Path) -> None:
    path = tmp_path / "results.log"
    path.write_text(f'{RESULT_MARK}{{"step": "env", "status": "ok"}}\r\n{RESULT_MARK}{{"step": "bu')
    assert [r["step"] for r in boot.read_results(path, final=False)] == ["env"]
    assert [r["step"] for r in boot.read_results(path)] == ["env", "garbled"]


def test_the_stage_error_is_the_cause_not_the_supervisors() -> None:
    out = (
        "2026-12-06 03:34:51,000 collector[184] WARNING x: offcpu_dwarf refused: needs task_pt_regs\n"
        "2026-12-06 03:34:52,000 run[167] ERROR ebpfprofiler.run: collector did not become ready\n"
        "2026-12-06 03:34:50,000 collector[184] ERROR c: loading offcpu_switch: Permission denied\n"
        "2026-12-06 03:34:53,000 uploader[1] INFO u: exiting: 0 written, 0 refused\n"
    )
    assert cause(out) == "collector[184] ERROR c: loading offcpu_switch: Permission denied"
    assert (
        cause('x\nTraceback (most recent call last):\n  File "a", line 1\nPermissionError: no\n')
        == "PermissionError: no"
    )
    assert cause("uploader exiting: 0 written, 0 refused\nlast words") == "last words"


def test_modules_load_after_their_dependencies_and_built_ins_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "modules.dep").write_text(
        "kernel/fs/ext4/ext4.ko.xz: kernel/fs/jbd2/jbd2.ko.xz kernel/lib/crc16.ko.xz\n"
        "kernel/fs/jbd2/jbd2.ko.xz:\nkernel/lib/crc16.ko.xz:\n"
        "kernel/drivers/block/virtio_blk.ko.xz:\nkernel/crypto/crc32c_generic.ko.xz:\n"
    )
    (tmp_path / "modules.builtin").write_text("kernel/drivers/virtio/virtio_pci.ko\n")
    order = [boot._name(m) for m in boot._load_order(tmp_path)]
    assert order == ["virtio_blk", "jbd2", "crc16", "ext4", "crc32c_generic"]


def test_a_guest_that_hung_mid_suite_fails_its_boot_cell_with_the_panic(tmp_path: Path) -> None:
    b = boot.BootResult(
        release="7.2.13+deb14-amd64",
        accel="tcg",
        seconds=900.0,
        timed_out=False,
        exit_code=0,
        console_log=tmp_path / "sid.console.log",
        results=[
            {"step": "env", "status": "ok", "uname_r": "7.2.13+deb14-amd64"},
            {"step": "preflight", "status": "ok"},
        ],
        panics=boot.panics(PANIC_LOG),
    )
    row = row_of("sid", "7.2.13+deb14-amd64", b)
    assert row["cells"]["boot"].startswith("✗ guest ended (qemu exit 0) before the suite finished: kernel panic")
    assert row["cells"]["preflight"] == "✓" and row["cells"]["fp"] == "✗ no result"
    assert row["cells"]["panics"].startswith("✗ 1: [  201.5] Oops: int3")
    timed_out = boot.BootResult(
        release="5.10.0-32-amd64",
        accel="tcg",
        seconds=GUEST_TIMEOUT_S,
        timed_out=True,
        exit_code=None,
        console_log=tmp_path / "bullseye.console.log",
    )
    assert (
        row_of("bullseye", "5.10.0-32-amd64", timed_out)["cells"]["boot"]
        == f"✗ timeout {GUEST_TIMEOUT_S} s before the suite started"
    )


def test_a_guest_gone_silent_is_said_with_its_last_step_and_its_log_kept(tmp_path: Path) -> None:
    console = tmp_path / "bookworm.console.log"
    console.write_text("[record  33.9] starting: 2 of 3 stages ready\n")
    silent = boot.BootResult(
        release="6.1.0-50-amd64",
        accel="tcg",
        seconds=700.0,
        timed_out=True,
        exit_code=None,
        console_log=console,
        results=[
            {"step": "env", "status": "ok", "uname_r": "6.1.0-50-amd64"},
            {"step": "progress", "message": "record: record -d 30 --offcpu"},
        ],
        silent=True,
    )
    # its row says the guest went silent, not that the suite ran out of time
    row = row_of("bookworm", "6.1.0-50-amd64", silent)
    assert row["cells"]["boot"] == f"✗ silent for {boot.SILENT_S:.0f} s before the suite finished"
    # and what the second boot's row carries names the step it hung in, with its log kept beside
    said = hung_guest("bookworm", silent, tmp_path)
    assert said == (
        f"went silent for {boot.SILENT_S:.0f} s after 'record: record -d 30 --offcpu' (log bookworm.hung.console.log)"
    )
    assert (tmp_path / "bookworm.hung.console.log").read_text().startswith("[record  33.9]")
    assert not console.exists()  # the second boot writes its own


def test_the_silence_watch_sees_either_log_grow(tmp_path: Path) -> None:
    console, results = tmp_path / "c.log", tmp_path / "r.log"
    first = boot.logs_grown((-1, -1, 0.0), console, results)
    assert first[:2] == (0, 0) and first[2] > 0
    assert boot.logs_grown(first, console, results) is first  # nothing new: the clock stays
    results.write_text("x")
    assert boot.logs_grown(first, console, results)[:2] == (0, 1)


def _profile(path: Path, sample_types: list[tuple[str, str]], stacks: list[tuple[list[str], list[int], int]]) -> None:
    from shared.pprof import ProfileBuilder

    b = ProfileBuilder(sample_types, sample_types[-1], 1, 0, 10_000_000_000)
    m = b.mapping(("/tmp/ktest/knofp", ""), "/tmp/ktest/knofp", "", has_functions=True)
    for frames, values, pid in stacks:
        ids = [
            b.location(("/tmp/ktest/knofp", "", i, f, 0), m, i, [b.function(f, "")], 0)
            for i, f in enumerate(reversed(frames))
        ]  # leaf first
        b.sample(ids, values, {"pid": str(pid)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b.gzipped())


def test_figures_count_a_programs_samples_and_read_runs_last_whole_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from report import profiles as pm
    from tests.kernels import guest_smoke

    cpu = [("samples", "count"), ("cpu", "nanoseconds")]
    whole, cut, other = ["_start", "main", "alpha", "beta"], ["beta"], ["main", "alpha", "beta"]
    for i, window in enumerate(["20261206T040000Z", "20261206T040010Z", "20261206T040020Z"]):
        _profile(
            tmp_path / "svc" / f"cpu-{window}-{i}.pb.gz",
            cpu,
            [(whole, [3 + i, 30], 7), (cut, [1, 10], 7), (other, [50, 500], 8)],
        )
    first = pm.load([str(tmp_path / "svc" / "cpu-20261206T040000Z-0.pb.gz")])
    assert guest_smoke.chain_share(first, 7)[:2] == (75.0, 4)  # 30 of 40 ns; 3 + 1 samples, not 2 rows
    wins = guest_smoke.windows_of(tmp_path, "cpu", 7)
    assert sorted(wins) == ["20261206T040000Z", "20261206T040010Z", "20261206T040020Z"]
    assert guest_smoke.windows_of(tmp_path, "offcpu", 7) == {}

    class Running:
        def poll(self) -> None:
            return None

    monkeypatch.setattr(guest_smoke, "STEADY_WINDOWS", 3)
    steady = guest_smoke.steady_figures(tmp_path, {"kfp": 8, "knofp": 7, "kblock": 9, "kblocklibc": 10}, Running())
    assert steady["dwarf"]["window"] == "20261206T040010Z"  # the last whole one, not the newest
    assert steady["dwarf"]["pct"] == 75.0 and steady["dwarf"]["samples"] == 5
    assert steady["fp"]["pct"] == 100.0 and steady["offcpu"] == {"pct": None, "windows": 0}


def test_a_figure_passes_on_runs_window_and_shows_records_too() -> None:
    from tests.kernels.__main__ import cell

    record = {"status": "failed", "pct": 77.4, "samples": 1575, "reason": "77.4% of knofp stacks …"}
    assert cell(record, {"pct": 100.0, "samples": 80}) == ("77.4% (1575) [run: 100.0%]", True)
    assert cell({**record, "status": "ok", "pct": 92.4, "samples": 1589}, {"pct": 1.3, "samples": 78}) == (
        "✗ 92.4% (1589) [run: 1.3%]",
        False,
    )
    # too few samples in run's window to judge by: record's figure does, run's is shown with its count
    assert cell({**record, "status": "ok", "pct": 92.4, "samples": 1589}, {"pct": 0.0, "samples": 3}) == (
        "92.4% (1589) [run: 0.0% of 3]",
        True,
    )
    assert cell({**record, "status": "ok", "pct": 92.4, "samples": 1589}, {}) == ("92.4% (1589)", True)
    assert cell({"status": "failed", "pct": 40.0, "samples": 3, "reason": "too few samples: 3"}, {}) == (
        "✗ 40.0% (3): too few samples",
        False,
    )
    assert cell({"status": "failed", "reason": "record failed"}, {}) == ("✗ record failed", False)
