#!/usr/bin/env bash
# Set-up for ebpfprofiler on Debian 12, as root. Needs only bash and apt: it installs
# everything else it uses, so it also works in a fresh Debian root (debootstrap
# --variant=minbase, a container or an image build) that has no python3, make or git.
# Idempotent: each step checks whether it is done, and a second run takes about a
# second. A step's "done" marker is written only after the step succeeded, so a
# step that failed is done again on the next run.
#
#   deploy/setup.sh            what running the agent needs (`make setup`)
#   deploy/setup.sh --test     that, and what the tests and `make bench` use (`make test-setup`)
#   deploy/setup.sh --system   the host part only, for deploy/install.sh (`make install`)
#   ... --kernel VER[,VER...]  (repeatable; `make setup KERNEL=VER[,VER...]`) the header
#                              trees of these kernels instead of the running one's: for a
#                              chroot or an image that will boot them. Then the running
#                              kernel is left alone: no tracefs mount, nothing under
#                              /lib/modules/$(uname -r).
#
# Steps:
#   1. Debian packages. Running: SYSTEM_PACKAGES (bcc's python3-bpfcc; python3-venv;
#      gcc, python3-dev and libcap-dev to build python-prctl; make for `make run`;
#      ca-certificates for pip over TLS). --test adds TEST_PACKAGES.
#   2. A kernel header tree for bcc, as /lib/modules/VER/build. The running kernel's
#      (linux-headers-$(uname -r)) if Debian has it, else Debian's newest
#      linux-headers-amd64 linked in its place, with a warning. With --kernel: each
#      named kernel's linux-headers-VER (already in the root, e.g. from `dpkg -i`, or
#      from apt), linked as /lib/modules/VER/build if the package did not; no fallback.
#   3. The agent's group and a system user per stage (deploy/users.sh); not --system.
#   4. tracefs mounted at /sys/kernel/tracing; not with --kernel.
#   5. A venv in .venv on /usr/bin/python3 with --system-site-packages (bcc is only in
#      Debian's dist-packages): marker .venv/.created. The pins of requirements.txt
#      and this project installed editable (console scripts: ebpfprofiler, ...):
#      marker .venv/.requirements, the checksums of the files it was made from. Not --system.
#   6. --test: requirements-dev.txt into the venv (marker .venv/.requirements-dev).
#
# `--system` (deploy/install.sh) does 1, 2 and 4 with SYSTEM_PACKAGES; install.sh itself
# makes the users (from deploy/sysusers.conf) and its own venv under /usr/lib/ebpfprofiler.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'setup: %s\n' "$*"; }
warn() { printf 'setup: WARNING: %s\n' "$*" >&2; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }
usage() { printf 'usage: %s [--test | --system] [--kernel VER[,VER...]]...\n' "$0" >&2; exit 2; }

MODE=run
KERNELS=()
add_kernels() {   # VER[,VER...] (commas or blanks): appended to KERNELS
    local v
    for v in ${1//,/ }; do
        [[ $v =~ ^[0-9][A-Za-z0-9._+~-]*$ ]] || die "--kernel $v: not a kernel release (as uname -r prints it, e.g. 6.1.0-40-amd64)"
        KERNELS+=("$v")
    done
}
while [ $# -gt 0 ]; do
    case "$1" in
        --test) [ "$MODE" = run ] || usage; MODE="test" ;;
        --system) [ "$MODE" = run ] || usage; MODE="system" ;;
        --kernel) [ $# -ge 2 ] || usage; add_kernels "$2"; shift ;;
        --kernel=*) add_kernels "${1#--kernel=}" ;;
        *) usage ;;
    esac
    shift
done

