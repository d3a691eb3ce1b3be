"""`ebpfprofiler report`: pprof files this project wrote (or a local_dir of them) → one offline HTML report.

Owns: the command line; reading is report/profiles.py's, the page is report/html.py's.

Must not: write anything but -o.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ebpfprofiler.report import html, profiles


def main(argv: Sequence[str] | None = None, prog: str = "ebpfprofiler report") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Render pprof files (or directories of them, such as the agent's local_dir, one "
                    "subdirectory per service) into one self-contained HTML file: a flame graph per profile "
                    "type and service, with click-to-zoom, search and tooltips; it needs no network.")
    p.add_argument("paths", nargs="+", metavar="FILE|DIR", help=".pb.gz files, or directories searched for them")
    p.add_argument("-o", "--output", default="profile.html", help="the HTML file (default: %(default)s)")
    args = p.parse_args(argv)
    skipped = profiles.Skipped()
    loaded = profiles.load(args.paths, skipped)
    if not loaded:
        print(f"{prog}: no readable pprof in {' '.join(args.paths)}"
              + (f" ({sum(skipped.counts.values())} skipped: {dict(skipped.counts)})" if skipped.counts else ""),
              file=sys.stderr)
        return 1
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(html.render(loaded))
    types = sorted({x.profile_type for x in loaded})
    print(f"{prog}: wrote {args.output}: {len(loaded)} profiles ({', '.join(types)}) of "
          f"{len({x.service for x in loaded})} services"
          + (f"; skipped {sum(skipped.counts.values())}" if skipped.counts else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
