"""The contract between the collector's main loop and its event sources (on-CPU, off-CPU, lock, alloc).

An event source is one family of BPF programs and maps: collector/stage.py's Collector makes
the ones the config turns on and then treats them alike: attach and detach them (remote
config's pause), drain each one's counts every drain, ship what it drained under its
profile_type, ask it for a snapshot once per upload window, log its counts and close it on stop
(what its programs cost they count themselves: collector/bpftime.py). A source that records only target
processes (lock waits, allocations) is a TargetedSource too: the collector's TargetWatcher for
its specs adds and removes the targets.

Owns: the Protocols, and the defaults of their optional parts. Must not: hold state, import bcc
or know any one family.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from collector.bpfmaps import RawDrain
from collector.targets import Target

__all__ = ["EventSource", "TargetedSource"]


class EventSource(Protocol):
    """One family of BPF events. Sources inherit the defaults below by subclassing this class."""

    # The profile type its samples are shipped under ("cpu", "offcpu", "lock", "alloc").
    profile_type: str

    def attach(self) -> None:
        """Start recording (again, after detach()); a no-op while attached."""
        ...

    def detach(self) -> None:
        """Stop recording; the programs and maps stay loaded. A no-op while detached."""
        ...

    def drain(self) -> RawDrain:
        """What was recorded since the last drain (the double buffer flipped, the retired half read and cleared)."""
        ...

    def snapshot(self) -> RawDrain | None:
        """Once per upload window, what the source sends besides its drains (alloc: the live allocations)."""
        return None

    def counts(self) -> dict[str, int]:
        """The source's own counters since it started, for the collector's stop log ({}: nothing to say)."""
        return {}

    def close(self) -> None:
        """Release what detach() leaves (threads, links, loaded programs); called once, after detach()."""
        return None


@runtime_checkable
class TargetedSource(EventSource, Protocol):
    """A source that records only the processes its target specs match (lock_targets, alloc_targets)."""

    # A DWARF-unwound source needs its targets' unwind tables asked for before they are sampled.
    dwarf: bool

    def add(self, t: Target) -> None:
        """Record `t` from now on (a target that appeared)."""
        ...

    def remove(self, t: Target) -> None:
        """Stop recording `t` (it exited, or no longer matches)."""
        ...

    def target_pids(self) -> set[int]:
        """The pids recorded now."""
        ...
