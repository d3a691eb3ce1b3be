#!/usr/bin/env bash
# `make uninstall`: remove what `make install` put in place. As root.
#
# Stops and disables the agent first, then removes the units, the venv and
# BPF programs (/usr/lib/ebpfprofiler), the sysusers.d and tmpfiles.d files
# and /run/ebpfprofiler. Keeps the config (/etc/wt-agent/agent.yaml) and the
# state (/var/lib/ebpfprofiler: pid secret, spool, locally written profiles)
# unless PURGE=1. The system users and the group stay either way (files they
# own may remain elsewhere, e.g. a local_dir of your choosing); remove them
# with userdel/groupdel if you want them gone.
set -euo pipefail
umask 022

LIB=/usr/lib/ebpfprofiler
UNIT_DIR=/usr/lib/systemd/system
UNITS="ebpfprofiler.target ebpfprofiler-collector.service ebpfprofiler-symbolizer@.service ebpfprofiler-runtime.service
       ebpfprofiler-uploader.service"
SYSUSERS=/usr/lib/sysusers.d/ebpfprofiler.conf
TMPFILES=/usr/lib/tmpfiles.d/ebpfprofiler.conf
CONF_DIR=/etc/wt-agent
STATE=/var/lib/ebpfprofiler
PURGE=${PURGE:-0}

say() { printf 'uninstall: %s\n' "$*"; }
die() { printf 'uninstall: ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root"

if [ -d /run/systemd/system ]; then
    # Stopping the target stops every stage (PartOf=), collector first.
    say "stopping ebpfprofiler.target"
    systemctl stop ebpfprofiler.target 'ebpfprofiler-*.service' 2>/dev/null || true
fi
# Disabling works without a running systemd too: it only removes symlinks.
if command -v systemctl >/dev/null; then
    enabled=""
    for link in /etc/systemd/system/*.wants/ebpfprofiler*; do
        [ -L "$link" ] && enabled="$enabled $(basename "$link")"
    done
    # shellcheck disable=SC2086
    [ -z "$enabled" ] || systemctl disable --quiet $(printf '%s\n' $enabled | sort -u) || true
fi
for u in $UNITS; do rm -f "$UNIT_DIR/$u"; done
rm -rf "$LIB" "$SYSUSERS" "$TMPFILES" /run/ebpfprofiler
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl reset-failed 'ebpfprofiler*' 2>/dev/null || true
fi
say "removed the units, $LIB, $SYSUSERS, $TMPFILES and /run/ebpfprofiler"

if [ "$PURGE" = 1 ]; then
    rm -f "$CONF_DIR/agent.yaml"
    rmdir "$CONF_DIR" 2>/dev/null || true
    rm -rf "$STATE"
    say "PURGE=1: removed $CONF_DIR/agent.yaml and $STATE"
else
    say "kept $CONF_DIR/agent.yaml and $STATE (make uninstall PURGE=1 removes them too)"
fi
