// CPython frames walked in BPF at the sample (docs/runtime-stacks.md, "In-BPF walkers"): the first of
// the in-BPF interpreter walkers. Compiled after common.h when the collector walks Python stacks
// (-DPY_WALK, collector/pywalk.py), and called by a family's program in the thread's own context: the
// on-CPU sample, and off-CPU's return to user space after a block (bpf/offcpu.c offcpu_resume: the thread
// has run no Python since it blocked, so its frames are where it blocked).
//
// py_procs holds, per CPython process, where its _PyRuntime is and the offsets the walk needs (struct
// py_proc: a version's layout from runtimes/cpython/layouts.py, checked and written by
// collector/pywalk.py). The walk:
//   1. the sampled thread's PyThreadState: the one py_tstates remembers for its thread id, if its
//      thread_id (pthread_self(), the thread's TCB: on x86-64 the fs base the kernel keeps in
//      task_struct.thread.fsbase) still matches; else the main interpreter's thread list, searched for it
//      (PY_THREAD_SCAN states at most) and remembered. Matching on the TCB, not the native thread id,
//      works in any pid namespace: a container's Python knows its threads by ids BPF does not see.
//   2. its current frame (3.11/3.12: through its _PyCFrame), then each frame's `previous`: one read of
//      the frame's first frame_bytes bytes, its code pointer (tag bits cleared), its instruction offset
//      in bytes from the code's first code unit, and whether it begins an _PyEval_EvalFrameDefault call
//      (PY_FRAME_ENTRY: 3.11's is_entry, or 3.12+'s shim frame below it, itself not recorded).
//   3. the frames go into a ring of PY_MAX_FRAMES: a walk past that many keeps the root-most ones (a
//      stack too deep is cut at its leaf end, never at its root), and a walk past PY_WALK_FRAMES ends
//      there (its cost is bounded: PY_STACK_TRUNCATED says it went on).
// The stack is stored under a 64-bit hash of every frame walked, in py_stacks_<family>_<buf>; the family's key
// carries the hash (0: no Python stack). Names, files and lines are made in user space from the code
// pointers (the walk reads no strings).
//
// Nothing is guessed: a frame that cannot be read, a null or misaligned code pointer, a frame that
// points at itself, ends the walk there, counted in py_counters by reason (PY_* below, named in
// collector/pywalk.py COUNTERS); what was walked so far is kept.
//
// Compiled with -DPY_PROCS, -DPY_STACK_ENTRIES and -DPY_TASK_FSBASE_OFFSET (task_struct.thread.fsbase in
// the running kernel's BTF) from collector/pywalk.py.

#define PY_MAX_FRAMES 64        // frames kept per stack; a power of two (ring index mask)
#ifndef PY_WALK_FRAMES          // (a test passes one no verifier takes: collector/main.py loads without it)
#define PY_WALK_FRAMES 512      // frames walked at most: what a 10,000-deep recursion costs
#endif
#define PY_THREAD_SCAN 64       // thread states searched for a thread not yet remembered
#define PY_FRAME_BYTES 128      // bytes of a frame read at most: every offset the walk uses lies below
#define PY_NO_OFFSET 0xffff     // a py_proc offset the version does not have
#define PY_NO_INSTR 0xffffffff  // a frame whose instruction pointer is not in its code (not started)
#define PY_MAX_INSTR (1 << 24)  // instruction offsets past this are not an instruction of the code

// struct py_frame flags.
#define PY_FRAME_ENTRY 1        // 3.11: the first frame of its _PyEval_EvalFrameDefault call
#define PY_FRAME_SHIM 2         // 3.12+: a shim, below the first frame of a call: not a Python frame

// struct py_stack flags.
#define PY_STACK_TRUNCATED 1    // the walk stopped at PY_WALK_FRAMES with frames left
#define PY_STACK_CUT 2          // the walk ended at a frame that failed validation (counted by reason)

// Indexes of py_counters.
#define PY_WALKS 0              // samples of a Python process walked
#define PY_FRAMES 1             // frames recorded
#define PY_NO_THREAD 2          // the sampled thread has no thread state (not a Python thread)
#define PY_BAD_READ 3           // a thread state or frame could not be read
#define PY_BAD_CODE 4           // a null or misaligned code pointer
#define PY_LOOP 5               // a frame whose previous frame is itself
#define PY_TRUNCATED 6          // walks that stopped at PY_WALK_FRAMES
#define PY_STACK_FULL 7         // py_stacks_<buf> was full: the sample has no Python stack
#define PY_BAD_PROC 8           // a py_proc whose offsets the walk cannot use (never written so)
#define PY_COUNTER_SLOTS 9

