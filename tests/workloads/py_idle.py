"""A Python process whose only thread sleeps from its start: idle_here() sleeps SECONDS (argv[1]) at once.

It prints "sleeping" before the sleep, so a test knows when it has nothing more to run, and ends by
itself when the sleep is over.
"""

import sys
import time


def idle_here(seconds):
    time.sleep(seconds)  # IDLE


print("sleeping", flush=True)
idle_here(float(sys.argv[1]))
