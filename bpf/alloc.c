// Allocation profiling: uprobes on libc's malloc, calloc, realloc and free,
// attached by the collector to each target process only (a per-process uprobe
// traps in that process's address space and no other).
//
// In bursts (collector/alloc.py): every uprobe traps into the kernel on every
// call whatever the sampling, so the collector attaches them for a short part
// of each period only. A burst has a sampling phase (alloc_state.sampling = 1)
// and a tail (0) in which nothing new is sampled but frees, and addresses
// malloc hands out again, still end live allocations sampled in the phase.
// alloc_state.burst numbers the bursts; a live allocation keeps the number of
// the burst that sampled it, and a free of one from an earlier burst is
// counted by stack in alloc_survivors_freed (the collector turns it into the
// frees it could not see, collector/alloc.py).
//
// Sampling by bytes, as Go's and tcmalloc's heap profilers do: each CPU
// counts down the bytes until its next sample point (exponentially
// distributed with mean ALLOC_SAMPLE_BYTES, drawn from alloc_exp, which the
// collector fills, as it fills each CPU's first countdown), and an allocation
// that crosses k points is sampled. It then stands for k * ALLOC_SAMPLE_BYTES
// bytes and k * ALLOC_SAMPLE_BYTES / size objects (kept in thousandths):
// unbiased estimates of what the sampling phase allocated; the collector
// scales them to the whole period. Most calls only subtract from the counter.
// An allocation of ALLOC_BIG_FACTOR means or more is always sampled, at its
// own size. ALLOC_SAMPLE_BYTES 0 records every one.
//
// The stack is taken at entry: the uprobe fires on the first instruction of
// malloc, before it sets up a frame, so the frame-pointer walk from the
// caller's rbp skips the caller itself; its return address, at [sp], is kept
// in the key (`caller`) and the collector puts it back as the second frame.
//
// A sampled allocation is counted when it returns (the address is known): in
// the double-buffered alloc_counts_<buf>, and in alloc_live until free() or
// realloc() of its address, or until malloc returns that address again (it
// was freed unseen; bounded; overflow counted). The thread's pending record
// keeps the stack pointer at entry: the return whose stack pointer is one
// word above it is that call's (realloc(NULL, n) calls malloc inside libc:
// that inner call runs deeper and is neither sampled nor counted), and a
// record the stack has already unwound past (a return never seen: the
// uretprobe attached or detached while the call ran) is replaced, never kept.
//
// Compiled with -DALLOC_SAMPLE_BYTES, -DALLOC_COUNTS_ENTRIES,
// -DALLOC_STACK_ENTRIES, -DALLOC_LIVE_ENTRIES from the collector.

#include <uapi/linux/ptrace.h>

struct alloc_key {
    u32 pid;
    u32 tid;
    s32 user_stack;
    u32 pad;
    u64 caller;           // return address at entry: the frame the stack walk skips
};

struct alloc_value {   // u64 fields only, each summed (counts_add in common.h)
    u64 objects_milli;    // estimated allocations, in thousandths
    u64 bytes;            // estimated bytes
};

struct alloc_live_key {
    u32 pid;
    u32 pad;
    u64 addr;
};

struct alloc_live_t {
    u32 tid;
    s32 user_stack;
    u64 caller;
    u64 objects_milli;
    u64 bytes;
    u64 burst;            // alloc_state.burst when it was sampled
};

struct alloc_pending_t {
    u64 sp;               // the stack pointer at entry: [sp] is the return address
    u32 sampled;
    s32 user_stack;
    u64 caller;
    u64 objects_milli;
    u64 bytes;
};

struct alloc_state_t {
    u64 sampling;         // 1 in a burst's sampling phase, 0 in its tail
    u64 burst;            // the burst's number, from 1
};

struct alloc_stack_key {
    u32 pid;
    s32 user_stack;
    u64 caller;
};

// Indexes of alloc_lost; the collector names them (collector/alloc.py).
#define ALLOC_LOST_COUNTS_FULL 0
#define ALLOC_LOST_USER_STACK 1
#define ALLOC_LOST_LIVE_FULL 2
#define ALLOC_LOST_PENDING_FULL 3
#define ALLOC_LOST_SLOTS 4

#define ALLOC_EXP_ENTRIES 256          // quantiles of Exp(1) in 16.16 fixed point
#define ALLOC_BIG_FACTOR 16            // sizes of 16 means are sampled with p > 1 - 1e-7: always
#define ALLOC_MAX_DRAWS 32             // sample points one allocation may cross before the rest is cut
#define ALLOC_PENDING_ENTRIES 16384    // threads inside a probed call at once
#define ALLOC_NEST_BYTES 4096          // realloc's inner malloc runs less than this below realloc's entry
#define ALLOC_SURVIVOR_STACKS 4096     // stacks whose survivors were seen freed, per drain