struct py_proc {
    u64 runtime;                // &_PyRuntime in the process
    u16 interpreters_head;      // _PyRuntime → the main interpreter
    u16 threads_head;           // interpreter → its newest thread state
    u16 tstate_next;
    u16 tstate_thread_id;
    u16 tstate_current_frame;   // 3.13+: the frame; 3.11/3.12: the _PyCFrame
    u16 cframe_current_frame;   // 3.11/3.12: the frame inside the _PyCFrame; else PY_NO_OFFSET
    u16 frame_previous;
    u16 frame_executable;
    u16 frame_instr_ptr;
    u16 frame_owner;
    u16 frame_is_entry;         // 3.11; else PY_NO_OFFSET
    u16 code_adaptive;          // the code object → its first code unit
    u16 frame_bytes;            // bytes of a frame read: 1 .. PY_FRAME_BYTES
    u8 skip_owners;             // bit n: frames owned by n are shims (3.12+: each begins a call)
    u8 tag_mask;                // low bits of a tagged code reference (3.14+)
    u8 entry_mask;              // 0xff where the version has frame_is_entry (3.11), else 0
    u8 pad8;
    u16 pad16;
};

struct py_frame {
    u64 code;                   // the code object
    u32 instr;                  // bytes from its first code unit to the instruction, or PY_NO_INSTR
    u32 flags;                  // PY_FRAME_*
};

struct py_stack {
    u32 walked;                 // frames walked; the ring holds the last min(walked, PY_MAX_FRAMES)
    u32 flags;                  // PY_STACK_*
    struct py_frame frames[PY_MAX_FRAMES];   // frame i of the walk (0: the leaf) at i % PY_MAX_FRAMES
};

struct py_scratch {
    u64 hash;
    u64 tstate;                 // the sampled thread's state, as py_thread_state found it
    u64 n, cut, frame_at, passed;   // the walk's state between its parts (see PY_FORGET)
    struct py_stack stack;
    u64 ring[PY_MAX_FRAMES];    // frame w of the walk's address at w % PY_MAX_FRAMES
    u64 frame[2 * PY_FRAME_BYTES / 8];   // twice the bytes read: a size masked to 2 * PY_FRAME_BYTES - 1 fits
};

BPF_HASH(py_procs, u32, struct py_proc, PY_PROCS);
BPF_TABLE("lru_hash", u32, u64, py_tstates, PY_PROCS * 16);   // thread id → its PyThreadState
// Per family and buffer: each family flips its own double buffer (oncpu_active, offcpu_active), and its
// drain empties the retired one's stacks.
BPF_HASH(py_stacks_oncpu_0, u64, struct py_stack, PY_STACK_ENTRIES);
BPF_HASH(py_stacks_oncpu_1, u64, struct py_stack, PY_STACK_ENTRIES);
BPF_HASH(py_stacks_offcpu_0, u64, struct py_stack, PY_STACK_ENTRIES);
BPF_HASH(py_stacks_offcpu_1, u64, struct py_stack, PY_STACK_ENTRIES);
// The families that walk, as py_walk's `slot`: on-CPU and off-CPU (a tracing program cannot interrupt
// another on its CPU, but the two never share a scratch slot).
#define PY_ONCPU 0
#define PY_OFFCPU 1
BPF_PERCPU_ARRAY(py_scratch, struct py_scratch, 2);
BPF_PERCPU_ARRAY(py_counters, u64, PY_COUNTER_SLOTS);

static __always_inline void py_count(int slot, u64 n) {
    u64 *c = py_counters.lookup(&slot);
    if (c)
        *c += n;
}

static __always_inline u64 py_read_u64(const void *at) {
    u64 v = 0;
    if (bpf_probe_read_user(&v, sizeof(v), at))
        return 0;
    return v;
}

// The u64 and the byte at `off` of the frame bytes read. The offset is masked, not checked: a check is
// a branch, one more state per frame for the verifier (collector/pywalk.py proc_entry refuses an offset
// past PY_FRAME_BYTES, and a u64's that is not 8-aligned).
static __always_inline u64 py_field(struct py_scratch *s, u32 off) {
    return s->frame[(off >> 3) & (PY_FRAME_BYTES / 8 - 1)];
}

static __always_inline u8 py_byte(struct py_scratch *s, u32 off) {
    return ((u8 *)s->frame)[off & (PY_FRAME_BYTES - 1)];
}

