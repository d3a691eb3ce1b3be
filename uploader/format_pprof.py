"""upload_format pprof: our POST {endpoint}/v1/profiles (docs/upload-api.md), unchanged.

Owns: the query parameters (source, type, service, host, start, end), the
X-Profile-Id header (the idempotency key) and the gzip pprof body as the
worker built it.

Must not: alter the profile's bytes.
"""

from __future__ import annotations

from shared.wire import ProfileUpload
from uploader.formats import Accepted, Request

PATH = "/v1/profiles"
SOURCE = "ebpf"


class PprofFormat:
    name = "pprof"
    path = PATH

    def request(self, upload: ProfileUpload) -> Request:
        params = {
            "source": SOURCE,
            "type": upload.profile_type,
            "service": upload.service,
            "host": upload.host,
            "start": str(upload.window_start_ns),
            "end": str(upload.window_end_ns),
        }
        headers = {"Content-Type": "application/octet-stream", "X-Profile-Id": upload.profile_id}
        return Request(params, headers, upload.pprof_gz, upload.profile_id)

    def accepted(self, reply: bytes, content_type: str) -> Accepted:
        return Accepted()
