"""upload_format otlp: OTLP/HTTP profiles to an OpenTelemetry Collector (docs/backends.md).

Owns: the conversion of one of our gzip pprof profiles into one
ExportProfilesServiceRequest of the `opentelemetry-proto` package (pinned in
requirements.txt; the profiles signal is in development, so its package,
SIGNAL_VERSION, names the path: POST {endpoint}/v1development/profiles), sent
as protobuf with Content-Encoding gzip; and reading partial_success from the
collector's reply.

The conversion, value for value:
- one ResourceProfiles per process (samples with the same process labels).
  Resource attributes (OpenTelemetry semantic conventions): service.name (our
  service), host.name (host), container.id (container), k8s.pod.uid (k8s.pod),
  process.executable.path and process.executable.name (process.executable;
  its file name), process.command_line, and process.pid only when plain_pid
  (otherwise our hashed pid label is kept as ebpfprofiler.pid_hash). Any other
  sample label becomes a sample attribute of the same key.
- one Profile per sample type of ours (OTLP profiles have one sample type
  each): ("samples", "count") and ("cpu", "nanoseconds") of a cpu profile are
  two Profiles with the same samples, stacks and attributes. Each carries the
  profile attribute ebpfprofiler.profile_type (cpu, offcpu, …), the window's
  time and duration, the period and period type.
- frames: one Location per pprof location, its address the module-relative
  address (file offset) as in pprof, its Mapping with the module path as
  filename and the GNU build id as the mapping attribute
  process.executable.build_id.gnu; function names (and files, lines) where
  the symbolizer knew them. Stacks keep pprof's order (leaf first).

Idempotency: each Profile's profile_id (16 bytes) is derived from our profile
id: the first is the id itself (a UUID), the others a hash of it with the
resource and sample type index. A retry sends the same ids; a backend that
deduplicates by profile_id (the reference receiver does) stores it once.

Must not: read more than shared.pprof's caps of a profile, or keep state
between requests.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import uuid
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as service_pb
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.profiles.v1development import profiles_pb2 as pb

from shared import pprof
from shared.wire import ProfileUpload
from uploader.formats import Accepted, FormatError, Request

# "v1development": the version part of the generated classes' package; OTLP/HTTP's path is /<version>/<signal>.
SIGNAL_VERSION = service_pb.DESCRIPTOR.package.rsplit(".", 1)[1]
PATH = f"/{SIGNAL_VERSION}/profiles"
CONTENT_TYPE = "application/x-protobuf"
SCOPE_NAME = "ebpfprofiler"
PROFILE_TYPE_ATTR = "ebpfprofiler.profile_type"
PID_HASH_ATTR = "ebpfprofiler.pid_hash"
BUILD_ID_ATTR = "process.executable.build_id.gnu"
# Our sample labels that describe the process, and the resource attribute each becomes.
RESOURCE_LABELS = {
    "host": "host.name",
    "container": "container.id",
    "k8s.pod": "k8s.pod.uid",
    "process.executable": "process.executable.path",
    "process.command_line": "process.command_line",
}

ExportRequest = service_pb.ExportProfilesServiceRequest
ExportResponse = service_pb.ExportProfilesServiceResponse


def profile_ids(profile_id: str, n_resources: int, n_types: int) -> list[list[bytes]]:
    """[resource][sample type] → the 16-byte OTLP profile_id; [0][0] is our id's own bytes."""
    try:
        base = uuid.UUID(profile_id).bytes
    except ValueError:
        base = hashlib.sha256(profile_id.encode()).digest()[:16]
    return [
        [
            base if (r, i) == (0, 0) else hashlib.sha256(base + f":{r}:{i}".encode()).digest()[:16]
            for i in range(n_types)
        ]
        for r in range(n_resources)
    ]


def request_key(profile_id: str) -> str:
    """The idempotency key of a request: its first Profile's profile_id, as 32 hex digits."""
    return profile_ids(profile_id, 1, 1)[0][0].hex()


