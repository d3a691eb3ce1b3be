/* A process that looks like CPython 3.13 to the runtime reader, built so that
 * what the reader must refuse or drop is known exactly.
 *
 * Built as .../python3.13 (or python3.10), it exports what the reader looks
 * for: _PyRuntime starting with a _Py_DebugOffsets struct (cookie "xdebugpy",
 * version, free-threading flag and the offsets of its own small fake
 * structs), Py_Version, PyCode_Type and PyType_Type. One interpreter, one
 * thread state (this thread's native id), and a chain of frames, leaf first:
 *
 *   F0  leaf_fn (/fake/app.py) at code unit 2: line 12        kept
 *   F1  executable is not a code object (an "int")            dropped: not_code
 *   F2  instruction pointer before the code                   dropped: bad_instruction_pointer
 *   F3  instruction pointer past the location table           dropped: impossible_line
 *   F4  executable is an unmapped address                     dropped: bad_pointer
 *   F5  owned by the C stack (a shim frame)                   skipped, not counted
 *   F6  Outer.root_fn (/fake/app.py) at code unit 0: line 20  kept
 *   F6's previous is F1 again                                 dropped: loop (the walk ends)
 *
 * argv[1] picks a variant: ok (the above), free-threaded (the debug offsets
 * say Py_GIL_DISABLED), selfcheck (PyCode_Type is not a type object), py310
 * (Py_Version says 3.10.0), hostile-offsets (a str's length lies past its
 * header: a reader trusting it would unpack beyond what it read). It prints {"tid": N} once set up, then waits for
 * stdin to close (or 240 s) and exits.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* CPython 3.13's _Py_DebugOffsets (Include/internal/pycore_runtime.h), field by field. */
struct debug_offsets {
    char cookie[8];
    uint64_t version;
    uint64_t free_threaded;
    struct { uint64_t size, finalizing, interpreters_head; } runtime_state;
    struct { uint64_t size, id, next, threads_head, gc, imports_modules, sysdict, builtins, ceval_gil,
             gil_runtime_state, gil_runtime_state_enabled, gil_runtime_state_locked,
             gil_runtime_state_holder; } interpreter_state;
    struct { uint64_t size, prev, next, interp, current_frame, thread_id, native_thread_id,
             datastack_chunk, status; } thread_state;
    struct { uint64_t size, previous, executable, instr_ptr, localsplus, owner; } interpreter_frame;
    struct { uint64_t size, filename, name, qualname, linetable, firstlineno, argcount, localsplusnames,
             localspluskinds, co_code_adaptive; } code_object;
    struct { uint64_t size, ob_type; } pyobject;
    struct { uint64_t size, tp_name, tp_repr, tp_flags; } type_object;
    struct { uint64_t size, ob_item, ob_size; } tuple_object;
    struct { uint64_t size, ob_item, ob_size; } list_object;
    struct { uint64_t size, ma_keys, ma_values; } dict_object;
    struct { uint64_t size, ob_fval; } float_object;
    struct { uint64_t size, lv_tag, ob_digit; } long_object;
    struct { uint64_t size, ob_size, ob_sval; } bytes_object;
    struct { uint64_t size, state, length, asciiobject_size; } unicode_object;
};

/* The fake objects: the reader learns every offset below from the debug offsets. */
struct type_obj { uint64_t refcnt; const void *ob_type; uint64_t ob_size; const char *tp_name; };
struct str_obj { uint64_t refcnt; const void *ob_type; uint64_t length; uint32_t state, pad; char data[64]; };
struct bytes_obj { uint64_t refcnt; const void *ob_type; uint64_t ob_size; uint64_t hash; unsigned char sval[16]; };
struct code_obj {
    uint64_t refcnt; const void *ob_type;
    const void *filename, *name, *qualname, *linetable;
    int32_t firstlineno, pad; uint64_t pad2;
    uint16_t code[16];                       /* co_code_adaptive: 16 code units */
};
struct frame { const void *previous; uint64_t executable; uint64_t instr_ptr; uint64_t localsplus; uint8_t owner; };
struct tstate { const void *prev, *next, *interp; const void *current_frame; uint64_t thread_id, native_thread_id; };
struct interp { uint64_t id; const void *next; const void *threads_head; };
struct runtime { struct debug_offsets dbg; uint64_t finalizing; const void *interpreters_head; };

struct type_obj PyType_Type = {1, &PyType_Type, 0, "type"};
struct type_obj PyCode_Type = {1, &PyType_Type, 0, "code"};
struct type_obj PyLong_Type = {1, &PyType_Type, 0, "int"};
unsigned long Py_Version = 0x030D05F0;   /* 3.13.5 final */
struct runtime _PyRuntime;

/* kind 1 (<< 2), compact (<< 5), ascii (<< 6) */
#define ASCII_STATE ((1u << 2) | (1u << 5) | (1u << 6))
static struct str_obj s_file = {1, 0, 12, ASCII_STATE, 0, "/fake/app.py"};
static struct str_obj s_leaf = {1, 0, 7, ASCII_STATE, 0, "leaf_fn"};
static struct str_obj s_root = {1, 0, 7, ASCII_STATE, 0, "root_fn"};
static struct str_obj s_root_q = {1, 0, 13, ASCII_STATE, 0, "Outer.root_fn"};
/* Two entries of code 13 (a signed line delta), 2 code units each: units 0-1 at
 * firstlineno + 0, units 2-3 at + 2. The table covers 4 code units. */
