"""Ruby 3.3, 3.4 and 4.0 struct offsets, per minor version, as data (x86-64, default builds).

Owns: what the reader needs of each Ruby minor version: rb_vm_t (self, the
ractor part's main_ractor and main_thread), rb_thread_t (its list node in its
ractor, ractor, vm, native thread, execution context), rb_native_thread
(tid), rb_execution_context_t (vm_stack, vm_stack_size, cfp),
rb_control_frame_t (pc, iseq; its size), rb_iseq_t (body),
rb_iseq_constant_body (iseq_encoded, location: pathobj, label,
first_lineno; insns_info: body, size, succ_index_table), RString and RArray.

Sources: Ruby's vm_core.h, iseq.h, internal/string.h of each branch, and
rbspy's bindgen layouts of them (ruby-structs). 3.3 was checked against
Debian trixie's libruby-3.3 by walking a live process end to end (the
integration test reads it); 3.4 against Debian experimental's libruby-3.4
the same way; 4.0 is data only: no 4.0 build was reachable here, and the
offsets below are those of 3.4 that rbspy's 4.0 bindings leave unchanged
for the fields read. The reader's self-checks (the VM's thread points back to
it, every iseq is an imemo_iseq, every string a T_STRING) refuse or drop what
a wrong layout would give.

Must not: read memory.
"""

from __future__ import annotations

from dataclasses import dataclass

T_MASK, T_STRING, T_ARRAY, T_IMEMO = 0x1F, 0x05, 0x07, 0x1A
IMEMO_ISEQ = 7                      # (flags >> FL_USHIFT) & 0xf of an rb_iseq_t
FL_USHIFT = 12
STRING_NOEMBED = 1 << 13            # RSTRING_NOEMBED: the bytes are behind a pointer
ARRAY_EMBED = 1 << 13               # RARRAY_EMBED_FLAG
ARRAY_EMBED_LEN_SHIFT = 15          # RARRAY_EMBED_LEN_SHIFT (FL_USHIFT + 3)
ARRAY_EMBED_LEN_MASK = 0x7F << 15
# succ_index_table: the first IMMEDIATE_TABLE_SIZE positions' ranks in 6 words, then blocks.
SUCC_IMMEDIATE = 54
SUCC_IMM_BYTES = 48
SUCC_BLOCK_BYTES = 80                # rank (u32, padded), small_block_ranks (u64), bits[8]
INSN_INFO_ENTRY_BYTES = 12           # line_no, node_id, events


@dataclass(frozen=True)
class Layout:
    vm_self: int
    vm_main_ractor: int
    vm_main_thread: int
    th_node: int                     # ccan_list_node in the ractor's thread list
    th_ractor: int
    th_vm: int
    th_nt: int
    th_ec: int
    nt_tid: int
    ec_vm_stack: int
    ec_vm_stack_size: int            # in VALUEs
    ec_cfp: int
    cfp_pc: int
    cfp_iseq: int
    cfp_bytes: int                   # sizeof(rb_control_frame_t)
    iseq_body: int
    body_iseq_encoded: int
    body_pathobj: int
    body_label: int
    body_first_lineno: int
    body_insns_body: int
    body_insns_size: int
    body_succ_table: int
    str_len: int
    str_ptr: int                     # heap pointer, or the embedded bytes when not NOEMBED
    ary_embed: int                   # embedded elements
    ary_heap_ptr: int


_V33 = Layout(vm_self=0, vm_main_ractor=32, vm_main_thread=40, th_node=0, th_ractor=24, th_vm=32, th_nt=40,
              th_ec=48, nt_tid=24, ec_vm_stack=0, ec_vm_stack_size=8, ec_cfp=16, cfp_pc=0, cfp_iseq=16,
              cfp_bytes=56, iseq_body=16, body_iseq_encoded=8, body_pathobj=64, body_label=80,
              body_first_lineno=88, body_insns_body=112, body_insns_size=128, body_succ_table=136,
              str_len=16, str_ptr=24, ary_embed=16, ary_heap_ptr=32)

LAYOUTS: dict[tuple[int, int], Layout] = {
    (3, 3): _V33,
    (3, 4): _V33,
    (4, 0): _V33,                   # as data only
}
