// Off-CPU time: where threads block, by stack, with blocked time only.
//
// Two tp_btf programs (BTF-typed raw tracepoints, loaded by
// collector/btfprog.py) keep a record per thread in task local storage:
//
//   offcpu_switch   sched_switch, in the context of the task switching out
//                   (prev). Switch-in half first: if next was blocked, its
//                   blocked interval ends at its wakeup: now, less the time it
//                   then waited for a CPU (offcpu_waited). An
//                   interval shorter than OFFCPU_MIN_NS costs nothing more:
//                   no kernel stack is read for it. A longer one takes
//                   next's kernel stack as it was saved when it blocked
//                   (bpf_get_task_stack, unless it, or another task, blocked
//                   in the same place before) and waits, pending, for the
//                   thread to return to user space. Switch-out half: prev blocks (state S or D;
//                   a preempted task is runnable and does not count): only
//                   the time (and its run-queue wait so far) is kept.
//   offcpu_resume   rseq_update, in the context of a thread about to return
//                   to user space after it was switched in (glibc registers
//                   rseq for every thread): its user registers and stack are
//                   still those it blocked with. A pending interval is
//                   charged here to that user stack (frame pointers, or the
//                   DWARF tables with offcpu_dwarf) and the kernel stack
//                   taken at switch-in.
//
// Threads that do not pass rseq_update (no rseq: static or musl binaries, Go,
// a thread before glibc registers it; task_struct.rseq, -DOFFCPU_TASK_RSEQ_OFFSET
// from the kernel's BTF, tells, else the first rseq_update seen) have their user stack taken
// when they block (frame pointers; the only moment it can be read) and are
// charged at switch-in with the kernel stack read then, like the others.
// Kernel threads (no user registers) are charged at switch-in, kernel stack
// only. The kernel's own unwinder is what costs (20-60 us a stack on these
// machines): it runs for long blocks only, once per place a thread blocks.
//
// Stacks go to offcpu_stacks_<buf> under a 64-bit hash of their frames (user
// and kernel stacks share the map); counts under (pid, tid, user hash,
// kernel hash) in offcpu_counts_<buf>. Both are double-buffered, like the
// on-CPU maps: a stack is stored in the buffer of the count that names it.
//
// offcpu_gen counts attachments: a record written before the last detach
// (its switch-in unseen) is stale and not charged.
//
// Long blocks shorter than OFFCPU_SAMPLE_NS are sampled (offcpu_first_pick, offcpu_second_pick): the
// chosen ones are charged with weights that keep every stack's expected time
// and count; the others cost what a short block does.
//
// Compiled by bcc together with oncpu.c, with -DCOUNTS_ENTRIES,
// -DSTACK_ENTRIES, -DOFFCPU_MIN_NS and -DOFFCPU_SAMPLE_NS from the collector; -DOFFCPU_DWARF
// (after unwind.h) for the DWARF walk at return to user; the kernel's features as
// collector/features.py found them: -DOFFCPU_TASK_STORAGE (else records by thread id, with
// -DOFFCPU_TASK_PID_OFFSET, -DOFFCPU_THREADS and -DOFFCPU_USER_STACK_THREADS),
// -DHAVE_GET_TASK_STACK (else no kernel frames), -DHAVE_TASK_PT_REGS; and how sched_switch tells
// prev's state (-DOFFCPU_SWITCH_PREV_STATE, else -DOFFCPU_TASK_STATE_OFFSET and _SIZE).

#ifndef OFFCPU_SAMPLE_NS
#define OFFCPU_SAMPLE_NS 0
#endif
#define OFFCPU_STATE_S 0x1   // TASK_INTERRUPTIBLE
#define OFFCPU_STATE_D 0x2   // TASK_UNINTERRUPTIBLE
#define OFFCPU_TASK_REPORT 0x7f         // the state bits the sched_switch tracepoint reports
#define OFFCPU_TASK_IDLE 0x402          // TASK_UNINTERRUPTIBLE | TASK_NOLOAD
#define OFFCPU_TASK_RTLOCK_WAIT 0x1000  // reported as D
#define OFFCPU_FRAMES 64     // per stack; the layout of struct unwind_stack
// Places tasks block in whose kernel stacks are kept for all (offcpu_kstacks, ~600 bytes each with
// the map's own, 2.4 MB): a host has tens to hundreds; the least recently used go. They are the
// only copy a thread's record names (no thread keeps its own), so there is room for many times
// that: a place evicted while a thread waits in it costs that thread one more walk (20-60 us).
#define OFFCPU_KSTACKS 4096
// x86-64's kernel text and module space (Documentation/arch/x86/x86_64/mm.rst): the words of a
// sleeping task's stack that may be code addresses (offcpu_same_block).
#define OFFCPU_CODE_START 0xffffffff80000000ULL
#define OFFCPU_CODE_END 0xffffffffff000000ULL

