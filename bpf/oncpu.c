// On-CPU sampling: a software cpu-clock perf event fires on every CPU at
// sample_hz; each sample of a user task is counted in kernel under
// (pid, tid, user stack id, kernel stack id).
//
// Maps are double-buffered: user space flips `oncpu_active` before it drains, so it
// reads and clears the buffer the program no longer writes. Nothing is lost
// silently: a full counts map, or a stack the stack map cannot hold, is
// counted in `oncpu_lost` by reason.
//
// With dwarf_unwind (-DDWARF_UNWIND, after unwind.h), a sample of a process
// the collector loaded unwind tables for is walked with them instead: its
// user stack goes to oncpu_dwarf_stacks_<buf> under a hash, and the key's
// user_hash names it (user_stack is then -1).
//
// With -DONCPU_REGS (collector/regs.py: runtime_stacks names a runtime whose
// on-CPU frames are named from the thread's registers: the JVM), a sample of
// a process in oncpu_regs_pids also goes to the oncpu_regs ring buffer as
// the thread's user registers and the top of its stack (struct
// oncpu_regs_record; its layout is RECORD in collector/regs.py), for the
// runtime reader to walk its JIT frames with.
//
// With -DPY_WALK (after python.h), a sample of a CPython process the collector named in py_procs has
// its Python frames walked too (bpf/python.h), and the key's py_hash names them in py_stacks_oncpu_<buf>.
//
// Compiled by bcc (with offcpu.c when off-CPU profiling is on), with
// -DCOUNTS_ENTRIES and -DSTACK_ENTRIES from the collector.

// The perf event program's context, as include/uapi/linux/bpf_perf_event.h declares it on x86-64
// (bpf_user_pt_regs_t is struct pt_regs there). Declared here, not included: that header pulls in most
// of the kernel's headers, which was half of bcc's compile (1.7 -> 0.9 s of CPU here, minutes under
// emulation); tests/unit/test_bpf_shared_constants.py checks it against the header tree.
struct bpf_perf_event_data {
    struct pt_regs regs;
    __u64 sample_period;
    __u64 addr;
};

struct oncpu_key {
    u32 pid;
    u32 tid;
    s32 user_stack;    // stack id, or -1 (kernel thread, or not recorded)
    s32 kernel_stack;  // stack id, or -1 (sample taken in user mode, or not recorded)
    u64 user_hash;     // DWARF-unwound user stack in oncpu_dwarf_stacks_<buf>, or 0
    u64 py_hash;       // Python stack in py_stacks_<buf> (bpf/python.h), or 0
};

// Indexes of `oncpu_lost`; the collector names them (LOST_REASONS in collector/oncpu.py).
#define ONCPU_LOST_COUNTS_FULL 0
#define ONCPU_LOST_USER_STACK 1
#define ONCPU_LOST_KERNEL_STACK 2
#define ONCPU_LOST_REGS 3
#define ONCPU_LOST_SLOTS 4

BPF_HASH(oncpu_counts_0, struct oncpu_key, u64, COUNTS_ENTRIES);
BPF_HASH(oncpu_counts_1, struct oncpu_key, u64, COUNTS_ENTRIES);
BPF_ARRAY_OF_MAPS(oncpu_count_maps, "oncpu_counts_0", 2);   // [buf]: oncpu_counts_<buf> (common.h)
BPF_STACK_TRACE(oncpu_stacks_0, STACK_ENTRIES);
BPF_STACK_TRACE(oncpu_stacks_1, STACK_ENTRIES);
BPF_ARRAY(oncpu_active, u32, 1);
BPF_PERCPU_ARRAY(oncpu_lost, u64, ONCPU_LOST_SLOTS);

#ifdef DWARF_UNWIND
BPF_HASH(oncpu_dwarf_stacks_0, u64, struct unwind_stack, DWARF_STACK_ENTRIES);
BPF_HASH(oncpu_dwarf_stacks_1, u64, struct unwind_stack, DWARF_STACK_ENTRIES);
BPF_PROG_ARRAY(oncpu_unwind_progs, 1);
#endif

static __always_inline void oncpu_count_lost(int reason) {
    u64 *n = oncpu_lost.lookup(&reason);
    if (n)
        (*n)++;
}

