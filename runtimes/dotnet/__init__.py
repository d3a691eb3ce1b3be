""".NET 8 and newer: JIT frame names, by asking each .NET process for a perf map. The plug-in.

Owns: detection (runtimes/runtime.py's contract): a process is .NET's when it
maps libcoreclr.so (its version read from the framework directory the file
is in, for the log); then, once per process, what its initial environment
(/proc/PID/environ, read as its user by the connector, capped) says, and one
EnablePerfMap command (PerfMapType PERFMAP: /tmp/perf-<pid>.map, no jitdump)
over its diagnostics socket,
connected as its user by the connector (connect.py), with the protocol and
its limits in ipc.py. The runtime writes every method it has compiled so far
and each one it compiles from then on; the symbolizers' perf-map path
(symbolizer/perfmap.py, through the collector's file broker) names the
process's JIT frames in its cpu (and offcpu) profiles from their next look
at the map (PERF_MAP_RECHECK_S), so from the next window on. The command is
sent without waiting and detect returns a Pending: its answer is read as it
arrives, at the reader's ticks (ipc.PendingAnswer), so a process that never
answers holds up neither the other processes nor the stop; one that does not
answer within ENABLE_ANSWER_TIMEOUT_S is asked again RETRY_AFTER_S later
(doubling), ENABLE_ATTEMPTS times in all (each counted as `stalled`), then
refused. The outcome is a Served (the map is on, or was on already), or a
Refusal with the reason:

- DOTNET_EnableDiagnostics=0 (or its _IPC form, or COMPlus_): no socket;
- a TMPDIR other than /tmp: the socket is there, and only /tmp is looked in;
- DOTNET_PerfMapJitDumpPath elsewhere than /tmp: the map would not be found;
- .NET 7 and older: the runtime answers "unknown command"; the log says to
  start the process with DOTNET_PerfMapEnabled=1;
- no socket, a socket that is not the process user's, a connection refused,
  an answer that does not come in time or is malformed (counted in `stats`).

A process started with DOTNET_PerfMapEnabled set writes its map already: it
is not asked (and not told to stop).

stop() sends DisablePerfMap to every process it enabled, or sent EnablePerfMap
to without a well-formed answer (it may have turned its map on all the same),
that still runs (the same pid and start time), the ones that answered OK
first, and awaits their answers together, within STOP_BUDGET_S in all,
and returns one line per process for the reader's log. The runtime then closes the map and stops
writing it; the file stays where it is, as the runtime itself leaves it
(DisablePerfMap and the runtime's shutdown close it, neither removes it), and
this reader could not remove it anyway (a user's file in a sticky /tmp).

Must not: read process memory, connect to a socket other than through the
connector, log (targets.py logs the answers; the reader logs stop()'s lines).
"""

from __future__ import annotations

import os
import re
import select
import socket
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from runtimes.dotnet import ipc
from runtimes.dotnet.connect import Connector, ConnectRefused
from runtimes.runtime import Pending, ProcessContext, Refusal, Served, first_mappings
from runtimes.targets import start_ticks as current_start_ticks
from shared.runtime_registry import RuntimeSpec, spec_of
from shared.safestr import process_string, quote

SPEC: RuntimeSpec = spec_of("dotnet")

# Processes remembered as enabled (each is told to stop at stop()); past this the exited ones are forgotten.
MAX_ENABLED = 16384
# Seconds stop() spends telling processes to stop their maps, in all (each costs a connect; their answers are
# awaited together, ANSWER_TIMEOUT_S at most).
STOP_BUDGET_S = 5.0
# Times EnablePerfMap is sent to a process that does not answer within ENABLE_ANSWER_TIMEOUT_S; then it is left alone.
ENABLE_ATTEMPTS = 3
# Seconds before the first retry of an unanswered EnablePerfMap; each later one waits twice the one before.
RETRY_AFTER_S = 10.0

_CORECLR = "libcoreclr.so"
# .../shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so: the framework's version is its directory's name.
_VERSION = re.compile(r"/(\d+)\.(\d+)\.(\d+)[^/]*/libcoreclr\.so$")
_DIAGNOSTICS_OFF = (
    "DOTNET_EnableDiagnostics",
    "COMPlus_EnableDiagnostics",
    "DOTNET_EnableDiagnostics_IPC",
    "COMPlus_EnableDiagnostics_IPC",
)
_PERF_MAP_ON = ("DOTNET_PerfMapEnabled", "COMPlus_PerfMapEnabled")
_PERF_MAP_PATH = ("DOTNET_PerfMapJitDumpPath", "COMPlus_PerfMapJitDumpPath")
TMP = "/tmp"


