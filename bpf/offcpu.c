// Off-CPU time: where threads block, by stack, with blocked time only.
//
// sched:sched_switch runs in the context of the task switching out (prev).
// When prev blocks (state S or D; a preempted task is runnable, state R+, and
// is not off-CPU) its stacks and the time are kept per thread in
// offcpu_start. sched:sched_wakeup marks when it became runnable again: the
// wait for a CPU after that is runnable time, not blocked time. When the
// thread is switched back in (it is next), the blocked interval (switch-out
// to wakeup) is charged to those stacks, unless it is shorter than
// OFFCPU_MIN_NS: short intervals are dropped here, in the kernel.
//
// Counts are double-buffered like the on-CPU counts. The stack map is not:
// a thread may block in one drain interval and wake in a later one, so its
// stack id must outlive a drain. The collector deletes stack ids that no
// pending interval refers to and no drain has used for a while.
//
// With offcpu_dwarf (-DOFFCPU_DWARF, after unwind.h), the user stack of a
// thread that blocks in a process with unwind tables is walked with them from
// the registers it entered the kernel with (bpf_task_pt_regs): the walk ends
// in offcpu_dwarf_finish, which stores the stack in offcpu_dwarf_stacks (kept
// like offcpu_stacks) and names it in the thread's start record. The switch-in
// half of sched_switch runs first, because the walk ends the program.
//
// Compiled by bcc together with oncpu.c, with -DCOUNTS_ENTRIES, -DSTACK_ENTRIES,
// -DSTART_ENTRIES and -DOFFCPU_MIN_NS from the collector.

#define OFFCPU_STATE_S 0x1   // TASK_INTERRUPTIBLE
#define OFFCPU_STATE_D 0x2   // TASK_UNINTERRUPTIBLE

struct offcpu_key {
    u32 pid;
    u32 tid;
    s32 user_stack;
    s32 kernel_stack;
    u64 user_hash;     // DWARF-unwound user stack in offcpu_dwarf_stacks, or 0
};

struct offcpu_value {
    u64 count;   // blocking intervals
    u64 ns;      // blocked nanoseconds
};

struct offcpu_start_t {
    u64 ts;        // switched out
    u64 wake_ts;   // woken (0 until then)
    u32 pid;       // as the collector's /proc names them (common.h)
    u32 tid;
    s32 user_stack;
    s32 kernel_stack;
    u64 user_hash;
};

// Indexes of offcpu_lost; the collector names them (collector/offcpu.py).
#define OFFCPU_LOST_COUNTS_FULL 0
#define OFFCPU_LOST_USER_STACK 1
#define OFFCPU_LOST_KERNEL_STACK 2
#define OFFCPU_LOST_START_FULL 3
#define OFFCPU_LOST_SLOTS 4

BPF_HASH(offcpu_counts_0, struct offcpu_key, struct offcpu_value, COUNTS_ENTRIES);
BPF_HASH(offcpu_counts_1, struct offcpu_key, struct offcpu_value, COUNTS_ENTRIES);
BPF_STACK_TRACE(offcpu_stacks, STACK_ENTRIES);
// LRU: a thread that exits while blocked never switches in; its entry ages out.
BPF_TABLE("lru_hash", u32, struct offcpu_start_t, offcpu_start, START_ENTRIES);
BPF_ARRAY(offcpu_active, u32, 1);
BPF_PERCPU_ARRAY(offcpu_lost, u64, OFFCPU_LOST_SLOTS);

static __always_inline void offcpu_count_lost(int reason) {
    u64 *n = offcpu_lost.lookup(&reason);
    if (n)
        (*n)++;
}

#ifdef OFFCPU_DWARF
BPF_HASH(offcpu_dwarf_stacks, u64, struct unwind_stack, DWARF_STACK_ENTRIES);
BPF_PROG_ARRAY(offcpu_unwind_progs, 1);

// The walk is over: store the stack and name it in the start record of the
// interval it began in (st->tid is the thread's offcpu_start key).
static __always_inline void offcpu_dwarf_finish(struct unwind_state *st) {
    u64 hash = unwind_finish(st);
    int err = offcpu_dwarf_stacks.insert(&hash, &st->stack);
    if (err != 0 && err != -EEXIST) {
        unwind_count(UNWIND_LOST_STACK_FULL);
        offcpu_count_lost(OFFCPU_LOST_USER_STACK);
        return;
    }
    u32 key = st->tid;
    struct offcpu_start_t *s = offcpu_start.lookup(&key);
    if (s && s->ts == st->ts)
        s->user_hash = hash;
}