# What running the agent needs (also what `make install` needs of a host), and what the
# tests and `make bench` add: bcc's tools (profile-bpfcc, the bench's peer), linux-perf,
# bpftool, golang-go (`go tool pprof`); systemd, systemd-container and debootstrap (tests
# of the systemd units, Debian roots of the runtimes); gcc-aarch64-linux-gnu and libc6-dbg
# (unwind-table tests); chromium (the HTML report in a headless browser);
# openjdk-17-jdk-headless (the JVM tests' JDK and javac); php8.2-cli, php8.2-fpm (the PHP
# tests; Debian starts its own php-fpm, stopped below); nodejs; qemu-system-x86,
# qemu-utils, e2fsprogs, cpio and busybox-static (the kernel matrix: guests booted under qemu);
# tmux (`ebpfprofiler top` drawn on a real terminal, its screen captured).
SYSTEM_PACKAGES="python3-bpfcc python3-venv python3-dev libcap-dev gcc make ca-certificates"
TEST_PACKAGES="bpfcc-tools linux-perf bpftool golang-go systemd systemd-container debootstrap gcc-aarch64-linux-gnu libc6-dbg chromium php8.2-cli php8.2-fpm openjdk-17-jdk-headless nodejs qemu-system-x86 qemu-utils e2fsprogs cpio busybox-static tmux"
PACKAGES=$SYSTEM_PACKAGES
[ "$MODE" != test ] || PACKAGES="$PACKAGES $TEST_PACKAGES"

[ "$(id -u)" = 0 ] || die "run as root (it installs Debian packages, creates users and mounts tracefs)"
[ "$(uname -s)" = Linux ] || die "ebpfprofiler runs on Linux only"
command -v apt-get >/dev/null || die "this set-up is for Debian (apt-get not found); install the equivalents of: $PACKAGES"

# --- 1. Debian packages ---------------------------------------------------------
apt_updated=0
apt_update() {
    [ "$apt_updated" = 0 ] || return 0
    say "apt-get update"
    apt-get -o Acquire::Retries=3 update -q >/dev/null
    apt_updated=1
}
apt_install() {
    apt_update
    say "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get -o Acquire::Retries=3 install -y -q --no-install-recommends "$@" >/dev/null
}
apt_has() { apt_update; apt-cache show "$1" >/dev/null 2>&1; }   # PKG: apt can install it
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
# The packages of the list not installed, from one dpkg-query (a second run stays fast).
not_installed() {
    local ok p
    ok=" $(dpkg-query -W -f='${Status} ${Package}\n' "$@" 2>/dev/null | sed -n 's/^install ok installed //p' | tr '\n' ' ') "
    for p in "$@"; do
        case "$ok" in *" $p "*) ;; *) printf '%s ' "$p" ;; esac
    done
}

# shellcheck disable=SC2086  # word splitting of the lists is meant
missing=$(not_installed $PACKAGES)
# shellcheck disable=SC2086
[ -z "$missing" ] || apt_install $missing
# Debian starts php8.2-fpm's own service when it is installed: the tests start theirs, so stop it.
case " $missing " in *" php8.2-fpm "*)
    if command -v systemctl >/dev/null; then systemctl disable --now php8.2-fpm >/dev/null 2>&1 || true; fi ;;
esac

# --- 2. kernel header trees -------------------------------------------------------
tree_ok() { [ -e "$1/include/generated/autoconf.h" ] || [ -e "$1/include/config/auto.conf" ]; }
has_headers() { tree_ok "/lib/modules/$1/build"; }
link_tree() {   # VER TREE: TREE as /lib/modules/VER/build (and its -common tree as source)
    local kdir=/lib/modules/$1 common=${2%-*}-common
    mkdir -p "$kdir"
    ln -sfn "$2" "$kdir/build"
    if [ -d "$common" ]; then ln -sfn "$common" "$kdir/source"; fi
}
# VER: Debian's header tree of kernel VER as /lib/modules/VER/build, from the root if it
# is there already, else from apt. Fails (1) if neither has it.
headers_of() {
    local ver=$1 tree=/usr/src/linux-headers-$1
    has_headers "$ver" && return 0
    if ! tree_ok "$tree"; then
        apt_has "linux-headers-$ver" || return 1
        apt_install "linux-headers-$ver"
        tree_ok "$tree" || die "linux-headers-$ver installed no header tree at $tree"
    fi
    has_headers "$ver" || { say "linking $tree as /lib/modules/$ver/build"; link_tree "$ver" "$tree"; }
}

