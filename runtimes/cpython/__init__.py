"""CPython 3.11 to 3.15 (GIL builds), the plug-in: version.py detects, reader.py reads.

Owns: the plug-in entry (runtime(cfg), runtimes/runtime.py's contract) that
turns the config's python_stacks and runtime_stacks: [python_legacy] into
version.detect's switches, and its Target into a CPythonProcess.

Must not: read memory itself.
"""

from __future__ import annotations

from typing import Any

from runtimes.cpython import version
from runtimes.cpython.reader import CPythonProcess
from runtimes.runtime import ProcessContext, Refusal
from shared.runtime_registry import RuntimeSpec, spec_of

SPEC: RuntimeSpec = spec_of("cpython")


class CPython:
    spec = SPEC

    def __init__(self, modern: bool, legacy: bool) -> None:
        self.modern, self.legacy = modern, legacy

    def detect(self, process: ProcessContext) -> CPythonProcess | Refusal | None:
        got = version.detect(process, modern=self.modern, legacy=self.legacy)
        if got is None or isinstance(got, Refusal):
            return got
        return CPythonProcess(got)

    def stop(self) -> list[str]:
        """Nothing to undo: detect asks nothing of a process, only reads it."""
        return []

    def counters(self) -> dict[str, int]:
        """No checks of its own (its refusals are counted by the reader, by kind)."""
        return {}


def runtime(cfg: Any) -> CPython | None:
    legacy = "python_legacy" in cfg.runtime_stacks
    return CPython(cfg.python_stacks, legacy) if cfg.python_stacks or legacy else None