def _any(value: str | int) -> common_pb2.AnyValue:
    return common_pb2.AnyValue(int_value=value) if isinstance(value, int) else common_pb2.AnyValue(string_value=value)


class _Dictionary:
    """The request's ProfilesDictionary, deduplicating as it grows; index 0 of each table is the zero value."""

    def __init__(self, d: pb.ProfilesDictionary) -> None:
        self.d = d
        self._strings: dict[str, int] = {}
        self._attrs: dict[tuple[str, Any], int] = {}
        self._stacks: dict[tuple[int, ...], int] = {}
        self.string("")
        d.mapping_table.add()
        d.location_table.add()
        d.function_table.add()
        d.link_table.add()
        d.attribute_table.add()
        d.stack_table.add()

    def string(self, s: str) -> int:
        i = self._strings.get(s)
        if i is None:
            i = self._strings[s] = len(self.d.string_table)
            self.d.string_table.append(s)
        return i

    def attribute(self, key: str, value: str | int) -> int:
        k = (key, value)
        i = self._attrs.get(k)
        if i is None:
            i = self._attrs[k] = len(self.d.attribute_table)
            self.d.attribute_table.add(key_strindex=self.string(key), value=_any(value))
        return i

    def stack(self, locations: tuple[int, ...]) -> int:
        i = self._stacks.get(locations)
        if i is None:
            i = self._stacks[locations] = len(self.d.stack_table)
            self.d.stack_table.add(location_indices=locations)
        return i


def _raw(gz: bytes) -> Any:
    """Our pprof as its protobuf message, after shared.pprof.read() checked every reference in it."""
    try:
        pprof.read(gz)
        p = pprof.Profile()
        p.ParseFromString(pprof.gunzip_capped(gz))
    except pprof.PprofError as e:
        raise FormatError(f"not a valid gzip pprof: {e}") from None
    return p


# Samples grouped by process: resource attributes → [(stack, values, sample attributes)].
Resource = tuple[tuple[str, str | int], ...]
Groups = dict[Resource, list[tuple[int, list[int], list[int]]]]


def convert(upload: ProfileUpload, *, plain_pid: bool) -> Any:
    """The ExportProfilesServiceRequest of one profile of ours (see the module docstring)."""
    p = _raw(upload.pprof_gz)
    req = ExportRequest()
    d = _Dictionary(req.dictionary)
    locations = _add_locations(p, d)
    groups = _group_samples(p, d, locations, upload, plain_pid)
    _add_profiles(req, p, d, groups, upload)
    return req


def _add_locations(p: Any, d: _Dictionary) -> dict[int, int]:
    """The pprof's mappings, functions and locations into the dictionary: pprof location id → its index."""
    st = list(p.string_table)
    mappings: dict[int, int] = {}
    for m in p.mapping:
        attrs = [d.attribute(BUILD_ID_ATTR, st[m.build_id])] if st[m.build_id] else []
        mappings[m.id] = len(d.d.mapping_table)
        d.d.mapping_table.add(
            memory_start=m.memory_start,
            memory_limit=m.memory_limit,
            file_offset=m.file_offset,
            filename_strindex=d.string(st[m.filename]),
            attribute_indices=attrs,
        )
    functions: dict[int, int] = {}
    for f in p.function:
        functions[f.id] = len(d.d.function_table)
        d.d.function_table.add(
            name_strindex=d.string(st[f.name]),
            system_name_strindex=d.string(st[f.system_name]),
            filename_strindex=d.string(st[f.filename]),
            start_line=f.start_line,
        )
    locations: dict[int, int] = {}
    for loc in p.location:
        locations[loc.id] = len(d.d.location_table)
        o = d.d.location_table.add(mapping_index=mappings.get(loc.mapping_id, 0), address=loc.address)
        for ln in loc.line:
            o.lines.add(function_index=functions[ln.function_id], line=ln.line, column=ln.column)
    return locations


