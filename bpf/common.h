// Shared by every program family; the collector puts it first.
//
// current_ids: the (process id, thread id) of the current task as the
// collector's /proc names them. In the host's pid namespace that is what
// bpf_get_current_pid_tgid() returns. A collector in another pid namespace
// (a container) is compiled with PIDNS_DEV and PIDNS_INO of its namespace,
// and asks for the ids in it; tasks outside it cannot be named there and are
// skipped (-1).

#ifdef PIDNS_INO
static __always_inline int current_ids(u32 *pid, u32 *tid) {
    struct bpf_pidns_info ns = {};
    if (bpf_get_ns_current_pid_tgid(PIDNS_DEV, PIDNS_INO, &ns, sizeof(ns)))
        return -1;
    *pid = ns.tgid;
    *tid = ns.pid;
    return 0;
}
#else
static __always_inline int current_ids(u32 *pid, u32 *tid) {
    u64 id = bpf_get_current_pid_tgid();
    *pid = id >> 32;
    *tid = (u32)id;
    return 0;
}
#endif

// notify_new_pid: the first count of a process the programs have not seen
// before wakes the collector (a ring-buffer event it polls), so a new
// process's stacks, and the unwind tables they need, are drained within
// EARLY_DRAIN_S of its first sample instead of at the next idle drain (if it
// still lives then: the collector looks). At most one event per
// NEW_PID_NOTIFY_NS: it is a hint to drain, not a record; a process first
// counted while that limit holds is notified by a later count past it.
// Compiled with -DNEW_PID_NOTIFY_NS and -DSEEN_PIDS from the collector (collector/main.py; these
// defaults, the same, are for a module compiled without them, as a test of one family does).
#ifndef NEW_PID_NOTIFY_NS
#define NEW_PID_NOTIFY_NS 100000000
#endif
#ifndef SEEN_PIDS
#define SEEN_PIDS 65536
#endif
BPF_RINGBUF_OUTPUT(new_pids, 1);
BPF_TABLE("lru_hash", u32, u8, seen_pids, SEEN_PIDS);
BPF_ARRAY(new_pid_last, u64, 1);

static __always_inline void notify_new_pid(u32 pid) {
    if (seen_pids.lookup(&pid))
        return;
    u32 zero = 0;
    u64 *last = new_pid_last.lookup(&zero);
    u64 now = bpf_ktime_get_ns();
    if (!last || now - *last < NEW_PID_NOTIFY_NS)
        return;   // not seen yet: its next count, past the limit, notifies it
    *last = now;
    u8 one = 1;
    seen_pids.update(&pid, &one);
    new_pids.ringbuf_output(&pid, sizeof(pid), 0);
}

// The double buffer (every family's <prefix>_counts_0/1): a count goes to the buffer
// <prefix>_active names, by lookup and atomic add, or by update, counting
// <PREFIX>_LOST_COUNTS_FULL when the map is full; the collector flips <prefix>_active before it
// drains the other one. Each family writes that step itself (oncpu_count, offcpu_charge,
// lock_charge, alloc_count): bcc rewrites map calls only where they are written in the source
// ("cannot use map function inside a macro"), and a map cannot be passed to a helper function
// (its address is not the map to the verifier), so it cannot live here as a macro or an inline.
