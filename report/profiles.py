"""Profiles this project writes, read back for people: merged, filtered, folded, ranked.

Owns: finding the pprof files of a directory (the agent's local_dir layout,
SERVICE/TYPE-WINDOW-ID.pb.gz) or of a list of files; reading them with size
caps (a file that is too big or not a pprof is a counted skip, never a
crash); grouping by profile type and service; merging one group into one
pprof; Brendan Gregg's folded stacks; the top functions by self and total
value; writing -o by its extension (the HTML report and speedscope's file are
report/html.py's and report/speedscope.py's). Used by `ebpfprofiler record`
and `ebpfprofiler report`.

Must not: start stages, or write anywhere but the path it is given.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared import files, pprof
from shared.safestr import printable

log = logging.getLogger("ebpfprofiler.report")

# A pprof file larger than this is skipped: 16x the uploader's wire cap would be far more than any window.
MAX_FILE_BYTES = 64 << 20
# Files read from one directory at most (a local_dir of a long-running agent holds many windows).
MAX_FILES = 20_000
# Characters of a profile type taken from a pprof's sample type (the agent's are a word).
MAX_TYPE_CHARS = 64
# pprof's own suffix; the local_dir layout names files TYPE-WINDOW-ID.pb.gz.
SUFFIX = ".pb.gz"


@dataclass(frozen=True)
class Loaded:
    path: str
    profile_type: str
    service: str
    profile: pprof.ReadProfile


@dataclass
class Skipped:
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, path: str, reason: str) -> None:
        self.counts[reason] += 1
        log.warning("skipped %s: %s", path, reason)


def profile_files(paths: Sequence[str]) -> list[str]:
    """The pprof files named, and those under the directories named (sorted; at most MAX_FILES)."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs.sort()
                out += [os.path.join(root, f) for f in sorted(files) if f.endswith(SUFFIX)]
        else:
            out.append(p)
    return out[:MAX_FILES]


def _word(text: str) -> bool:
    return text.replace("_", "").isalnum() and text.isascii() and len(text) <= MAX_TYPE_CHARS


def type_of(path: str, profile: pprof.ReadProfile) -> str:
    """cpu, offcpu, python_wall …: the local_dir name's prefix, else the profile's last sample type, else
    "profile". Only a word: the type names output files (out.TYPE.folded) and is printed."""
    name = os.path.basename(path)
    head = name.split("-", 1)[0]
    if "-" in name and _word(head):
        return head
    kind = profile.sample_types[-1][0] if profile.sample_types else ""
    return kind if _word(kind) else "profile"


def service_of(profile: pprof.ReadProfile) -> str:
    """The service as the agent groups them: the container, else the executable."""
    for s in profile.samples:
        svc = s.labels.get("container") or s.labels.get("process.executable")
        if svc:
            return str(svc)
    return "unknown"


def load(paths: Sequence[str], skipped: Skipped | None = None) -> list[Loaded]:
    skipped = skipped if skipped is not None else Skipped()
    out = []
    for path in profile_files(paths):
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            skipped.add(path, f"unreadable ({e.strerror})")
            continue
        if len(data) > MAX_FILE_BYTES:
            skipped.add(path, f"larger than {MAX_FILE_BYTES} bytes")
            continue
        try:
            prof = pprof.read(data)
        except pprof.PprofError as e:
            skipped.add(path, f"not a pprof ({e})")
            continue
        out.append(Loaded(path, type_of(path, prof), service_of(prof), prof))
    return out


def keep_pids(loaded: Iterable[Loaded], pids: set[int]) -> list[Loaded]:
    """Only the samples of `pids` (plain pid labels, as `record` asks the agent for)."""
    want = {str(p) for p in pids}
    out = []
    for item in loaded:
        samples = tuple(s for s in item.profile.samples if str(s.labels.get("pid")) in want)
        if samples:
            prof = pprof.ReadProfile(
                item.profile.sample_types,
                item.profile.period_type,
                item.profile.period,
                item.profile.time_ns,
                item.profile.duration_ns,
                samples,
            )
            out.append(Loaded(item.path, item.profile_type, item.service, prof))
    return out


