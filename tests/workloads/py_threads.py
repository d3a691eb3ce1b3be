"""A Python workload for the runtime reader's tests (runs on any CPython 3.x).

One thread spends 75% of its wall time in cpu_a() and 25% in cpu_b(), busy
(python_wall profiles count wall time: a thread preempted in cpu_a() is still
in cpu_a(), so the split holds on a loaded host, where a split by CPU time
would charge cpu_a()'s waits to it and tilt the ratio), both called from run(); another is blocked in wait_here(). It prints one JSON line
with the native thread ids, then runs until its stdin closes or SECONDS pass.
"""

import json
import sys
import threading
import time

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0


def cpu_a():
    end = time.monotonic() + 0.015
    while time.monotonic() < end:  # LINE_A
        pass  # LINE_A


def cpu_b():
    end = time.monotonic() + 0.005
    while time.monotonic() < end:  # LINE_B
        pass  # LINE_B


def run(stop):
    while not stop.is_set():
        cpu_a()  # CALL_A
        cpu_b()  # CALL_B


def wait_here(stop):
    stop.wait()  # WAIT


def main():
    stop = threading.Event()
    ids = {}
    workers = [threading.Thread(target=run, args=(stop,), name="worker"),
               threading.Thread(target=wait_here, args=(stop,), name="waiter")]
    for t in workers:
        t.start()
    while any(t.native_id is None for t in workers):
        time.sleep(0.001)
    ids = {t.name: t.native_id for t in workers}
    print(json.dumps(ids), flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait(SECONDS)
    stop.set()
    for t in workers:
        t.join()


if __name__ == "__main__":
    main()
