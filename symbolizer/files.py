"""How an unprivileged symbolizer gets the files it reads: from the collector's file broker.

Owns: the client side of collector/filebroker.py — one SOCK_SEQPACKET
connection to the broker's socket, a request per file (a mapped module, a
perf map, a separate debug file by build id), the descriptor that comes back
with the reply. A broker that is not there (the collector is
restarting) is an OSError the caller counts; the next request reconnects.

Must not: open files of other processes itself (it has no right to), or
parse what it gets (elf.py and perfmap.py do).
"""

from __future__ import annotations

import array
import os
import socket
from typing import BinaryIO

from shared import endpoints
from shared.wire import MAX_FILE_MESSAGE_BYTES, FileReply, FileRequest, Mapping, Process, WireError, decode, encode

# The broker opens one file per request; anything slower is a stuck collector.
REQUEST_TIMEOUT_S = 5.0


class FileRefused(OSError):
    """The broker would not open the file; .error is one of wire.FILE_ERRORS."""

    def __init__(self, reply: FileReply) -> None:
        super().__init__(reply.reason or reply.error)
        self.error = reply.error


class ProcessGone(FileNotFoundError):
    """The process the request named has exited: the file may well be there for another process."""


class FileClient:
    def __init__(self, run_dir: str) -> None:
        self._path = endpoints.file_broker(run_dir)
        self._sock: socket.socket | None = None

    def module(self, proc: Process, m: Mapping) -> BinaryIO:
        """The file mapped at [m.start, m.end) in `proc`, open for reading."""
        fd = self._request(FileRequest(proc.pid, proc.start_ticks, "module", m.start, m.end))
        return os.fdopen(fd, "rb")

    def debug(self, proc: Process, build_id: str) -> BinaryIO:
        """The separate debug file of `build_id` (lowercase hex), from `proc`'s root or the host's,
        open for reading (FileNotFoundError if neither has one)."""
        fd = self._request(FileRequest(proc.pid, proc.start_ticks, "debug", build_id=build_id))
        return os.fdopen(fd, "rb")

    def perf_map(self, pid: int, start_ticks: int) -> int:
        """A descriptor of the process's /tmp/perf-<nspid>.map (FileNotFoundError if none)."""
        return self._request(FileRequest(pid, start_ticks, "perf_map"))

    def _request(self, req: FileRequest) -> int:
        sock = self._connect()
        try:
            sock.sendall(encode(req)[0])
            data, ancdata, _, _ = sock.recvmsg(MAX_FILE_MESSAGE_BYTES + 1, socket.CMSG_SPACE(4))
        except OSError:
            self.close()
            raise
        fds = array.array("i")
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        try:
            reply = decode([data])
            if not isinstance(reply, FileReply):
                raise WireError(f"expected a file reply, got {type(reply).__name__}")
        except WireError as e:
            for fd in fds:
                os.close(fd)
            self.close()
            raise OSError(f"file broker sent a bad reply: {e}") from None
        if not reply.ok or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if reply.error == "gone":
                raise ProcessGone(reply.reason)
            if reply.error == "missing":
                raise FileNotFoundError(reply.reason)
            raise FileRefused(reply if not reply.ok else FileReply(False, "unreadable", "no descriptor in reply"))
        return fds[0]

    def _connect(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            s.settimeout(REQUEST_TIMEOUT_S)
            try:
                s.connect(self._path)
            except OSError:
                s.close()
                raise
            self._sock = s
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
