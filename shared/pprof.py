"""The pprof format: schema, a builder that writes gzip pprof, a reader that checks it.

Owns: profile.proto (github.com/google/pprof/proto/profile.proto) expressed as
a protobuf descriptor built at import time, so no generated code or protoc is
needed; ProfileBuilder (string table, deduplicated mappings, functions,
locations); read() which un-gzips with a size cap, parses, checks every
reference and returns a plain view that tests and the receiver use.

Must not: know where samples come from or where profiles go.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as TMapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

# A decompressed profile bigger than this is refused: 16x the wire cap on the
# compressed body, enough for any real window, and a bound on gzip bombs.
MAX_DECOMPRESSED_BYTES = 512 << 20

_F = descriptor_pb2.FieldDescriptorProto
_SCHEMA: dict[str, list[tuple[str, int, int, int, str]]] = {
    # message: [(field, number, type, label, type_name)]
    "Profile": [
        ("sample_type", 1, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "ValueType"),
        ("sample", 2, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "Sample"),
        ("mapping", 3, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "Mapping"),
        ("location", 4, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "Location"),
        ("function", 5, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "Function"),
        ("string_table", 6, _F.TYPE_STRING, _F.LABEL_REPEATED, ""),
        ("drop_frames", 7, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("keep_frames", 8, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("time_nanos", 9, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("duration_nanos", 10, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("period_type", 11, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, "ValueType"),
        ("period", 12, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("comment", 13, _F.TYPE_INT64, _F.LABEL_REPEATED, ""),
        ("default_sample_type", 14, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
    ],
    "ValueType": [
        ("type", 1, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("unit", 2, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
    ],
    "Sample": [
        ("location_id", 1, _F.TYPE_UINT64, _F.LABEL_REPEATED, ""),
        ("value", 2, _F.TYPE_INT64, _F.LABEL_REPEATED, ""),
        ("label", 3, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "Label"),
    ],
    "Label": [
        ("key", 1, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("str", 2, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("num", 3, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("num_unit", 4, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
    ],
    "Mapping": [
        ("id", 1, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("memory_start", 2, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("memory_limit", 3, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("file_offset", 4, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("filename", 5, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("build_id", 6, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("has_functions", 7, _F.TYPE_BOOL, _F.LABEL_OPTIONAL, ""),
        ("has_filenames", 8, _F.TYPE_BOOL, _F.LABEL_OPTIONAL, ""),
        ("has_line_numbers", 9, _F.TYPE_BOOL, _F.LABEL_OPTIONAL, ""),
        ("has_inline_frames", 10, _F.TYPE_BOOL, _F.LABEL_OPTIONAL, ""),
    ],
    "Location": [
        ("id", 1, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("mapping_id", 2, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("address", 3, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("line", 4, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "Line"),
        ("is_folded", 5, _F.TYPE_BOOL, _F.LABEL_OPTIONAL, ""),
    ],
    "Line": [
        ("function_id", 1, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("line", 2, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("column", 3, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
    ],
    "Function": [
        ("id", 1, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("name", 2, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("system_name", 3, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("filename", 4, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ("start_line", 5, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
    ],
}


def _build_classes() -> dict[str, Any]:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="ebpfprofiler/perftools_profiles.proto", package="perftools.profiles", syntax="proto3"
    )
    for msg_name, fields in _SCHEMA.items():
        msg = fdp.message_type.add(name=msg_name)
        for name, number, ftype, label, type_name in fields:
            f = msg.field.add(name=name, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = f".perftools.profiles.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"perftools.profiles.{name}"))
        for name in _SCHEMA
    }


_CLASSES = _build_classes()
Profile = _CLASSES["Profile"]


class ProfileBuilder:
    """Accumulates one profile; ids and strings are deduplicated as they are added."""

    def __init__(
        self,
        sample_types: Sequence[tuple[str, str]],
        period_type: tuple[str, str],
        period: int,
        time_ns: int,
        duration_ns: int,
    ) -> None:
        self._p = Profile()
        self._strings: dict[str, int] = {}
        self.string("")
        for t, u in sample_types:
            self._p.sample_type.add(type=self.string(t), unit=self.string(u))
        self._p.period_type.type = self.string(period_type[0])
        self._p.period_type.unit = self.string(period_type[1])
        self._p.period = period
        self._p.time_nanos = time_ns
        self._p.duration_nanos = duration_ns
        self._mappings: dict[Any, int] = {}
        self._functions: dict[tuple[str, str], int] = {}
        self._locations: dict[Any, int] = {}
        self.n_values = len(sample_types)

    def string(self, s: str) -> int:
        i = self._strings.get(s)
        if i is None:
            i = self._strings[s] = len(self._strings)
            self._p.string_table.append(s)
        return i

    def mapping(
        self,
        key: Any,
        filename: str,
        build_id: str = "",
        *,
        memory_start: int = 0,
        memory_limit: int = 0,
        file_offset: int = 0,
        has_functions: bool = False,
    ) -> int:
        """The id of the mapping known by `key`, added on first use."""
        mid = self._mappings.get(key)
        if mid is None:
            mid = self._mappings[key] = len(self._mappings) + 1
            self._p.mapping.add(
                id=mid,
                memory_start=memory_start,
                memory_limit=memory_limit,
                file_offset=file_offset,
                filename=self.string(filename),
                build_id=self.string(build_id),
                has_functions=has_functions,
            )
        return mid

    def function(self, name: str, filename: str = "") -> int:
        fid = self._functions.get((name, filename))
        if fid is None:
            fid = self._functions[(name, filename)] = len(self._functions) + 1
            self._p.function.add(
                id=fid, name=self.string(name), system_name=self.string(name), filename=self.string(filename)
            )
        return fid

    def location(self, key: Any, mapping_id: int, address: int, function_ids: Iterable[int] = (), line: int = 0) -> int:
        """The id of the location known by `key`; function_ids innermost first (inlining)."""
        lid = self._locations.get(key)
        if lid is None:
            lid = self._locations[key] = len(self._locations) + 1
            loc = self._p.location.add(id=lid, mapping_id=mapping_id, address=address)
            for fid in function_ids:
                loc.line.add(function_id=fid, line=line)
        return lid

    def sample(self, location_ids: Sequence[int], values: Sequence[int], labels: TMapping[str, str | int]) -> None:
        """One sample; location_ids leaf first, as pprof wants them."""
        if len(values) != self.n_values:
            raise ValueError(f"{len(values)} values for {self.n_values} sample types")
        s = self._p.sample.add(location_id=location_ids, value=values)
        for k, v in labels.items():
            if isinstance(v, int):
                s.label.add(key=self.string(k), num=v)
            elif v:  # an empty string is index 0, which pprof reads as the number 0
                s.label.add(key=self.string(k), str=self.string(v))

    @property
    def sample_count(self) -> int:
        return len(self._p.sample)

    def gzipped(self) -> bytes:
        return gzip.compress(self._p.SerializeToString(), compresslevel=6, mtime=0)


# ---------------------------------------------------------------- reading


class PprofError(ValueError):
    """Bytes that are not a valid gzip pprof; the message says why."""


@dataclass(frozen=True)
class Frame:
    function: str
    filename: str
    module: str
    build_id: str
    address: int
    line: int = 0


@dataclass(frozen=True)
class ReadSample:
    frames: tuple[Frame, ...]  # root first (main … leaf), unlike pprof
    values: tuple[int, ...]
    labels: dict[str, str | int] = field(default_factory=dict)

    @property
    def functions(self) -> tuple[str, ...]:
        return tuple(f.function for f in self.frames)


@dataclass(frozen=True)
class ReadProfile:
    sample_types: tuple[tuple[str, str], ...]
    period_type: tuple[str, str]
    period: int
    time_ns: int
    duration_ns: int
    samples: tuple[ReadSample, ...]

    def total(self, sample_type: str) -> int:
        i = [t for t, _ in self.sample_types].index(sample_type)
        return sum(s.values[i] for s in self.samples)


def gunzip_capped(data: bytes, cap: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """Decompress gzip data, refusing output over `cap` bytes."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, cap + 1)
    except zlib.error as e:
        raise PprofError(f"body is not gzip data: {e}") from None
    if len(out) > cap or d.unconsumed_tail:
        raise PprofError(f"decompressed profile is larger than {cap} bytes")
    if not d.eof:
        raise PprofError("gzip data is truncated")
    return out


