"""The labels every sample of a process carries, the same in every stage that builds profiles.

Owns: host, container, k8s.pod, process.executable, pid (a keyed hash of pid and
start time unless plain_pid) and process.command_line (only when
strip_process_args is false), in that order.

Must not: read /proc or decide windows.
"""

from __future__ import annotations

from shared import identity
from shared.wire import Process


def process_labels(
    host: str, p: Process, secret: bytes, *, plain_pid: bool, strip_process_args: bool
) -> tuple[tuple[str, str], ...]:
    pid = str(p.pid) if plain_pid else identity.pid_label(secret, p.pid, p.start_ticks)
    pairs = [("host", host)]
    if p.container_id:
        pairs.append(("container", p.container_id))
    if p.pod_uid:
        pairs.append(("k8s.pod", p.pod_uid))
    pairs.append(("process.executable", p.executable or f"[{p.comm}]"))
    pairs.append(("pid", pid))
    if p.cmdline is not None and not strip_process_args:
        pairs.append(("process.command_line", " ".join(p.cmdline)))
    return tuple(pairs)
