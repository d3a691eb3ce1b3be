"""Run one fuzz target for a while: `python -m tests.fuzz.run TARGET SECONDS` (tests/fuzz/test_fuzz.py runs it).

Deterministic (a fixed random seed per target): each round takes a seed input
from tests/fuzz/seeds/TARGET/, mutates it (bytes; and, for JSON inputs, its
structure) and runs the target. First every kept crasher in
tests/fuzz/crashers/TARGET/ is replayed. The process runs under an address
space cap (MAX_MEMORY_BYTES); an input that raises anything but the target's
own errors, takes more than MAX_INPUT_SECONDS or exhausts the memory is
written to tests/fuzz/crashers/TARGET/<sha1>.bin. The last line of stdout is a
JSON summary: runs, the slowest input's seconds, and the crashes.
"""

from __future__ import annotations

import hashlib
import json
import random
import resource
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.fuzz.targets import Target

HERE = Path(__file__).resolve().parent
SEEDS, CRASHERS = HERE / "seeds", HERE / "crashers"
# No input may take longer than this ...
MAX_INPUT_SECONDS = 2.0
# ... or make the process larger than this (the workers' own cap is of this order).
MAX_MEMORY_BYTES = 1 << 30
# An input still running after this is stopped (and is a crash: it was over MAX_INPUT_SECONDS anyway).
WATCHDOG_S = 10
INTERESTING = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, (1 << 63) - 1, (1 << 64) - 1)


class Watchdog(BaseException):
    """An input ran past WATCHDOG_S (a BaseException: parsers' `except Exception` must not eat it)."""


def mutate_bytes(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        op = rng.randrange(8)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip a bit
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # a random byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2:  # an interesting integer, 1 to 8 bytes LE
            width = rng.choice((1, 2, 4, 8))
            b[pos : pos + width] = (rng.choice(INTERESTING) & ((1 << 8 * width) - 1)).to_bytes(width, "little")
        elif op == 3:  # insert random bytes
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 32)))
        elif op == 4 and b:  # delete a range
            del b[pos : pos + rng.randrange(1, 64)]
        elif op == 5 and b:  # duplicate a range
            end = min(len(b), pos + rng.randrange(1, 256))
            b[pos:pos] = b[pos:end] * rng.randrange(1, 8)
        elif op == 6:  # splice another seed
            other = rng.choice(seeds)
            cut = rng.randrange(len(other) + 1)
            b[pos:] = other[cut:]
        elif op == 7:  # truncate
            del b[pos:]
    return bytes(b)


def mutate_json(rng: random.Random, doc: Any) -> Any:
    """`doc` with one node replaced by something hostile."""
    hostile = [
        "9" * 5000,
        -1,
        1 << 64,
        1e308,
        "",
        "x" * 70000,
        None,
        True,
        [],
        {},
        [[[[[[[[[[[]]]]]]]]]]],
        "\udcff".encode("utf-8", "surrogatepass").decode("latin-1"),
        {"k" * 300: [0] * 1000},
    ]
    if isinstance(doc, dict) and doc and rng.random() < 0.8:
        k = rng.choice(list(doc))
        out = dict(doc)
        out[k] = mutate_json(rng, doc[k]) if rng.random() < 0.7 else rng.choice(hostile)
        return out
    if isinstance(doc, list) and doc and rng.random() < 0.8:
        i = rng.randrange(len(doc))
        items = list(doc)
        items[i] = mutate_json(rng, doc[i]) if rng.random() < 0.7 else rng.choice(hostile)
        return items
    return rng.choice(hostile)


def structured(rng: random.Random, data: bytes) -> bytes | None:
    head, sep, tail = data.partition(b"\n\0\n")
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    text = json.dumps(mutate_json(rng, doc)).encode()
    r = rng.random()
    if r < 0.2:  # an integer of more digits than int() takes, where an integer was
        text = text.replace(b"1", b"1" + b"0" * 4400, 1)
    elif r < 0.3:  # nesting deeper than the interpreter's recursion limit, where a value was
        text = text.replace(b":", b":" + b"[" * 1500 + b"]" * 1500, 1) if b":" in text else b"[" * 1500 + b"]" * 1500
    return text + sep + tail


def run_once(target: Target, data: bytes) -> tuple[str, float]:
    """`data` through the target under the watchdog: how it failed ("" if it did not), and the seconds it took."""
    failure = ""
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)
    try:
        target.run(data)
    except target.errors:
        pass
    except Watchdog:
        failure = f"still running after {WATCHDOG_S} s"
    except MemoryError:
        failure = f"over the memory cap of {MAX_MEMORY_BYTES} bytes"
    except Exception as e:  # that is what a fuzzer is looking for
        failure = (
            "".join(traceback.format_exception_only(type(e), e)).strip()[:300]
            + "\n"
            + "".join(traceback.format_tb(e.__traceback__)[-3:])
        )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return failure, time.monotonic() - started


def main(name: str, seconds: float) -> int:
    resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY_BYTES, MAX_MEMORY_BYTES))
    from tests.fuzz.targets import TARGETS

    target = TARGETS[name]
    seeds = [p.read_bytes() for p in sorted((SEEDS / name).iterdir())]
    kept = sorted((CRASHERS / name).glob("*.bin")) if (CRASHERS / name).exists() else []
    rng = random.Random(f"ebpfprofiler-fuzz-{name}")
    crashes: list[dict[str, Any]] = []
    slowest = 0.0
    runs = 0

    def on_alarm(_sig: int, _frame: object) -> None:
        raise Watchdog()

    signal.signal(signal.SIGALRM, on_alarm)

    def one(data: bytes, origin: str) -> None:
        nonlocal slowest, runs
        runs += 1
        failure, took = run_once(target, data)
        slowest = max(slowest, took)
        if not failure and took > MAX_INPUT_SECONDS:
            failure = f"took {took:.2f} s, more than {MAX_INPUT_SECONDS} s"
        if failure:
            digest = hashlib.sha1(data).hexdigest()
            path = CRASHERS / name / f"{digest}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            crashes.append({"input": str(path.relative_to(HERE.parent.parent)), "origin": origin, "failure": failure})

    for p in kept:
        one(p.read_bytes(), "kept crasher")
    for s in seeds:
        one(s, "seed")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(crashes) < 20:
        data = rng.choice(seeds)
        mutated = structured(rng, data) if target.structured and rng.random() < 0.5 else None
        one(mutated if mutated is not None else mutate_bytes(rng, data, seeds), "mutation")
    print(json.dumps({"target": name, "runs": runs, "slowest_s": round(slowest, 3), "crashes": crashes}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