static struct bytes_obj linetable = {1, 0, 4, 0, {0x80 | 13 << 3 | 1, 0x00, 0x80 | 13 << 3 | 1, 0x04}};
static struct code_obj leaf_code = {1, &PyCode_Type, &s_file, &s_leaf, &s_leaf, &linetable, 10, 0, 0, {0}};
static struct code_obj root_code = {1, &PyCode_Type, &s_file, &s_root, &s_root_q, &linetable, 20, 0, 0, {0}};
static struct { uint64_t refcnt; const void *ob_type; uint64_t value; } an_int = {1, &PyLong_Type, 7};
static struct frame f[7];
static struct tstate thread;
static struct interp interp;

#define UNIT(obj, n) ((uint64_t)(uintptr_t)&(obj).code[0] + 2 * (n))

int main(int argc, char **argv) {
    const char *variant = argc > 1 ? argv[1] : "ok";
    struct debug_offsets *d = &_PyRuntime.dbg;
    memcpy(d->cookie, "xdebugpy", 8);
    if (!strcmp(variant, "py310"))
        Py_Version = 0x030A00F0;
    if (!strcmp(variant, "selfcheck"))
        PyCode_Type.ob_type = &PyLong_Type;
    d->version = 0x030D05F0;
    d->free_threaded = !strcmp(variant, "free-threaded");
    d->runtime_state.size = sizeof(struct runtime);
    d->runtime_state.finalizing = offsetof(struct runtime, finalizing);
    d->runtime_state.interpreters_head = offsetof(struct runtime, interpreters_head);
    d->interpreter_state.size = sizeof(struct interp);
    d->interpreter_state.id = offsetof(struct interp, id);
    d->interpreter_state.next = offsetof(struct interp, next);
    d->interpreter_state.threads_head = offsetof(struct interp, threads_head);
    d->thread_state.size = sizeof(struct tstate);
    d->thread_state.prev = offsetof(struct tstate, prev);
    d->thread_state.next = offsetof(struct tstate, next);
    d->thread_state.interp = offsetof(struct tstate, interp);
    d->thread_state.current_frame = offsetof(struct tstate, current_frame);
    d->thread_state.thread_id = offsetof(struct tstate, thread_id);
    d->thread_state.native_thread_id = offsetof(struct tstate, native_thread_id);
    d->interpreter_frame.size = sizeof(struct frame);
    d->interpreter_frame.previous = offsetof(struct frame, previous);
    d->interpreter_frame.executable = offsetof(struct frame, executable);
    d->interpreter_frame.instr_ptr = offsetof(struct frame, instr_ptr);
    d->interpreter_frame.localsplus = offsetof(struct frame, localsplus);
    d->interpreter_frame.owner = offsetof(struct frame, owner);
    d->code_object.size = sizeof(struct code_obj);
    d->code_object.filename = offsetof(struct code_obj, filename);
    d->code_object.name = offsetof(struct code_obj, name);
    d->code_object.qualname = offsetof(struct code_obj, qualname);
    d->code_object.linetable = offsetof(struct code_obj, linetable);
    d->code_object.firstlineno = offsetof(struct code_obj, firstlineno);
    d->code_object.co_code_adaptive = offsetof(struct code_obj, code);
    d->pyobject.size = 16;
    d->pyobject.ob_type = offsetof(struct type_obj, ob_type);
    d->type_object.size = sizeof(struct type_obj);
    d->type_object.tp_name = offsetof(struct type_obj, tp_name);
    d->bytes_object.size = sizeof(struct bytes_obj);
    d->bytes_object.ob_size = offsetof(struct bytes_obj, ob_size);
    d->bytes_object.ob_sval = offsetof(struct bytes_obj, sval);
    d->unicode_object.size = sizeof(struct str_obj);
    d->unicode_object.state = offsetof(struct str_obj, state);
    d->unicode_object.length = offsetof(struct str_obj, length);
    d->unicode_object.asciiobject_size = offsetof(struct str_obj, data);
    if (!strcmp(variant, "hostile-offsets"))
        d->unicode_object.length = 4000;

    f[0] = (struct frame){&f[1], (uintptr_t)&leaf_code, UNIT(leaf_code, 2), 0, 0};
    f[1] = (struct frame){&f[2], (uintptr_t)&an_int, 0, 0, 0};
    f[2] = (struct frame){&f[3], (uintptr_t)&leaf_code, (uintptr_t)&leaf_code, 0, 0};
    f[3] = (struct frame){&f[4], (uintptr_t)&root_code, UNIT(root_code, 10), 0, 0};
    f[4] = (struct frame){&f[5], 0x10000, 0, 0, 0};
    f[5] = (struct frame){&f[6], (uintptr_t)&root_code, UNIT(root_code, 0), 0, 3};
    f[6] = (struct frame){&f[1], (uintptr_t)&root_code, UNIT(root_code, 0), 0, 0};
    thread = (struct tstate){0, 0, &interp, &f[0], 1, (uint64_t)gettid()};
    interp = (struct interp){0, 0, &thread};
    _PyRuntime.interpreters_head = &interp;

    printf("{\"tid\": %d}\n", gettid());
    fflush(stdout);
    alarm(240);   /* ends by itself even if the test cannot end it */
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {
    }
    return 0;
}
