"""upload_format pyroscope: Pyroscope's push API, POST {endpoint}/ingest (docs/backends.md).

Owns: the query `name=APP{labels}&from=&until=&format=pprof` and the body (the
gzip pprof as the worker built it). APP is the profile's service (a container
id, else the executable path) with characters Pyroscope's application names do
not take replaced by "_". The labels are ours: profile_type, host, and the
container, k8s.pod and process.executable labels when every sample of the
profile has the same value (so they name the series, not one process); label
names have "." turned into "_" (k8s_pod). The pprof's per-sample labels (pid,
process.executable …) stay in the body, where Pyroscope reads them too. from
and until are unix seconds (the window's bounds; windows start on whole
seconds).

Idempotency: Pyroscope's /ingest has no idempotency key. The series (name with
its labels) and the window (from, until) identify a profile; the reference
receiver stores one profile per (name, from, until). The X-Profile-Id header
is sent as well, for a proxy or receiver that wants it.

Must not: alter the profile's bytes.
"""

from __future__ import annotations

import re

from shared import pprof
from shared.wire import ProfileUpload
from uploader.formats import Accepted, FormatError, Request

PATH = "/ingest"
# Labels of ours that name a series when all samples share them, and their Pyroscope names.
SERIES_LABELS = (
    ("host", "host"),
    ("container", "container"),
    ("k8s.pod", "k8s_pod"),
    ("process.executable", "process_executable"),
)
TYPE_LABEL = "profile_type"
_APP_BAD = re.compile(r"[^A-Za-z0-9_./:-]")
_VALUE_BAD = re.compile(r"[{},=\s\"\\]")


def app_name(service: str) -> str:
    return _APP_BAD.sub("_", service) or "_"


def label_value(value: str) -> str:
    return _VALUE_BAD.sub("_", value)


def series_labels(upload: ProfileUpload, profile: pprof.ReadProfile) -> dict[str, str]:
    """Our labels that are the same for every sample, under Pyroscope's names; the type first."""
    labels = {TYPE_LABEL: upload.profile_type, "host": label_value(upload.host)}
    for ours, theirs in SERIES_LABELS:
        values = {s.labels.get(ours) for s in profile.samples}
        if len(values) == 1 and (v := values.pop()) not in (None, ""):
            labels[theirs] = label_value(str(v))
    return labels


def series_name(upload: ProfileUpload, labels: dict[str, str]) -> str:
    return app_name(upload.service) + "{" + ",".join(f"{k}={v}" for k, v in labels.items()) + "}"


class PyroscopeFormat:
    name = "pyroscope"
    path = PATH

    def request(self, upload: ProfileUpload) -> Request:
        try:
            profile = pprof.read(upload.pprof_gz)
        except pprof.PprofError as e:
            raise FormatError(f"not a valid gzip pprof: {e}") from None
        series = series_name(upload, series_labels(upload, profile))
        start_s, end_s = upload.window_start_ns // 10**9, -(-upload.window_end_ns // 10**9)
        params = {"name": series, "from": str(start_s), "until": str(end_s), "format": "pprof"}
        headers = {"Content-Type": "application/octet-stream", "X-Profile-Id": upload.profile_id}
        return Request(params, headers, upload.pprof_gz, f"{series}@{start_s}-{end_s}")

    def accepted(self, reply: bytes, content_type: str) -> Accepted:
        return Accepted()
