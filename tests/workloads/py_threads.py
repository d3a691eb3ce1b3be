"""A Python workload for the runtime reader's tests (runs on any CPython 3.x).

One thread runs run(), which calls cpu_a() and cpu_b(): the same loop, three times as many
iterations in cpu_a() (~15 ms and ~5 ms here, calibrated at start). A split by work holds
on a loaded host, where a split by time would not: a thread preempted past a deadline
stretches both functions by the same amount and tilts the ratio towards 1. python_wall counts
wall time, and a preemption is as likely in either loop, so the wall-time split is 3:1 too.
Another thread is blocked in wait_here(). It prints one JSON line with the native thread ids,
then runs until its stdin closes or SECONDS pass (timed: then prints a last JSON line with the thread
CPU time each of cpu_a() and cpu_b() took).
"""

import json
import sys
import threading
import time

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0


def _calibrate():
    """Iterations of the loop that take about 5 ms here."""
    n, x = 20000, 0
    t = time.perf_counter()
    for i in range(n):
        x ^= i
    return max(1000, int(n * 0.005 / max(time.perf_counter() - t, 1e-6)))


N = _calibrate()


def cpu_a():
    x = 0
    for i in range(3 * N):  # LINE_A
        x ^= i  # LINE_A
    return x


def cpu_b():
    x = 0
    for i in range(N):  # LINE_B
        x ^= i  # LINE_B
    return x


# With a second argument "timed", run() measures the thread CPU time each of cpu_a() and cpu_b() takes:
# the split an on-CPU profile of this host must show (3:1 where the host runs both loops at the same speed
# per iteration). Not by default: under a loaded host a syscall's return is where the thread is often
# preempted, and a wall-time profile then finds it in run() (python_wall: 20-30% of its samples).
TIMED = len(sys.argv) > 2 and sys.argv[2] == "timed"
SPENT_NS = {"cpu_a": 0, "cpu_b": 0}

if TIMED:

    def run(stop):
        clock, spent = time.thread_time_ns, SPENT_NS  # TIMING
        while not stop.is_set():  # LOOP
            t0 = clock()  # TIMING
            cpu_a()  # CALL_A
            t1 = clock()  # TIMING
            cpu_b()  # CALL_B
            spent["cpu_a"] += t1 - t0  # TIMING
            spent["cpu_b"] += clock() - t1  # TIMING

else:

    def run(stop):
        while not stop.is_set():  # LOOP
            cpu_a()  # CALL_A
            cpu_b()  # CALL_B


def wait_here(stop):
    stop.wait()  # WAIT


def main():
    stop = threading.Event()
    ids = {}
    workers = [
        threading.Thread(target=run, args=(stop,), name="worker"),
        threading.Thread(target=wait_here, args=(stop,), name="waiter"),
    ]
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
    if TIMED:
        print(json.dumps({"spent_ns": SPENT_NS}), flush=True)


if __name__ == "__main__":
    main()
