#!/usr/bin/env bash
# `make install`: ebpfprofiler as systemd units, in the standard places. As root,
# from the checkout. Idempotent: a second run updates the code and the units,
# keeps the config, and restarts the agent if it is running.
#
#   host         deploy/setup.sh --system: Debian packages (bcc, python3-venv,
#                what python-prctl builds with), a kernel header tree, tracefs
#   users        /usr/lib/sysusers.d/ebpfprofiler.conf, applied (systemd-sysusers,
#                else deploy/users.sh: groupadd/useradd)
#   directories  /usr/lib/tmpfiles.d/ebpfprofiler.conf, applied: /run/ebpfprofiler
#                (3770 root:ebpfprofiler, sticky), /var/lib/ebpfprofiler (0750)
#   code         /usr/lib/ebpfprofiler/venv: a venv on /usr/bin/python3 with
#                --system-site-packages (bcc), the project (not editable) and its
#                dependencies at the versions pinned in requirements.txt
#                /usr/lib/ebpfprofiler/bpf: the BPF C programs
#   units        /usr/lib/systemd/system/ebpfprofiler{.target,-collector.service,
#                -symbolizer@.service,-runtime.service,-uploader.service}
#   config       /etc/wt-agent/agent.yaml (0640 root:ebpfprofiler) from
#                deploy/agent.yaml, only if there is none
#
# It neither enables nor starts anything: `systemctl enable --now ebpfprofiler.target`.
set -euo pipefail
cd "$(dirname "$0")/.."
umask 022   # everything installed is readable by the stages' users

LIB=/usr/lib/ebpfprofiler
VENV=$LIB/venv
BPF_DIR=$LIB/bpf
UNIT_DIR=/usr/lib/systemd/system
SYSUSERS=/usr/lib/sysusers.d/ebpfprofiler.conf
TMPFILES=/usr/lib/tmpfiles.d/ebpfprofiler.conf
CONF_DIR=/etc/wt-agent
CONF=$CONF_DIR/agent.yaml
GROUP=ebpfprofiler

say() { printf 'install: %s\n' "$*"; }
die() { printf 'install: ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it creates users and writes under /usr/lib, /etc and /var/lib)"

# --- the host: packages, kernel headers, tracefs (shared with make setup) --------
bash deploy/setup.sh --system

# --- users and directories ----------------------------------------------------
install -D -m 0644 deploy/sysusers.conf "$SYSUSERS"
if command -v systemd-sysusers >/dev/null; then
    systemd-sysusers "$SYSUSERS"
else
    bash deploy/users.sh
fi
install -D -m 0644 deploy/tmpfiles.conf "$TMPFILES"
if command -v systemd-tmpfiles >/dev/null; then
    systemd-tmpfiles --create "$TMPFILES"
else
    install -d -m 3770 -o root -g "$GROUP" /run/ebpfprofiler
    install -d -m 0750 -o root -g "$GROUP" /var/lib/ebpfprofiler
fi

# --- code: the venv and the BPF programs --------------------------------------
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import bcc' 2>/dev/null; then
    say "creating $VENV (python3 -m venv --system-site-packages on /usr/bin/python3)"
    rm -rf "$VENV"
    mkdir -p "$LIB"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
# pip builds the project in its source directory (build/, *.egg-info): give it a
# copy of the tree, not the checkout. The pins of requirements.txt are applied
# as constraints: the versions the tests ran with, without test-only packages.
src=$(mktemp -d /tmp/ebpfprofiler-install.XXXXXX)
trap 'rm -rf "$src"' EXIT
tar --exclude='./.*' --exclude=./build --exclude='./*.egg-info' --exclude=./tests --exclude=./bench \
    --exclude='__pycache__' -cf - . | tar -xf - -C "$src"
say "installing ebpfprofiler and its pinned dependencies into $VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check --use-pep517 -c requirements.txt "$src"
"$VENV/bin/python" -c 'import bcc, zmq, google.protobuf, requests, prctl, yaml, cli.main' \
    || die "$VENV is incomplete; remove it and run make install again"
for stage in collector symbolizer runtime uploader; do
    [ -x "$VENV/bin/ebpfprofiler-$stage" ] || die "$VENV/bin/ebpfprofiler-$stage was not installed"
done

rm -rf "$BPF_DIR.new"
install -d -m 0755 "$BPF_DIR.new"
install -m 0644 bpf/*.c bpf/*.h "$BPF_DIR.new/"
rm -rf "$BPF_DIR"
mv "$BPF_DIR.new" "$BPF_DIR"

# --- units and config -----------------------------------------------------------
install -d -m 0755 "$UNIT_DIR"
install -m 0644 deploy/systemd/ebpfprofiler.target deploy/systemd/ebpfprofiler-*.service "$UNIT_DIR/"
install -d -m 0755 "$CONF_DIR"
if [ -e "$CONF" ]; then
    say "kept the existing $CONF"
else
    install -m 0640 -o root -g "$GROUP" deploy/agent.yaml "$CONF"
    say "installed the default config as $CONF"
fi
# Every stage reads it as its own user, in the agent's group.
for stage in collector symbolizer runtime uploader; do
    if ! setpriv --reuid="ebpfprofiler-$stage" --regid="$GROUP" --clear-groups test -r "$CONF"; then
        printf 'install: WARNING: ebpfprofiler-%s cannot read %s; the stages will not start. Fix: %s\n' \
            "$stage" "$CONF" "chgrp $GROUP $CONF && chmod g+r $CONF" >&2
        break
    fi
done

if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    if systemctl -q is-active ebpfprofiler.target; then
        say "restarting the running agent with the new code"
        systemctl restart ebpfprofiler.target
        say "done"
    else
        say "done; start the agent now and at every boot with: systemctl enable --now ebpfprofiler.target"
    fi
else
    say "done (systemd is not running here: units installed, nothing reloaded)"
fi