BPF_HASH(alloc_counts_0, struct alloc_key, struct alloc_value, ALLOC_COUNTS_ENTRIES);
BPF_HASH(alloc_counts_1, struct alloc_key, struct alloc_value, ALLOC_COUNTS_ENTRIES);
BPF_ARRAY_OF_MAPS(alloc_count_maps, "alloc_counts_0", 2);   // [buf]: alloc_counts_<buf> (common.h)
BPF_STACK_TRACE(alloc_stacks, ALLOC_STACK_ENTRIES);
BPF_HASH(alloc_live, struct alloc_live_key, struct alloc_live_t, ALLOC_LIVE_ENTRIES);
// LRU: a thread killed inside malloc never returns; its record ages out.
BPF_TABLE("lru_hash", u32, struct alloc_pending_t, alloc_pending, ALLOC_PENDING_ENTRIES);
BPF_ARRAY(alloc_active, u32, 1);
BPF_ARRAY(alloc_state, struct alloc_state_t, 1);
BPF_HASH(alloc_survivors_freed, struct alloc_stack_key, u64, ALLOC_SURVIVOR_STACKS);
BPF_ARRAY(alloc_exp, u32, ALLOC_EXP_ENTRIES);
BPF_PERCPU_ARRAY(alloc_left, s64, 1);
BPF_PERCPU_ARRAY(alloc_lost, u64, ALLOC_LOST_SLOTS);

static __always_inline void alloc_count_lost(int reason) {
    u64 *n = alloc_lost.lookup(&reason);
    if (n)
        (*n)++;
}

static __always_inline s64 alloc_draw(void) {
    u32 i = bpf_get_prandom_u32() & (ALLOC_EXP_ENTRIES - 1);
    u32 *q = alloc_exp.lookup(&i);
    s64 t = q ? (s64)(((u64)ALLOC_SAMPLE_BYTES * *q) >> 16) : ALLOC_SAMPLE_BYTES;
    return t > 0 ? t : 1;
}

// Is an allocation of `size` sampled, and what does it stand for?
static __always_inline int alloc_sample(u64 size, struct alloc_pending_t *p) {
#if ALLOC_SAMPLE_BYTES == 0
    p->objects_milli = 1000;
    p->bytes = size;
    return 1;
#else
    if (size == 0)
        return 0;
    if (size >= (u64)ALLOC_BIG_FACTOR * ALLOC_SAMPLE_BYTES) {
        p->objects_milli = 1000;
        p->bytes = size;
        return 1;
    }
    u32 zero = 0;
    s64 *left = alloc_left.lookup(&zero);
    if (!left)
        return 0;
    s64 l = *left - (s64)size;
    u64 k = 0;
    for (int i = 0; i < ALLOC_MAX_DRAWS; i++) {
        if (l > 0)
            break;
        k++;
        l += alloc_draw();
    }
    if (l <= 0)
        l = alloc_draw();
    *left = l;
    if (k == 0)
        return 0;
    p->bytes = k * ALLOC_SAMPLE_BYTES;
    p->objects_milli = p->bytes * 1000 / size;
    return 1;
#endif
}

static __always_inline struct alloc_state_t *alloc_now(void) {
    u32 zero = 0;
    return alloc_state.lookup(&zero);
}

static __always_inline void alloc_enter(struct pt_regs *ctx, u64 size, int always_pending) {
    u32 ktid = (u32)bpf_get_current_pid_tgid();
    u64 sp = PT_REGS_SP(ctx);
    struct alloc_pending_t *outer = alloc_pending.lookup(&ktid);
    // Inside a probed call of this thread (realloc's own malloc): below its entry, close to it.
    if (outer && sp < outer->sp && outer->sp - sp < ALLOC_NEST_BYTES)
        return;
    struct alloc_state_t *st = alloc_now();
    if (!st)
        return;
    struct alloc_pending_t p = {};
    p.sp = sp;
    if (st->sampling)
        p.sampled = alloc_sample(size, &p);
    if (!p.sampled && !always_pending) {
        if (outer)                 // a call that returned unseen: its record must not wait for it
            alloc_pending.delete(&ktid);
        return;
    }
    if (p.sampled) {
        int id = alloc_stacks.get_stackid(ctx, BPF_F_USER_STACK);
        if (id < 0 && id != -EFAULT)
            alloc_count_lost(ALLOC_LOST_USER_STACK);
        p.user_stack = id < 0 ? -1 : id;
        bpf_probe_read_user(&p.caller, sizeof(p.caller), (void *)sp);
    }
    if (alloc_pending.update(&ktid, &p) != 0)
        alloc_count_lost(ALLOC_LOST_PENDING_FULL);
}

