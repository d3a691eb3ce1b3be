"""Profiles as one speedscope file (https://www.speedscope.app/file-format-schema.json), for speedscope's viewer.

Owns: turning loaded pprof profiles (report/profiles.py) into speedscope's JSON: one "sampled"
profile per profile type, process and thread where the samples say (the pid and thread.id labels;
a cpu profile's samples name the process only), named so (`cpu /usr/bin/python3.11 pid 4242`,
`python_wall … pid 4242 thread 4243 (worker)`); frames shared by the whole file, with file and line
where the frame has them; each stack root first, weighted by the profile's default value (samples,
nanoseconds or bytes: speedscope's units "none", "nanoseconds", "bytes").

Time order: the samples of each profile come in the order of the windows they were recorded in
(`record` writes a window every 2 s), so speedscope's "Time Order" view shows when each stack ran, at
that resolution; within a window the agent keeps counts, not times, and stacks come heaviest first.

Must not: read or write files (report/profiles.py does), or drop a sample (a profile too large for a
browser is the reader's to cut: speedscope has no size limit of its own).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from report.profiles import Loaded, frame_name, value_index

SCHEMA = "https://www.speedscope.app/file-format-schema.json"
# pprof sample-type units → speedscope's (its ValueUnit); any other is a plain count.
UNITS = {"nanoseconds": "nanoseconds", "bytes": "bytes", "microseconds": "microseconds"}


@dataclass
class _Profile:
    name: str
    unit: str
    samples: list[list[int]] = field(default_factory=list)
    weights: list[int] = field(default_factory=list)


def _profile_name(ptype: str, labels: dict[str, Any]) -> str:
    who = str(labels.get("container") or labels.get("process.executable") or "")
    name = " ".join(x for x in (ptype, who) if x)
    if "pid" in labels:
        name += f" pid {labels['pid']}"
    if "thread.id" in labels:
        name += f" thread {labels['thread.id']}"
        if labels.get("thread.name"):
            name += f" ({labels['thread.name']})"
    return name


def render(loaded: Sequence[Loaded], name: str = "ebpfprofiler") -> str:
    """One speedscope file of every profile in `loaded`, the cpu ones first."""
    frames: list[dict[str, Any]] = []
    frame_ids: dict[tuple[str, str, int], int] = {}
    profiles: dict[tuple[str, str, str], _Profile] = {}
    for item in sorted(loaded, key=lambda x: (x.profile_type != "cpu", x.profile_type, x.profile.time_ns)):
        i = value_index(item.profile)
        unit = UNITS.get(item.profile.sample_types[i][1], "none") if item.profile.sample_types else "none"
        for s in sorted(item.profile.samples, key=lambda s: -s.values[i]):
            labels = dict(s.labels)
            key = (item.profile_type, str(labels.get("pid", "")), str(labels.get("thread.id", "")))
            prof = profiles.get(key)
            if prof is None:
                prof = profiles[key] = _Profile(_profile_name(item.profile_type, labels), unit)
            stack = []
            for f in s.frames:  # root first, as speedscope wants them
                fkey = (frame_name(f), f.filename, f.line)
                fid = frame_ids.get(fkey)
                if fid is None:
                    fid = frame_ids[fkey] = len(frames)
                    frame: dict[str, Any] = {"name": fkey[0]}
                    if f.filename:
                        frame["file"] = f.filename
                    if f.line:
                        frame["line"] = f.line
                    frames.append(frame)
                stack.append(fid)
            prof.samples.append(stack)
            prof.weights.append(s.values[i])
    out = [
        {
            "type": "sampled",
            "name": p.name,
            "unit": p.unit,
            "startValue": 0,
            "endValue": sum(p.weights),
            "samples": p.samples,
            "weights": p.weights,
        }
        for p in profiles.values()
    ]
    doc = {
        "$schema": SCHEMA,
        "name": name,
        "exporter": "ebpfprofiler",
        "activeProfileIndex": 0,
        "shared": {"frames": frames},
        "profiles": out,
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