// offcpu_task.flags
#define OFFCPU_CHECKED 0x1   // whether it has user registers is known
#define OFFCPU_KTHREAD 0x2   // no user registers: kernel stack only
#define OFFCPU_RSEQ 0x4      // passes rseq_update: stacks at return to user

struct offcpu_key {
    u32 pid;
    u32 tid;
    u64 user_hash;     // in offcpu_stacks_<buf>, or 0
    u64 kernel_hash;   // likewise
    u64 py_hash;       // Python stack in py_stacks_offcpu_<buf> (bpf/python.h), or 0
};

struct offcpu_value {   // u64 fields only, each summed (counts_add in common.h)
    u64 count;   // blocking intervals
    u64 ns;      // blocked nanoseconds
};

struct offcpu_stack {
    u64 pcs[OFFCPU_FRAMES];   // leaf first; zero after the last frame
};

struct offcpu_task {
    u64 ts;             // blocked since (0: not blocked)
    u64 run_delay;      // its sched_info.run_delay when it blocked (offcpu_waited)
    u64 pending_ns;     // blocked time to charge when it returns to user space
    u64 pending_count;
    u32 pid;            // as the collector's /proc names them (common.h)
    u32 tid;
    u32 gen;            // offcpu_gen when ts was written
    u32 flags;
    u32 kernel_n;       // frames of its kernel stack, kept in offcpu_kstacks under kernel_print
    u32 user_n;         // frames in offcpu_user_stacks (threads without rseq only)
    u64 kernel_print;   // the place it last blocked in (offcpu_same_block) whose kernel stack was read
#ifndef OFFCPU_TASK_STORAGE
    u64 owner;          // the task_struct it belongs to (records by thread id: see offcpu_record_of)
#endif
};

// Indexes of offcpu_lost; the collector names them (collector/offcpu.py).
#define OFFCPU_LOST_COUNTS_FULL 0
#define OFFCPU_LOST_USER_STACK 1
#define OFFCPU_LOST_KERNEL_STACK 2
#define OFFCPU_LOST_NO_RECORD 3
#define OFFCPU_LOST_SLOTS 4

// Every task that blocks gets a record, so it is kept small (64 bytes): creating one is the
// dearest thing offcpu_switch does (~1 us), on a host that starts hundreds of processes a second
// hundreds of times a second, and a record with the two stacks in it (1.1 KB) cost a third more to
// create and made every switch slower (measured: ~40 ns a switch with short processes). The stacks live
// apart: kernel stacks by place in offcpu_kstacks, shared; user stacks, for threads without rseq
// only, in offcpu_user_stacks.
//
// Kernels before 5.11 have no task storage (-DOFFCPU_TASK_STORAGE from collector/features.py says
// it is there): the records then live in LRU hash maps keyed by the thread's kernel id, each naming
// the task it belongs to, so that the record of an exited thread whose id was reused is not taken
// for the new thread's (offcpu_record_of); an evicted record loses that thread's interval.
#ifdef OFFCPU_TASK_STORAGE
BPF_TASK_STORAGE(offcpu_tasks, struct offcpu_task);
BPF_TASK_STORAGE(offcpu_user_stacks, struct offcpu_stack);
#else
#ifndef OFFCPU_TASK_PID_OFFSET
#error "records by thread id need -DOFFCPU_TASK_PID_OFFSET (task_struct.pid in the kernel's BTF)"
#endif
#ifdef OFFCPU_DWARF
#error "the off-CPU DWARF walk needs task storage (bpf_get_current_task_btf)"
#endif
BPF_TABLE("lru_hash", u32, struct offcpu_task, offcpu_tasks, OFFCPU_THREADS);
BPF_TABLE("lru_hash", u32, struct offcpu_stack, offcpu_user_stacks, OFFCPU_USER_STACK_THREADS);
#endif
BPF_HASH(offcpu_counts_0, struct offcpu_key, struct offcpu_value, COUNTS_ENTRIES);
BPF_HASH(offcpu_counts_1, struct offcpu_key, struct offcpu_value, COUNTS_ENTRIES);
BPF_ARRAY_OF_MAPS(offcpu_count_maps, "offcpu_counts_0", 2);   // [buf]: offcpu_counts_<buf> (common.h)
BPF_HASH(offcpu_stacks_0, u64, struct offcpu_stack, STACK_ENTRIES);
BPF_HASH(offcpu_stacks_1, u64, struct offcpu_stack, STACK_ENTRIES);
BPF_ARRAY(offcpu_active, u32, 1);
// Kernel stacks by the place tasks blocked in (offcpu_same_block's print; a stack's own hash when
// the place is not known), shared by every task: a new process blocks where others did before it
// (a shell's wait4, a nanosleep, a pipe read), and its first long block finds their stack instead
// of walking its own. On a host that starts hundreds of processes a second those first blocks were
// most of the walks. A record names its stack here by kernel_print until it is charged.
BPF_TABLE("lru_hash", u64, struct offcpu_stack, offcpu_kstacks, OFFCPU_KSTACKS);
BPF_ARRAY(offcpu_gen, u32, 1);
BPF_PERCPU_ARRAY(offcpu_lost, u64, OFFCPU_LOST_SLOTS);
// Slot 0: offcpu_resume's user stack; slot 1: offcpu_switch's look at a sleeping task's stack (the
// two may run on one CPU at once: a preempted rseq_update under a sched_switch).
BPF_PERCPU_ARRAY(offcpu_scratch, struct offcpu_stack, 2);
// Per CPU: the task last switched in on it with an interval pending (its task_struct's address), or
// 0. A thread returns to user space on the CPU whose last switch put it there, so offcpu_resume,
// which runs at every return to user after a switch (thousands a second) and has work for a few of
// them only, looks the thread's record up only when the hint names it: one per-CPU array read
// instead of a task storage lookup (~100 ns on a busy host). A stale hint costs that lookup.
BPF_PERCPU_ARRAY(offcpu_resume_hint, u64, 1);

