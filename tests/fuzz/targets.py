"""The fuzz targets: each parser of untrusted input, with the one error type it may raise.

A target takes bytes (a seed from tests/fuzz/seeds/<name>/, mutated) and runs
the parser as its stage does; any exception other than the target's own
error types is a crash, and so is an input that takes longer than
MAX_INPUT_SECONDS or the memory cap (tests/fuzz/run.py enforces them).
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from receiver import server as receiver
from runtimes import elfsyms
from shared import pprof, remote_config, unwind_table, wire
from symbolizer import cfi, elf, perfmap


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], object]
    errors: tuple[type[BaseException], ...]  # what the parser may raise for bad input
    structured: bool = False  # seeds are JSON: mutate its structure too


def _wire(data: bytes) -> object:
    # a seed is frame 0, then (after a NUL line) frame 1 if the message has one
    head, sep, tail = data.partition(b"\n\0\n")
    return wire.decode([head, tail] if sep else [head])


def _cfi(data: bytes) -> object:
    return cfi.build_table(io.BytesIO(data))


def _elf(data: bytes) -> object:
    return elf.read_elf(io.BytesIO(data))


def _elfsyms(data: bytes) -> object:
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        elfsyms.read_symbols(f, ("_PyRuntime", "Py_Version", "PyCode_Type", "PyType_Type"))
        # node's reads: every v8dbg_ symbol of .dynsym, and their values
        info = elfsyms.read_symbols(f, ("_ZN2v88internal7Version6major_E",), prefix="v8dbg_", dynsym_only=True)
        return elfsyms.read_values(f, info, info.symbols)


def _perf_map(data: bytes) -> object:
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        f.seek(0)
        return perfmap.read_perf_map(os.dup(f.fileno()), 1, os.getuid())


def _unwind_table(data: bytes) -> object:
    t = unwind_table.decode(data)
    if t.row_count:
        t.row_for(t.header.span // 2)
    return t


_run_dir: list[str] = []  # made on first use, removed at exit


def _remote_config(data: bytes) -> object:
    # the overrides file as the stages read it (size cap, JSON, then the same rules as a fetched document)
    if not _run_dir:
        _run_dir.append(tempfile.mkdtemp(prefix="ebpfprofiler-fuzz-"))
        atexit.register(shutil.rmtree, _run_dir[0], True)
    with open(remote_config.path(_run_dir[0]), "wb") as f:
        f.write(data)
    return remote_config.load_overrides(_run_dir[0], writers={os.getuid()})


def _receiver(data: bytes) -> object:
    # query string, Content-Length and body, split by NUL lines, as the handler takes them apart
    parts = [*data.split(b"\n\x00\n", 2), b"", b""]
    query, length, body = parts[0].decode("latin-1"), parts[1].decode("latin-1"), parts[2]
    params = receiver.query_params(query)
    receiver.content_length(length)
    pprof.read(body, min(receiver.MAX_INFLATED_BYTES, max(1 << 20, receiver.INFLATE_RATIO * len(body))))
    return params


TARGETS = {
    t.name: t
    for t in (
        Target("wire", _wire, (wire.WireError,), structured=True),
        Target("cfi", _cfi, (cfi.CfiError,)),
        Target("elf", _elf, (elf.ElfError,)),
        Target("elfsyms", _elfsyms, (elfsyms.ElfSymbolError,)),
        Target("perf_map", _perf_map, (perfmap.PerfMapRefused,)),
        Target("unwind_table", _unwind_table, (unwind_table.UnwindTableError,)),
        Target("remote_config", _remote_config, (remote_config.OverridesFileError,), structured=True),
        Target("receiver", _receiver, (receiver.RequestError, pprof.PprofError)),
    )
}
