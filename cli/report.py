"""`ebpfprofiler report`: pprof files this project wrote (or a local_dir of them) → one offline HTML report.

Owns: the command line; reading is report/profiles.py's, the page is report/html.py's.

Must not: write anything but -o, which goes through shared/files.py's
write_atomic (0600 unless --mode; a symlink at -o is replaced, never followed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from report import html, profiles
from shared import files


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler report") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Render pprof files (or directories of them, such as the agent's local_dir, one "
        "subdirectory per service) into one self-contained HTML file: a flame graph per profile "
        "type and service, with click-to-zoom, search and tooltips; it needs no network.",
    )
    p.add_argument("paths", nargs="+", metavar="FILE|DIR", help=".pb.gz files, or directories searched for them")
    p.add_argument(
        "-o",
        "--output",
        default="profile.html",
        help="the HTML file (default: %(default)s); written beside its name, then renamed into place "
        "(a symlink there is replaced, never followed); its directory must exist",
    )
    p.add_argument(
        "--mode",
        type=files.parse_mode,
        default=files.PRIVATE_MODE,
        metavar="OCTAL",
        help="permissions of the file written, such as 0644 (default: 0600: the stacks may be other users')",
    )
    args = p.parse_args(argv)
    problem = files.output_dir_problem(args.output)
    if problem:
        print(f"{prog}: -o {problem}", file=sys.stderr)
        return 2
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
        files.write_atomic(args.output, html.render(loaded).encode(), mode=args.mode)
    except OSError as e:
        print(f"{prog}: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    types = sorted({x.profile_type for x in loaded})
    print(
        f"{prog}: wrote {args.output}: {len(loaded)} profiles ({', '.join(types)}) of "
        f"{len({x.service for x in loaded})} services"
        + (f"; skipped {sum(skipped.counts.values())}" if skipped.counts else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
