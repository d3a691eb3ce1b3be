"""A Python workload for the in-BPF walker's tests (runs on any CPython 3.11+).

`callback`: sort_loop() sorts with key=key_of, so each key_of() is a Python call made from C (sorted's
C code calls it): its stack is leaf_spin ← key_of ← sorted (C) ← sort_loop ← <module>, and key_of and
<module> each begin a call of the interpreter's eval function.
`deep N`: descend() recurses N levels, then spins in leaf_spin() at the bottom.
`sleep`: sleep_loop() calls nap(), which sleeps 20 ms in time.sleep: off-CPU under nap.
Prints "ready" once the loop is about to start, then runs until its stdin closes or SECONDS pass.
"""

import sys
import threading
import time

SECONDS = 120.0
stop = threading.Event()


def leaf_spin():
    x = 0
    for i in range(2000):  # LEAF
        x ^= i
    return x


def key_of(v):
    leaf_spin()
    return v


def sort_loop():
    while not stop.is_set():
        sorted(range(20), key=key_of)


def descend(n):
    if n:
        return descend(n - 1)
    while not stop.is_set():
        leaf_spin()
    return 0


def nap():
    time.sleep(0.02)  # NAP


def sleep_loop():
    while not stop.is_set():
        nap()


def main():
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    deadline = threading.Timer(SECONDS, stop.set)
    deadline.daemon = True
    deadline.start()
    sys.setrecursionlimit(10000)
    print("ready", flush=True)
    if sys.argv[1] == "callback":
        sort_loop()
    elif sys.argv[1] == "sleep":
        sleep_loop()
    else:
        descend(int(sys.argv[2]))
    stop.set()


if __name__ == "__main__":
    main()
