"""The collector's sockets to its symbolizer workers, and which workers are alive.

Owns: one PUSH socket per worker (ZMQ_IMMEDIATE: nothing queues for a worker
that is not connected) and a socket monitor on each, so a worker whose
process dies is known within the next drain (its connection drops) and one
that comes back is known as soon as it accepts the connection again.

Must not: choose which worker gets which service (routing.py does).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

import zmq

from shared import endpoints

log = logging.getLogger(__name__)

# Batches queued per worker before new ones are refused (and counted): a worker
# this far behind is down or overloaded, and the collector must not grow.
BATCH_QUEUE_PER_WORKER = 64
# On stop, how long queued batches may take to reach the workers.
STOP_LINGER_MS = 3000
# Reconnect to a restarting worker this often (ZeroMQ's own retry).
RECONNECT_MS = 100

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED


def _monitor_event(mon: zmq.Socket) -> int:
    """The event number of one socket-monitor message (ZeroMQ's zmq_socket_monitor: a frame of a
    16-bit event and a 32-bit value, native order, then the endpoint). Parsed here, not with
    zmq.utils.monitor, which imports asyncio: ~8 MB of the collector's RSS for six bytes."""
    frames = mon.recv_multipart()
    return int(struct.unpack_from("=H", frames[0])[0])


class WorkerLinks:
    def __init__(self, ctx: zmq.Context, run_dir: str, workers: int) -> None:
        self.workers = list(range(workers))
        self._sockets: list[zmq.Socket] = []
        self._monitors: list[zmq.Socket] = []
        self._live: set[int] = set()
        for w in self.workers:
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, BATCH_QUEUE_PER_WORKER)
            s.setsockopt(zmq.LINGER, STOP_LINGER_MS)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
            self._monitors.append(s.get_monitor_socket(_UP | _DOWN))
            s.connect(endpoints.symbolizer(run_dir, w))
            self._sockets.append(s)

    def live(self) -> Sequence[int]:
        """Workers connected now; all of them if none is (batches then wait or are refused)."""
        for w, mon in enumerate(self._monitors):
            while mon.poll(0):
                event = _monitor_event(mon)
                if event == _UP and w not in self._live:
                    self._live.add(w)
                    log.info("symbolizer worker %d is connected: it takes its services", w)
                elif event == _DOWN and w in self._live:
                    self._live.discard(w)
                    log.warning(
                        "symbolizer worker %d disconnected: its services move to workers %s",
                        w,
                        sorted(self._live) or "none (batches wait)",
                    )
        return sorted(self._live) or self.workers

    def wait_connected(self, timeout_ms: int) -> None:
        """Take connection events for up to timeout_ms, until every worker is connected."""
        poller = zmq.Poller()
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        while len(self._live) < len(self.workers) and poller.poll(timeout_ms):
            self.live()

    def send(self, worker: int, frames: list[bytes]) -> bool:
        """Queue frames for `worker`; False if its queue is full or it is not connected."""
        try:
            self._sockets[worker].send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        for s in self._sockets:
            s.disable_monitor()
        for m in self._monitors:
            m.close(linger=0)
        for s in self._sockets:
            s.close()
