"""The `ebpfprofiler` command: one subcommand per stage or tool, each in its own module.

Owns: dispatch from `ebpfprofiler SUBCOMMAND ...` to the subcommand's main().
Subcommand modules are imported only when chosen, so `ebpfprofiler receiver`
never imports bcc and the stages stay small.

Must not: parse a subcommand's own options.
"""

from __future__ import annotations

import importlib
import sys

# subcommand → (module with main(argv) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("cli.run", "profile this host: start and supervise every stage in the foreground"),
    "collector": ("collector.main", "the root stage: BPF programs, /proc discovery, stack batches"),
    "symbolizer": ("symbolizer.main", "a symbolizer worker: names frames, builds one pprof per service"),
    "uploader": ("uploader.main", "the uploader: posts profiles to the backend or writes them locally"),
    "runtime": (
        "runtimes.main",
        "the runtime reader: interpreter and JIT stacks (CPython, PHP, Ruby, Node.js, JVM, .NET)",
    ),
    "receiver": ("receiver.server", "a reference backend implementing POST /v1/profiles"),
    "record": ("cli.record", "profile this host now, or a command (record -- CMD), into .html, .pb.gz, .folded"),
    "top": ("cli.top", "a live view of the hottest functions, host-wide or of -p PID (keys sort and switch views)"),
    "report": ("cli.report", "an offline HTML flame graph of pprof files or a local_dir"),
    "status": ("cli.status", "what the running profiler costs: stage CPU, BPF time, samples, rate"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [
        "usage: ebpfprofiler SUBCOMMAND [options]   (ebpfprofiler SUBCOMMAND --help for its options)",
        "",
        "subcommands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"ebpfprofiler: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest, prog=f"ebpfprofiler {name}") or 0)


if __name__ == "__main__":
    sys.exit(main())
