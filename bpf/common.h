// Shared by every program family; the collector puts it first.
//
// current_ids: the (process id, thread id) of the current task as the
// collector's /proc names them. In the host's pid namespace that is what
// bpf_get_current_pid_tgid() returns. A collector in another pid namespace
// (a container) is compiled with PIDNS_DEV and PIDNS_INO of its namespace,
// and asks for the ids in it; tasks outside it cannot be named there and are
// skipped (-1).

#include <linux/errno.h>   // EEXIST, EFAULT: what map and stack helpers return
#include <uapi/linux/ptrace.h>

// Whether registers saved in a perf event's context were taken in user mode (x86-64: the privilege
// level in cs). The whole 8-byte slot is read: since 6.12 (FRED) the kernel's headers declare cs as
// a 16-bit member of a union, and the verifier refuses a 2-byte read of a perf event's context
// ("invalid bpf_context access off=136 size=2"); the level is in the low bits either way.
static __always_inline int regs_user_mode(struct pt_regs *regs) {
    return (*(u64 *)((char *)regs + __builtin_offsetof(struct pt_regs, cs)) & 3) == 3;
}

// The FNV-1a prime the stack hashes of unwind.h and python.h step with.
#define STACK_HASH_PRIME 0x100000001b3ULL

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

// Self-timing: what each program costs, counted by the programs themselves, so that the kernel's
// run-time statistics (BPF_ENABLE_STATS) need not be on: while on, they read the clock twice around
// every run of every BPF program on the host, ~8% of a context-switch-heavy workload's speed with
// the off-CPU programs running three times per switch (bench: pingpong). Instead every run is
// counted, and about one run in TIMING_PERIOD (a random gap, so that no pattern of the runs lines
// up with it) reads the clock at both ends; the collector scales the timed runs' nanoseconds to
// all runs (collector/bpftime.py). The run's clock reading lives in its slot between begin and end,
// so a program ends its timing at every return and before every tail call (TIMED_RETURN and
// timing_end, given what timing_begin returned); a step program reached by a tail call times
// itself in its own slot.
// -DTIMED_SLOTS and a -DTIMED_<program> slot per program come from collector/bpftime.py.
#ifndef TIMED_SLOTS
#define TIMED_SLOTS 1
#endif
#ifndef TIMING_PERIOD
#define TIMING_PERIOD 16
#endif
struct prog_time {
    u64 runs;      // every run
    u64 timed;     // the runs that were timed
    u64 ns;        // their nanoseconds
    u64 t0;        // the run in progress on this CPU: when it began, if timed (else 0)
    u64 skip;      // runs before the next timed one
};
BPF_PERCPU_ARRAY(prog_times, struct prog_time, TIMED_SLOTS);

// The slot of the run in progress; timing_end(it) and TIMED_RETURN(it, value) end its timing.
static __always_inline struct prog_time *timing_begin(u32 slot) {
    struct prog_time *t = prog_times.lookup(&slot);
    if (!t)
        return 0;
    t->runs++;
    if (t->skip) {
        t->skip--;
        t->t0 = 0;
        return t;
    }
    t->skip = bpf_get_prandom_u32() % (2 * TIMING_PERIOD - 1);   // 0 .. 2 * period - 2: one in period
    t->t0 = bpf_ktime_get_ns();
    return t;
}

static __always_inline void timing_end(struct prog_time *t) {
    if (!t || !t->t0)
        return;
    t->timed++;
    t->ns += bpf_ktime_get_ns() - t->t0;
    t->t0 = 0;
}

#define TIMED_RETURN(timing, value) do { timing_end(timing); return (value); } while (0)

