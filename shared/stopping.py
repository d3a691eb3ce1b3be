"""How a stage learns that it must stop, and how an idle stage sleeps until there is work.

Owns: installing the stop handlers, the log line naming the signal, the Event
the stage's loop waits on (Event.wait wakes as soon as it is set), and the
signal wake-up descriptor: a stage that blocks in a ZeroMQ poll registers
`wakeup_fd()` beside its sockets, so a signal ends the poll at once and the
stage can sleep until its next deadline instead of waking on a short timer
(an idle host should cost nothing: issue 14).

Must not: decide what stopping means for a stage.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

# While remote config is on, a stage with nothing to do still wakes this often to check the
# overrides file the uploader writes (shared/remote_config.Watcher.wake_s).
IDLE_WAKE_S = 5.0
# Otherwise it sleeps until a message, a signal or its own deadline, and at most this long (a clock
# step or a lost wake-up cannot leave it asleep for good). Each wake-up of an idle stage costs
# 0.1-4 ms of CPU on these VMs (the longer it slept, the more: caches and host-side mappings are
# cold), so on an idle host the wake-ups themselves were most of the agent's cost.
QUIET_WAKE_S = 60.0

_wakeup: tuple[int, int] | None = None


def stop_on_signals(
    log: logging.Logger, what: str = "stopping", also: threading.Event | None = None
) -> threading.Event:
    """An Event set by SIGTERM or SIGINT; call from the main thread. `also` is set too (a loop's wake-up)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s: %s", signal.Signals(signum).name, what)
        stop.set()
        if also is not None:
            also.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def wakeup_fd() -> int:
    """A descriptor that becomes readable whenever a signal arrives (call from the main thread, once
    the handlers are installed); poll it beside the sockets and `drain_wakeups()` when it is."""
    global _wakeup  # noqa: PLW0603 - one wake-up pipe per process, made on first use
    if _wakeup is None:
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        _wakeup = (r, w)
    return _wakeup[0]


def drain_wakeups() -> None:
    """Empty the wake-up pipe (the signals themselves were handled by their handlers)."""
    if _wakeup is None:
        return
    try:
        while os.read(_wakeup[0], 512):
            pass
    except BlockingIOError:
        pass


def poll_timeout_ms(deadline_s: float, now_s: float, cap_s: float = QUIET_WAKE_S) -> int:
    """Milliseconds to block in a poll until `deadline_s` (a time.monotonic() value), at most cap_s;
    rounded up, so the loop does not spin through the last millisecond."""
    left = min(max(0.0, deadline_s - now_s), cap_s)
    return int(left * 1000) + (1 if left * 1000 % 1 else 0)
