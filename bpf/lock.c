// Lock contention: the time threads of target processes spend blocked in
// futex waits, by user stack. An uncontended pthread mutex never enters the
// kernel, so it costs nothing here; a contended one waits in futex(2).
//
// syscalls:sys_enter_futex keeps, per thread of a process in lock_pids (the
// collector writes it), when a wait began and its stack; sys_exit_futex
// charges the wait (one contention, its nanoseconds) to that stack. Shapes
// (key, value, start record, lost slots) are offcpu.c's, so the collector
// drains both the same way (collector/intervals.py).
//
// A futex wait is entered from inside libc (pthread_mutex_lock ->
// __lll_lock_wait), which has no frame pointers: with dwarf_unwind
// (-DLOCK_DWARF, after unwind.h) a process with unwind tables has its stack
// walked with them from the registers it entered the kernel with, so the
// function that took the lock keeps its frame.
//
// Compiled with -DCOUNTS_ENTRIES, -DSTACK_ENTRIES, -DSTART_ENTRIES and
// -DLOCK_PIDS from the collector.

#define FUTEX_CMD_MASK 0x7f      // without FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME
#define FUTEX_WAIT 0
#define FUTEX_LOCK_PI 6
#define FUTEX_WAIT_BITSET 9
#define FUTEX_WAIT_REQUEUE_PI 11
#define FUTEX_LOCK_PI2 13

struct lock_key {
    u32 pid;
    u32 tid;
    s32 user_stack;
    s32 kernel_stack;  // always -1: every wait is the same futex_wait in the kernel
    u64 user_hash;     // DWARF-unwound user stack in lock_dwarf_stacks, or 0
};

struct lock_value {   // u64 fields only, each summed (counts_add in common.h)
    u64 count;   // contentions: waits
    u64 ns;      // nanoseconds waited
};

struct lock_start_t {
    u64 ts;
    u64 wake_ts;   // unused (offcpu.c's shape)
    u32 pid;
    u32 tid;
    s32 user_stack;
    s32 kernel_stack;
    u64 user_hash;
};

// Indexes of lock_lost; the collector names them (collector/lock.py).
#define LOCK_LOST_COUNTS_FULL 0
#define LOCK_LOST_USER_STACK 1
#define LOCK_LOST_KERNEL_STACK 2
#define LOCK_LOST_START_FULL 3
#define LOCK_LOST_SLOTS 4

BPF_HASH(lock_pids, u32, u8, LOCK_PIDS);
BPF_HASH(lock_counts_0, struct lock_key, struct lock_value, COUNTS_ENTRIES);
BPF_HASH(lock_counts_1, struct lock_key, struct lock_value, COUNTS_ENTRIES);
BPF_ARRAY_OF_MAPS(lock_count_maps, "lock_counts_0", 2);   // [buf]: lock_counts_<buf> (common.h)
BPF_STACK_TRACE(lock_stacks, STACK_ENTRIES);
BPF_TABLE("lru_hash", u32, struct lock_start_t, lock_start, START_ENTRIES);
BPF_ARRAY(lock_active, u32, 1);
BPF_PERCPU_ARRAY(lock_lost, u64, LOCK_LOST_SLOTS);

static __always_inline void lock_count_lost(int reason) {
    u64 *n = lock_lost.lookup(&reason);
    if (n)
        (*n)++;
}

#ifdef LOCK_DWARF
BPF_HASH(lock_dwarf_stacks, u64, struct unwind_stack, DWARF_STACK_ENTRIES);
BPF_PROG_ARRAY(lock_unwind_progs, 1);

