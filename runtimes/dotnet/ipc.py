""".NET's diagnostics IPC protocol, the two commands this reader sends: EnablePerfMap and DisablePerfMap.

Owns: the messages (DOTNET_IPC_V1 header: 14-byte magic, uint16 size of the
whole message, command set, command id, uint16 reserved; little-endian; the
Process command set 0x04, EnablePerfMap 0x05 with a uint32 PerfMapType,
DisablePerfMap 0x06 without payload; as in dotnet/diagnostics'
documentation/design-docs/ipc-protocol.md and dotnet/runtime's ds-protocol.h,
available since .NET 8) and reading the runtime's answer on a connected
socket: the Server command set 0xFF with OK 0x00 or Error 0xFF, and an int32
HRESULT payload. One command per connection: the runtime closes it after
answering.

The peer is untrusted (any process can listen on a socket of that name): the
command is sent without waiting, the answer read without blocking as it
arrives (PendingAnswer: the reader polls it at its ticks, so a peer that never
answers holds up nothing) within a time limit, up to MAX_ANSWER_BYTES, and
must be exactly one well-formed message; anything else raises MalformedAnswer,
a timeout AnswerTimeout, a failed connection OSError.

Must not: open or connect sockets (connect.py does), or log.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from dataclasses import dataclass

MAGIC = b"DOTNET_IPC_V1\0"
_HEADER = struct.Struct("<14sHBBH")
HEADER_BYTES = _HEADER.size  # 20
COMMAND_SET_PROCESS = 0x04
COMMAND_SET_SERVER = 0xFF
ENABLE_PERF_MAP = 0x05
DISABLE_PERF_MAP = 0x06
RESPONSE_OK = 0x00
RESPONSE_ERROR = 0xFF
# PerfMapType: 3 writes /tmp/perf-PID.map only (1 would add jitdump files, 2 jitdump only).
PERF_MAP_ONLY = 3

# The answer to either command is 24 bytes (header and an HRESULT); anything longer is not an answer.
MAX_ANSWER_BYTES = 64
# Seconds for sending DisablePerfMap and for its whole answer: the runtime answers in well under a
# millisecond once its diagnostics server thread runs; a peer that stalls costs the reader this, once.
ANSWER_TIMEOUT_S = 0.5
# The same for EnablePerfMap: the runtime answers once it has written every method compiled so far
# (~60-100 us each here: 1,900 in ~120 ms, bench suite dotnet), so a large application takes seconds.
ENABLE_ANSWER_TIMEOUT_S = 3.0

# HRESULTs the runtime answers with, by name (dotnet/diagnostics ipc-protocol.md, "Errors").
HRESULTS = {
    0x80131384: "bad encoding",
    0x80131385: "unknown command",
    0x80131386: "unknown magic",
    0x80131515: "not supported",
    0x80004005: "failed",
    0x8013135B: "not yet available",
    0x80131371: "runtime uninitialized",
    0x80070057: "invalid argument",
}
UNKNOWN_COMMAND = 0x80131385


class MalformedAnswer(Exception):
    """What the peer sent is not a diagnostics IPC answer; str(e) says how."""


class AnswerTimeout(Exception):
    """The peer did not answer within ANSWER_TIMEOUT_S."""


@dataclass(frozen=True)
class Answer:
    ok: bool
    hresult: int  # as unsigned 32 bits; 0 is success

    def text(self) -> str:
        if self.ok and self.hresult == 0:
            return "OK"
        name = HRESULTS.get(self.hresult, "")
        return f"{'OK' if self.ok else 'error'} HRESULT {self.hresult:#010x}" + (f" ({name})" if name else "")


def command(command_id: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(MAGIC, HEADER_BYTES + len(payload), COMMAND_SET_PROCESS, command_id, 0) + payload


def enable_perf_map() -> bytes:
    return command(ENABLE_PERF_MAP, struct.pack("<I", PERF_MAP_ONLY))


def disable_perf_map() -> bytes:
    return command(DISABLE_PERF_MAP)


def parse_answer(data: bytes) -> Answer:
    """The answer in `data`: all the bytes the peer sent before it closed (or MAX_ANSWER_BYTES + 1)."""
    if len(data) < HEADER_BYTES:
        raise MalformedAnswer(f"{len(data)} bytes, shorter than a header ({HEADER_BYTES})")
    magic, size, command_set, command_id, reserved = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MalformedAnswer(f"magic {magic[:16]!r} is not {MAGIC!r}")
    if size != len(data):
        raise MalformedAnswer(
            f"the header says {size} bytes, the peer sent {len(data)}"
            f"{' or more' if len(data) > MAX_ANSWER_BYTES else ''}"
        )
    if command_set != COMMAND_SET_SERVER or command_id not in (RESPONSE_OK, RESPONSE_ERROR):
        raise MalformedAnswer(f"command {command_set:#04x}/{command_id:#04x} is not a server OK or error")
    if reserved:
        raise MalformedAnswer(f"reserved field is {reserved:#06x}, not 0")
    payload = data[HEADER_BYTES:]
    if len(payload) != 4:
        raise MalformedAnswer(f"a payload of {len(payload)} bytes, not an HRESULT's 4")
    (hresult,) = struct.unpack("<I", payload)
    return Answer(command_id == RESPONSE_OK, hresult)


def send_now(sock: socket.socket, message: bytes) -> None:
    """Send `message` (a few bytes) on the fresh connection `sock` without waiting: it fits in the socket's
    buffer, or OSError. The socket stays non-blocking, for PendingAnswer."""
    sock.setblocking(False)
    if sock.send(message) != len(message):
        raise OSError("the command did not fit in the connection's buffer")


class PendingAnswer:
    """The answer on `sock` as it arrives, read without blocking (the socket is non-blocking: send_now),
    within `timeout` seconds from now."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.data = b""

    def poll(self) -> Answer | None:
        """The Answer once it is whole (or the peer closed), None while more may come; AnswerTimeout past
        the deadline, MalformedAnswer, or OSError (the connection failed)."""
        while len(self.data) <= MAX_ANSWER_BYTES:
            try:
                chunk = self.sock.recv(MAX_ANSWER_BYTES + 1 - len(self.data))
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > self.deadline:
                    raise AnswerTimeout(f"no whole answer within {self.timeout} s ({len(self.data)} bytes)") from None
                return None
            if not chunk:
                break
            self.data += chunk
            if len(self.data) >= HEADER_BYTES and _HEADER.unpack_from(self.data)[1] == len(self.data):
                break  # a whole message: the runtime closes after it, a peer may not
        return parse_answer(self.data)


def exchange(sock: socket.socket, message: bytes, timeout: float = ANSWER_TIMEOUT_S) -> Answer:
    """Send `message` on the connected `sock` and read its answer, within `timeout` seconds in all."""
    send_now(sock, message)
    pending = PendingAnswer(sock, timeout)
    while True:
        got = pending.poll()
        if got is not None:
            return got
        select.select([sock], [], [], max(0.0, pending.deadline - time.monotonic()) + 0.001)
