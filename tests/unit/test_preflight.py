"""Preflight's verdicts on given capability sets and systems."""

from __future__ import annotations

import platform

import pytest

from collector import preflight
from collector.preflight import CAP_BPF, CAP_SYS_ADMIN, REQUIRED_CAPS


def mask(*bits: int) -> int:
    return sum(1 << b for b in bits)


def test_all_required_capabilities_pass() -> None:
    assert all(c.ok for c in preflight.check_caps(mask(*REQUIRED_CAPS)))


def test_each_missing_capability_is_named_with_its_fix() -> None:
    for bit, (name, _) in REQUIRED_CAPS.items():
        checks = preflight.check_caps(mask(*(set(REQUIRED_CAPS) - {bit})))
        failed = [c for c in checks if not c.ok]
        assert [c.name for c in failed] == [f"capability {name}"]
        assert name in failed[0].fix


def test_cap_sys_admin_stands_in_for_bpf_on_older_kernels() -> None:
    caps = mask(*(set(REQUIRED_CAPS) - {CAP_BPF}), CAP_SYS_ADMIN)
    assert all(c.ok for c in preflight.check_caps(caps))


def test_a_system_that_is_not_linux_is_reported_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    checks = preflight.run_checks()
    assert len(checks) == 1 and not checks[0].ok and "unsupported" in checks[0].detail
    assert "1 problem(s): operating system" in preflight.report(checks)