def read(gz: bytes, max_inflated: int = MAX_DECOMPRESSED_BYTES) -> ReadProfile:
    """Parse and check a gzip pprof, inflating at most `max_inflated` bytes; PprofError says what is wrong
    with a bad one."""
    raw = gunzip_capped(gz, max_inflated)
    p = Profile()
    try:
        p.ParseFromString(raw)
    except Exception as e:  # protobuf raises DecodeError and, for some inputs, others
        raise PprofError(f"not a pprof protobuf: {e}") from None
    strings = list(p.string_table)
    if not strings or strings[0] != "":
        raise PprofError("string_table must start with the empty string")

    def s(i: int, what: str) -> str:
        if not 0 <= i < len(strings):
            raise PprofError(f"{what}: string index {i} out of range")
        return strings[i]

    if not p.sample_type:
        raise PprofError("no sample_type")
    types = tuple((s(v.type, "sample_type"), s(v.unit, "sample_type")) for v in p.sample_type)
    mappings = {m.id: (s(m.filename, "mapping"), s(m.build_id, "mapping")) for m in p.mapping}
    functions = {f.id: (s(f.name, "function"), s(f.filename, "function")) for f in p.function}
    if 0 in mappings or 0 in functions:
        raise PprofError("mapping and function ids must be non-zero")
    locations: dict[int, tuple[Frame, ...]] = {}
    for loc in p.location:
        if loc.id == 0:
            raise PprofError("location id must be non-zero")
        if loc.mapping_id and loc.mapping_id not in mappings:
            raise PprofError(f"location {loc.id}: unknown mapping {loc.mapping_id}")
        module, build_id = mappings.get(loc.mapping_id, ("", ""))
        frames: list[Frame] = []
        for ln in loc.line:
            if ln.function_id not in functions:
                raise PprofError(f"location {loc.id}: unknown function {ln.function_id}")
            name, filename = functions[ln.function_id]
            frames.append(Frame(name, filename, module, build_id, loc.address, ln.line))
        if not frames:
            frames.append(Frame("", "", module, build_id, loc.address))
        locations[loc.id] = tuple(reversed(frames))  # outermost inline frame first
    samples = []
    for smp in p.sample:
        if len(smp.value) != len(types):
            raise PprofError(f"a sample has {len(smp.value)} values for {len(types)} sample types")
        frames = []
        for lid in reversed(smp.location_id):
            if lid not in locations:
                raise PprofError(f"sample refers to unknown location {lid}")
            frames.extend(locations[lid])
        labels: dict[str, str | int] = {}
        for lb in smp.label:
            labels[s(lb.key, "label")] = s(lb.str, "label") if lb.str else lb.num
        samples.append(ReadSample(tuple(frames), tuple(smp.value), labels))
    period_type = (s(p.period_type.type, "period_type"), s(p.period_type.unit, "period_type"))
    return ReadProfile(types, period_type, p.period, p.time_nanos, p.duration_nanos, tuple(samples))