static __always_inline void alloc_free(u64 addr) {
    if (addr == 0)
        return;
    u32 pid, tid;
    if (current_ids(&pid, &tid))
        return;
    struct alloc_live_key k = {};
    k.pid = pid;
    k.addr = addr;
    struct alloc_live_t *v = alloc_live.lookup(&k);
    if (!v)
        return;
    struct alloc_state_t *st = alloc_now();
    if (st && v->burst != st->burst) {    // it lived past its burst: seen freed by chance
        struct alloc_stack_key sk = {};
        sk.pid = pid;
        sk.user_stack = v->user_stack;
        sk.caller = v->caller;
        u64 one = 1;
        u64 *n = alloc_survivors_freed.lookup(&sk);
        if (n)
            __sync_fetch_and_add(n, 1);
        else
            alloc_survivors_freed.update(&sk, &one);
    }
    alloc_live.delete(&k);
}

static __always_inline void alloc_count(struct alloc_key *key, struct alloc_value *add) {
    u32 zero = 0;
    u32 *buf = alloc_active.lookup(&zero);
    if (!buf)
        return;
    u32 b = *buf;
    void *counts = alloc_count_maps.lookup(&b);
    if (!counts || counts_add(counts, key, (u64 *)add, sizeof(*add) / sizeof(u64)))
        alloc_count_lost(ALLOC_LOST_COUNTS_FULL);
}

static __always_inline void alloc_return(struct pt_regs *ctx) {
    u64 addr = PT_REGS_RC(ctx);
    u32 pid, tid;
    if (addr == 0 || current_ids(&pid, &tid))
        return;
    // Whatever was at this address was freed, seen or not: it is not live any more.
    struct alloc_live_key lk = {};
    lk.pid = pid;
    lk.addr = addr;
    alloc_live.delete(&lk);
    u32 ktid = (u32)bpf_get_current_pid_tgid();
    struct alloc_pending_t *p = alloc_pending.lookup(&ktid);
    if (!p)
        return;
    u64 sp = PT_REGS_SP(ctx);
    if (sp < p->sp + 8)          // an inner call's return (the outer one's is still to come)
        return;
    struct alloc_pending_t done = *p;
    alloc_pending.delete(&ktid);
    if (sp != done.sp + 8 || !done.sampled)    // past it: a record whose return went unseen
        return;
    struct alloc_state_t *st = alloc_now();
    struct alloc_key key = {};
    key.pid = pid;
    key.tid = tid;
    key.user_stack = done.user_stack;
    key.caller = done.caller;
    struct alloc_value add = {done.objects_milli, done.bytes};
    alloc_count(&key, &add);
    struct alloc_live_t live = {};
    live.tid = tid;
    live.user_stack = done.user_stack;
    live.caller = done.caller;
    live.objects_milli = done.objects_milli;
    live.bytes = done.bytes;
    live.burst = st ? st->burst : 0;
    if (alloc_live.update(&lk, &live) != 0)
        alloc_count_lost(ALLOC_LOST_LIVE_FULL);
}

int alloc_malloc_enter(struct pt_regs *ctx) {
    struct prog_time *timing = timing_begin(TIMED_alloc_malloc_enter);
    alloc_enter(ctx, PT_REGS_PARM1(ctx), 0);
    TIMED_RETURN(timing, 0);
}

int alloc_calloc_enter(struct pt_regs *ctx) {
    struct prog_time *timing = timing_begin(TIMED_alloc_calloc_enter);
    alloc_enter(ctx, PT_REGS_PARM1(ctx) * PT_REGS_PARM2(ctx), 0);
    TIMED_RETURN(timing, 0);
}

// realloc(old, n): old is gone (moved or resized; a failed realloc keeps it,
// which this does not see), n is a new allocation. Always pending: the malloc
// that realloc(NULL, n) makes inside libc must see it.
int alloc_realloc_enter(struct pt_regs *ctx) {
    struct prog_time *timing = timing_begin(TIMED_alloc_realloc_enter);
    alloc_free(PT_REGS_PARM1(ctx));
    alloc_enter(ctx, PT_REGS_PARM2(ctx), 1);
    TIMED_RETURN(timing, 0);
}

int alloc_return_probe(struct pt_regs *ctx) {
    struct prog_time *timing = timing_begin(TIMED_alloc_return_probe);
    alloc_return(ctx);
    TIMED_RETURN(timing, 0);
}

int alloc_free_enter(struct pt_regs *ctx) {
    struct prog_time *timing = timing_begin(TIMED_alloc_free_enter);
    alloc_free(PT_REGS_PARM1(ctx));
    TIMED_RETURN(timing, 0);
}
