#!/bin/bash
# PID 1 of a kernel-matrix guest (tests/kernels): mounts what a Debian host has
# mounted, runs the smoke suite with the project's venv, then powers off.
#
# Owns: the guest's mounts and its power-off. Must not: change a sysctl or an
# rlimit (Debian's stock settings are what the suite tests), or the project.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
PROJECT=/opt/ebpfprofiler

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs -o mode=755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || echo "guest: no tracefs"
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || echo "guest: no debugfs"
mount -t bpf bpf /sys/fs/bpf 2>/dev/null || echo "guest: no bpffs"
hostname ktest-guest

if grep -qw ktest.probe=1 /proc/cmdline; then
    echo o > /proc/sysrq-trigger
fi
echo "guest: $(uname -r) up; running the smoke suite"
cd "$PROJECT" && "$PROJECT/.venv/bin/python" -m tests.kernels.guest_smoke --results /dev/ttyS1
echo "guest: smoke suite exited $?; powering off"
sync
echo o > /proc/sysrq-trigger
# sysrq is asynchronous: PID 1 must not exit before the power-off (the kernel would panic)
while :; do sleep 60; done
