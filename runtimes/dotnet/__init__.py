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
at the map (PERF_MAP_RECHECK_S), so from the next window on. The answer is a
Served (the map is on, or was on already), or a Refusal with the reason:

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
that still runs (the same pid and start time), within STOP_BUDGET_S in all,
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
import socket
import time
from dataclasses import dataclass
from typing import Any

from ebpfprofiler.runtimes.dotnet import ipc
from ebpfprofiler.runtimes.dotnet.connect import ConnectRefused, Connector
from ebpfprofiler.runtimes.runtime import ProcessContext, Refusal, Served, first_mappings
from ebpfprofiler.runtimes.targets import start_ticks as current_start_ticks
from ebpfprofiler.shared.runtime_registry import RuntimeSpec, spec_of
from ebpfprofiler.shared.safestr import process_string, quote

SPEC: RuntimeSpec = spec_of("dotnet")

# Processes remembered as enabled (each is told to stop at stop()); past this the exited ones are forgotten.
MAX_ENABLED = 16384
# Seconds stop() spends telling processes to stop their maps, in all (each costs a connect and an answer).
STOP_BUDGET_S = 5.0

_CORECLR = "libcoreclr.so"
# .../shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so: the framework's version is its directory's name.
_VERSION = re.compile(r"/(\d+)\.(\d+)\.(\d+)[^/]*/libcoreclr\.so$")
_DIAGNOSTICS_OFF = ("DOTNET_EnableDiagnostics", "COMPlus_EnableDiagnostics",
                    "DOTNET_EnableDiagnostics_IPC", "COMPlus_EnableDiagnostics_IPC")
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
        if eq and name not in out:       # the first of a repeated name is the one getenv finds
            out[name] = value
    return out


def environment_refusal(env: dict[bytes, bytes]) -> Refusal | Served | None:
    """What the environment alone decides, or None: ask the runtime."""
    for name in _DIAGNOSTICS_OFF:
        if env.get(name.encode()) == b"0":
            return Refusal(f"{name}=0: the runtime opened no diagnostics socket to ask for a perf map; "
                           f"start it with DOTNET_PerfMapEnabled=1 to name its JIT frames")
    tmpdir = env.get(b"TMPDIR", b"")
    if tmpdir and os.path.normpath(tmpdir.decode("utf-8", "surrogateescape")) != TMP:
        return Refusal(f"TMPDIR is {quote(process_string(tmpdir))}: its diagnostics socket is there, and only {TMP} is looked "
                       f"in; start it with DOTNET_PerfMapEnabled=1 (the map goes to {TMP}) to name its JIT frames")
    for name in _PERF_MAP_PATH:
        path = env.get(name.encode(), b"")
        if path and os.path.normpath(path.decode("utf-8", "surrogateescape")) != TMP:
            return Refusal(f"{name} is {quote(process_string(path))}: its perf map would be written there, and only "
                           f"{TMP}/perf-<pid>.map is read")
    for name in _PERF_MAP_ON:
        value = env.get(name.encode())
        if value is not None and value not in (b"", b"0"):
            return Served(f"{name}={quote(process_string(value))}: it writes its perf map already; not asked")
    return None


