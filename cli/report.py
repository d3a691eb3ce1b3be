"""`ebpfprofiler report`: pprof files this project wrote (or a local_dir of them) → one offline HTML report,
or speedscope's file (or a merged pprof, or folded stacks), by -o's extension; with --diff BASE NEW, the
differential flame graph of two recordings.

Owns: the command line; reading and writing by extension are report/profiles.py's, the page is
report/html.py's, the speedscope file report/speedscope.py's, the diff's shares and movers report/diff.py's.

Must not: write anything but -o, which goes through shared/files.py's
write_atomic (0600 unless --mode; a symlink at -o is replaced, never followed).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from report import profiles
from shared import files
from shared.safestr import printable


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Render pprof files (or directories of them, such as the agent's local_dir, one "
        "subdirectory per service) into one self-contained HTML file: a flame graph per profile "
        "type and service, with click-to-zoom, search and tooltips; it needs no network. With -o "
        "NAME.speedscope.json, one file for speedscope's viewer instead (one profile per type, "
        "process and thread, in time order); .pb.gz and .folded write merged pprof and folded stacks. With --diff BASE NEW, a differential "
        "flame graph of two recordings instead.",
    )
    p.add_argument("paths", nargs="*", metavar="FILE|DIR", help=".pb.gz files, or directories searched for them")
    p.add_argument(
        "--diff",
        nargs=2,
        metavar=("BASE", "NEW"),
        help="a differential flame graph (-o NAME.html only) of NEW against BASE, each a .pb.gz file or a "
        "directory of them (a `record -o X.pb.gz` result, or a local_dir): NEW's flame graph with each frame "
        "coloured by the change in its share of its side's total (red grew, blue shrank, deeper the larger), "
        "a view of BASE's graph in the same colours (frames gone from NEW are there), and a table of the "
        "functions whose self and total shares moved most. Frames are matched by function name, not "
        "address, so two builds (before and after a deploy) compare",
    )
    p.add_argument(
        "-o",
        "--output",
        default="profile.html",
        help="the file, by its extension: .html, .speedscope.json, .pb.gz or .folded (default: "
        "%(default)s); written beside its name, then renamed into place (a symlink there is replaced, "
        "never followed); its directory must exist",
    )
    p.add_argument(
        "--mode",
        type=files.parse_mode,
        default=files.PRIVATE_MODE,
        metavar="OCTAL",
        help="permissions of the file written, such as 0644 (default: 0600: the stacks may be other users')",
    )
    return p


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler report") -> int:
    p = _parser(prog)
    args = p.parse_args(argv)
    if args.diff and args.paths:
        p.error("--diff BASE NEW takes no other FILE|DIR")
    if not args.diff and not args.paths:
        p.error("name the profiles: FILE|DIR …, or --diff BASE NEW")
    if profiles.output_extension(args.output) is None:
        p.error(f"-o {args.output}: the extension must be one of {', '.join(profiles.OUTPUT_EXTENSIONS)}")
    if args.diff and profiles.output_extension(args.output) != ".html":
        p.error(f"-o {args.output}: --diff writes an .html page only")
    problem = files.output_dir_problem(args.output)
    if problem:
        print(f"{prog}: -o {problem}", file=sys.stderr)
        return 2
    if args.diff:
        return _diff(prog, args.diff[0], args.diff[1], args.output, args.mode)
    skipped = profiles.Skipped()
    loaded = profiles.load(args.paths, skipped)
    if not loaded:
        print(
            f"{prog}: no readable pprof in {' '.join(args.paths)}"
            + (f" ({sum(skipped.counts.values())} skipped: {dict(skipped.counts)})" if skipped.counts else ""),
            file=sys.stderr,
        )
        return 1
    try:
        written = profiles.write_outputs(loaded, args.output, args.mode)
    except OSError as e:
        print(f"{prog}: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    types = sorted({x.profile_type for x in loaded})
    print(
        f"{prog}: wrote {', '.join(written)}: {len(loaded)} profiles ({', '.join(types)}) of "
        f"{len({x.service for x in loaded})} services"
        + (f"; skipped {sum(skipped.counts.values())}" if skipped.counts else "")
    )
    return 0


def _load_side(prog: str, side: str, path: str) -> list[profiles.Loaded] | None:
    skipped = profiles.Skipped()
    loaded = profiles.load([path], skipped) if os.path.exists(path) else []
    if not loaded:
        why = (
            f" ({sum(skipped.counts.values())} skipped: {dict(skipped.counts)})"
            if skipped.counts
            else ("" if os.path.exists(path) else " (no such file or directory)")
        )
        print(f"{prog}: --diff {side} {path}: no readable pprof{why}", file=sys.stderr)
        return None
    return loaded


def _diff(prog: str, base_path: str, new_path: str, out: str, mode: int) -> int:
    from report import diff, html

    base = _load_side(prog, "BASE", base_path)
    new = _load_side(prog, "NEW", new_path)
    if base is None or new is None:
        return 1
    pairs = diff.compare(base, new)
    try:
        files.write_atomic(out, html.render_diff(pairs, base_path, new_path).encode(), mode=mode)
    except OSError as e:
        print(f"{prog}: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    types = sorted({p.profile_type for p in pairs})
    print(f"{prog}: wrote {out}: {new_path} against {base_path}, {len(pairs)} graphs ({', '.join(types)})")
    for p in pairs[:1]:
        for m in p.movers[:5]:
            print(f"  {m.status:>6} {100 * m.total_delta:+7.2f} pts total {printable(m.function)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