def by_type(loaded: Iterable[Loaded]) -> dict[str, list[Loaded]]:
    out: dict[str, list[Loaded]] = {}
    for item in loaded:
        out.setdefault(item.profile_type, []).append(item)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != "cpu", kv[0])))


def frame_name(f: pprof.Frame) -> str:
    """A frame's function, else module+offset (a frame without symbols)."""
    if f.function:
        return f.function
    module = os.path.basename(f.module) if f.module else "?"
    return f"{module}+{f.address:#x}"


def value_index(profile: pprof.ReadProfile) -> int:
    """The value a flame graph shows: pprof's default, the last sample type."""
    return len(profile.sample_types) - 1


def stacks(loaded: Iterable[Loaded]) -> Counter[tuple[str, ...]]:
    """Root-first stacks of function names → summed default value."""
    out: Counter[tuple[str, ...]] = Counter()
    for item in loaded:
        i = value_index(item.profile)
        for s in item.profile.samples:
            out[tuple(frame_name(f) for f in s.frames)] += s.values[i]
    return out


def folded(loaded: Iterable[Loaded], value: str = "samples") -> str:
    """Brendan Gregg's folded stacks: `root;…;leaf COUNT`, one line per stack, by count, heaviest first.
    Names as safestr.printable writes them (no control character or line break), `;` as `:`."""
    out: Counter[tuple[str, ...]] = Counter()
    for item in loaded:
        names = [t for t, _ in item.profile.sample_types]
        i = names.index(value) if value in names else value_index(item.profile)
        for s in item.profile.samples:
            out[tuple(printable(frame_name(f)).replace(";", ":") for f in s.frames)] += s.values[i]
    return "".join(f"{';'.join(k)} {v}\n" for k, v in sorted(out.items(), key=lambda kv: (-kv[1], kv[0])) if k)


# The service of the graph that puts every service together, each as its first frame.
ALL_SERVICES = "(all services)"


@dataclass(frozen=True)
class Group:
    """One flame graph's stacks: a profile type's, for one service or for ALL_SERVICES (the service then
    the first frame of each stack)."""

    profile_type: str
    service: str
    unit: str
    stacks: dict[tuple[str, ...], int]
    samples: int

    @property
    def total(self) -> int:
        return sum(self.stacks.values())


def groups(loaded: Sequence[Loaded]) -> list[Group]:
    """The graphs a report draws, the cpu type first: per type, ALL_SERVICES (when there are several),
    then each service by name."""
    out = []
    for ptype, items in by_type(loaded).items():
        unit = items[0].profile.sample_types[-1][1]
        by_service: dict[str, list[Loaded]] = {}
        for item in items:
            by_service.setdefault(item.service, []).append(item)
        per_service = {svc: dict(stacks(group)) for svc, group in sorted(by_service.items())}
        counts = {svc: sum(s.values[0] for g in group for s in g.profile.samples) for svc, group in by_service.items()}
        graphs = [Group(ptype, svc, unit, st, counts[svc]) for svc, st in per_service.items()]
        if len(per_service) > 1:
            merged = {(svc, *stack): v for svc, st in per_service.items() for stack, v in st.items()}
            graphs.insert(0, Group(ptype, ALL_SERVICES, unit, merged, sum(counts.values())))
        out += graphs
    return out


def function_values(stack_values: dict[tuple[str, ...], int]) -> tuple[Counter[str], Counter[str], int]:
    """Per function, its self value (stacks it is the leaf of) and its total (stacks it is in, counted once
    per stack however often it recurses); and the grand total."""
    self_v: Counter[str] = Counter()
    total_v: Counter[str] = Counter()
    grand = 0
    for stack, v in stack_values.items():
        grand += v
        if stack:
            self_v[stack[-1]] += v
        for name in set(stack):
            total_v[name] += v
    return self_v, total_v, grand


@dataclass(frozen=True)
class Ranked:
    function: str
    self_value: int
    total_value: int


def top(loaded: Sequence[Loaded], n: int = 15) -> tuple[list[Ranked], int]:
    """The `n` functions with the most self value, with their total (a function counted once per
    stack however often it recurses), and the grand total."""
    self_v, total_v, grand = function_values(stacks(loaded))
    ranked = sorted(total_v, key=lambda f: (-self_v[f], -total_v[f], f))[:n]
    return [Ranked(f, self_v[f], total_v[f]) for f in ranked], grand


