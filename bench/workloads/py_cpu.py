"""A CPU-bound Python workload for the python bench suite (any CPython 3).

Usage: py_cpu.py UNITS WARMUP_S

The main thread computes at a depth of DEPTH Python frames (a recursive
descent, then a loop of integer arithmetic per unit), first untimed for
WARMUP_S seconds (so a profiler has found the process and read its code
objects before the timed part), then UNITS units timed. A second thread is
blocked on an event all along, as in most real programs. Prints one JSON
line: {"units": UNITS, "seconds": timed wall seconds}.
"""

import json
import sys
import threading
import time

DEPTH = 20
# Integer operations per unit: ~1 ms of CPU with CPython 3.11 here.
OPS_PER_UNIT = 10_000


def work():
    x = 0
    for i in range(OPS_PER_UNIT):
        x = (x * 31 + i) & 0xFFFF
    return x


def descend(depth, fn):
    if depth:
        return descend(depth - 1, fn)
    return fn()


def units(n):
    for _ in range(n):
        descend(DEPTH, work)


def warm_up(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        units(10)


def main():
    n, warm = int(sys.argv[1]), float(sys.argv[2])
    stop = threading.Event()
    blocked = threading.Thread(target=stop.wait, name="blocked", daemon=True)
    blocked.start()
    warm_up(warm)
    t0 = time.perf_counter()
    units(n)
    seconds = time.perf_counter() - t0
    stop.set()
    print(json.dumps({"units": n, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