// The thread pointer of the current task: what pthread_self() returns in it (x86-64: the fs base).
static __always_inline u64 py_thread_pointer(void) {
    u64 tp = 0;
    bpf_probe_read_kernel(&tp, sizeof(tp), (char *)bpf_get_current_task() + PY_TASK_FSBASE_OFFSET);
    return tp;
}

// The PyThreadState of thread `tid` whose TCB is `tp`, or 0.
static __always_inline u64 py_thread_state(struct py_proc *p, u32 tid, u64 tp) {
    u64 *known = py_tstates.lookup(&tid);
    if (known && *known && py_read_u64((void *)(*known + p->tstate_thread_id)) == tp)
        return *known;
    u64 interp = py_read_u64((void *)(p->runtime + p->interpreters_head));
    if (!interp)
        return 0;
    u64 t = py_read_u64((void *)(interp + p->threads_head));
    for (int i = 0; i < PY_THREAD_SCAN && t; i++) {
        if (py_read_u64((void *)(t + p->tstate_thread_id)) == tp) {
            py_tstates.update(&tid, &t);
            return t;
        }
        t = py_read_u64((void *)(t + p->tstate_next));
    }
    return 0;
}

// `var` stored in the scratch and read back: what follows is then checked by the verifier once for every
// way the code before could reach it (each end of a loop, with its own count), not once per way: a
// value read from memory is one the verifier knows nothing of, so the states it reaches are alike.
#define PY_FORGET_AS(s, field, var) do {             \
        s->field = var;                               \
        asm volatile("" ::: "memory");                \
        var = *(volatile u64 *)&s->field;             \
    } while (0)
#define PY_FORGET(s, var) PY_FORGET_AS(s, var, var)

// Read the frame at `frame` and record it as frame `n` of the walk (ring slot n % PY_MAX_FRAMES), its
// `previous` into *previous: 0, or the PY_* reason it fails validation (nothing recorded).
static __always_inline u32 py_record(struct py_scratch *s, struct py_proc *p, u64 frame, u32 n, u32 size,
                                     u64 *previous) {
    // The size is masked where it is used: the verifier loses the bound checked by py_walk when the
    // compiler keeps it on the stack across the loop.
    if (bpf_probe_read_user(s->frame, size & (2 * PY_FRAME_BYTES - 1), (void *)frame))
        return PY_BAD_READ;
    u64 prev = py_field(s, p->frame_previous);
    u32 flags = ((p->skip_owners >> (py_byte(s, p->frame_owner) & 7)) & 1) * PY_FRAME_SHIM;
    flags |= (py_byte(s, p->frame_is_entry) & p->entry_mask) ? PY_FRAME_ENTRY : 0;
    u64 code = py_field(s, p->frame_executable) & ~(u64)p->tag_mask;
    if (prev == frame)
        return PY_LOOP;
    if (!code || (code & 7))
        return PY_BAD_CODE;
    u64 instr = py_field(s, p->frame_instr_ptr);
    u64 first = code + p->code_adaptive;
    u32 off = instr >= first && instr - first < PY_MAX_INSTR ? (u32)(instr - first) : PY_NO_INSTR;
    struct py_frame *f = &s->stack.frames[n & (PY_MAX_FRAMES - 1)];
    f->code = code;
    f->instr = off;
    f->flags = flags;
    s->hash = (((s->hash ^ code) * STACK_HASH_PRIME ^ off) * STACK_HASH_PRIME ^ flags) * STACK_HASH_PRIME;
    *previous = prev;
    return 0;
}