int lock_unwind_step(void *ctx) {
    struct prog_time *timing = timing_begin(TIMED_lock_unwind_step);
    u32 slot = 2;
    struct unwind_state *st = unwind_scratch.lookup(&slot);
    if (!st)
        TIMED_RETURN(timing, 0);
    unwind_frames(st);
    if (!st->done) {
        timing_end(timing);
        lock_unwind_progs.call(ctx, 0);
        unwind_count(UNWIND_LOST_TAIL_CALL);
    }
    u64 hash = unwind_finish(st);
    int err = lock_dwarf_stacks.insert(&hash, &st->stack);
    if (err != 0 && err != -EEXIST) {
        unwind_count(UNWIND_LOST_STACK_FULL);
        lock_count_lost(LOCK_LOST_USER_STACK);
        TIMED_RETURN(timing, 0);
    }
    u32 key = st->tid;
    struct lock_start_t *s = lock_start.lookup(&key);
    if (s && s->ts == st->ts)
        s->user_hash = hash;
    TIMED_RETURN(timing, 0);
}
#endif

static __always_inline void lock_charge(struct lock_key *key, u64 ns) {
    u32 zero = 0;
    u32 *buf = lock_active.lookup(&zero);
    if (!buf)
        return;
    u32 b = *buf;
    struct lock_value add = {1, ns};
    void *counts = lock_count_maps.lookup(&b);
    if (!counts || counts_add(counts, key, (u64 *)&add, sizeof(add) / sizeof(u64)))
        lock_count_lost(LOCK_LOST_COUNTS_FULL);
}

TRACEPOINT_PROBE(syscalls, sys_enter_futex) {
    struct prog_time *timing = timing_begin(TIMED_sys_enter_futex);
    struct lock_start_t s = {};
    if (current_ids(&s.pid, &s.tid) || !lock_pids.lookup(&s.pid))
        TIMED_RETURN(timing, 0);
    int cmd = args->op & FUTEX_CMD_MASK;
    if (cmd != FUTEX_WAIT && cmd != FUTEX_WAIT_BITSET && cmd != FUTEX_LOCK_PI && cmd != FUTEX_LOCK_PI2 &&
        cmd != FUTEX_WAIT_REQUEUE_PI)
        TIMED_RETURN(timing, 0);
    u32 ktid = (u32)bpf_get_current_pid_tgid();
    s.ts = bpf_ktime_get_ns();
    s.kernel_stack = -1;
#ifdef LOCK_DWARF
    if (unwind_procs.lookup(&s.pid)) {   // the collector loaded unwind tables for this process
        u32 slot = 2;
        struct unwind_state *st = unwind_scratch.lookup(&slot);
        if (st && unwind_begin(st, 0)) {
            st->pid = s.pid;
            st->tid = ktid;
            st->ts = s.ts;
            s.user_stack = -1;
            if (lock_start.update(&ktid, &s) != 0) {
                lock_count_lost(LOCK_LOST_START_FULL);
                TIMED_RETURN(timing, 0);
            }
            timing_end(timing);
            lock_unwind_progs.call(args, 0);
            unwind_count(UNWIND_LOST_TAIL_CALL);   // not entered: frame pointers below
        }
    }
#endif
    int id = lock_stacks.get_stackid(args, BPF_F_USER_STACK);
    if (id < 0 && id != -EFAULT)
        lock_count_lost(LOCK_LOST_USER_STACK);
    s.user_stack = id < 0 ? -1 : id;
    if (lock_start.update(&ktid, &s) != 0)
        lock_count_lost(LOCK_LOST_START_FULL);
    TIMED_RETURN(timing, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex) {
    struct prog_time *timing = timing_begin(TIMED_sys_exit_futex);
    u32 ktid = (u32)bpf_get_current_pid_tgid();
    struct lock_start_t *s = lock_start.lookup(&ktid);
    if (!s)
        TIMED_RETURN(timing, 0);
    u64 now = bpf_ktime_get_ns();
    struct lock_key key = {};
    key.pid = s->pid;
    key.tid = s->tid;
    key.user_stack = s->user_stack;
    key.kernel_stack = -1;
    key.user_hash = s->user_hash;
    u64 delta = now > s->ts ? now - s->ts : 0;
    lock_start.delete(&ktid);
    lock_charge(&key, delta);
    TIMED_RETURN(timing, 0);
}
