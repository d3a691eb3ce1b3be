"""Local delivery: write each profile as a file under `local_dir` (config endpoint "").

Owns: the on-disk layout of locally written profiles,
`{local_dir}/{service_dir}/{type}-{window start, UTC}-{profile_id}.pb.gz`, the
mapping of service names (paths, container ids) to safe directory names, and
writing each file atomically (temporary file, fsync, rename, fsync of the
directory), so a reader never sees a partial profile.

In local mode this write is the delivery: the uploader acknowledges a profile
to its worker once accept() has written it, and has no spool.

Must not: talk to the network, validate or change the pprof bytes, or write
outside `local_dir`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from datetime import UTC, datetime

from shared.files import write_atomic
from shared.handoff import RETRY, STORED, window_text
from shared.wire import ProfileUpload

log = logging.getLogger("ebpfprofiler.uploader.local")

# Directory and id parts stay well under NAME_MAX (255) and readable in `ls`.
MAX_SERVICE_DIR_CHARS = 96
MAX_ID_CHARS = 128
# Directories are created for the uploader's user and group only.
DIR_MODE = 0o750

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(name: str, cap: int, empty: str = "unknown") -> str:
    """A readable file name for `name`: never empty, ".", "..", hidden, or containing "/".

    "/usr/bin/python3.11" → "usr_bin_python3.11"; "[kernel]" → "kernel". A name
    cut to `cap` characters ends in a hash of the whole name, so long names
    that share a prefix stay apart.
    """
    s = _UNSAFE.sub("_", name).strip("._-")
    if not s:
        return empty
    if len(s) > cap:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        s = s[: cap - 9].rstrip("._-") + "-" + digest
    return s


def profile_path(local_dir: str, upload: ProfileUpload) -> str:
    """Where `upload` is written under `local_dir`."""
    start = datetime.fromtimestamp(upload.window_start_ns // 1_000_000_000, tz=UTC)
    name = (
        f"{upload.profile_type}-{start:%Y%m%dT%H%M%SZ}-{safe_name(upload.profile_id, MAX_ID_CHARS, empty='noid')}.pb.gz"
    )
    return os.path.join(local_dir, safe_name(upload.service, MAX_SERVICE_DIR_CHARS), name)


class LocalWriter:
    """Delivers profiles by writing them under `local_dir`."""

    def __init__(self, local_dir: str) -> None:
        self.local_dir = local_dir

    def describe(self) -> str:
        return f"local directory {self.local_dir}"

    def accept(self, upload: ProfileUpload) -> tuple[str, str]:
        """Write one profile durably: (STORED, "") or (RETRY, why it could not be written, logged)."""
        path = profile_path(self.local_dir, upload)
        window = window_text(upload)
        try:
            os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
            write_atomic(path, upload.pprof_gz)
        except OSError as e:
            log.error(
                "cannot write profile service=%r type=%s window=%s to %s: %s; the worker keeps it and offers it again",
                upload.service,
                upload.profile_type,
                window,
                path,
                e,
            )
            return RETRY, f"cannot write under local_dir: {e}"
        log.info(
            "wrote profile service=%r type=%s window=%s samples=%d bytes=%d to %s",
            upload.service,
            upload.profile_type,
            window,
            upload.samples,
            len(upload.pprof_gz),
            path,
        )
        return STORED, ""

    def close(self) -> None:
        pass