// Walk the Python frames of the current thread (pid, tid) of a process in py_procs into the family's
// py_stacks_<family>_<buf> (`slot` PY_ONCPU or PY_OFFCPU, also its scratch): the stack's hash, or 0
// (not a Python process or thread, or nothing walked).
static __always_inline u64 py_walk(u32 pid, u32 tid, u32 buf, u32 slot) {
    struct py_proc *p = py_procs.lookup(&pid);
    if (!p)
        return 0;
    struct py_scratch *s = py_scratch.lookup(&slot);
    if (!s)
        return 0;
    u32 size = p->frame_bytes;
    if (size == 0 || size > PY_FRAME_BYTES) {
        py_count(PY_BAD_PROC, 1);
        return 0;
    }
    py_count(PY_WALKS, 1);
    u64 tstate = py_thread_state(p, tid, py_thread_pointer());
    PY_FORGET(s, tstate);       // the thread scan's ends
    if (!tstate) {
        py_count(PY_NO_THREAD, 1);
        return 0;
    }
    u64 frame = py_read_u64((void *)(tstate + p->tstate_current_frame));
    if (frame && p->cframe_current_frame != PY_NO_OFFSET)
        frame = py_read_u64((void *)(frame + p->cframe_current_frame));

    s->hash = 0xcbf29ce484222325ULL;
    s->stack.flags = 0;
    // Three parts, so that the verifier's work is bounded by 2 * PY_MAX_FRAMES full frames, not by
    // PY_WALK_FRAMES of them (it walks a loop's body once per iteration: 512 full frames took minutes
    // to check on a 5.10 or 6.1 kernel under emulation):
    //   1. the leaf-most PY_MAX_FRAMES frames, recorded;
    //   2. past them, to PY_WALK_FRAMES, each frame's `previous` alone (every frame's address is kept
    //      in a ring of PY_MAX_FRAMES, the first part's too);
    //   3. the last PY_MAX_FRAMES of the walk (the root-most frames) read again and recorded, in order:
    //      the ring of frames then holds them, as if every frame had been recorded. Only a stack deeper
    //      than PY_MAX_FRAMES pays for parts 2 and 3.
    // Every frame recorded is a frame of the walk, shims too: a loop whose iterations all end alike is
    // one the verifier prunes. User space drops the shims.
    u64 n = 0;
    u64 cut = 0;
    for (u32 i = 0; i < PY_MAX_FRAMES && frame; i++) {
        u64 previous = 0;
        s->ring[i & (PY_MAX_FRAMES - 1)] = frame;
        cut = py_record(s, p, frame, n, size, &previous);
        if (cut)
            break;
        n++;
        frame = previous;
    }
    PY_FORGET(s, n);            // the first part's ends
    PY_FORGET(s, cut);
    PY_FORGET_AS(s, frame_at, frame);
    u64 passed = 0;
    if (!cut && frame) {
        for (u32 i = 0; i < PY_WALK_FRAMES - PY_MAX_FRAMES && frame; i++) {
            s->ring[i & (PY_MAX_FRAMES - 1)] = frame;
            u64 previous = 0;
            void *at = (void *)(frame + (p->frame_previous & (PY_FRAME_BYTES - 1)));
            if (bpf_probe_read_user(&previous, sizeof(previous), at)) {
                cut = PY_BAD_READ;
                break;
            }
            if (previous == frame) {
                cut = PY_LOOP;
                break;
            }
            passed++;
            frame = previous;
        }
        PY_FORGET(s, passed);   // the second part's ends
        PY_FORGET(s, cut);
        PY_FORGET_AS(s, frame_at, frame);
        // Frame w of the walk is at ring[w % PY_MAX_FRAMES] (the first part's too), so the last
        // PY_MAX_FRAMES of the n + passed walked are ring[(passed + j) % PY_MAX_FRAMES]: every one a
        // frame, whatever `passed` is (a loop with no early end, which the verifier checks once).
        for (u32 j = 0; j < PY_MAX_FRAMES; j++) {
            u32 w = (u32)passed + j;
            u64 previous = 0;
            if (py_record(s, p, s->ring[w & (PY_MAX_FRAMES - 1)], w, size, &previous)) {
                // A frame read a moment ago that cannot be read now: no stack rather than a mixed one.
                py_count(PY_BAD_READ, 1);
                return 0;
            }
        }
        n += passed;
    }
    if (cut) {
        py_count((int)(cut & 15), 1);
        s->stack.flags |= PY_STACK_CUT;
    }
    if (frame && !cut) {        // PY_WALK_FRAMES walked, and frames left
        py_count(PY_TRUNCATED, 1);
        s->stack.flags |= PY_STACK_TRUNCATED;
    }
    if (n == 0)
        return 0;
    py_count(PY_FRAMES, n);
    s->stack.walked = n;
    u64 hash = ((s->hash ^ s->stack.flags) * STACK_HASH_PRIME ^ n) * STACK_HASH_PRIME;
    hash = hash ? hash : 1;
    int err;
    if (slot == PY_ONCPU)
        err = buf == 0 ? py_stacks_oncpu_0.insert(&hash, &s->stack) : py_stacks_oncpu_1.insert(&hash, &s->stack);
    else
        err = buf == 0 ? py_stacks_offcpu_0.insert(&hash, &s->stack) : py_stacks_offcpu_1.insert(&hash, &s->stack);
    if (err != 0 && err != -EEXIST) {
        py_count(PY_STACK_FULL, 1);
        return 0;
    }
    return hash;
}
