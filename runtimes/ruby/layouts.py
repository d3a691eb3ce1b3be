"""Ruby 3.3, 3.4 and 4.0 struct offsets, per minor version, as data (x86-64, default builds).

Owns: what the reader needs of each Ruby minor version: rb_vm_t (self, the
ractor part's set of ractors, main_ractor and main_thread), rb_ractor_t (its
node in the VM's set, the head of its threads' list), rb_thread_t (its list
node in its ractor, ractor, vm, native thread, execution context),
rb_native_thread (tid), rb_execution_context_t (vm_stack, vm_stack_size,
cfp), rb_control_frame_t (pc, iseq, ep; its size), the method entry (owner),
a class (its rb_classext_t's classpath and attached_object, where the class
ends and its classext begins; the singleton flag), a C function's method
entry (def, called_id) and definition (type, original_id), the global
symbol table (rb_symbols_t: last_id, ids; tLAST_OP_ID, ID_ENTRY_UNIT), the
frame type of a C function's frame, rb_iseq_t (body),
rb_iseq_constant_body (iseq_encoded, location: pathobj, base_label, label,
first_lineno; insns_info: body, size, succ_index_table), RString and RArray.

Sources: Ruby's vm_core.h, method.h, internal/class.h, iseq.h,
internal/string.h, symbol.h, symbol.c, id.h of each branch, and rbspy's
bindgen layouts of them
(ruby-structs: ruby_3_3_8.rs, ruby_3_4_7.rs, ruby_4_0_0.rs), whose offsets
were taken with rustc's offset_of! on those files. 3.3 was checked against
Debian trixie's libruby-3.3 by walking a live process end to end (the
integration test reads it: classes, singleton classes, a second ractor, C
functions named through the symbol table); 3.4
against Debian experimental's libruby-3.4 the same way; 4.0 is data only: no
4.0 build was reachable here. 4.0 moved the ractor's threads and its node in
the VM's set (its sync part shrank) and the classext (RClass lost super and
m_tbl to the classext, which now starts at 24). The reader's self-checks
(the VM's thread points back to it, every thread to its VM and ractor, every
iseq is an imemo_iseq, every method entry an imemo_ment, every owner a class
or module, every string a T_STRING, a C function's definition of type CFUNC,
the symbol table naming the operators' serials) refuse or drop what a wrong
layout would give.

Must not: read memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

T_MASK, T_CLASS, T_MODULE, T_STRING, T_ARRAY, T_IMEMO = 0x1F, 0x02, 0x03, 0x05, 0x07, 0x1A
# (flags >> FL_USHIFT) & IMEMO_MASK of an imemo: an rb_iseq_t, a method entry, an svar (3.3 to 4.0).
IMEMO_MASK, IMEMO_ISEQ, IMEMO_MENT, IMEMO_SVAR = 0xF, 7, 6, 2
SVAR_CREF_OR_ME = 8  # struct vm_svar: flags, cref_or_me
# An environment: ep[-2] the method entry or cref, ep[-1] the previous ep (low 2 bits tags), ep[0] flags.
EP_ME_CREF, EP_SPECVAL, EP_FLAGS = -16, -8, 0
ENV_FLAG_LOCAL = 0x2  # VM_ENV_FLAG_LOCAL: the method's own environment, not a block's
FL_USHIFT = 12
STRING_NOEMBED = 1 << 13  # RSTRING_NOEMBED: the bytes are behind a pointer
ARRAY_EMBED = 1 << 13  # RARRAY_EMBED_FLAG
ARRAY_EMBED_LEN_SHIFT = 15  # RARRAY_EMBED_LEN_SHIFT (FL_USHIFT + 3)
ARRAY_EMBED_LEN_MASK = 0x7F << 15
# succ_index_table: the first IMMEDIATE_TABLE_SIZE positions' ranks in 6 words, then blocks.
SUCC_IMMEDIATE = 54
SUCC_IMM_BYTES = 48
SUCC_BLOCK_BYTES = 80  # rank (u32, padded), small_block_ranks (u64), bits[8]
INSN_INFO_ENTRY_BYTES = 12  # line_no, node_id, events
# A frame's type, in its environment's flags (ep[0]): VM_FRAME_MAGIC_MASK and VM_FRAME_MAGIC_CFUNC (vm_core.h,
# the same in 3.3, 3.4 and 4.0): a C function's frame, whose ep[-2] is its method entry.
FRAME_MAGIC_MASK, FRAME_MAGIC_CFUNC = 0x7FFF0001, 0x55550001
# rb_method_definition_t's type: its first 4 bits (method.h: `rb_method_type_t type : 4`); VM_METHOD_TYPE_CFUNC.
METHOD_TYPE_MASK, METHOD_TYPE_CFUNC = 0xF, 1
# An ID past tLAST_OP_ID carries its serial above RUBY_ID_SCOPE_SHIFT bits (symbol.h: rb_id_to_serial).
ID_SCOPE_SHIFT = 4
# The symbol table's ids: an array of arrays of ID_ENTRY_UNIT serials, ID_ENTRY_SIZE values each (symbol.c),
# the name (an fstring) at ID_ENTRY_STR.
ID_ENTRY_UNIT, ID_ENTRY_SIZE, ID_ENTRY_STR = 512, 2, 0


@dataclass(frozen=True)
class Layout:
    vm_self: int
    vm_ractor_set: int  # ccan_list_head of every ractor's vmlr_node
    vm_main_ractor: int
    vm_main_thread: int
    ractor_threads: int  # ccan_list_head of the ractor's threads (their th_node)
    ractor_node: int  # vmlr_node, its ccan_list_node in vm_ractor_set
    th_node: int  # ccan_list_node in the ractor's thread list
    th_ractor: int
    th_vm: int
    th_nt: int
    th_ec: int
    nt_tid: int
    ec_vm_stack: int
    ec_vm_stack_size: int  # in VALUEs
    ec_cfp: int
    cfp_pc: int
    cfp_iseq: int
    cfp_ep: int
    cfp_bytes: int  # sizeof(rb_control_frame_t)
    me_owner: int  # rb_method_entry_t.owner: the class or module the method is in
    class_attached: int  # RCLASS_EXT(c)->as.singleton_class.attached_object
    class_path: int  # RCLASS_EXT(c)->classpath
    fl_singleton: int  # RUBY_FL_SINGLETON: a singleton class (a class method's owner)
    iseq_body: int
    body_iseq_encoded: int
    body_pathobj: int
    body_base_label: int  # the method's name in a block's iseq ("cpu_a" of "block in cpu_a")
    body_label: int
    body_first_lineno: int
    body_insns_body: int
    body_insns_size: int
    body_succ_table: int
    str_len: int
    str_ptr: int  # heap pointer, or the embedded bytes when not NOEMBED
    ary_embed: int  # embedded elements
    ary_heap_len: int  # as.heap.len (an embedded array's length is in its flags)
    ary_heap_ptr: int
    me_def: int  # rb_method_entry_t.def: its rb_method_definition_t
    me_called_id: int  # the ID it was called by (an alias's name)
    def_original_id: int  # rb_method_definition_t.original_id: the method's own name, an ID
    last_op_id: int  # tLAST_OP_ID (id.h): IDs up to it are operators, their serial the ID itself
    sym_last_id: int  # rb_symbols_t (ruby_global_symbols).last_id: the newest serial (a u32)
    sym_ids: int  # rb_symbols_t.ids: the array of arrays of each serial's name and symbol


_V33 = Layout(
    vm_self=0,
    vm_ractor_set=8,
    vm_main_ractor=32,
    vm_main_thread=40,
    ractor_threads=256,
    ractor_node=432,
    th_node=0,
    th_ractor=24,
    th_vm=32,
    th_nt=40,
    th_ec=48,
    nt_tid=24,
    ec_vm_stack=0,
    ec_vm_stack_size=8,
    ec_cfp=16,
    cfp_pc=0,
    cfp_iseq=16,
    cfp_ep=32,
    cfp_bytes=56,
    me_owner=32,
    class_attached=32 + 96,
    class_path=32 + 120,
    fl_singleton=1 << 12,
    iseq_body=16,
    body_iseq_encoded=8,
    body_pathobj=64,
    body_base_label=72,
    body_label=80,
    body_first_lineno=88,
    body_insns_body=112,
    body_insns_size=128,
    body_succ_table=136,
    str_len=16,
    str_ptr=24,
    ary_embed=16,
    ary_heap_len=16,
    ary_heap_ptr=32,
    me_def=16,
    me_called_id=24,
    def_original_id=32,  # after 8 bytes of bit fields (type, flags, reference_count) and a 24-byte body union
    last_op_id=169,
    sym_last_id=0,
    sym_ids=16,  # after last_id (padded) and str_sym
)
# 3.4: the singleton flag moved from FL_USER0 to FL_USER1.
# tLAST_OP_ID is 170 (one more operator token in id.h).
_V34 = replace(_V33, fl_singleton=1 << 13, last_op_id=170)
# 4.0: the ractor's sync part shrank (its threads and node moved 72 bytes down); RClass is 24 bytes and
# its classext starts with the box, super, fields, m_tbl (attached_object at 24 + 112, classpath 24 + 128).
# Its rb_symbols_t is last_id, sym_set, ids (ids still at 16); tLAST_OP_ID is 171.
_V40 = replace(
    _V34,
    ractor_threads=184,
    ractor_node=360,
    class_attached=24 + 112,
    class_path=24 + 128,
    last_op_id=171,
)

LAYOUTS: dict[tuple[int, int], Layout] = {
    (3, 3): _V33,
    (3, 4): _V34,
    (4, 0): _V40,  # as data only
}