#ifdef ONCPU_REGS
// -DONCPU_REGS_PIDS, -DONCPU_REGS_RING_PAGES, -DONCPU_REGS_STACK_BYTES, -DONCPU_REGS_SHORT_STACK_BYTES
// and -DONCPU_REGS_WAKE_EVERY come from collector/regs.py.
struct oncpu_regs_record {
    u32 pid;
    u32 tid;
    u64 time_ns;      // bpf_ktime_get_ns of the sample
    u64 ip;           // user registers: where the thread runs,
    u64 sp;           // its stack pointer,
    u64 fp;           // its frame pointer (rbp)
    u32 stack_len;    // bytes of `stack` copied from sp up: ONCPU_REGS_STACK_BYTES, SHORT_STACK_BYTES or 0
    u32 pad;
    u8 stack[ONCPU_REGS_STACK_BYTES];
};
BPF_HASH(oncpu_regs_pids, u32, u8, ONCPU_REGS_PIDS);      // processes whose samples carry registers
BPF_RINGBUF_OUTPUT(oncpu_regs, ONCPU_REGS_RING_PAGES);
BPF_ARRAY(oncpu_regs_sent, u64, 1);                       // records submitted: every WAKE_EVERY-th wakes the collector

// The user registers of the sampled thread (the sample's, or those saved at kernel entry) and the top of its
// stack, for a process the collector marked. A ring that is full loses the record, counted.
static __always_inline void oncpu_send_regs(struct bpf_perf_event_data *ctx, u32 pid, u32 tid) {
    if (!oncpu_regs_pids.lookup(&pid))
        return;
    struct pt_regs *regs = (struct pt_regs *)&ctx->regs;
    u64 ip, sp, fp;
    if (regs_user_mode(regs)) {
        ip = regs->ip;
        sp = regs->sp;
        fp = regs->bp;
    } else {
#ifdef HAVE_TASK_PT_REGS
        struct pt_regs *user = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
        struct pt_regs r = {};
        if (!user || bpf_probe_read_kernel(&r, sizeof(r), user) || !regs_user_mode(&r))
            return;
        ip = r.ip;
        sp = r.sp;
        fp = r.bp;
#else
        return;
#endif
    }
    struct oncpu_regs_record *rec = oncpu_regs.ringbuf_reserve(sizeof(struct oncpu_regs_record));
    if (!rec) {
        oncpu_count_lost(ONCPU_LOST_REGS);
        return;
    }
    rec->pid = pid;
    rec->tid = tid;
    rec->time_ns = bpf_ktime_get_ns();
    rec->ip = ip;
    rec->sp = sp;
    rec->fp = fp;
    rec->pad = 0;
    // Near the top of the stack the whole copy would cross its end: a shorter one, else none.
    if (bpf_probe_read_user(rec->stack, ONCPU_REGS_STACK_BYTES, (void *)sp) == 0)
        rec->stack_len = ONCPU_REGS_STACK_BYTES;
    else if (bpf_probe_read_user(rec->stack, ONCPU_REGS_SHORT_STACK_BYTES, (void *)sp) == 0)
        rec->stack_len = ONCPU_REGS_SHORT_STACK_BYTES;
    else
        rec->stack_len = 0;
    u32 zero = 0;
    u64 *sent = oncpu_regs_sent.lookup(&zero);
    u64 n = sent ? __sync_fetch_and_add(sent, 1) : 0;
    // Woken only every WAKE_EVERY-th record (the collector also takes them at every drain): one
    // wake-up a sample would cost the collector more than the sample.
    oncpu_regs.ringbuf_submit(rec, n % ONCPU_REGS_WAKE_EVERY == 0 ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}
#endif

// -EFAULT means there is no such stack (a kernel thread has no user stack, a
// sample in user mode no kernel stack); any other error is a stack we lost.
static __always_inline s32 oncpu_stack_or_lost(int id, int reason) {
    if (id >= 0)
        return id;
    if (id != -EFAULT)
        oncpu_count_lost(reason);
    return -1;
}

static __always_inline void oncpu_count(struct oncpu_key *key, u32 buf) {
    u64 one = 1;
    notify_new_pid(key->pid);
    void *counts = oncpu_count_maps.lookup(&buf);
    if (!counts || counts_add(counts, key, &one, 1))
        oncpu_count_lost(ONCPU_LOST_COUNTS_FULL);
}

#ifdef DWARF_UNWIND
// The walk is over: store the stack in the buffer the sample was taken in, count it.
static __always_inline void oncpu_count_dwarf(struct unwind_state *st) {
    u64 hash = unwind_finish(st);
    int err = st->buf == 0 ? oncpu_dwarf_stacks_0.insert(&hash, &st->stack)
                           : oncpu_dwarf_stacks_1.insert(&hash, &st->stack);
    if (err != 0 && err != -EEXIST) {
        unwind_count(UNWIND_LOST_STACK_FULL);
        oncpu_count_lost(ONCPU_LOST_USER_STACK);
        hash = 0;
    }
    struct oncpu_key key = {};
    key.pid = st->pid;
    key.tid = st->tid;
    key.user_stack = -1;
    key.kernel_stack = st->kernel_stack;
    key.user_hash = hash;
    key.py_hash = st->py_hash;
    oncpu_count(&key, st->buf);
}

int oncpu_unwind_step(struct bpf_perf_event_data *ctx) {
    struct prog_time *timing = timing_begin(TIMED_oncpu_unwind_step);
    u32 slot = 0;
    struct unwind_state *st = unwind_scratch.lookup(&slot);
    if (!st)
        TIMED_RETURN(timing, 0);
    unwind_frames(st);
    if (!st->done) {
        timing_end(timing);
        oncpu_unwind_progs.call(ctx, 0);
        unwind_count(UNWIND_LOST_TAIL_CALL);   // reached only when the tail call failed
    }
    oncpu_count_dwarf(st);
    TIMED_RETURN(timing, 0);
}
#endif

int on_cpu_sample(struct bpf_perf_event_data *ctx) {
    struct prog_time *timing = timing_begin(TIMED_on_cpu_sample);
    u32 pid, tid;
    if (current_ids(&pid, &tid) || pid == 0)  // outside our pid namespace; or the idle task: not work
        TIMED_RETURN(timing, 0);

    u32 zero = 0;
    u32 *buf = oncpu_active.lookup(&zero);
    if (!buf)
        TIMED_RETURN(timing, 0);

#ifdef ONCPU_REGS
    oncpu_send_regs(ctx, pid, tid);
#endif

    struct oncpu_key key = {};
    key.pid = pid;
    key.tid = tid;
    u32 b = *buf;
    if (b == 0)
        key.kernel_stack = oncpu_stack_or_lost(oncpu_stacks_0.get_stackid(&ctx->regs, 0), ONCPU_LOST_KERNEL_STACK);
    else
        key.kernel_stack = oncpu_stack_or_lost(oncpu_stacks_1.get_stackid(&ctx->regs, 0), ONCPU_LOST_KERNEL_STACK);
#ifdef PY_WALK
    key.py_hash = py_walk(pid, tid, b, PY_ONCPU);
#endif

#ifdef DWARF_UNWIND
    if (unwind_procs.lookup(&pid)) {   // the collector loaded unwind tables for this process
        u32 slot = 0;
        struct unwind_state *st = unwind_scratch.lookup(&slot);
        if (st && unwind_begin(st, (struct pt_regs *)&ctx->regs)) {
            st->pid = pid;
            st->tid = tid;
            st->buf = b;
            st->kernel_stack = key.kernel_stack;
            st->py_hash = key.py_hash;
            timing_end(timing);
            oncpu_unwind_progs.call(ctx, 0);
            unwind_count(UNWIND_LOST_TAIL_CALL);   // not entered: frame pointers below
        }
    }
#endif

    if (b == 0)
        key.user_stack = oncpu_stack_or_lost(oncpu_stacks_0.get_stackid(&ctx->regs, BPF_F_USER_STACK), ONCPU_LOST_USER_STACK);
    else
        key.user_stack = oncpu_stack_or_lost(oncpu_stacks_1.get_stackid(&ctx->regs, BPF_F_USER_STACK), ONCPU_LOST_USER_STACK);
    oncpu_count(&key, b);
    TIMED_RETURN(timing, 0);
}