def merge(loaded: Sequence[Loaded]) -> bytes:
    """One gzip pprof of every sample of `loaded` (same profile type), labels and modules kept."""
    first = loaded[0].profile
    start = min(x.profile.time_ns for x in loaded)
    end = max(x.profile.time_ns + x.profile.duration_ns for x in loaded)
    b = pprof.ProfileBuilder(first.sample_types, first.period_type, first.period, start, end - start)
    for item in loaded:
        if item.profile.sample_types != first.sample_types:
            log.warning(
                "%s: sample types %s differ from %s; left out of the merge",
                item.path,
                item.profile.sample_types,
                first.sample_types,
            )
            continue
        for s in item.profile.samples:
            ids = []
            for f in reversed(s.frames):  # pprof wants leaf first
                m = b.mapping((f.module, f.build_id), f.module, f.build_id, has_functions=bool(f.function))
                fids = [b.function(f.function, f.filename)] if f.function else []
                ids.append(
                    b.location((f.module, f.build_id, f.address, f.function, f.line), m, f.address, fids, f.line)
                )
            b.sample(ids, s.values, s.labels)
    return b.gzipped()


def format_value(v: int, unit: str) -> str:
    if unit == "nanoseconds":
        return f"{v / 1e9:.2f}s"
    if unit == "bytes":
        return f"{v / (1 << 20):.1f}MiB"
    return str(v)


def top_table(loaded: Sequence[Loaded], n: int = 15) -> str:
    """The top-`n` table `record` prints to root's terminal: flat and cumulative, as go tool pprof -top does;
    names as safestr.printable writes them (no escape sequence or line break reaches the terminal)."""
    if not loaded:
        return "(no samples)"
    unit = loaded[0].profile.sample_types[-1][1]
    rows, grand = top(loaded, n)
    grand = grand or 1
    lines = [f"{'self':>10} {'self%':>6} {'total':>10} {'total%':>6}  function"]
    for r in rows:
        lines.append(
            f"{format_value(r.self_value, unit):>10} {100 * r.self_value / grand:5.1f}% "
            f"{format_value(r.total_value, unit):>10} {100 * r.total_value / grand:5.1f}%  "
            f"{printable(r.function)}"
        )
    return "\n".join(lines)


# The files `record` and `report` write, by the extension of -o.
OUTPUT_EXTENSIONS = (SUFFIX, ".folded", ".html", ".speedscope.json")


def output_extension(out: str) -> str | None:
    """The extension of OUTPUT_EXTENSIONS that `out` ends in, or None."""
    return next((ext for ext in OUTPUT_EXTENSIONS if out.endswith(ext)), None)


def write_outputs(loaded: Sequence[Loaded], out: str, mode: int = files.PRIVATE_MODE) -> list[str]:
    """`out` by its extension: .pb.gz (merged pprof), .folded, .html (the report), .speedscope.json
    (speedscope's viewer). The report and speedscope hold every type in one file; otherwise the cpu
    profile (else the first type) takes the name given, and every other type gets its name as a
    suffix: out.offcpu.pb.gz.

    Each file is written by files.write_atomic (a symlink at its name is replaced, never followed), with
    `mode`: 0600 by default, as the stacks may be other users'."""
    groups = by_type(loaded)
    written = []
    ext = output_extension(out)
    if ext is None:
        raise ValueError(f"{out}: the output's extension must be one of {', '.join(OUTPUT_EXTENSIONS)}")
    if ext == ".html":
        from report import html

        files.write_atomic(out, html.render(loaded).encode(), mode=mode)
        return [out]
    if ext == ".speedscope.json":
        from report import speedscope

        name = os.path.basename(out)[: -len(ext)] or "ebpfprofiler"
        files.write_atomic(out, speedscope.render(loaded, name).encode(), mode=mode)
        return [out]
    stem = out[: -len(ext)]
    for i, (ptype, items) in enumerate(groups.items()):
        path = out if i == 0 else f"{stem}.{ptype}{ext}"
        files.write_atomic(path, merge(items) if ext == SUFFIX else folded(items).encode(), mode=mode)
        written.append(path)
    return written
