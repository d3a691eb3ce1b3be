"""The reference receiver's OTLP/HTTP profiles: POST /v1development/profiles, as an OpenTelemetry Collector takes it.

Owns: reading the body (protobuf, Content-Encoding gzip or none, decompressed
within shared.pprof's cap), decoding it with opentelemetry-proto's
ExportProfilesServiceRequest, checking every index into the dictionary, the
id (the first Profile's profile_id as 32 hex digits: OTLP's own dedup key),
the metadata (service.name, host.name, the ebpfprofiler.profile_type profile
attribute, the window from time_unix_nano and duration_nano) and the reply,
an ExportProfilesServiceResponse, with partial_success when asked to reject.

Must not: accept a body the generated classes cannot decode, or one whose
indices point outside the dictionary.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as service_pb

from receiver.formats import BadRequest, Headers, Parsed
from shared.pprof import PprofError, gunzip_capped

SIGNAL_VERSION = service_pb.DESCRIPTOR.package.rsplit(".", 1)[1]
PATH = f"/{SIGNAL_VERSION}/profiles"
CONTENT_TYPE = "application/x-protobuf"
PROFILE_TYPE_ATTR = "ebpfprofiler.profile_type"


def decode(body: bytes, content_encoding: str = "") -> Any:
    """The ExportProfilesServiceRequest in a body, checked; BadRequest says what is wrong."""
    if content_encoding == "gzip":
        try:
            body = gunzip_capped(body)
        except PprofError as e:
            raise BadRequest(400, str(e)) from None
    elif content_encoding not in ("", "identity"):
        raise BadRequest(415, f"Content-Encoding {content_encoding[:40]!r}: gzip or none")
    req = service_pb.ExportProfilesServiceRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as e:
        raise BadRequest(400, f"not an ExportProfilesServiceRequest: {e}") from None
    check(req)
    return req


def _in(i: int, table: Any, what: str) -> None:
    if not 0 <= i < len(table):
        raise BadRequest(400, f"{what} index {i} outside its table of {len(table)}")


def check(req: Any) -> None:
    """Every reference into the dictionary is in range, and every profile has an id."""
    _check_dictionary(req.dictionary)
    _check_profiles(req)


def _check_dictionary(d: Any) -> None:
    if not d.string_table or d.string_table[0] != "":
        raise BadRequest(400, "dictionary.string_table must start with the empty string")
    for name in ("mapping_table", "location_table", "function_table", "attribute_table", "stack_table"):
        if not getattr(d, name):
            raise BadRequest(400, f"dictionary.{name} must hold its zero value at index 0")
    strings = d.string_table
    for a in d.attribute_table:
        _in(a.key_strindex, strings, "attribute key")
    for m in d.mapping_table:
        _in(m.filename_strindex, strings, "mapping filename")
        for i in m.attribute_indices:
            _in(i, d.attribute_table, "mapping attribute")
    for f in d.function_table:
        for i in (f.name_strindex, f.system_name_strindex, f.filename_strindex):
            _in(i, strings, "function string")
    for loc in d.location_table:
        _in(loc.mapping_index, d.mapping_table, "location mapping")
        for ln in loc.lines:
            _in(ln.function_index, d.function_table, "line function")
    for s in d.stack_table:
        for i in s.location_indices:
            _in(i, d.location_table, "stack location")


def _check_profiles(req: Any) -> None:
    d = req.dictionary
    strings = d.string_table
    n = 0
    for rp in req.resource_profiles:
        for sp in rp.scope_profiles:
            for p in sp.profiles:
                n += 1
                if len(p.profile_id) != 16 or not any(p.profile_id):
                    raise BadRequest(400, "a profile's profile_id is not 16 bytes, not all zero")
                for i in (
                    p.sample_type.type_strindex,
                    p.sample_type.unit_strindex,
                    p.period_type.type_strindex,
                    p.period_type.unit_strindex,
                ):
                    _in(i, strings, "value type string")
                for i in p.attribute_indices:
                    _in(i, d.attribute_table, "profile attribute")
                for s in p.samples:
                    _in(s.stack_index, d.stack_table, "sample stack")
                    for i in s.attribute_indices:
                        _in(i, d.attribute_table, "sample attribute")
    if not n:
        raise BadRequest(400, "the request holds no profile")


def resource_attributes(rp: Any) -> dict[str, Any]:
    out = {}
    for kv in rp.resource.attributes:
        v = kv.value
        out[kv.key] = v.int_value if v.WhichOneof("value") == "int_value" else v.string_value
    return out


def profile_attributes(req: Any, p: Any) -> dict[str, Any]:
    d = req.dictionary
    out = {}
    for i in p.attribute_indices:
        a = d.attribute_table[i]
        out[d.string_table[a.key_strindex]] = (
            a.value.int_value if a.value.WhichOneof("value") == "int_value" else a.value.string_value
        )
    return out


class OtlpIngest:
    name = "otlp"
    path = PATH

    def parse(self, query: str, headers: Headers, body: bytes) -> Parsed:
        content_type = (headers.get("Content-Type") or "").split(";")[0].strip()
        if content_type != CONTENT_TYPE:
            raise BadRequest(415, f"Content-Type {content_type[:60]!r}: this receiver takes {CONTENT_TYPE}")
        req = decode(body, (headers.get("Content-Encoding") or "").strip().lower())
        first_rp = req.resource_profiles[0] if req.resource_profiles else None
        first = next(p for rp in req.resource_profiles for sp in rp.scope_profiles for p in sp.profiles)
        resource = resource_attributes(first_rp) if first_rp is not None else {}
        types = profile_attributes(req, first)
        sample_type = req.dictionary.string_table[first.sample_type.type_strindex]
        samples = n_profiles = 0
        for rp in req.resource_profiles:
            profiles = [p for sp in rp.scope_profiles for p in sp.profiles]
            n_profiles += len(profiles)
            samples += len(profiles[0].samples) if profiles else 0
        meta = {
            "format": self.name,
            "service": str(resource.get("service.name", "")),
            "host": str(resource.get("host.name", "")),
            "type": str(types.get(PROFILE_TYPE_ATTR, sample_type)),
            "start": first.time_unix_nano,
            "end": first.time_unix_nano + first.duration_nano,
            "samples": samples,
            "profiles": n_profiles,
        }
        return Parsed(first.profile_id.hex(), meta, req.SerializeToString(deterministic=True), ".otlp.pb", n_profiles)

    def reply(self, parsed: Parsed, stored: bool, rejected_message: str = "") -> tuple[bytes, str]:
        resp = service_pb.ExportProfilesServiceResponse()
        if rejected_message:
            resp.partial_success.rejected_profiles = parsed.profiles
            resp.partial_success.error_message = rejected_message
        return resp.SerializeToString(), CONTENT_TYPE