if [ ${#KERNELS[@]} -gt 0 ]; then
    for ver in "${KERNELS[@]}"; do
        headers_of "$ver" || die "no header tree for kernel $ver: apt has no linux-headers-$ver and /usr/src/linux-headers-$ver is not there. Install that kernel's linux-headers .deb files into this root (dpkg -i, with their -common and linux-kbuild) or add the suite that has them to its apt sources, then run again"
    done
else
    kver=$(uname -r)
    kdir=/lib/modules/$kver
    if ! headers_of "$kver"; then
        installed linux-headers-amd64 || apt_install linux-headers-amd64
        tree=$(printf '%s\n' /usr/src/linux-headers-*-amd64 | sort -V | tail -n 1)
        tree_ok "$tree" || die "no kernel header tree could be installed"
        link_tree "$kver" "$tree"
        warn "no headers for the running kernel $kver: linked $(basename "$tree") as $kdir/build."
        warn "BPF programs that read only helper results and tracepoint fields (all of ours) work with it;"
        warn "install linux-headers-$kver if your distribution has it."
    fi
    case "$(readlink "$kdir/build" 2>/dev/null)" in
        /usr/src/linux-headers-"$kver") ;;
        /usr/src/linux-headers-*) warn "kernel headers: $kdir/build is the fallback tree $(readlink "$kdir/build"), not $kver's";;
    esac
fi

# --- 3. the agent's users ---------------------------------------------------------
[ "$MODE" = system ] || bash deploy/users.sh

# --- 4. tracefs -------------------------------------------------------------------
# With --kernel this is a root for other kernels (a chroot, an image): the agent mounts
# nothing there, and the host's /sys is not this set-up's to change.
if [ ${#KERNELS[@]} = 0 ] && [ ! -e /sys/kernel/tracing/available_events ]; then
    say "mounting tracefs at /sys/kernel/tracing"
    mount -t tracefs tracefs /sys/kernel/tracing \
        || die "cannot mount tracefs at /sys/kernel/tracing (in a chroot or an image build, name the kernels it will boot: --kernel VER)"
fi

if [ "$MODE" = system ]; then
    say "host ready for the installed agent"
    exit 0
fi

# --- 5. the venv ------------------------------------------------------------------
VENV=.venv
PIP=("$VENV/bin/pip" --disable-pip-version-check)
stamp_matches() { [ -e "$1" ] && [ "$(cat "$1")" = "$2" ]; }   # MARKER CONTENT

# A venv of the set-up before markers: its .installed stamp was written after the whole
# venv step had succeeded, so it counts as made (and is not made again under other users).
if [ -e "$VENV/.installed" ] && [ -x "$VENV/bin/python" ] && [ ! -e "$VENV/.created" ]; then
    touch "$VENV/.created"
    rm -f "$VENV/.installed"
fi
if [ ! -e "$VENV/.created" ] || [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV (python3 -m venv --system-site-packages on /usr/bin/python3)"
    rm -rf "$VENV"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
    "${PIP[@]}" install -q --upgrade pip setuptools
    touch "$VENV/.created"
fi

want=$(sha256sum requirements.txt requirements-dev.txt pyproject.toml)
if ! stamp_matches "$VENV/.requirements" "$want"; then
    say "installing the pinned requirements (requirements.txt) and the project into $VENV"
    rm -f "$VENV/.requirements"
    "${PIP[@]}" install -q -r requirements.txt
    "${PIP[@]}" install -q --no-deps -e .
    printf '%s\n' "$want" >"$VENV/.requirements"
fi

# --- 6. what the tests add ------------------------------------------------------------
checks='import bcc, zmq, google.protobuf, requests, prctl, yaml, cli.main'
if [ "$MODE" = test ]; then
    want=$(sha256sum requirements.txt requirements-dev.txt)
    if ! stamp_matches "$VENV/.requirements-dev" "$want"; then
        say "installing the test tools (requirements-dev.txt) into $VENV"
        rm -f "$VENV/.requirements-dev"
        "${PIP[@]}" install -q -r requirements.txt -r requirements-dev.txt
        printf '%s\n' "$want" >"$VENV/.requirements-dev"
    fi
    checks="$checks, pytest"
    command -v go >/dev/null || die "go is not on PATH (golang-go), needed for go tool pprof"
fi
"$VENV/bin/python" -c "$checks" || die "the venv is incomplete; remove $VENV and run this again"
say "ready: $VENV/bin/ebpfprofiler${KERNELS[*]:+ (kernel headers: ${KERNELS[*]})}"
