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
