#!/usr/bin/env bash
# Host set-up for ebpfprofiler on Debian 12, as root. Idempotent: a second run
# checks each step and does nothing that is already done (it takes ~1 s).
#
#   1. Debian packages: bcc (python3-bpfcc, bpfcc-tools), linux-perf, bpftool,
#      golang-go (for `go tool pprof`), libcap-dev (python-prctl builds on it),
#      gcc, python3-venv.
#   2. A kernel header tree for bcc: the running kernel's if Debian has it,
#      else Debian's newest linux-headers-amd64 linked in place, with a warning.
#   3. The agent's group and a system user per stage (deploy/users.sh).
#      tracefs mounted at /sys/kernel/tracing.
#   4. A venv in .venv on /usr/bin/python3 with --system-site-packages (bcc is
#      only in Debian's dist-packages), the pinned requirements, and this
#      project installed editable (console scripts: ebpfprofiler, ...).
#
# `setup.sh --system` (deploy/install.sh, `make install`) does only what the
# installed agent needs of the host: the Debian packages of SYSTEM_PACKAGES, the
# kernel header tree and tracefs; install.sh itself makes the users (from
# deploy/sysusers.conf) and its own venv under /usr/lib/ebpfprofiler.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=dev
case "${1:-}" in
    "") ;;
    --system) MODE=system ;;
    *) printf 'usage: %s [--system]\n' "$0" >&2; exit 2 ;;
esac

say() { printf 'setup: %s\n' "$*"; }
warn() { printf 'setup: WARNING: %s\n' "$*" >&2; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs Debian packages and mounts tracefs)"
[ "$(uname -s)" = Linux ] || die "ebpfprofiler runs on Linux only"
command -v apt-get >/dev/null || die "this set-up is for Debian (apt-get not found); install the equivalents of: $*"

# What the installed agent needs (bcc; python3-venv; gcc, make, libcap-dev and
# python3-dev to build python-prctl), and what development and the tests add
# (systemd-analyze, systemd-nspawn and debootstrap: tests of the systemd units;
# chromium: the HTML report opened in a headless browser; openjdk-17-jdk-headless:
# the JVM tests' JDK 17 and their javac; php8.2-fpm: the PHP test's php-fpm, started
# with its own config).
SYSTEM_PACKAGES="python3-bpfcc python3-venv python3-dev libcap-dev gcc make"
DEV_PACKAGES="bpfcc-tools linux-perf bpftool golang-go systemd systemd-container debootstrap gcc-aarch64-linux-gnu libc6-dbg chromium php8.2-cli php8.2-fpm openjdk-17-jdk-headless nodejs"
PACKAGES=$SYSTEM_PACKAGES
[ "$MODE" = system ] || PACKAGES="$PACKAGES $DEV_PACKAGES"
apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then
        say "apt-get update"
        apt-get update -q >/dev/null
        apt_updated=1
    fi
    say "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null
}
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

missing=""
for p in $PACKAGES; do installed "$p" || missing="$missing $p"; done
[ -z "$missing" ] || apt_install $missing
# Debian starts php8.2-fpm's own service when it is installed: the tests start theirs, so stop it.
case " $missing " in *" php8.2-fpm "*)
    command -v systemctl >/dev/null && systemctl disable --now php8.2-fpm >/dev/null 2>&1 || true ;;
esac

# --- kernel headers -----------------------------------------------------------
kver=$(uname -r)
kdir=/lib/modules/$kver
has_headers() { [ -e "$kdir/build/include/generated/autoconf.h" ] || [ -e "$kdir/build/include/config/auto.conf" ]; }
if ! has_headers && apt-cache show "linux-headers-$kver" >/dev/null 2>&1; then
    apt_install "linux-headers-$kver"
fi
if ! has_headers; then
    installed linux-headers-amd64 || apt_install linux-headers-amd64
    tree=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
    [ -n "$tree" ] || die "no kernel header tree could be installed"
    common=${tree%-amd64}-common
    mkdir -p "$kdir"
    ln -sfn "$tree" "$kdir/build"
    [ -d "$common" ] && ln -sfn "$common" "$kdir/source"
    warn "no headers for the running kernel $kver: linked $(basename "$tree") as $kdir/build."
    warn "BPF programs that read only helper results and tracepoint fields (all of ours) work with it;"
    warn "install linux-headers-$kver if your distribution has it."
fi
case "$(readlink "$kdir/build" 2>/dev/null)" in
    /usr/src/linux-headers-"$kver") ;;
    /usr/src/linux-headers-*) warn "kernel headers: $kdir/build is the fallback tree $(readlink "$kdir/build"), not $kver's";;
esac

# --- the agent's users ---------------------------------------------------------
[ "$MODE" = system ] || bash deploy/users.sh

# --- tracefs ------------------------------------------------------------------
if [ ! -e /sys/kernel/tracing/available_events ]; then
    say "mounting tracefs at /sys/kernel/tracing"
    mount -t tracefs tracefs /sys/kernel/tracing || die "cannot mount tracefs at /sys/kernel/tracing"
fi

if [ "$MODE" = system ]; then
    say "host ready for the installed agent"
    exit 0
fi

# --- venv ---------------------------------------------------------------------
VENV=.venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import bcc' 2>/dev/null; then
    say "creating $VENV (python3 -m venv --system-site-packages on /usr/bin/python3)"
    rm -rf "$VENV"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip setuptools
fi
stamp=$VENV/.installed
if [ ! -e "$stamp" ] || [ requirements.txt -nt "$stamp" ] || [ requirements-dev.txt -nt "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    say "installing pinned requirements and the project into $VENV"
    "$VENV/bin/pip" install -q -r requirements.txt -r requirements-dev.txt
    "$VENV/bin/pip" install -q --no-deps -e .
    touch "$stamp"
fi
"$VENV/bin/python" -c 'import bcc, zmq, elftools, google.protobuf, requests, prctl, yaml, ebpfprofiler.cli.main' \
    || die "the venv is incomplete; remove $VENV and run make setup again"
go version >/dev/null || die "go is not on PATH (golang-go), needed for go tool pprof"
say "ready: $VENV/bin/ebpfprofiler"
