"""Connections to .NET processes' diagnostics sockets, made as each process's own user.

Owns: the connector, a small process the runtime reader forks at start while
it still holds CAP_SETUID and CAP_SETGID (shared/privileges.py
OPTIONAL_CAPS["runtime"]), keeping those and the reader's CAP_SYS_PTRACE; the
reader drops the two right after. For each request (pid, start time) the
connector forks a child that takes that process's uid and gid (from
/proc/PID/status, the pid's start time checked first), reads its /proc/PID/environ (mode 0400: its user's) or
opens /proc/PID/root/tmp with CAP_SYS_PTRACE alone (a root process's root is closed
to a process of its uid with fewer capabilities), gives up every capability,
and then, as the process's user and nothing more, connects to the socket
the runtime made, `dotnet-diagnostic-<its pid>-<its start time>-socket` in
its /tmp, reached through /proc/PID/root (a container's /tmp): /tmp opened
without following a symlink, the socket opened O_PATH without following one,
checked to be a socket owned by that uid, and connected through
/proc/self/fd (so what was checked is what is connected to). The connected
socket goes back to the reader over SCM_RIGHTS; the reader talks over it
(ipc.py). So the reader reaches a socket only as its owner could (root's
processes: as uid 0 without capabilities), and nothing the target sends is
parsed by a process holding a privilege.

Every step has a time limit: the child is killed after CONNECT_TIMEOUT_S,
the reader waits REPLY_TIMEOUT_S for the connector; a request the connector
does not answer is a failure, never a wait. The connector dies with the
reader (PR_SET_PDEATHSIG) and ends when the reader closes its end.

Must not: read or write the diagnostics protocol (ipc.py does), or run anything
as a process's user but the connect.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import socket
import stat
import struct
import time

import prctl

from shared import privileges, procstat

# Seconds the child has to take the ids, find the socket and connect (a runtime's backlog is short).
CONNECT_TIMEOUT_S = 0.5
# Seconds the reader waits for the connector's reply: the child's limit plus a fork's cost on a busy host.
REPLY_TIMEOUT_S = 2.0
# Bytes of a reply's reason text; longer ones are cut.
MAX_REASON_BYTES = 512
# /proc/PID/status of any process is well under this.
MAX_STATUS_BYTES = 16384
# Bytes of /proc/PID/environ sent back: a process's initial environment is rarely past a few KB
# (and a reply is one datagram).
MAX_ENVIRON_BYTES = 64 << 10

_REQUEST = struct.Struct("<QQIB")  # pid, start ticks, request number, kind
ENVIRON, CONNECT = 1, 2
_REPLY = struct.Struct("<IB")  # request number, status
OK, REFUSED, FAILED = 0, 1, 2


class ConnectRefused(Exception):
    """No connection to this process's socket: str(e) says why (no socket, not its owner's, ...)."""


def socket_name(nspid: int, start_ticks: int) -> str:
    """The name .NET gives its diagnostics socket: its own pid and its start time in clock ticks."""
    return f"dotnet-diagnostic-{nspid}-{start_ticks}-socket"


def _owner(pid: int, start_ticks: int) -> tuple[int, int, int]:
    """(effective uid, effective gid, pid in its own namespace) of pid, if it still is the process."""
    ticks = procstat.start_ticks(pid)
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read(MAX_STATUS_BYTES).decode("utf-8", "replace")
    except OSError:
        ticks = None
    if ticks is None:
        raise ConnectRefused("the process is gone")
    if ticks != start_ticks:
        raise ConnectRefused("the pid names another process now")
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        uid = int(fields["Uid"].split()[1])
        gid = int(fields["Gid"].split()[1])
        nspid = int(fields.get("NSpid", str(pid)).split()[-1])
    except (KeyError, ValueError, IndexError):
        raise ConnectRefused("its /proc status has no Uid, Gid or NSpid") from None
    return uid, gid, nspid


def _become_owner(pid: int, start_ticks: int) -> tuple[int, int]:
    """In the connector's child: take the process's uid and gid, keeping CAP_SYS_PTRACE (the reader's
    own) for its /proc files alone: a root process's are closed to a process with fewer capabilities
    than it, even of its uid. Returns (uid, pid in its namespace)."""
    uid, gid, nspid = _owner(pid, start_ticks)
    prctl.set_keepcaps(True)
    try:
        os.setgroups([gid])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except PermissionError:
        raise ConnectRefused(
            f"the connector cannot take the process's uid {uid} and gid {gid}: it lacks "
            f"CAP_SETUID and CAP_SETGID (under systemd, give them to the runtime unit)"
        ) from None
    privileges.keep_only(frozenset({privileges.CAP_SYS_PTRACE}))
    return uid, nspid


def _environ_as_owner(pid: int, start_ticks: int) -> bytes:
    """In the connector's child: the process's initial environment (mode 0400, its user's), capped."""
    _become_owner(pid, start_ticks)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read(MAX_ENVIRON_BYTES)
    except OSError as e:
        raise ConnectRefused(f"its environment cannot be read as its user: {e.strerror or e}") from None
    _owner(pid, start_ticks)  # still the process whose environment this is (raises if not)
    return data


def _connect_as_owner(pid: int, start_ticks: int) -> socket.socket:
    """In the connector's child: become the process's user and connect to its socket."""
    uid, nspid = _become_owner(pid, start_ticks)
    # Its /tmp is searched as its user.
    name = socket_name(nspid, start_ticks)
    try:
        tmp = os.open(f"/proc/{pid}/root/tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConnectRefused("its /tmp is a symlink or not a directory") from None
        raise ConnectRefused(f"its /tmp cannot be opened as its user: {e.strerror}") from None
    privileges.keep_only(frozenset())  # the socket is opened and connected to as the user, nothing more
    try:
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tmp)
        except FileNotFoundError:
            raise ConnectRefused(f"no diagnostics socket /tmp/{name}") from None
    finally:
        os.close(tmp)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode):
            raise ConnectRefused(f"/tmp/{name} is not a socket")
        if st.st_uid != uid:
            raise ConnectRefused(f"/tmp/{name} is owned by uid {st.st_uid}, not the process's uid {uid}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            s.connect(f"/proc/self/fd/{fd}")
        except OSError as e:
            s.close()
            raise ConnectRefused(f"connecting to /tmp/{name} failed: {e.strerror or e}") from None
        return s
    finally:
        os.close(fd)


def _reply(
    sock: socket.socket, seq: int, status: int, reason: str, fds: list[int] | None = None, data: bytes = b""
) -> None:
    body = data[:MAX_ENVIRON_BYTES] if status == OK else reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
    socket.send_fds(sock, [_REPLY.pack(seq, status) + body], fds or [])


def _serve(sock: socket.socket) -> None:
    """The connector's loop: one request at a time, each in a child of its own."""
    while True:
        try:
            data = sock.recv(_REQUEST.size)
        except InterruptedError:
            continue
        except OSError:
            return
        if len(data) != _REQUEST.size:
            return  # the reader closed its end (or sent what it never sends)
        pid, start_ticks, seq, kind = _REQUEST.unpack(data)
        child = os.fork()
        if child == 0:
            code = 0
            try:
                try:
                    if kind == ENVIRON:
                        env = _environ_as_owner(pid, start_ticks)
                    else:
                        s = _connect_as_owner(pid, start_ticks)
                except ConnectRefused as e:
                    _reply(sock, seq, REFUSED, str(e))
                else:
                    if kind == ENVIRON:
                        _reply(sock, seq, OK, "", data=env)
                    else:
                        _reply(sock, seq, OK, "", [s.fileno()])
            except BaseException:  # anything: the child ends here whatever happened
                code = 1
            os._exit(code)
        status = _wait(child, CONNECT_TIMEOUT_S)
        if status is None:
            _reply(sock, seq, FAILED, f"connecting took longer than {CONNECT_TIMEOUT_S} s")
        elif status != 0:
            _reply(sock, seq, FAILED, f"the connecting process failed (wait status {status})")


def _wait(pid: int, timeout: float) -> int | None:
    """pid's wait status, or None after killing it when it ran longer than timeout."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        return os.waitpid(pid, 0)[1]
    finally:
        os.close(pidfd)


class Connector:
    """The reader's end of the connector."""

    def __init__(self) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._seq = 0
        self.pid = os.fork()
        if self.pid == 0:
            try:
                self._sock.close()
                prctl.set_pdeathsig(signal.SIGKILL)
                privileges.keep_only(privileges.OPTIONAL_CAPS["runtime"] | privileges.STAGES["runtime"].caps)
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # the reader stops it, when it is done
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                _serve(theirs)
            finally:
                os._exit(0)
        theirs.close()

    def connect(self, pid: int, start_ticks: int) -> socket.socket:
        """A socket connected to (pid, start_ticks)'s diagnostics socket, as its user.

        Raises ConnectRefused with the reason."""
        data, fds = self._ask(pid, start_ticks, CONNECT)  # noqa: RUF059
        if len(fds) == 1:
            return socket.socket(fileno=fds[0])
        for fd in fds:
            os.close(fd)
        raise ConnectRefused("no socket came back")

    def environ(self, pid: int, start_ticks: int) -> bytes:
        """(pid, start_ticks)'s /proc/PID/environ, read as its user (up to MAX_ENVIRON_BYTES).

        Raises ConnectRefused with the reason."""
        data, fds = self._ask(pid, start_ticks, ENVIRON)
        for fd in fds:
            os.close(fd)
        return data

    def _ask(self, pid: int, start_ticks: int, kind: int) -> tuple[bytes, list[int]]:
        self._seq += 1
        try:
            self._sock.send(_REQUEST.pack(pid, start_ticks, self._seq, kind))
        except OSError as e:
            raise ConnectRefused(f"the connector is gone ({e.strerror or e})") from None
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._sock], [], [], left)[0]:
                raise ConnectRefused(f"the connector did not answer within {REPLY_TIMEOUT_S} s")
            data, fds, _, _ = socket.recv_fds(self._sock, _REPLY.size + max(MAX_REASON_BYTES, MAX_ENVIRON_BYTES), 1)
            if len(data) < _REPLY.size:
                for fd in fds:
                    os.close(fd)
                raise ConnectRefused("the connector is gone")
            seq, status = _REPLY.unpack_from(data)
            if seq != self._seq:  # the late reply of a request given up on
                for fd in fds:
                    os.close(fd)
                continue
            if status == OK:
                return data[_REPLY.size :], fds
            for fd in fds:
                os.close(fd)
            raise ConnectRefused(data[_REPLY.size :].decode("utf-8", "replace") or "the connector failed")

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(ChildProcessError, ProcessLookupError, OSError):
            _wait(self.pid, REPLY_TIMEOUT_S)