@dataclass(frozen=True)
class _Enabled:
    pid: int
    start_ticks: int
    nspid: int
    version: str


def parse_environ(data: bytes) -> dict[bytes, bytes]:
    """/proc/PID/environ's NUL-separated NAME=value items."""
    out: dict[bytes, bytes] = {}
    for item in data.split(b"\0"):
        name, eq, value = item.partition(b"=")
        if eq and name not in out:  # the first of a repeated name is the one getenv finds
            out[name] = value
    return out


def environment_refusal(env: dict[bytes, bytes]) -> Refusal | Served | None:
    """What the environment alone decides, or None: ask the runtime."""
    for name in _DIAGNOSTICS_OFF:
        if env.get(name.encode()) == b"0":
            return Refusal(
                f"{name}=0: the runtime opened no diagnostics socket to ask for a perf map; "
                f"start it with DOTNET_PerfMapEnabled=1 to name its JIT frames"
            )
    tmpdir = env.get(b"TMPDIR", b"")
    if tmpdir and os.path.normpath(tmpdir.decode("utf-8", "surrogateescape")) != TMP:
        return Refusal(
            f"TMPDIR is {quote(process_string(tmpdir))}: its diagnostics socket is there, and only {TMP} is looked "
            f"in; start it with DOTNET_PerfMapEnabled=1 (the map goes to {TMP}) to name its JIT frames"
        )
    for name in _PERF_MAP_PATH:
        path = env.get(name.encode(), b"")
        if path and os.path.normpath(path.decode("utf-8", "surrogateescape")) != TMP:
            return Refusal(
                f"{name} is {quote(process_string(path))}: its perf map would be written there, and only "
                f"{TMP}/perf-<pid>.map is read"
            )
    for name in _PERF_MAP_ON:
        value = env.get(name.encode())
        if value is not None and value not in (b"", b"0"):
            return Served(f"{name}={quote(process_string(value))}: it writes its perf map already; not asked")
    return None


_Outcome = TypeVar("_Outcome", bound=Served | Refusal)


@dataclass
class _Request:
    """EnablePerfMap asked of one process: its answer read as it arrives (reader ticks), retried when late."""

    enabled: _Enabled
    where: str
    answer: ipc.PendingAnswer | None = None  # None: waiting to retry (or not sent yet)
    attempts: int = 0
    retry_at: float = 0.0


