"""What the collector makes of a kernel: its features, the capabilities it starts with, its build flags.

Given what a kernel's probes answered (recorded on Debian's kernels, tests/fixtures/kernels/), when the
collector resolves its features, then each missing one is named with the version that has it and what
the agent does without it, and a feature that needs a missing one is missing too; the -D flags follow.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from collector import features, perfevents, programs
from collector.main import start_caps
from shared.privileges import CAP_SYS_ADMIN

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kernels"
ALL_YES = {spec.name: True for spec in features.FEATURES}


def test_a_kernel_with_everything_misses_nothing_and_compiles_every_path() -> None:
    k = features.resolve("6.12.0", ALL_YES)
    assert k.missing() == []
    assert features.bpf_defines(k) == {"HAVE_RINGBUF": 1, "HAVE_GET_TASK_STACK": 1, "HAVE_TASK_PT_REGS": 1}


def test_debian_11s_kernel_lacks_task_storage_and_pt_regs_and_says_what_is_done_instead() -> None:
    # as 5.10 answers: no task storage, no bpf_get_current_task_btf, no bpf_task_pt_regs, no memcg accounting
    probes = {**ALL_YES, "task_storage": False, "memcg_accounting": False, "task_pt_regs": False, "uprobe_multi": False}
    k = features.resolve("5.10.0-35-amd64", probes)
    missing = {f.spec.name: f for f in k.missing()}
    assert set(missing) == {"task_storage", "memcg_accounting", "task_pt_regs", "uprobe_multi"}
    assert missing["task_storage"].why == "Linux 5.10.0-35-amd64 lacks it"
    assert "LRU hash map by thread id" in missing["task_storage"].describe()
    assert "Linux 5.11" in missing["task_storage"].describe()
    assert features.bpf_defines(k) == {"HAVE_RINGBUF": 1, "HAVE_GET_TASK_STACK": 1}


def test_without_btf_the_features_that_need_it_are_missing_for_that_reason() -> None:
    k = features.resolve("6.1.0", {**ALL_YES, "btf": False})
    assert not k.has("task_storage") and not k.has("task_pt_regs") and not k.has("uprobe_multi")
    assert k.features["task_storage"].why == "needs btf, which is not available"
    assert k.has("ringbuf") and k.has("get_task_stack")


def test_a_probe_that_could_not_tell_is_a_missing_feature_not_a_guess() -> None:
    k = features.resolve("6.1.0", {**ALL_YES, "task_pt_regs": None})
    assert not k.has("task_pt_regs")
    assert "not probed" in k.features["task_pt_regs"].why


def test_features_turned_off_by_the_environment_are_missing_and_unknown_names_refused() -> None:
    off = features.disabled_by_env({features.DISABLE_ENV: "task_storage, ringbuf"})
    k = features.resolve("6.18", ALL_YES, off)
    assert {f.spec.name for f in k.missing()} == {"task_storage", "ringbuf", "task_pt_regs"}
    assert k.features["ringbuf"].why == f"turned off by {features.DISABLE_ENV}"
    with pytest.raises(ValueError, match="unknown feature.*tsk_storage.*known: btf"):  # noqa: RUF043
        features.disabled_by_env({features.DISABLE_ENV: "tsk_storage"})


def test_a_recorded_probe_round_trips_through_json() -> None:
    k = features.resolve("5.10.0", {**ALL_YES, "task_storage": False}, frozenset({"ringbuf"}))
    doc: dict[str, Any] = k.to_json()  # a JSON document: its values as json.loads would give them
    again = features.resolve(doc["release"], doc["probes"], frozenset(doc["disabled"]))
    assert again.to_json() == doc


def test_every_feature_the_programs_test_for_is_passed_and_documented() -> None:
    sources = "".join(p.read_text() for p in (Path(__file__).resolve().parents[2] / "bpf").iterdir())
    for define in features.bpf_defines(features.resolve("x", ALL_YES)):
        assert f"#ifdef {define}" in sources, define
    docs = (Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text()
    for spec in features.FEATURES:
        assert f"`{spec.name}`" in docs, spec.name


def test_cap_sys_admin_is_kept_for_allocations_and_held_at_start_only_under_paranoid_3(tmp_path: Path) -> None:
    alloc = tmp_path / "alloc.yaml"
    alloc.write_text("modules:\n  ebpf_profiler:\n    alloc_targets: [python3]\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text("modules:\n  ebpf_profiler: {}\n")
    admin = frozenset({CAP_SYS_ADMIN})
    assert start_caps(str(plain), 2) == (frozenset(), frozenset())
    assert start_caps(str(plain), 3) == (frozenset(), admin)  # Debian's default
    assert start_caps(str(plain), 4) == (frozenset(), admin)  # Ubuntu's
    assert start_caps(str(alloc), 3) == (admin, frozenset())  # kept: uprobes take it
    assert start_caps(None, 3) == (frozenset(), admin)  # --preflight: as the start would be
    assert start_caps(str(plain), None) == (frozenset(), frozenset())


def test_the_kernels_ms_extensions_flag_is_passed_where_its_header_tree_says_so(tmp_path: Path) -> None:
    # the line of sid's 7.2.13+deb14-amd64 header tree (include/config/auto.conf, as Debian ships it), and
    # bookworm's 6.1, which has none
    for release, config in (
        ("7.sid", "CONFIG_X86_64=y\nCONFIG_CC_MS_EXTENSIONS=-fms-extensions\nCONFIG_SMP=y\n"),
        ("6.1.bookworm", "CONFIG_X86_64=y\n"),
    ):
        tree = tmp_path / release / "build" / "include" / "config"
        tree.mkdir(parents=True)
        (tree / "auto.conf").write_text(config)
    assert programs.kernel_cflags("7.sid", str(tmp_path)) == ["-fms-extensions", "-Wno-microsoft-anon-tag"]
    assert programs.kernel_cflags("6.1.bookworm", str(tmp_path)) == []
    assert programs.kernel_cflags("no-such-kernel", str(tmp_path)) == []


def test_a_refused_program_is_named_with_the_verifiers_last_lines() -> None:
    # what bcc raises and writes when 6.12's verifier refuses a 2-byte read of pt_regs.cs (issue 39)
    with programs.capture_stderr() as said:
        os.write(2, b"".join(f"{i}: (79) r1 = *(u64 *)(r6 +{i})\n".encode() for i in range(40)))
        os.write(2, b"invalid bpf_context access off=136 size=2\nprocessed 12 insns\n")
    message = programs.explain(Exception("Failed to load BPF program b'on_cpu_sample': Permission denied"), said)
    assert message.startswith("the kernel refused BPF program on_cpu_sample: Permission denied")
    assert "invalid bpf_context access off=136 size=2" in message
    assert message.count("\n") <= programs.QUOTED_LINES + 1  # the end of the log, not all of it
    assert errno.EACCES  # (the error is the kernel's EACCES, passed on as its text)


def test_a_fault_of_ours_while_loading_is_named_by_its_type_not_taken_for_the_kernels_word() -> None:
    # an assert of the collector's own failing during the load (its message is empty): on sid 7.2 the
    # refusal read "the BPF programs with the Python walker were refused: " and nothing more
    with programs.capture_stderr() as said:
        os.write(2, b"3 warnings generated.\n")
    assert not programs.is_refusal(AssertionError())
    assert programs.explain(AssertionError(), said).startswith("AssertionError\n")
    assert programs.explain(KeyError("py_counters"), said).startswith("KeyError: 'py_counters'")
    # and the kernel's and bcc's words stay as they are
    assert programs.is_refusal(Exception("Failed to compile BPF module"))
    assert programs.is_refusal(OSError(7, "Argument list too long"))


def test_kernel_cpu_lists_are_read_as_the_kernel_writes_them() -> None:
    assert perfevents.cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert perfevents.cpu_list("0\n") == [0]
    assert perfevents.cpu_list("") == []


def test_a_walker_the_off_cpu_programs_refused_stays_in_the_on_cpu_ones() -> None:
    # sid's 7.2 took the on-CPU walk and found offcpu_resume with it too complex: the next load leaves the
    # walk out of the off-CPU programs alone, and the one after that out of all
    from collector import plan
    from shared.config import ProfilerConfig

    kernel = features.resolve("7.2.0", ALL_YES)
    cfg = ProfilerConfig(python_stacks=True, offcpu=True)
    first = plan.plan(cfg, kernel)
    assert first.python_walk and first.python_walk_offcpu
    assert {"PY_WALK", "PY_WALK_OFFCPU"} <= first.defines.keys()
    second = plan.plan(cfg, kernel, plan.WalkRefusals(offcpu="too complex"))
    assert second.python_walk and not second.python_walk_offcpu
    assert "PY_WALK" in second.defines and "PY_WALK_OFFCPU" not in second.defines
    assert ("Python frames in offcpu profiles", "too complex") in second.refused
    last = plan.plan(cfg, kernel, plan.WalkRefusals(offcpu="too complex", all="refused"))
    assert not last.python_walk and "PY_WALK" not in last.defines
    assert ("Python frames in cpu profiles", "refused") in last.refused
