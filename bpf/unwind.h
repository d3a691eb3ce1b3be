// DWARF unwinding of user stacks in the kernel, with the tables of
// docs/unwinding.md: shared by the on-CPU and off-CPU families, which the
// collector compiles after this file when dwarf_unwind is on (-DDWARF_UNWIND).
//
// A sampling program fills this CPU's unwind_state (user registers, ids) and
// tail-calls its family's step program; each step program walks up to
// UNWIND_FRAMES_PER_PROG frames and tail-calls itself until the stack ends
// or UNWIND_MAX_FRAMES are recorded (a single program walking 64 frames with
// a table search per frame is refused by the verifier as too complex; a chain
// of small ones is not). The family's finish function then stores the stack
// under a 64-bit hash of its frames and counts it.
//
// Per frame: the mapping of the pc in unwind_procs[pid] (sorted by start; the
// collector writes it), then the last row at or before pc - bias in the
// module's rows (unwind_modules[slot] is its range in unwind_rows). No
// mapping, an evicted module, or a FALLBACK row: one frame-pointer step.
// Every read of user memory is bpf_probe_read_user; a stack that does not
// grow towards its callers ends the walk.
//
// Compiled with -DUNWIND_ROWS, -DUNWIND_MODULES, -DUNWIND_PROCS,
// -DDWARF_STACK_ENTRIES from the collector; -DHAVE_TASK_PT_REGS on 5.15+
// kernels, where a sample taken in the kernel still has the thread's user
// registers (bpf_task_pt_regs); without it such samples use frame pointers.

#define UNWIND_MAX_FRAMES 64
// Frames per step program: on 6.18, 6 verify in 0.3 s and 8 exceed the
// verifier's 1M-instruction budget; 4 leaves room for older verifiers.
// 64 frames are then 16 tail calls (the kernel allows 33).
#define UNWIND_FRAMES_PER_PROG 4
#define UNWIND_MAPPINGS 128          // per process; a power of two (index masks)
#define UNWIND_MAPPING_STEPS 8       // binary search over UNWIND_MAPPINGS
#define UNWIND_ROW_STEPS 23          // binary search over up to 8M rows

// Row kinds (shared/unwind_table.py names the same numbers).
#define CFA_SP 0
#define CFA_FP 1
#define CFA_PLT 2
#define CFA_FALLBACK 3
#define CFA_END 4
#define FP_SAME 0
#define FP_SAVED 1

struct unwind_row {
    u32 pc;
    s32 cfa_off;
    s16 fp_off;
    s16 ra_off;
    u8 cfa_kind;
    u8 fp_kind;
    u8 ra_kind;
    u8 pad;
};

struct unwind_module {
    u32 row_start;
    u32 row_count;     // 0: no table (evicted); frame-pointer steps
};

struct unwind_mapping {
    u64 start;
    u64 end;
    u64 bias;          // pc - bias is the address the rows are keyed by
    u32 span;          // rows cover [0, span)
    u32 module;        // slot in unwind_modules
};

struct unwind_proc {
    u32 count;
    u32 pad;
    struct unwind_mapping maps[UNWIND_MAPPINGS];
};

struct unwind_stack {
    u64 pcs[UNWIND_MAX_FRAMES];   // leaf first; zero after the last frame
};

struct unwind_state {
    u64 pc;
    u64 sp;
    u64 fp;
    u64 hash;
    u64 ts;            // off-CPU: when the thread blocked
    u64 py_hash;       // the sample's Python stack (bpf/python.h), or 0
    u32 pid;
    u32 tid;
    s32 kernel_stack;
    u32 buf;           // counts buffer selected when the sample was taken
    u32 n;             // frames recorded in pcs
    u32 done;
    u32 hint;          // index of the mapping the previous frame was in: tried first
    u32 fp_steps;      // counted once per walk (unwind_finish), not per frame
    u32 dwarf_steps;
    struct unwind_stack stack;
};