class DotNet:
    spec = SPEC

    def __init__(self) -> None:
        # Forked now, while the reader still holds CAP_SETUID and CAP_SETGID (runtimes/main.py).
        self._connector = Connector()
        # Told to stop at stop(): True once EnablePerfMap was answered OK, False while it was only sent (it
        # may have turned its map on without a well-formed answer).
        self._enabled: dict[tuple[int, int], tuple[_Enabled, bool]] = {}
        self._requests: dict[tuple[int, int], _Request] = {}
        self.stats = {
            "enabled": 0,
            "already_on": 0,
            "refused": 0,
            "no_socket": 0,
            "not_answered": 0,
            "stalled": 0,
            "malformed": 0,
            "disabled": 0,
            "disable_failed": 0,
        }
        self._stopped = False

    def detect(self, process: ProcessContext) -> Served | Refusal | Pending | None:
        mods = first_mappings(process.mappings, lambda base: base == _CORECLR)
        if not mods:
            return None
        path = next(iter(mods))
        m = _VERSION.search(path)
        version = ".".join(m.groups()) if m else "(version unknown)"
        where = f"{process_string(path)} (.NET {version})"  # a path is the process's: escaped for the log
        try:
            env = parse_environ(self._connector.environ(process.pid, process.start_ticks))
        except ConnectRefused as e:
            self.stats["refused"] += 1
            return Refusal(f"{where}: {e}")
        decided = environment_refusal(env)
        if isinstance(decided, Served):
            self.stats["already_on"] += 1
            return Served(f"{where}: {decided.message}")
        if decided is not None:
            self.stats["refused"] += 1
            return Refusal(f"{where}: {decided.reason}")
        req = _Request(_Enabled(process.pid, process.start_ticks, _nspid(process.pid, process.proc), version), where)
        failed = self._send(req)
        if failed is not None:
            return failed
        self._requests[(process.pid, process.start_ticks)] = req
        return Pending(f"{where}: EnablePerfMap sent", partial(self._poll, req))

    def _send(self, req: _Request) -> Refusal | None:
        """EnablePerfMap sent to req's process without waiting for the answer; a Refusal if it could not be."""
        e = req.enabled
        try:
            sock: socket.socket = self._connector.connect(e.pid, e.start_ticks)
        except ConnectRefused as err:
            self.stats["no_socket"] += 1
            return self._done(req, Refusal(f"{req.where}: EnablePerfMap not sent or not answered: {err}"))
        req.attempts += 1
        if (e.pid, e.start_ticks) not in self._enabled:
            self._remember(e, False)  # it may turn its map on whatever comes back: told to stop at stop()
        try:
            ipc.send_now(sock, ipc.enable_perf_map())
        except OSError as err:
            sock.close()
            self.stats["not_answered"] += 1
            return self._done(
                req,
                Refusal(
                    f"{req.where}: EnablePerfMap not sent or not answered: the connection failed: {err.strerror or err}"
                ),
            )
        req.answer = ipc.PendingAnswer(sock, ipc.ENABLE_ANSWER_TIMEOUT_S)
        return None

    def _poll(self, req: _Request) -> Served | Refusal | None:
        """The outcome of req once known (never blocks): read what the process has answered so far; past
        the time limit, close and retry after RETRY_AFTER_S (doubling), up to ENABLE_ATTEMPTS in all."""
        if req.answer is None:
            if time.monotonic() < req.retry_at:
                return None
            return self._send(req)
        try:
            got = req.answer.poll()
        except ipc.AnswerTimeout:
            return self._stalled(req)
        except (ipc.MalformedAnswer, OSError) as err:
            req.answer.sock.close()
            return self._done(req, self._failed(req, err))
        if got is None:
            return None
        req.answer.sock.close()
        return self._done(req, self._answered(req, got))

    def _stalled(self, req: _Request) -> Refusal | None:
        """req's answer did not come in time: a retry later, or (its last attempt) a Refusal."""
        assert req.answer is not None
        req.answer.sock.close()
        req.answer = None
        self.stats["stalled"] += 1
        if req.attempts >= ENABLE_ATTEMPTS:
            return self._done(
                req,
                Refusal(
                    f"{req.where}: EnablePerfMap not sent or not answered: no answer within "
                    f"{ipc.ENABLE_ANSWER_TIMEOUT_S} s, {req.attempts} times; left alone",
                    "dotnet_stalled",
                ),
            )
        req.retry_at = time.monotonic() + RETRY_AFTER_S * 2 ** (req.attempts - 1)
        return None

    def _failed(self, req: _Request, err: ipc.MalformedAnswer | OSError) -> Refusal:
        """The Refusal of a malformed answer or a failed connection (counted)."""
        if isinstance(err, ipc.MalformedAnswer):
            self.stats["malformed"] += 1
            return Refusal(
                f"{req.where}: EnablePerfMap not sent or not answered: a malformed answer "
                f"({self.stats['malformed']} so far): {err}",
                "dotnet_malformed",
            )
        self.stats["not_answered"] += 1
        return Refusal(
            f"{req.where}: EnablePerfMap not sent or not answered: the connection failed: {err.strerror or err}"
        )

    def _answered(self, req: _Request, got: ipc.Answer) -> Served | Refusal:
        """What the process's well-formed answer to EnablePerfMap means (counted)."""
        e, where = req.enabled, req.where
        if got.ok and got.hresult == 0:
            self._remember(e, True)
            self.stats["enabled"] += 1
            return Served(
                f"{where}: EnablePerfMap answered {got.text()}: it writes "
                f"/tmp/perf-{e.nspid}.map; its JIT frames are named from the next window on"
            )
        self._enabled.pop((e.pid, e.start_ticks), None)  # it answered an error: no map was turned on
        self.stats["refused"] += 1
        if got.hresult == ipc.UNKNOWN_COMMAND:
            return Refusal(
                f"{where}: EnablePerfMap answered {got.text()}: .NET 7 and older have no such command; "
                f"start the process with DOTNET_PerfMapEnabled=1 to name its JIT frames"
            )
        return Refusal(f"{where}: EnablePerfMap answered {got.text()}")

    def _done(self, req: _Request, outcome: _Outcome) -> _Outcome:
        self._requests.pop((req.enabled.pid, req.enabled.start_ticks), None)
        return outcome

    def _remember(self, e: _Enabled, confirmed: bool) -> None:
        if len(self._enabled) >= MAX_ENABLED:
            for key in [k for k in self._enabled if current_start_ticks(k[0]) != k[1]]:
                del self._enabled[key]
        if len(self._enabled) >= MAX_ENABLED:
            self._enabled.pop(next(iter(self._enabled)))
        self._enabled[(e.pid, e.start_ticks)] = (e, confirmed)

    def stop(self) -> list[str]:
        """DisablePerfMap to every process this reader enabled (or sent EnablePerfMap) that still runs, the
        ones that answered OK first, all answers awaited together within STOP_BUDGET_S; a log line each.
        The connector is closed (its helper reaped); a second call has nothing left to do and returns []."""
        if self._stopped:
            return []
        self._stopped = True
        deadline = time.monotonic() + STOP_BUDGET_S
        for req in self._requests.values():
            if req.answer is not None:
                req.answer.sock.close()
        self._requests.clear()
        left = sorted(self._enabled.values(), key=lambda ec: not ec[1])
        self._enabled.clear()
        lines: list[str] = []
        asking = self._ask_to_disable([e for e, _ in left], deadline, lines)
        self._await_disabled(asking, deadline, lines)
        self._connector.close()
        lines.append(f".NET: perf maps {self.stats}")
        return lines

    def _ask_to_disable(
        self, left: list[_Enabled], deadline: float, lines: list[str]
    ) -> list[tuple[_Enabled, ipc.PendingAnswer]]:
        """DisablePerfMap sent without waiting to each process of `left` that still runs, until the deadline."""
        asking: list[tuple[_Enabled, ipc.PendingAnswer]] = []
        for i, e in enumerate(left):
            if time.monotonic() > deadline:
                lines.append(
                    f".NET: {len(left) - i} processes were not asked to stop their perf maps within "
                    f"{STOP_BUDGET_S} s; they keep writing them"
                )
                break
            if current_start_ticks(e.pid) != e.start_ticks:
                continue  # exited: its runtime closed the map
            try:
                sock = self._connector.connect(e.pid, e.start_ticks)
            except ConnectRefused as err:
                self._stop_failed(lines, e, str(err))
                continue
            try:
                ipc.send_now(sock, ipc.disable_perf_map())
            except OSError as err:
                sock.close()
                self._stop_failed(lines, e, f"the connection failed: {err.strerror or err}")
                continue
            asking.append((e, ipc.PendingAnswer(sock, ipc.ANSWER_TIMEOUT_S)))
        return asking

    def _await_disabled(
        self, asking: list[tuple[_Enabled, ipc.PendingAnswer]], deadline: float, lines: list[str]
    ) -> None:
        """The answers to DisablePerfMap, read together as they arrive, until the deadline (a line each)."""
        while asking:
            waiting = []
            for e, pending in asking:
                try:
                    if time.monotonic() > deadline:
                        raise ipc.AnswerTimeout(f"no answer within the stop budget of {STOP_BUDGET_S} s")
                    got = pending.poll()
                except (ipc.AnswerTimeout, ipc.MalformedAnswer, OSError) as err:
                    pending.sock.close()
                    self._stop_failed(lines, e, str(err))
                    continue
                if got is None:
                    waiting.append((e, pending))
                    continue
                pending.sock.close()
                if got.ok and got.hresult == 0:
                    self.stats["disabled"] += 1
                    lines.append(
                        f"pid {e.pid} (.NET {e.version}): DisablePerfMap answered {got.text()}: it stopped "
                        f"writing /tmp/perf-{e.nspid}.map (the file stays, as the runtime leaves it)"
                    )
                else:
                    self._stop_failed(lines, e, f"answered {got.text()}")
            asking = waiting
            if asking:
                soonest = min(*(p.deadline for _, p in asking), deadline)
                select.select([p.sock for _, p in asking], [], [], max(0.0, soonest - time.monotonic()) + 0.001)

    def counters(self) -> dict[str, int]:
        """The checks on what processes answered that fired, for the reader's status counters, and the
        perf maps asked back at stop (disabled, or failed to)."""
        return {
            "dotnet_stalled": self.stats["stalled"],
            "dotnet_malformed": self.stats["malformed"],
            "dotnet_not_answered": self.stats["not_answered"],
            "dotnet_perf_maps_disabled": self.stats["disabled"],
            "dotnet_disable_failed": self.stats["disable_failed"],
        }

    def _stop_failed(self, lines: list[str], e: _Enabled, why: str) -> None:
        self.stats["disable_failed"] += 1
        lines.append(f"pid {e.pid} (.NET {e.version}): DisablePerfMap failed: {why}")


def _nspid(pid: int, proc: str) -> int:
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            for line in f.read(16384).decode("utf-8", "replace").splitlines():
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return pid


def runtime(cfg: Any) -> DotNet | None:
    return DotNet() if "dotnet" in cfg.runtime_stacks else None
