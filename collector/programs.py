"""Compiles the BPF program families the config asks for into one bcc module.

Owns: the bcc BPF object: one compile (LLVM costs seconds and ~100 MB, so
once), the -D sizes every program is built with, the pid namespace the
programs name tasks in, the flags of the running kernel's own build that bcc
does not pass (kernel_cflags: a new distribution kernel compiles without a
release of ours), what the compiler and the verifier said when something is
refused (their output captured and quoted, not a traceback), and unloading it all.
A family that is not asked for is not compiled, so it cannot be loaded or
attached (offcpu: false loads no sched_switch program).

Must not: attach, drain or interpret maps (oncpu.py and offcpu.py do).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence

from collector import bpftime
from collector.btfprog import BtfProgramError

FAMILIES = ("oncpu", "offcpu", "lock", "alloc")
# Headers the families call into, each compiled when its -D flag is passed, in this order.
OPTIONAL_HEADERS = (("DWARF_UNWIND", "unwind.h"), ("PY_WALK", "python.h"))
# PROC_PID_INIT_INO: the inode of the host's (initial) pid namespace.
INIT_PID_NS_INO = 0xEFFFFFFC


class Programs:
    def __init__(self, bpf_dir: str, families: Sequence[str], defines: Mapping[str, int]) -> None:
        unknown = set(families) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown BPF program families: {sorted(unknown)}")
        for f in families:
            path = os.path.join(bpf_dir, f"{f}.c")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"BPF program {path} not found (--bpf-dir {bpf_dir})")
        # Concatenated, not #included: bcc generates TRACEPOINT_PROBE argument
        # structs only for the main source. common.h comes first, then the
        # DWARF unwinder and the Python walker the families use when they are on.
        headers = ["common.h"] + [h for flag, h in OPTIONAL_HEADERS if flag in defines]
        text = "\n".join(_read(os.path.join(bpf_dir, f)) for f in headers + [f"{f}.c" for f in families])
        cflags = [f"-D{k}={v}" for k, v in {**defines, **bpftime.bpf_defines(), **pid_namespace_defines()}.items()]
        self.kernel_cflags = kernel_cflags()
        self.families = tuple(families)
        from bcc import BPF  # only the collector imports bcc, and only where it compiles: unit tests need none

        self.bpf = BPF(text=text.encode(), cflags=cflags + self.kernel_cflags)

    def close(self) -> None:
        """Detach whatever is still attached and unload every program and map."""
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None


def pid_namespace_defines(ns_path: str = "/proc/self/ns/pid") -> dict[str, int]:
    """PIDNS_DEV/PIDNS_INO when the collector runs in a pid namespace other than the host's.

    BPF sees host pids; a collector in a container reads its own /proc, so
    the programs must ask for ids in its namespace (bpf/common.h)."""
    st = os.stat(ns_path)
    if st.st_ino == INIT_PID_NS_INO:
        return {}
    return {"PIDNS_DEV": st.st_dev, "PIDNS_INO": st.st_ino}


# Flags of the kernel's own build that clang needs to read its headers, by the config symbol (or the
# top Makefile's text) that says the kernel was built with them. Linux 6.19 and newer (Debian's 7.x)
# use Microsoft's anonymous struct members in their headers ("-fms-extensions"); without the flag
# clang reads e.g. "no member named 'ns_id' in 'struct ns_common'".
BUILD_FLAGS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("CONFIG_CC_MS_EXTENSIONS", "-fms-extensions", ("-fms-extensions", "-Wno-microsoft-anon-tag")),
)
# Lines of the compiler's or the verifier's output quoted when a program is refused.
QUOTED_LINES = 25
# A line of the stage's own log (shared/log.py's format), captured with the rest: not the compiler's.
OWN_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+\[\d+\] ")
# Bytes of that output kept (a verifier log can be megabytes; its end says why).
CAPTURED_BYTES = 1 << 20


def kernel_cflags(release: str | None = None, modules: str = "/lib/modules") -> list[str]:
    """The flags of BUILD_FLAGS that the header tree bcc compiles against (/lib/modules/RELEASE/build)
    says its kernel was built with: from its include/config/auto.conf, or its top Makefile."""
    release = release or os.uname().release
    out: list[str] = []
    for symbol, makefile_text, flags in BUILD_FLAGS:
        if _config_has(os.path.join(modules, release, "build"), symbol, makefile_text):
            out.extend(f for f in flags if f not in out)
    return out


def _config_has(tree: str, symbol: str, makefile_text: str) -> bool:
    for path, pattern in (
        (os.path.join(tree, "include/config/auto.conf"), rf"^{symbol}=(?!n$)"),
        (os.path.join(tree, "Makefile"), re.escape(makefile_text)),
    ):
        try:
            with open(path, errors="replace") as f:
                if re.search(pattern, f.read(), re.MULTILINE):
                    return True
        except OSError:
            continue
    return False


class Captured:
    """What the process wrote to its standard error while captured (bcc's C++ code writes the compiler's
    diagnostics and the verifier's log there)."""

    def __init__(self) -> None:
        self.text = ""

    def tail(self, lines: int = QUOTED_LINES) -> str:
        """The last `lines` lines, without the stage's own log lines (they go to standard error too)."""
        kept = [ln for ln in self.text.splitlines() if ln.strip() and not OWN_LOG_LINE.match(ln)]
        return "\n".join(kept[-lines:])


@contextlib.contextmanager
def capture_stderr() -> Iterator[Captured]:
    """Standard error (file descriptor 2) into a private file for the duration; what was written is then
    in the Captured object, and is written to the real standard error too, so nothing is lost."""
    captured = Captured()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            size = sink.seek(0, os.SEEK_END)
            sink.seek(max(0, size - CAPTURED_BYTES))
            raw = sink.read()
            captured.text = raw.decode("utf-8", "replace")
            os.write(2, raw)


def is_refusal(error: BaseException) -> bool:
    """Whether `error` is the compiler's or the kernel's word on the programs (bcc raises bare Exception;
    collector/btfprog.py BtfProgramError; a bpf() call OSError), not a fault of the collector's own."""
    return type(error) is Exception or isinstance(error, (OSError, BtfProgramError))


def explain(error: BaseException, captured: Captured) -> str:
    """One message for a failed compile or load: what failed (the program bcc or the kernel refused),
    the error, and the last lines the compiler or the verifier wrote."""
    text = str(error)
    m = re.search(r"Failed to load BPF program b?'?([\w.]+)'?: (.*)", text)
    if m:
        head = f"the kernel refused BPF program {m.group(1)}: {m.group(2)}"
    elif "Failed to compile BPF" in text or "error:" in captured.text:
        head = "the BPF programs did not compile against this kernel's headers"
    elif is_refusal(error):
        head = text
    else:  # a fault of ours, named by its type (an assert's message is empty)
        head = f"{type(error).__name__}: {text}" if text else type(error).__name__
    if "verifier:" in text:  # a program we load ourselves (collector/btfprog.py): its log is in the error
        return head
    tail = captured.tail()
    return head + (f"\nlast lines of the compiler's and verifier's output:\n{tail}" if tail else "")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