def _group_samples(p: Any, d: _Dictionary, locations: dict[int, int], upload: ProfileUpload, plain_pid: bool) -> Groups:
    """The samples by process, each with its stack's index and its other labels as attributes."""
    st = list(p.string_table)
    groups: Groups = {}
    for s in p.sample:
        labels = {st[lb.key]: (st[lb.str] if lb.str else lb.num) for lb in s.label}
        resource: list[tuple[str, str | int]] = [("service.name", upload.service)]
        extra: list[int] = []
        for key, value in labels.items():
            if key in RESOURCE_LABELS:
                resource.append((RESOURCE_LABELS[key], value))
                if key == "process.executable":
                    resource.append(("process.executable.name", os.path.basename(str(value)) or str(value)))
            elif key == "pid":
                if plain_pid and str(value).isdigit():
                    resource.append(("process.pid", int(value)))
                else:
                    resource.append((PID_HASH_ATTR, str(value)))
            else:
                extra.append(d.attribute(key, value))
        if not any(k == "host.name" for k, _ in resource):
            resource.append(("host.name", upload.host))
        stack = d.stack(tuple(locations[lid] for lid in s.location_id))
        groups.setdefault(tuple(resource), []).append((stack, list(s.value), extra))
    if not groups:
        groups[(("service.name", upload.service), ("host.name", upload.host))] = []
    return groups


def _add_profiles(req: Any, p: Any, d: _Dictionary, groups: Groups, upload: ProfileUpload) -> None:
    """One ResourceProfiles per group, with one Profile per sample type."""
    st = list(p.string_table)
    types = [(st[v.type], st[v.unit]) for v in p.sample_type]
    ids = profile_ids(upload.profile_id, len(groups), len(types))
    type_attr = d.attribute(PROFILE_TYPE_ATTR, upload.profile_type)
    period_type = pb.ValueType(
        type_strindex=d.string(st[p.period_type.type]), unit_strindex=d.string(st[p.period_type.unit])
    )
    for r, (attributes, samples) in enumerate(groups.items()):
        rp = req.resource_profiles.add()
        for key, value in attributes:
            rp.resource.attributes.add(key=key, value=_any(value))
        sp = rp.scope_profiles.add()
        sp.scope.name = SCOPE_NAME
        for i, (t, u) in enumerate(types):
            prof = sp.profiles.add(
                sample_type=pb.ValueType(type_strindex=d.string(t), unit_strindex=d.string(u)),
                time_unix_nano=p.time_nanos,
                duration_nano=p.duration_nanos,
                period_type=period_type,
                period=p.period,
                profile_id=ids[r][i],
                attribute_indices=[type_attr],
            )
            for stack, values, extra in samples:
                prof.samples.add(stack_index=stack, values=[values[i]], attribute_indices=extra)


class OtlpFormat:
    name = "otlp"
    path = PATH

    def __init__(self, plain_pid: bool) -> None:
        self.plain_pid = plain_pid

    def request(self, upload: ProfileUpload) -> Request:
        req = convert(upload, plain_pid=self.plain_pid)
        body = gzip.compress(req.SerializeToString(deterministic=True), compresslevel=6, mtime=0)
        headers = {"Content-Type": CONTENT_TYPE, "Content-Encoding": "gzip"}
        return Request({}, headers, body, request_key(upload.profile_id))

    def accepted(self, reply: bytes, content_type: str) -> Accepted:
        """partial_success of an ExportProfilesServiceResponse (protobuf; JSON is not asked for)."""
        if not reply:
            return Accepted()
        if not content_type.startswith(CONTENT_TYPE):
            return Accepted(message=f"reply of type {content_type!r}, not {CONTENT_TYPE}: partial success unknown")
        try:
            resp = ExportResponse.FromString(reply)
        except DecodeError as e:
            return Accepted(message=f"reply is not an ExportProfilesServiceResponse ({e}): partial success unknown")
        ps = resp.partial_success
        return Accepted(rejected=ps.rejected_profiles, message=ps.error_message[:300])