// notify_new_pid: a process counted again at least NEW_PID_ALIVE_NS after
// its first count, within NEW_PID_STALE_NS of it, wakes the collector (one
// ring-buffer event it polls), so that a new process that lives has its
// metadata and the unwind tables its stacks need read soon, not at the next
// regular drain (collector/drains.py). One that ends sooner (a shell loop's
// children live 1-5 ms) never wakes it: before, every new process's first
// count did, and the collector woke twice (the event, then a look 0.25 s
// later at whether it still lived) about once a second on a host that starts
// processes all the time, for processes long gone. seen_pids keeps each
// pid's first count's time, or SEEN_NOTIFIED; a first count older than
// NEW_PID_STALE_NS (a pid reused since, or a process counted once long ago)
// starts over. At most one event per NEW_PID_NOTIFY_NS: it is a hint to
// drain, not a record; a process that waits for that limit is notified by a
// later count past it.
// Compiled with -DNEW_PID_NOTIFY_NS, -DNEW_PID_ALIVE_NS, -DNEW_PID_STALE_NS and -DSEEN_PIDS from
// the collector (collector/main.py, collector/drains.py; these defaults, the same, are for a module
// compiled without them, as a test of one family does).
#ifndef NEW_PID_NOTIFY_NS
#define NEW_PID_NOTIFY_NS 100000000
#endif
#ifndef NEW_PID_ALIVE_NS
#define NEW_PID_ALIVE_NS 250000000
#endif
#ifndef NEW_PID_STALE_NS
#define NEW_PID_STALE_NS 10000000000
#endif
#ifndef SEEN_PIDS
#define SEEN_PIDS 65536
#endif
// Without ring buffers (-DHAVE_RINGBUF from collector/features.py: Linux 5.8) nothing is notified:
// new processes are read at the regular drains.
#define SEEN_NOTIFIED 0xffffffffffffffffULL
#ifdef HAVE_RINGBUF
BPF_RINGBUF_OUTPUT(new_pids, 1);
BPF_TABLE("lru_hash", u32, u64, seen_pids, SEEN_PIDS);   // pid -> its first count's time, or SEEN_NOTIFIED
BPF_ARRAY(new_pid_last, u64, 1);
#endif

static __always_inline void notify_new_pid(u32 pid) {
#ifdef HAVE_RINGBUF
    u64 now = bpf_ktime_get_ns();
    u64 *first = seen_pids.lookup(&pid);
    if (!first) {
        seen_pids.update(&pid, &now);
        return;
    }
    if (*first == SEEN_NOTIFIED)
        return;
    u64 since = now - *first;
    if (since < NEW_PID_ALIVE_NS)
        return;
    if (since > NEW_PID_STALE_NS) {
        *first = now;
        return;
    }
    u32 zero = 0;
    u64 *last = new_pid_last.lookup(&zero);
    if (!last || now - *last < NEW_PID_NOTIFY_NS)
        return;   // its next count, past the limit, notifies it
    *last = now;
    *first = SEEN_NOTIFIED;
    new_pids.ringbuf_output(&pid, sizeof(pid), 0);
#endif
}

// The double buffer: each family (oncpu, offcpu, lock, alloc) counts in two hash maps,
// <prefix>_counts_0 and _1, that are the inner maps of <prefix>_count_maps, an array of maps the
// collector fills once (collector/bpfmaps.py DoubleBuffer); <prefix>_active says which one the
// programs write. The collector flips <prefix>_active before it drains the other one. A family's
// count step looks the active inner map up (`<prefix>_count_maps.lookup(&buf)`: bcc rewrites map
// calls only where they are written in the family's source, not in a macro or here) and passes the
// map pointer it got, a value the verifier tracks through an inline function, to counts_add.
// (A map named in the source cannot be passed: its address is not the map to the verifier.)
// The extra array lookup costs a few ns a count (1-4 ns measured beside two named maps).
//
// counts_add: add `add` (`words` u64 words: a value of u64 fields, each summed) to the value under
// `key` in `counts`, or insert it; by lookup and atomic add, else insert (BPF_NOEXIST) and, if another
// CPU inserted the key first, look up and add again. 0, or -1 when the key could not be counted (the
// map is full): the caller counts its <PREFIX>_LOST_COUNTS_FULL slot.
static __always_inline int counts_add(void *counts, void *key, u64 *add, int words) {
    u64 *v = bpf_map_lookup_elem(counts, key);
    if (!v) {
        int err = bpf_map_update_elem(counts, key, add, BPF_NOEXIST);
        if (err == 0)
            return 0;
        if (err != -EEXIST)
            return -1;
        v = bpf_map_lookup_elem(counts, key);   // another CPU inserted it between the two calls
        if (!v)
            return -1;
    }
#pragma unroll
    for (int i = 0; i < words; i++)
        __sync_fetch_and_add(&v[i], add[i]);
    return 0;
}