static __always_inline void offcpu_count_lost(int reason) {
    u64 *n = offcpu_lost.lookup(&reason);
    if (n)
        (*n)++;
}

#ifndef OFFCPU_TASK_STORAGE
// The record of kernel thread `ktid` if it belongs to task `owner` (a task_struct's address); with
// `create`, a new one in place of one that belongs to another task (the id was reused).
static __always_inline struct offcpu_task *offcpu_record_of(u32 ktid, u64 owner, int create) {
    struct offcpu_task *t = offcpu_tasks.lookup(&ktid);
    if (t && t->owner == owner)
        return t;
    if (!create)
        return 0;
    struct offcpu_task fresh = {};
    fresh.owner = owner;
    if (offcpu_tasks.update(&ktid, &fresh))
        return 0;
    return offcpu_tasks.lookup(&ktid);
}

static __always_inline u32 offcpu_ktid(struct task_struct *task) {
    return *(u32 *)((char *)task + OFFCPU_TASK_PID_OFFSET);   // a plain load from a BTF pointer
}
#endif

// The record of `task` (a tp_btf argument), made if missing with `create`.
static __always_inline struct offcpu_task *offcpu_task_of(struct task_struct *task, int create) {
#ifdef OFFCPU_TASK_STORAGE
    if (create)
        return offcpu_tasks.task_storage_get(task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    return offcpu_tasks.task_storage_get(task, 0, 0);
#else
    return offcpu_record_of(offcpu_ktid(task), (u64)task, create);
#endif
}

// The record of the current task, made if missing with `create`.
static __always_inline struct offcpu_task *offcpu_current_task(int create) {
#ifdef OFFCPU_TASK_STORAGE
    if (create)
        return offcpu_tasks.task_storage_get(bpf_get_current_task_btf(), 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    return offcpu_tasks.task_storage_get(bpf_get_current_task_btf(), 0, 0);
#else
    return offcpu_record_of((u32)bpf_get_current_pid_tgid(), bpf_get_current_task(), create);
#endif
}

// The user stack kept for `task` (a thread without rseq), made if missing with `create`. Without task
// storage it is under the thread's id: only read for a thread whose own record (offcpu_task_of) names
// frames in it, which it wrote when it blocked.
static __always_inline struct offcpu_stack *offcpu_user_stack_of(struct task_struct *task, int create) {
#ifdef OFFCPU_TASK_STORAGE
    if (create)
        return offcpu_user_stacks.task_storage_get(task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    return offcpu_user_stacks.task_storage_get(task, 0, 0);
#else
    u32 ktid = offcpu_ktid(task);
    struct offcpu_stack *s = offcpu_user_stacks.lookup(&ktid);
    if (s || !create)
        return s;
    u32 slot = 1;   // any 512 bytes to create it with (its frames are written next)
    struct offcpu_stack *init = offcpu_scratch.lookup(&slot);
    if (!init || offcpu_user_stacks.update(&ktid, init))
        return 0;
    return offcpu_user_stacks.lookup(&ktid);
#endif
}

// The stack's hash (never 0), or 0 for no frames; with `pad`, the frames after the n-th are zeroed
// first (a stack a helper wrote: the words past its end are whatever was there).
static __always_inline u64 offcpu_hash(struct offcpu_stack *s, u32 n, int pad) {
    u64 h = 0xcbf29ce484222325ULL;
    for (int i = 0; i < OFFCPU_FRAMES; i++) {
        if (i >= n) {
            if (!pad)
                break;
            s->pcs[i] = 0;
        } else {
            h = (h ^ s->pcs[i]) * STACK_HASH_PRIME;
        }
    }
    if (n == 0)
        return 0;
    return h ? h : 1;
}

// Frames of a zero-padded stack (one in offcpu_kstacks).
static __always_inline u32 offcpu_frames_in(struct offcpu_stack *s) {
    u32 n = 0;
    for (int i = 0; i < OFFCPU_FRAMES; i++) {
        if (s->pcs[i] == 0)
            break;
        n++;
    }
    return n;
}

// Store a stack in buffer `buf`; its hash, or 0 if it has no frames or the map is full. `pad` as
// offcpu_hash: a stack shared with other CPUs (offcpu_kstacks) is zero-padded already and not written.
static __always_inline u64 offcpu_store(struct offcpu_stack *s, u32 n, u32 buf, int lost_reason, int pad) {
    u64 h = offcpu_hash(s, n, pad);
    if (h == 0)
        return 0;
    int err = buf == 0 ? offcpu_stacks_0.insert(&h, s) : offcpu_stacks_1.insert(&h, s);
    if (err != 0 && err != -EEXIST) {
        offcpu_count_lost(lost_reason);
        return 0;
    }
    return h;
}

// Charge to (pid, tid), the user stack `user` and the kernel stack kept under `kernel_print`; with
// `in_thread` (called in the thread's own context, at its return to user space) its Python frames too.
static __always_inline void offcpu_charge(u32 pid, u32 tid, struct offcpu_stack *user, u32 user_n,
                                          u64 kernel_print, u32 kernel_n, u64 count, u64 ns, int in_thread) {
    u32 zero = 0;
    u32 *active = offcpu_active.lookup(&zero);
    if (!active)
        return;
    u32 buf = *active;
    notify_new_pid(pid);
    struct offcpu_key key = {};
    key.pid = pid;
    key.tid = tid;
    key.user_hash = user ? offcpu_store(user, user_n, buf, OFFCPU_LOST_USER_STACK, 1) : 0;
#ifdef PY_WALK_OFFCPU
    if (in_thread)
        key.py_hash = py_walk(pid, tid, buf, PY_OFFCPU);
#endif
    if (kernel_n) {
        // Its frames as kept now: another task that blocked in the same place may have replaced it.
        struct offcpu_stack *kernel = offcpu_kstacks.lookup(&kernel_print);
        if (kernel)
            key.kernel_hash = offcpu_store(kernel, offcpu_frames_in(kernel), buf, OFFCPU_LOST_KERNEL_STACK, 0);
        else
            offcpu_count_lost(OFFCPU_LOST_KERNEL_STACK);   // evicted since it was read: hundreds of places later
    }
    struct offcpu_value add = {count, ns};
    void *counts = offcpu_count_maps.lookup(&buf);
    if (!counts || counts_add(counts, &key, (u64 *)&add, sizeof(add) / sizeof(u64)))
        offcpu_count_lost(OFFCPU_LOST_COUNTS_FULL);
}

static __always_inline u32 offcpu_frames(long bytes) {
    if (bytes <= 0)
        return 0;
    u32 n = bytes / 8;
    return n > OFFCPU_FRAMES ? OFFCPU_FRAMES : n;
}

// Whether `task`, switching in after a long block, blocked where it blocked the last time its
// kernel stack was read: the same code addresses in the 512 bytes above its saved stack pointer
// (the return addresses into the scheduler and the functions that blocked, and any function
// pointer they keep there, such as a wait queue entry's). The other words there (saved
// registers, timeouts, a poll table's pointers) and the stack pointer itself (the kernel moves
// each syscall's stack by a random offset) change from one block to the next at the same place,
// and are left out. Then its stack is the one kept for that place and the walk (bpf_get_task_stack: 20-60 us
// on these machines) is not made; a thread that waits in one place (an event loop, a worker
// pool's queue, a kernel thread's idle wait) is walked once. A shallow stack ends before 512
// bytes (a read past it faults): 256, then 128 are tried. With the user registers
// (HAVE_TASK_PT_REGS), the system call it blocked in is part of the print too.
// 1: the same place; 0: another (t->kernel_print is now this one's); -1: not known (a read failed).
//
// OFFCPU_TASK_SP_OFFSET is task_struct.thread.sp in the running kernel's BTF (the collector's
// -D; bcc's headers may be another kernel's); without it every long block walks.
static __always_inline int offcpu_same_block(struct task_struct *task, struct offcpu_task *t) {
#ifdef OFFCPU_TASK_SP_OFFSET
    u64 sp = 0;
    u32 slot = 1;
    struct offcpu_stack *words = offcpu_scratch.lookup(&slot);
    if (!words || bpf_probe_read_kernel(&sp, sizeof(sp), (char *)task + OFFCPU_TASK_SP_OFFSET) || !sp)
        return -1;
    u32 n = OFFCPU_FRAMES;
    if (bpf_probe_read_kernel(words->pcs, sizeof(words->pcs), (void *)sp)) {
        n = OFFCPU_FRAMES / 2;
        if (bpf_probe_read_kernel(words->pcs, sizeof(words->pcs) / 2, (void *)sp)) {
            n = OFFCPU_FRAMES / 4;
            if (bpf_probe_read_kernel(words->pcs, sizeof(words->pcs) / 4, (void *)sp))
                return -1;
        }
    }
    u64 h = 0xcbf29ce484222325ULL ^ n;
    for (int i = 0; i < OFFCPU_FRAMES; i++) {
        if (i >= n)
            break;
        u64 w = words->pcs[i];
        if (w >= OFFCPU_CODE_START && w < OFFCPU_CODE_END)
            h = (h ^ w) * STACK_HASH_PRIME;
    }
#ifdef HAVE_TASK_PT_REGS
    // the same wait reached from another call (a page-cache wait from read() or from a fault,
    // orig_ax -1) is not the same place
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
    u64 nr = 0;
    if (regs)
        bpf_probe_read_kernel(&nr, sizeof(nr), &regs->orig_ax);
    h = (h ^ nr) * STACK_HASH_PRIME;
#endif
    if (t->kernel_n && t->kernel_print == h)
        return 1;
    t->kernel_print = h;
    return 0;
#else
    return -1;
#endif
}


// next's kernel stack into offcpu_kstacks under t->kernel_print (t->kernel_n frames; 0: none):
// found there if it blocked where it, or another task, blocked before, else walked and kept.
static __always_inline void offcpu_read_kernel(struct task_struct *next, struct offcpu_task *t) {
    int same = offcpu_same_block(next, t);
    u64 print = t->kernel_print;
    if (same >= 0) {
        struct offcpu_stack *known = offcpu_kstacks.lookup(&print);
        if (known) {
            if (same == 0)
                t->kernel_n = offcpu_frames_in(known);
            if (t->kernel_n)
                return;
        }
    }
    t->kernel_n = 0;
#ifdef HAVE_GET_TASK_STACK
    u32 slot = 1;
    struct offcpu_stack *walked = offcpu_scratch.lookup(&slot);
    if (!walked)
        return;
    u32 n = offcpu_frames(bpf_get_task_stack(next, walked->pcs, sizeof(walked->pcs), 0));
    if (!n)
        return;
    u64 h = offcpu_hash(walked, n, 1);   // zero-padded, as readers of the kept copy expect
    if (same < 0)
        print = t->kernel_print = h;   // the place is not known: the stack names itself
    if (offcpu_kstacks.update(&print, walked) == 0)
        t->kernel_n = n;
#endif
}

// Whether a long block is charged, and with what weight, by its blocked time `net` (its length
// less its wait for a CPU). A block of OFFCPU_SAMPLE_NS or more always is, with its own time. A
// shorter one is charged with the chance net / OFFCPU_SAMPLE_NS, as OFFCPU_SAMPLE_NS of blocked
// time and OFFCPU_SAMPLE_NS / net intervals (rounded up or down at random, so that the expected
// count stays 1): the expected time and count of every stack are its true ones, as in Go's block
// profile (runtime.SetBlockProfileRate), and a block not chosen costs what a short one does (no
// stack is read for it). A host that starts hundreds of processes a second blocks thousands of
// times a second for 1-3 ms (a shell waiting for its child, a 1-ms sleep): charged in full, their
// stack reads and the keys they made were most of the agent's cost there. OFFCPU_SAMPLE_NS 0 (or
// not above OFFCPU_MIN_NS): every block in full.
//
// The choice is made in two steps, so that the wait for a CPU (offcpu_waited: up to six reads of
// scheduler state) is read only for the blocks the first step keeps. offcpu_first_pick, on the
// block's whole length `delta`: kept with the chance min(1, delta / OFFCPU_SAMPLE_NS).
// offcpu_second_pick, on `net` <= delta: a block under OFFCPU_SAMPLE_NS kept with the chance
// net / delta, one over it as above. Together: net / OFFCPU_SAMPLE_NS, the chance above.
static __always_inline int offcpu_first_pick(u64 delta) {
#if OFFCPU_SAMPLE_NS > 0
    if (delta < OFFCPU_SAMPLE_NS && (u64)(bpf_get_prandom_u32() % OFFCPU_SAMPLE_NS) >= delta)
        return 0;
#endif
    return 1;
}

static __always_inline int offcpu_second_pick(u64 delta, u64 net, u64 *count, u64 *ns) {
    *count = 1;
    *ns = net;
#if OFFCPU_SAMPLE_NS > 0
    if (net >= OFFCPU_SAMPLE_NS)
        return 1;
    u64 first = delta < OFFCPU_SAMPLE_NS ? delta : OFFCPU_SAMPLE_NS;   // what the first step kept by
    if (net == 0 || (u64)(bpf_get_prandom_u32() % first) >= net)
        return 0;
    *ns = OFFCPU_SAMPLE_NS;
    *count = OFFCPU_SAMPLE_NS / net;
    if ((u64)bpf_get_prandom_u32() % net < OFFCPU_SAMPLE_NS % net)
        *count += 1;
#endif
    return 1;
}

// Whether the current task has user registers (a kernel thread has none).
static __always_inline int offcpu_has_user_regs(void) {
#ifdef HAVE_TASK_PT_REGS
    struct pt_regs *user = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    u64 cs = 0;
    if (!user || bpf_probe_read_kernel(&cs, sizeof(cs), &user->cs))
        return 0;
    return (cs & 3) == 3;
#else
    return 1;
#endif
}

// The wait for a CPU after a wakeup is not blocked time. The scheduler keeps it per task
// (CONFIG_SCHED_INFO: /proc/PID/schedstat's second figure): sched_info.run_delay sums the waits
// that ended, and sched_info.last_queued is when the current one began, in the run queue's clock
// (rq->clock, not the clock of bpf_ktime_get_ns), cleared when the task gets the CPU, just after
// this tracepoint. So the wait since a block began is the growth of run_delay since then plus
// rq->clock - last_queued now, all in one clock; this CPU's run queue is found through a fair
// task's cfs_rq (next's, else prev's; the idle task's is this CPU's too) and checked by its cpu.
// Each field's offset comes from the running kernel's BTF (collector/offcpu.py); without them the
// wait counts as blocked time (the collector logs that loss).
#if defined(OFFCPU_TASK_RUN_DELAY_OFFSET) && defined(OFFCPU_TASK_LAST_QUEUED_OFFSET) && \
    defined(OFFCPU_TASK_CFS_RQ_OFFSET) && defined(OFFCPU_CFS_RQ_RQ_OFFSET) && defined(OFFCPU_RQ_CLOCK_OFFSET) && \
    defined(OFFCPU_RQ_CPU_OFFSET)
#define OFFCPU_RUN_DELAY 1
#endif

// `task` is one of sched_switch's tp_btf arguments, a BTF pointer: a plain load of its member, which
// the verifier checks against the kernel's BTF, costs one instruction where bpf_probe_read_kernel costs
// a helper call (this runs at every block).
static __always_inline u64 offcpu_run_delay(struct task_struct *task) {
#ifdef OFFCPU_RUN_DELAY
    return *(u64 *)((char *)task + OFFCPU_TASK_RUN_DELAY_OFFSET);
#else
    return 0;
#endif
}

#ifdef OFFCPU_RUN_DELAY
// rq->clock of this CPU's run queue, reached through `task`'s cfs_rq; 0 if that is another CPU's.
static __always_inline u64 offcpu_rq_clock(struct task_struct *task, u32 cpu) {
    void *cfs_rq = 0, *rq = 0;
    u64 clock = 0;
    int rq_cpu = -1;
    if (bpf_probe_read_kernel(&cfs_rq, sizeof(cfs_rq), (char *)task + OFFCPU_TASK_CFS_RQ_OFFSET) || !cfs_rq ||
        bpf_probe_read_kernel(&rq, sizeof(rq), (char *)cfs_rq + OFFCPU_CFS_RQ_RQ_OFFSET) || !rq ||
        bpf_probe_read_kernel(&rq_cpu, sizeof(rq_cpu), (char *)rq + OFFCPU_RQ_CPU_OFFSET) || rq_cpu != (int)cpu ||
        bpf_probe_read_kernel(&clock, sizeof(clock), (char *)rq + OFFCPU_RQ_CLOCK_OFFSET))
        return 0;
    return clock;
}
#endif

// Nanoseconds `next`, switching in after a block of `delta` ns, spent runnable since it blocked
// (at most delta).
static __always_inline u64 offcpu_waited(struct task_struct *prev, struct task_struct *next,
                                         struct offcpu_task *t, u64 delta) {
#ifdef OFFCPU_RUN_DELAY
    u64 run_delay = offcpu_run_delay(next), last_queued = 0;
    u64 waited = run_delay > t->run_delay ? run_delay - t->run_delay : 0;
    bpf_probe_read_kernel(&last_queued, sizeof(last_queued), (char *)next + OFFCPU_TASK_LAST_QUEUED_OFFSET);
    if (last_queued) {
        u32 cpu = bpf_get_smp_processor_id();
        u64 clock = offcpu_rq_clock(next, cpu);
        if (!clock)
            clock = offcpu_rq_clock(prev, cpu);
        if (clock > last_queued)
            waited += clock - last_queued;
    }
    return waited < delta ? waited : delta;
#else
    return 0;
#endif
}

// sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next, unsigned int prev_state); before
// 5.18 without prev_state (-DOFFCPU_SWITCH_PREV_STATE from collector/offcpu.py says which)
int offcpu_switch(u64 *ctx) {
    struct prog_time *timing = timing_begin(TIMED_offcpu_switch);
    struct task_struct *prev = (struct task_struct *)ctx[1];
    struct task_struct *next = (struct task_struct *)ctx[2];
#ifdef OFFCPU_SWITCH_PREV_STATE
    unsigned int state = (unsigned int)ctx[3];
#elif OFFCPU_TASK_STATE_SIZE == 8
    // before 5.18 sched_switch passes no prev_state: prev's own field, as the classic tracepoint read it
    unsigned int state = (unsigned int)*(u64 *)((char *)prev + OFFCPU_TASK_STATE_OFFSET);   // long state (< 5.14)
#else
    unsigned int state = *(u32 *)((char *)prev + OFFCPU_TASK_STATE_OFFSET);                 // unsigned int __state
#endif
    u32 zero = 0;
    u32 *gen = offcpu_gen.lookup(&zero);
    if (!gen)
        TIMED_RETURN(timing, 0);
    u64 now = bpf_ktime_get_ns();

    // Switch-in: the end of next's blocked interval.
    struct offcpu_task *t = offcpu_task_of(next, 0);
    u64 *hint = offcpu_resume_hint.lookup(&zero);
    if (hint && *hint)
        *hint = 0;
    if (t && t->ts) {
        u64 delta = now > t->ts ? now - t->ts : 0;
        u64 count = 1, ns = 0, net = 0;
        // a short block, or a long one the first step leaves, reads nothing more
        int picked = t->gen == *gen && delta >= OFFCPU_MIN_NS && offcpu_first_pick(delta);
        if (picked)
            net = delta - offcpu_waited(prev, next, t, delta);
        if (picked && net >= OFFCPU_MIN_NS && offcpu_second_pick(delta, net, &count, &ns)) {
            if (t->flags & OFFCPU_KTHREAD) {
                offcpu_read_kernel(next, t);
                offcpu_charge(t->pid, t->tid, 0, 0, t->kernel_print, t->kernel_n, count, ns, 0);
            } else if (t->flags & OFFCPU_RSEQ) {
                // blocked again before it returned: same stacks
                if (t->pending_count == 0)
                    offcpu_read_kernel(next, t);
                t->pending_ns += ns;
                t->pending_count += count;
            } else {
                offcpu_read_kernel(next, t);
                struct offcpu_stack *user = t->user_n ? offcpu_user_stack_of(next, 0) : 0;
                if (t->user_n && !user)
                    offcpu_count_lost(OFFCPU_LOST_USER_STACK);   // evicted (records by thread id only)
                offcpu_charge(t->pid, t->tid, user, user ? t->user_n : 0, t->kernel_print, t->kernel_n, count, ns, 0);
            }
        }
        t->ts = 0;
    }
    if (hint && t && t->pending_count)
        *hint = (u64)next;

    // As the classic tracepoint reports it (__trace_sched_switch_state): a preempted task is
    // runnable; TASK_IDLE (an idle kernel thread's wait) is not blocked; flags such as
    // TASK_FREEZABLE (a nanosleep) are not part of the state.
    if (ctx[0] || state == OFFCPU_TASK_IDLE)
        TIMED_RETURN(timing, 0);
    if (state == OFFCPU_TASK_RTLOCK_WAIT)
        state = OFFCPU_STATE_D;
    state &= OFFCPU_TASK_REPORT;
    if (state != OFFCPU_STATE_S && state != OFFCPU_STATE_D)
        TIMED_RETURN(timing, 0);
    u32 pid, tid;
    if (current_ids(&pid, &tid) != 0 || pid == 0)   // current is prev; pid 0: the idle task
        TIMED_RETURN(timing, 0);
    struct offcpu_task *p = offcpu_task_of(prev, 1);
    if (!p) {
        offcpu_count_lost(OFFCPU_LOST_NO_RECORD);
        TIMED_RETURN(timing, 0);
    }
    if (!(p->flags & OFFCPU_CHECKED))
        p->flags |= OFFCPU_CHECKED | (offcpu_has_user_regs() ? 0 : OFFCPU_KTHREAD);
#ifdef OFFCPU_TASK_RSEQ_OFFSET
    // Whether it will pass rseq_update now, not whether it once did: exec unregisters rseq, and
    // a shell's child that execs a Go or static binary keeps its task (and this record).
    // (a plain load from the BTF pointer, as in offcpu_run_delay)
    u64 rseq = *(u64 *)((char *)prev + OFFCPU_TASK_RSEQ_OFFSET);
    if (rseq) {
        p->flags |= OFFCPU_RSEQ;
    } else if (p->flags & OFFCPU_RSEQ) {
        p->flags &= ~OFFCPU_RSEQ;
        p->pending_ns = 0;      // a block inside execve: it will not pass rseq_update to be charged
        p->pending_count = 0;
    }
#endif
    p->ts = now;
    p->run_delay = offcpu_run_delay(prev);
    p->gen = *gen;
    p->pid = pid;
    p->tid = tid;
    if (!(p->flags & (OFFCPU_KTHREAD | OFFCPU_RSEQ))) {
        // No rseq_update to wait for: the user stack now, frame pointers only.
        struct offcpu_stack *user = offcpu_user_stack_of(prev, 1);
        p->user_n = user ? offcpu_frames(bpf_get_stack(ctx, user->pcs, sizeof(user->pcs), BPF_F_USER_STACK)) : 0;
    }
    TIMED_RETURN(timing, 0);
}

#ifdef OFFCPU_DWARF
// Slot 0: the step program; slot 1: the finish program (charging in the step
// program itself makes it too complex for the verifier).
BPF_PROG_ARRAY(offcpu_unwind_progs, 2);

// Loaded as tp_btf programs on rseq_update like offcpu_resume, so that they may be tail-called.
int offcpu_unwind_step(u64 *ctx) {
    struct prog_time *timing = timing_begin(TIMED_offcpu_unwind_step);
    u32 slot = 1;
    struct unwind_state *st = unwind_scratch.lookup(&slot);
    if (!st)
        TIMED_RETURN(timing, 0);
    unwind_frames(st);
    timing_end(timing);
    if (!st->done)
        offcpu_unwind_progs.call(ctx, 0);
    offcpu_unwind_progs.call(ctx, 1);
    unwind_count(UNWIND_LOST_TAIL_CALL);
    TIMED_RETURN(timing, 0);
}

// The walk is over: charge the pending interval of the current thread to it.
int offcpu_unwind_finish(u64 *ctx) {
    struct prog_time *timing = timing_begin(TIMED_offcpu_unwind_finish);
    u32 slot = 1;
    struct unwind_state *st = unwind_scratch.lookup(&slot);
    if (!st)
        TIMED_RETURN(timing, 0);
    unwind_finish(st);
    struct offcpu_task *t = offcpu_current_task(0);
    if (!t || t->pending_count == 0)
        TIMED_RETURN(timing, 0);
    offcpu_charge(t->pid, t->tid, (struct offcpu_stack *)&st->stack, st->n, t->kernel_print, t->kernel_n,
                  t->pending_count, t->pending_ns, 1);
    t->pending_ns = 0;
    t->pending_count = 0;
    TIMED_RETURN(timing, 0);
}
#endif

// rseq_update(struct task_struct *t): current, about to return to user space.
int offcpu_resume(u64 *ctx) {
    struct prog_time *timing = timing_begin(TIMED_offcpu_resume);
#ifdef OFFCPU_TASK_RSEQ_OFFSET
    // offcpu_switch reads OFFCPU_RSEQ from task_struct.rseq: a thread with no record has nothing
    // pending, and no record is made for it here (this runs at every return to user after a switch).
    u32 zero = 0;
    u64 *hint = offcpu_resume_hint.lookup(&zero);
    if (!hint || *hint != bpf_get_current_task())
        TIMED_RETURN(timing, 0);
    struct offcpu_task *t = offcpu_current_task(0);
    if (!t)
        TIMED_RETURN(timing, 0);
#else
    struct offcpu_task *t = offcpu_current_task(1);
    if (!t)
        TIMED_RETURN(timing, 0);
    if (!(t->flags & OFFCPU_RSEQ))
        t->flags |= OFFCPU_RSEQ;
#endif
    if (t->pending_count == 0)
        TIMED_RETURN(timing, 0);
#ifdef OFFCPU_DWARF
    u32 pid = t->pid;
    if (unwind_procs.lookup(&pid)) {   // the collector loaded unwind tables for this process
        u32 slot = 1;
        struct unwind_state *st = unwind_scratch.lookup(&slot);
        if (st && unwind_begin(st, 0)) {
            st->pid = pid;
            st->tid = t->tid;
            timing_end(timing);
            offcpu_unwind_progs.call(ctx, 0);
            unwind_count(UNWIND_LOST_TAIL_CALL);   // not entered: frame pointers below
        }
    }
#endif
    u32 slot = 0;
    struct offcpu_stack *user = offcpu_scratch.lookup(&slot);
    if (!user)
        TIMED_RETURN(timing, 0);
    u32 n = offcpu_frames(bpf_get_stack(ctx, user->pcs, sizeof(user->pcs), BPF_F_USER_STACK));
    offcpu_charge(t->pid, t->tid, user, n, t->kernel_print, t->kernel_n, t->pending_count, t->pending_ns, 1);
    t->pending_ns = 0;
    t->pending_count = 0;
    TIMED_RETURN(timing, 0);
}
