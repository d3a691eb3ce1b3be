"""Services per window are capped (issue 40, suspected case: "no cap on the number of services in one
window"). It was real: every new executable path (or container) made a new service window of up to
MAX_ROWS_PER_SERVICE_WINDOW rows, and one profile and one upload per window, without bound; a local
user can start programs from any number of paths.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shared import config as config_mod
from shared import counters
from shared import window as window_mod
from shared.window import MAX_SERVICES_PER_WINDOW, OTHER_SERVICES, Windows
from shared.wire import Process, Sample, StackBatch
from symbolizer.main import Worker

T0 = 1_700_000_000_000_000_000
EXTRA = 250  # services past the cap


def test_a_window_holds_at_most_the_cap_and_the_rest_is_one_counted_service(caplog: pytest.LogCaptureFixture) -> None:
    w = Windows(10)
    by_service = w.services("cpu", T0)
    with caplog.at_level(logging.WARNING, logger=window_mod.__name__):
        for i in range(MAX_SERVICES_PER_WINDOW + EXTRA):
            w.service_in(by_service, f"/tmp/bin{i}").add((("pid", str(i)),), ("f",), 2, 20)
    assert len(by_service) == MAX_SERVICES_PER_WINDOW + 1 and OTHER_SERVICES in by_service
    assert sum(r[0] for r in by_service[OTHER_SERVICES].rows.values()) == 2 * EXTRA  # each process's row kept
    assert len(by_service[OTHER_SERVICES].rows) == EXTRA
    # a service already in the window keeps its own
    assert w.service_in(by_service, "/tmp/bin0") is by_service["/tmp/bin0"]
    # the log line is the feature: a check that fires is logged once, not per service past the cap
    assert len([r for r in caplog.records if "services in one window" in r.getMessage()]) == 1
    closed = list(w.close_all())
    assert len(closed) == MAX_SERVICES_PER_WINDOW + 1
    assert w.samples_over_service_cap == 2 * EXTRA


def test_the_symbolizer_sums_services_past_the_cap_and_status_counts_them(tmp_path: Path) -> None:
    # Given a real symbolizer worker, and one batch of processes from more executables than the cap
    run_dir, state_dir = tmp_path / "run", tmp_path / "state"
    run_dir.mkdir()
    state_dir.mkdir()
    cfg = config_mod.from_mapping({"plain_pid": True})
    worker = Worker(cfg, 0, str(run_dir), str(state_dir))
    try:
        n = MAX_SERVICES_PER_WINDOW + EXTRA
        procs = tuple(
            Process(
                pid=100 + i,
                start_ticks=1,
                uid=1000,
                nspid=100 + i,
                comm="x",
                executable=f"/tmp/u/bin{i}",
                service=f"/tmp/u/bin{i}",
            )
            for i in range(n)
        )
        samples = tuple(
            Sample(pid=100 + i, tid=100 + i, user_stack=-1, kernel_stack=-1, count=3, value=30) for i in range(n)
        )
        worker.add_batch(StackBatch("h", "cpu", 100, T0, procs, (), (), samples))
        # When the window is handed out
        closed = list(worker.windows.close_all())
        # Then it is the cap's services and one more, which holds the others' samples under their own labels
        assert len(closed) == MAX_SERVICES_PER_WINDOW + 1
        other = next(c for c in closed if c.service == OTHER_SERVICES)
        assert sum(r[0] for r in other.data.rows.values()) == 3 * EXTRA
        pids = {dict(labels)["pid"] for labels, _ in other.data.rows}
        assert len(pids) == EXTRA
        # And the count reaches `ebpfprofiler status` through the worker's counters file
        worker.counters.update(worker.checks(), force=True)
        assert counters.read_all(str(run_dir))["symbolizer-0"]["samples_over_service_cap"] == 3 * EXTRA
    finally:
        worker.inbox.close()
        worker.outbox.close()
