"""A CPU-bound CPython loop for the overhead bench: a fixed amount of pure-Python work.

Usage: py_loop.py UNITS
Each unit is OPS_PER_UNIT integer operations in a function a few Python
frames deep. Prints "elapsed=<wall seconds>" of the work.
"""

import sys
import time

OPS_PER_UNIT = 10_000


def unit():
    x = 0
    for i in range(OPS_PER_UNIT):
        x = (x * 31 + i) & 0xFFFF
    return x


def middle(n):
    s = 0
    for _ in range(n):
        s += unit()
    return s


def outer(n):
    return middle(n)


def main():
    units = int(sys.argv[1])
    t0 = time.monotonic()
    outer(units)
    print(f"elapsed={time.monotonic() - t0:.6f}")


if __name__ == "__main__":
    main()
