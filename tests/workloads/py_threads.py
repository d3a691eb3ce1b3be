"""A Python workload for the runtime reader's tests (runs on any CPython 3.x).

One thread spends 75% of its CPU time in cpu_a() and 25% in cpu_b() (CPU
time, not wall time: a preempted thread's wait would count for whichever
function it was in, blurring the ratio on a loaded host), both
called from run(); another is blocked in wait_here(). It prints one JSON line
with the native thread ids, then runs until its stdin closes or SECONDS pass.
"""

import json
import sys
import threading
import time

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0


def cpu_a():
    end = time.thread_time() + 0.015
    while time.thread_time() < end:  # LINE_A
        pass  # LINE_A


def cpu_b():
    end = time.thread_time() + 0.005
    while time.thread_time() < end:  # LINE_B
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