// Indexes of unwind_lost (named in collector/unwind.py).
#define UNWIND_LOST_TAIL_CALL 0      // a step program could not be entered: the stack was cut there
#define UNWIND_LOST_STACK_FULL 1     // the stack map was full
#define UNWIND_TRUNCATED 2           // walked UNWIND_MAX_FRAMES and the stack went on
#define UNWIND_FP_STEPS 3            // frames taken with frame pointers (no table for the pc)
#define UNWIND_DWARF_STEPS 4         // frames taken with a table row
#define UNWIND_COUNTER_SLOTS 5

BPF_ARRAY(unwind_rows, struct unwind_row, UNWIND_ROWS);
BPF_ARRAY(unwind_modules, struct unwind_module, UNWIND_MODULES);
BPF_HASH(unwind_procs, u32, struct unwind_proc, UNWIND_PROCS);
// Slot 0: on-CPU, slot 1: off-CPU, slot 2: lock (a tracing program cannot
// interrupt another on its CPU, but no two families share a slot).
BPF_PERCPU_ARRAY(unwind_scratch, struct unwind_state, 3);
BPF_PERCPU_ARRAY(unwind_counters, u64, UNWIND_COUNTER_SLOTS);

static __always_inline void unwind_add(int slot, u64 k) {
    u64 *n = unwind_counters.lookup(&slot);
    if (n)
        *n += k;
}

static __always_inline void unwind_count(int slot) {
    unwind_add(slot, 1);
}

static __always_inline void unwind_record(struct unwind_state *st, u64 pc) {
    u32 i = st->n;
    if (i < UNWIND_MAX_FRAMES) {
        st->stack.pcs[i & (UNWIND_MAX_FRAMES - 1)] = pc;
        st->n = i + 1;
        st->hash = (st->hash ^ pc) * STACK_HASH_PRIME;
    }
}

// User registers of the current task: those of the sample when it was taken
// in user mode, else the ones saved at kernel entry. 0 if there are none.
static __always_inline int unwind_begin(struct unwind_state *st, struct pt_regs *regs) {
    st->n = 0;
    st->done = 0;
    st->hint = 0;
    st->fp_steps = 0;
    st->dwarf_steps = 0;
    st->hash = 0xcbf29ce484222325ULL;
    if (regs && regs_user_mode(regs)) {
        st->pc = regs->ip;
        st->sp = regs->sp;
        st->fp = regs->bp;
    } else {
#ifdef HAVE_TASK_PT_REGS
        struct pt_regs *user = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
        struct pt_regs r = {};
        if (!user || bpf_probe_read_kernel(&r, sizeof(r), user) || !regs_user_mode(&r))
            return 0;
        st->pc = r.ip;
        st->sp = r.sp;
        st->fp = r.bp;
#else
        return 0;
#endif
    }
    if (st->pc == 0)
        return 0;
    unwind_record(st, st->pc);
    return 1;
}

// One frame-pointer step: the caller's frame pointer at [fp], its return
// address at [fp + 8].
static __always_inline int unwind_fp_step(struct unwind_state *st) {
    u64 fp = st->fp, frame[2] = {};
    if (fp == 0 || fp < st->sp || bpf_probe_read_user(frame, sizeof(frame), (void *)fp))
        return 0;
    if (frame[0] != 0 && frame[0] <= fp)   // a caller's frame lies above its callee's
        return 0;
    st->sp = fp + 16;
    st->fp = frame[0];
    st->pc = frame[1];
    st->fp_steps++;
    return 1;
}