class DotNet:
    spec = SPEC

    def __init__(self) -> None:
        # Forked now, while the reader still holds CAP_SETUID and CAP_SETGID (runtimes/main.py).
        self._connector = Connector()
        self._enabled: dict[tuple[int, int], _Enabled] = {}
        self.stats = {"enabled": 0, "already_on": 0, "refused": 0, "no_socket": 0, "not_answered": 0,
                      "malformed": 0, "disabled": 0, "disable_failed": 0}

    def detect(self, process: ProcessContext) -> Served | Refusal | None:
        mods = first_mappings(process.mappings, lambda base: base == _CORECLR)
        if not mods:
            return None
        path = next(iter(mods))
        m = _VERSION.search(path)
        version = ".".join(m.groups()) if m else "(version unknown)"
        where = f"{process_string(path)} (.NET {version})"     # a path is the process's: escaped for the log
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
        sent: list[bool] = []
        got = self._ask(process.pid, process.start_ticks, ipc.enable_perf_map(), ipc.ENABLE_ANSWER_TIMEOUT_S, sent)
        nspid = _nspid(process.pid, process.proc)
        enabled = _Enabled(process.pid, process.start_ticks, nspid, version)
        if isinstance(got, Refusal):
            if sent:      # it may have turned the map on without a (well-formed) answer: told to stop at stop()
                self._remember(enabled)
            return Refusal(f"{where}: EnablePerfMap not sent or not answered: {got.reason}")
        if got.ok and got.hresult == 0:
            self._remember(enabled)
            self.stats["enabled"] += 1
            return Served(f"{where}: EnablePerfMap answered {got.text()}: it writes /tmp/perf-{nspid}.map; "
                          f"its JIT frames are named from the next window on")
        self.stats["refused"] += 1
        if got.hresult == ipc.UNKNOWN_COMMAND:
            return Refusal(f"{where}: EnablePerfMap answered {got.text()}: .NET 7 and older have no such command; "
                           f"start the process with DOTNET_PerfMapEnabled=1 to name its JIT frames")
        return Refusal(f"{where}: EnablePerfMap answered {got.text()}")

    def _ask(self, pid: int, start_ticks: int, message: bytes, timeout: float = ipc.ANSWER_TIMEOUT_S,
             sent: list[bool] | None = None) -> ipc.Answer | Refusal:
        """The answer to `message`, or a Refusal with the reason; `sent` gets True once connected (the
        command may have reached the runtime, whatever comes back)."""
        try:
            sock: socket.socket = self._connector.connect(pid, start_ticks)
        except ConnectRefused as e:
            self.stats["no_socket"] += 1
            return Refusal(str(e))
        if sent is not None:
            sent.append(True)
        with sock:
            try:
                return ipc.exchange(sock, message, timeout)
            except ipc.AnswerTimeout as e:
                self.stats["not_answered"] += 1
                return Refusal(str(e))
            except ipc.MalformedAnswer as e:
                self.stats["malformed"] += 1
                return Refusal(f"a malformed answer ({self.stats['malformed']} so far): {e}")
            except OSError as e:
                self.stats["not_answered"] += 1
                return Refusal(f"the connection failed: {e.strerror or e}")

    def _remember(self, e: _Enabled) -> None:
        if len(self._enabled) >= MAX_ENABLED:
            for key in [k for k in self._enabled if current_start_ticks(k[0]) != k[1]]:
                del self._enabled[key]
        if len(self._enabled) >= MAX_ENABLED:
            self._enabled.pop(next(iter(self._enabled)))
        self._enabled[(e.pid, e.start_ticks)] = e

    def stop(self) -> list[str]:
        """DisablePerfMap to every process this reader enabled that still runs; a log line for each."""
        lines: list[str] = []
        deadline = time.monotonic() + STOP_BUDGET_S
        left = list(self._enabled.values())
        self._enabled.clear()
        for i, e in enumerate(left):
            if time.monotonic() > deadline:
                lines.append(f".NET: {len(left) - i} processes were not asked to stop their perf maps within "
                             f"{STOP_BUDGET_S} s; they keep writing them")
                break
            if current_start_ticks(e.pid) != e.start_ticks:
                continue                 # exited: its runtime closed the map
            got = self._ask(e.pid, e.start_ticks, ipc.disable_perf_map())
            if isinstance(got, ipc.Answer) and got.ok and got.hresult == 0:
                self.stats["disabled"] += 1
                lines.append(f"pid {e.pid} (.NET {e.version}): DisablePerfMap answered {got.text()}: it stopped "
                             f"writing /tmp/perf-{e.nspid}.map (the file stays, as the runtime leaves it)")
            else:
                self.stats["disable_failed"] += 1
                why = got.reason if isinstance(got, Refusal) else f"answered {got.text()}"
                lines.append(f"pid {e.pid} (.NET {e.version}): DisablePerfMap failed: {why}")
        self._connector.close()
        lines.append(f".NET: perf maps {self.stats}")
        return lines


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
