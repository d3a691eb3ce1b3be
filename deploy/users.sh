#!/usr/bin/env bash
# The agent's group and one system user per stage (docs/architecture.md, "Processes").
# Idempotent. Used by deploy/setup.sh; systemd hosts can use deploy/sysusers.conf.
set -euo pipefail
GROUP=ebpfprofiler
getent group "$GROUP" >/dev/null || groupadd --system "$GROUP"
for stage in collector symbolizer uploader runtime; do
    user="ebpfprofiler-$stage"
    id "$user" >/dev/null 2>&1 || useradd --system --gid "$GROUP" --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin --comment "ebpfprofiler $stage" "$user"
done
