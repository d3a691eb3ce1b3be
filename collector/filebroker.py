"""The file broker: the collector opens files of profiled processes for the symbolizers.

Owns: a Unix SOCK_SEQPACKET socket (shared.endpoints.file_broker) on which
symbolizer workers ask for a file (shared.wire.FileRequest) and get back a
FileReply with an open, read-only descriptor (SCM_RIGHTS). A symbolizer runs
without privileges; through this socket it can read exactly what is mapped
executable into profiled processes, their perf maps, and the debug files root
installed for their build ids, and nothing else:

- module: /proc/<pid>/map_files/<start>-<end>, only if /proc/<pid>/maps has
  an executable, file-backed mapping with exactly that range;
- perf_map: /tmp/perf-<nspid>.map inside the process's root, opened without
  following a symlink at /tmp or at the map, and only if it is a regular file.
  (The symbolizer checks the owner against the process's uid on the fd.)
- debug: the separate debug file of a GNU build id,
  usr/lib/debug/.build-id/<first 2 hex>/<rest>.debug, first inside the
  process's root (/proc/<pid>/root: a container has its own) and then in the
  host's. The path is resolved with openat2(RESOLVE_IN_ROOT), so its symlinks
  (normal there: they point into ../../..) are followed but cannot leave the
  root they are in. Only a regular file owned by root (uid 0 as this host
  sees it) and readable by everyone is served, under MAX_DEBUG_FILE_BYTES: the
  symbolizer trusts a debug file's names only when root installed it, and is
  never handed a file root keeps from other users. (A container whose root is
  mapped to another uid by a user namespace gets no debug files served.)
  The file is opened O_PATH first and checked before it is opened for
  reading, so a device or FIFO planted at that path is never opened.

Every request names the process by (pid, start time): a pid that was reused
since the batch is refused. Peers are checked with SO_PEERCRED.

Must not: read or parse what it opens (untrusted content is the symbolizer's),
or block the collector's drain loop: it serves in its own threads.
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Collection, Sequence

from collector.procfs import MAX_MAPS_BYTES, parse_maps, parse_status
from shared import endpoints
from shared.files import PATH_ONLY, NotRegular, open_in_root, open_regular, reopen
from shared.log import LogOnce
from shared.procstat import start_ticks
from shared.wire import MAX_FILE_MESSAGE_BYTES, FileReply, FileRequest, WireError, decode, encode

log = logging.getLogger(__name__)

# Connections served at once (one thread each), and the listen backlog: one per symbolizer worker,
# with room to spare; past it a connection is closed at once.
MAX_CONNECTIONS = 128
_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
# Where a root keeps debug files by build id (the layout of Debian's -dbg/-dbgsym packages and of GDB).
DEBUG_DIR = "usr/lib/debug/.build-id"
# symbolizer/elf.py reads no file larger than 2 GiB (its MAX_FILE_BYTES): a larger one is not passed for nothing.
MAX_DEBUG_FILE_BYTES = 2 << 30


class Refused(Exception):
    def __init__(self, error: str, reason: str) -> None:
        super().__init__(reason)
        self.error = error


def _start_ticks(proc: str, pid: int) -> int:
    ticks = start_ticks(pid, proc)
    if ticks is None:
        raise Refused("gone", f"process {pid} is gone")
    return ticks


def open_module(proc: str, req: FileRequest) -> int:
    with open(f"{proc}/{req.pid}/maps", "rb") as f:
        maps = parse_maps(f.read(MAX_MAPS_BYTES).decode("utf-8", "replace"))
    if not any(m.start == req.start and m.end == req.end and m.inode and not m.path.startswith("[") for m in maps):
        raise Refused("refused", f"process {req.pid} has no executable file mapping {req.start:x}-{req.end:x}")
    fd = os.open(f"{proc}/{req.pid}/map_files/{req.start:x}-{req.end:x}", PATH_ONLY)
    return _reopen_regular(fd, f"mapping {req.start:x}-{req.end:x}")


def open_perf_map(proc: str, req: FileRequest) -> int:
    with open(f"{proc}/{req.pid}/status", "rb") as f:
        nspid = parse_status(f.read(16384).decode("utf-8", "replace"))[1]
    name = f"perf-{nspid if nspid > 0 else req.pid}.map"
    try:
        tmp = os.open(f"{proc}/{req.pid}/root/tmp", _NOFOLLOW | os.O_DIRECTORY)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused("refused", "the process's /tmp is a symlink or not a directory") from None
        raise
    try:
        # O_PATH: nothing is opened (a FIFO would block, a device node would see root open it)
        # until fstat says it is a regular file.
        fd = os.open(name, PATH_ONLY | os.O_NOFOLLOW, dir_fd=tmp)
    finally:
        os.close(tmp)
    if stat.S_ISLNK(os.fstat(fd).st_mode):  # O_PATH|O_NOFOLLOW opens the symlink itself
        os.close(fd)
        raise Refused("refused", f"{name} is a symlink")
    return _reopen_regular(fd, name)


def open_debug(roots: Sequence[str], build_id: str) -> int:
    """A read-only descriptor of the debug file of `build_id` (lowercase hex, as wire.decode
    checks it) in the first of `roots` that has a trusted one: regular, owned by root, readable
    by everyone, at most MAX_DEBUG_FILE_BYTES. FileNotFoundError if no root has one; else, if
    none could be served, the first reason (Refused, or the OSError of a root or file we
    could not open)."""
    path = f"{DEBUG_DIR}/{build_id[:2]}/{build_id[2:]}.debug"
    failed: Exception | None = None  # the first reason a root had none to give, other than "not there"
    seen: set[tuple[int, int]] = set()
    for root in roots:
        try:
            dirfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:  # the process is gone, or its root is not ours to see: the host may have it
            failed = failed or (None if isinstance(e, FileNotFoundError) else e)
            continue
        try:
            st = os.fstat(dirfd)
            if (st.st_dev, st.st_ino) in seen:  # the process's root is the host's
                continue
            seen.add((st.st_dev, st.st_ino))
            fd = _open_in_root(dirfd, path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except (OSError, Refused) as e:
            failed = failed or e
            continue
        finally:
            os.close(dirfd)
        try:
            return _reopen_trusted(fd, path)
        except (OSError, Refused) as e:
            failed = failed or e
        finally:
            os.close(fd)
    if failed is not None:
        raise failed
    raise FileNotFoundError(errno.ENOENT, f"no debug file for build id {build_id}")


def _open_in_root(dirfd: int, path: str) -> int:
    """An O_PATH descriptor of `path` resolved with `dirfd` as its root (symlinks and .. stay inside)."""
    try:
        return open_in_root(dirfd, path)
    except OSError as e:
        if e.errno == errno.ENOSYS:
            raise Refused("unreadable", "this kernel has no openat2 (Linux 5.6+): debug files are not served") from None
        raise


def _reopen_trusted(path_fd: int, what: str) -> int:
    """`path_fd` (O_PATH) opened for reading, if it is a debug file the symbolizer may trust."""
    st = os.fstat(path_fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused("refused", f"{what} is not a regular file")
    if st.st_uid != 0:
        raise Refused("refused", f"{what} is owned by uid {st.st_uid}, not root")
    if not st.st_mode & stat.S_IROTH:
        raise Refused("refused", f"{what} is not readable by everyone")
    if st.st_size > MAX_DEBUG_FILE_BYTES:
        raise Refused("refused", f"{what}: {st.st_size} bytes is over the cap of {MAX_DEBUG_FILE_BYTES}")
    return reopen(path_fd, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)


def _reopen_regular(path_fd: int, what: str) -> int:
    """`path_fd` (O_PATH, closed here) opened for reading if it is a regular file; Refused if not, before
    anything opens it."""
    try:
        return open_regular(path_fd, what)
    except NotRegular:
        raise Refused("refused", f"{what} is not a regular file") from None
    finally:
        os.close(path_fd)


def serve_one(proc: str, req: FileRequest) -> tuple[FileReply, int | None]:
    """The reply to one request, and the descriptor to pass with it (the caller closes it)."""
    try:
        if _start_ticks(proc, req.pid) != req.start_ticks:
            raise Refused("gone", f"pid {req.pid} is another process now")
        if req.kind == "module":
            fd = open_module(proc, req)
        elif req.kind == "debug":
            fd = open_debug((f"{proc}/{req.pid}/root", "/"), req.build_id)
        else:
            fd = open_perf_map(proc, req)
        return FileReply(ok=True), fd
    except Refused as e:
        return FileReply(ok=False, error=e.error, reason=str(e)), None
    except FileNotFoundError:
        return FileReply(ok=False, error="missing", reason=f"no {req.kind} for pid {req.pid}"), None
    except OSError as e:
        return FileReply(ok=False, error="unreadable", reason=f"{req.kind} of pid {req.pid}: {e.strerror}"), None


class FileBroker:
    """Serves file requests on run_dir/files.sock until close()."""

    def __init__(self, run_dir: str, allowed_uids: Collection[int], proc: str = "/proc") -> None:
        self.path = endpoints.file_broker(run_dir)
        self._proc = proc
        self._allowed = set(allowed_uids)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o007)  # the agent's group may connect; nobody else
        try:
            self._sock.bind(self.path)
        finally:
            os.umask(old)
        self._sock.listen(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._log_once = LogOnce(log)
        self.stats = {"served": 0, "refused": 0, "bad_requests": 0, "peers_refused": 0}
        self._thread = threading.Thread(target=self._accept, name="file-broker", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            uid = _peer_uid(conn)
            if uid not in self._allowed:
                self.stats["peers_refused"] += 1
                log.warning("file broker: refused a connection from uid %d (allowed: %s)", uid, sorted(self._allowed))
                conn.close()
                continue
            if not self._slots.acquire(blocking=False):
                self.stats["peers_refused"] += 1
                self._log_once(
                    "busy",
                    logging.WARNING,
                    "file broker: %d connections are being served; further ones are closed (counted in peers_refused)",
                    MAX_CONNECTIONS,
                )
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="file-broker-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_conn(conn)
        finally:
            self._slots.release()

    def _serve_conn(self, conn: socket.socket) -> None:
        with conn:
            while not self._stop.is_set():
                try:
                    data = conn.recv(MAX_FILE_MESSAGE_BYTES + 1)
                except OSError:
                    return
                if not data:
                    return
                try:
                    req = decode([data])
                    if not isinstance(req, FileRequest):
                        raise WireError(f"expected a file request, got {type(req).__name__}")
                except WireError as e:
                    self.stats["bad_requests"] += 1
                    reply, fd = FileReply(ok=False, error="bad_request", reason=str(e)), None
                else:
                    reply, fd = serve_one(self._proc, req)
                self.stats["served" if reply.ok else "refused"] += 1
                try:
                    fds = [fd] if fd is not None else []
                    conn.sendmsg(
                        encode(reply), [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                    )
                except OSError:
                    return
                finally:
                    if fd is not None:
                        os.close(fd)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