static __always_inline struct unwind_mapping *unwind_find_mapping(struct unwind_proc *proc, u64 pc, u32 *hint) {
    u32 lo = 0, hi = proc->count;
    if (hi > UNWIND_MAPPINGS)
        hi = UNWIND_MAPPINGS;
    // Callers are mostly in the same module as their callees: try the last frame's mapping first.
    struct unwind_mapping *last = &proc->maps[*hint & (UNWIND_MAPPINGS - 1)];
    if (*hint < hi && last->start <= pc && pc < last->end)
        return last;
    for (int i = 0; i < UNWIND_MAPPING_STEPS; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        if (proc->maps[mid & (UNWIND_MAPPINGS - 1)].start <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return 0;
    *hint = lo - 1;
    struct unwind_mapping *m = &proc->maps[(lo - 1) & (UNWIND_MAPPINGS - 1)];
    return pc < m->end ? m : 0;
}

// The row whose range holds rel, or 0.
static __always_inline struct unwind_row *unwind_find_row(u32 module, u32 rel) {
    struct unwind_module *mod = unwind_modules.lookup(&module);
    if (!mod || mod->row_count == 0)
        return 0;
    u32 base = mod->row_start, lo = 0, hi = mod->row_count;
    for (int i = 0; i < UNWIND_ROW_STEPS; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        u32 idx = base + mid;
        struct unwind_row *row = unwind_rows.lookup(&idx);
        if (!row)
            return 0;
        if (row->pc <= rel)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return 0;
    u32 idx = base + lo - 1;
    return unwind_rows.lookup(&idx);
}

// One frame: 1 when st holds the caller's registers, 0 when the stack ended.
static __always_inline int unwind_step(struct unwind_state *st, struct unwind_proc *proc) {
    // A return address points after its call: look up the call itself.
    u64 lookup = st->n > 1 ? st->pc - 1 : st->pc;
    struct unwind_mapping *m = proc ? unwind_find_mapping(proc, lookup, &st->hint) : 0;
    struct unwind_row *row = 0;
    if (m && lookup - m->bias < m->span)
        row = unwind_find_row(m->module, (u32)(lookup - m->bias));
    if (!row || row->cfa_kind == CFA_FALLBACK)
        return unwind_fp_step(st);
    if (row->cfa_kind == CFA_END)
        return 0;

    u64 cfa;
    if (row->cfa_kind == CFA_SP)
        cfa = st->sp + (s64)row->cfa_off;
    else if (row->cfa_kind == CFA_FP)
        cfa = st->fp + (s64)row->cfa_off;
    else if (row->cfa_kind == CFA_PLT)
        cfa = st->sp + (s64)row->cfa_off + (((st->pc & 15) >= 11) ? 8 : 0);
    else
        return 0;
    if (cfa <= st->sp)
        return 0;
    u64 ra = 0, fp = st->fp;
    if (row->fp_kind == FP_SAVED && row->fp_off + 8 == row->ra_off) {
        // The usual frame that saves rbp (pushed first, below the return address): one read.
        u64 saved[2] = {};
        if (bpf_probe_read_user(saved, sizeof(saved), (void *)(cfa + (s64)row->fp_off)))
            return 0;
        fp = saved[0];
        ra = saved[1];
    } else {
        if (bpf_probe_read_user(&ra, sizeof(ra), (void *)(cfa + (s64)row->ra_off)))
            return 0;
        if (row->fp_kind == FP_SAVED &&
            bpf_probe_read_user(&fp, sizeof(fp), (void *)(cfa + (s64)row->fp_off)))
            return 0;
    }
    st->sp = cfa;
    st->fp = fp;
    st->pc = ra;
    st->dwarf_steps++;
    return 1;
}

// Up to UNWIND_FRAMES_PER_PROG frames; sets st->done when the walk is over.
static __always_inline void unwind_frames(struct unwind_state *st) {
    struct unwind_proc *proc = unwind_procs.lookup(&st->pid);
    for (int i = 0; i < UNWIND_FRAMES_PER_PROG; i++) {
        if (st->n >= UNWIND_MAX_FRAMES) {
            unwind_count(UNWIND_TRUNCATED);
            st->done = 1;
            return;
        }
        if (!unwind_step(st, proc) || st->pc == 0) {
            st->done = 1;
            return;
        }
        unwind_record(st, st->pc);
    }
}

// The stack's key in a DWARF stack map: never 0 (0 means "no DWARF stack").
static __always_inline u64 unwind_finish(struct unwind_state *st) {
    unwind_add(UNWIND_FP_STEPS, st->fp_steps);
    unwind_add(UNWIND_DWARF_STEPS, st->dwarf_steps);
    for (int i = 0; i < UNWIND_MAX_FRAMES; i++)
        if (i >= st->n)
            st->stack.pcs[i] = 0;
    return st->hash ? st->hash : 1;
}
