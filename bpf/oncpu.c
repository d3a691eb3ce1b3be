// On-CPU sampling: a software cpu-clock perf event fires on every CPU at
// sample_hz; each sample of a user task is counted in kernel under
// (pid, tid, user stack id, kernel stack id).
//
// Maps are double-buffered: user space flips `active` before it drains, so it
// reads and clears the buffer the program no longer writes. Nothing is lost
// silently: a full counts map, or a stack the stack map cannot hold, is
// counted in `lost` by reason.
//
// Compiled by bcc with -DCOUNTS_ENTRIES=… -DSTACK_ENTRIES=… from the collector.

#include <uapi/linux/bpf_perf_event.h>

struct sample_key {
    u32 pid;
    u32 tid;
    s32 user_stack;    // stack id, or -1 (kernel thread, or not recorded)
    s32 kernel_stack;  // stack id, or -1 (sample taken in user mode, or not recorded)
};

// Indexes of `lost`; the collector names them (LOST_REASONS in collector/bpf.py).
#define LOST_COUNTS_FULL 0
#define LOST_USER_STACK 1
#define LOST_KERNEL_STACK 2
#define LOST_SLOTS 3

BPF_HASH(counts_0, struct sample_key, u64, COUNTS_ENTRIES);
BPF_HASH(counts_1, struct sample_key, u64, COUNTS_ENTRIES);
BPF_STACK_TRACE(stacks_0, STACK_ENTRIES);
BPF_STACK_TRACE(stacks_1, STACK_ENTRIES);
BPF_ARRAY(active, u32, 1);
BPF_PERCPU_ARRAY(lost, u64, LOST_SLOTS);

static __always_inline void count_lost(int reason) {
    u64 *n = lost.lookup(&reason);
    if (n)
        (*n)++;
}

// -EFAULT means there is no such stack (a kernel thread has no user stack, a
// sample in user mode no kernel stack); any other error is a stack we lost.
static __always_inline s32 stack_or_lost(int id, int reason) {
    if (id >= 0)
        return id;
    if (id != -EFAULT)
        count_lost(reason);
    return -1;
}

int on_cpu_sample(struct bpf_perf_event_data *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32;
    if (pid == 0)  // the idle task: not work
        return 0;

    u32 zero = 0;
    u32 *buf = active.lookup(&zero);
    if (!buf)
        return 0;

    struct sample_key key = {};
    key.pid = pid;
    key.tid = (u32)id;
    u64 one = 1, *n;
    if (*buf == 0) {
        key.user_stack = stack_or_lost(stacks_0.get_stackid(&ctx->regs, BPF_F_USER_STACK), LOST_USER_STACK);
        key.kernel_stack = stack_or_lost(stacks_0.get_stackid(&ctx->regs, 0), LOST_KERNEL_STACK);
        n = counts_0.lookup(&key);
        if (n)
            __sync_fetch_and_add(n, 1);
        else if (counts_0.update(&key, &one) != 0)
            count_lost(LOST_COUNTS_FULL);
    } else {
        key.user_stack = stack_or_lost(stacks_1.get_stackid(&ctx->regs, BPF_F_USER_STACK), LOST_USER_STACK);
        key.kernel_stack = stack_or_lost(stacks_1.get_stackid(&ctx->regs, 0), LOST_KERNEL_STACK);
        n = counts_1.lookup(&key);
        if (n)
            __sync_fetch_and_add(n, 1);
        else if (counts_1.update(&key, &one) != 0)
            count_lost(LOST_COUNTS_FULL);
    }
    return 0;
}