int offcpu_unwind_step(void *ctx) {
    u32 slot = 1;
    struct unwind_state *st = unwind_scratch.lookup(&slot);
    if (!st)
        return 0;
    unwind_frames(st);
    if (!st->done) {
        offcpu_unwind_progs.call(ctx, 0);
        unwind_count(UNWIND_LOST_TAIL_CALL);
    }
    offcpu_dwarf_finish(st);
    return 0;
}
#endif

static __always_inline s32 offcpu_stack_or_lost(int id, int reason) {
    if (id >= 0)
        return id;
    if (id != -EFAULT)
        offcpu_count_lost(reason);
    return -1;
}

static __always_inline void offcpu_charge(struct offcpu_key *key, u64 ns) {
    u32 zero = 0;
    u32 *buf = offcpu_active.lookup(&zero);
    if (!buf)
        return;
    struct offcpu_value one = {1, ns}, *v;
    if (*buf == 0) {
        v = offcpu_counts_0.lookup(key);
        if (v) {
            __sync_fetch_and_add(&v->count, 1);
            __sync_fetch_and_add(&v->ns, ns);
        } else if (offcpu_counts_0.update(key, &one) != 0) {
            offcpu_count_lost(OFFCPU_LOST_COUNTS_FULL);
        }
    } else {
        v = offcpu_counts_1.lookup(key);
        if (v) {
            __sync_fetch_and_add(&v->count, 1);
            __sync_fetch_and_add(&v->ns, ns);
        } else if (offcpu_counts_1.update(key, &one) != 0) {
            offcpu_count_lost(OFFCPU_LOST_COUNTS_FULL);
        }
    }
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();

    // Switch-in first: the switch-out half may end in a tail call.
    u32 next = args->next_pid;
    struct offcpu_start_t *started = next != 0 ? offcpu_start.lookup(&next) : 0;
    if (started) {
        u64 end = started->wake_ts ? started->wake_ts : now;
        u64 delta = end > started->ts ? end - started->ts : 0;
        struct offcpu_key key = {};
        key.pid = started->pid;
        key.tid = started->tid;
        key.user_stack = started->user_stack;
        key.kernel_stack = started->kernel_stack;
        key.user_hash = started->user_hash;
        offcpu_start.delete(&next);
        if (delta >= OFFCPU_MIN_NS)
            offcpu_charge(&key, delta);
    }

    u32 prev = args->prev_pid;
    long state = args->prev_state;
    struct offcpu_start_t s = {};
    if (prev == 0 || (state != OFFCPU_STATE_S && state != OFFCPU_STATE_D) ||
        current_ids(&s.pid, &s.tid) != 0)   // current is prev
        return 0;
    s.ts = now;
    s.kernel_stack = offcpu_stack_or_lost(offcpu_stacks.get_stackid(args, 0), OFFCPU_LOST_KERNEL_STACK);
#ifdef OFFCPU_DWARF
    if (unwind_procs.lookup(&s.pid)) {   // the collector loaded unwind tables for this process
        u32 slot = 1;
        struct unwind_state *st = unwind_scratch.lookup(&slot);
        if (st && unwind_begin(st, 0)) {
            st->pid = s.pid;
            st->tid = prev;
            st->ts = now;
            s.user_stack = -1;
            if (offcpu_start.update(&prev, &s) != 0) {
                offcpu_count_lost(OFFCPU_LOST_START_FULL);
                return 0;
            }
            offcpu_unwind_progs.call(args, 0);
            unwind_count(UNWIND_LOST_TAIL_CALL);   // not entered: frame pointers below
        }
    }
#endif
    s.user_stack = offcpu_stack_or_lost(offcpu_stacks.get_stackid(args, BPF_F_USER_STACK),
                                        OFFCPU_LOST_USER_STACK);
    if (offcpu_start.update(&prev, &s) != 0)
        offcpu_count_lost(OFFCPU_LOST_START_FULL);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup) {
    u32 tid = args->pid;
    struct offcpu_start_t *s = offcpu_start.lookup(&tid);
    if (s && s->wake_ts == 0)
        s->wake_ts = bpf_ktime_get_ns();
    return 0;
}
