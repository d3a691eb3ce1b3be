"""The Debian roots the PHP and Ruby tests run their runtimes in (container stand-ins), built once and cached.

Owns: which packages each root holds: trixie (PHP 8.4's CLI and php-fpm, Ruby
3.3) and sid with experimental's PHP 8.5 (CLI and php-fpm) and Ruby 3.4;
bookworm's Ruby 3.1 (to be refused); sid's OpenJDK 8 (to be refused by the JVM
reader).

Must not: start anything inside a root.
"""

from __future__ import annotations

from pathlib import Path

from bench.assets.debroot import cached_root

# Bump when the way a root is built changes.
RECIPE = 1


def _log(msg: str) -> None:
    print(f"runtime roots: {msg}", flush=True)


def trixie() -> Path:
    return cached_root("trixie", ["php8.4-cli", "php8.4-fpm", "ruby3.3"], RECIPE, name="trixie-runtimes", log=_log)[0]


def experimental() -> Path:
    return cached_root(
        "sid",
        ["ca-certificates"],
        RECIPE,
        name="experimental-runtimes",
        log=_log,
        # php-common from sid: experimental's newer one Breaks php8.5-common.
        extra=("experimental", ["php8.5-cli", "php8.5-fpm", "ruby3.4", "php-common/sid"]),
    )[0]


def bookworm_ruby() -> Path:
    return cached_root("bookworm", ["ruby3.1"], RECIPE, name="bookworm-ruby", log=_log)[0]


def sid_jdk8() -> Path:
    """Debian sid's OpenJDK 8 (HotSpot 8: the JVM reader refuses it)."""
    return cached_root("sid", ["openjdk-8-jre-headless"], RECIPE, name="sid-jdk8", log=_log)[0]
