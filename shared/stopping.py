"""How a stage learns that it must stop: SIGTERM or SIGINT set an Event, and say so.

Owns: installing the stop handlers, the log line naming the signal, and the
Event the stage's loop waits on (Event.wait wakes as soon as it is set).

Must not: decide what stopping means for a stage.
"""

from __future__ import annotations

import logging
import signal
import threading


def stop_on_signals(log: logging.Logger, what: str = "stopping") -> threading.Event:
    """An Event set by SIGTERM or SIGINT; call from the main thread."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s: %s", signal.Signals(signum).name, what)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop
