"""Where a HotSpot compiled frame's return address is while its method is entering or returning (x86-64).

Between its prologue and its epilogue a compiled method's frame is whole: the return address is then
the frame size (CodeBlob::_frame_size words) above sp, which is how the reader walks. A thread sampled
on the method's first instructions (before its `sub rsp`, `push rbp`) or on its last ones (after its
`add rsp`, `pop rbp`, up to `ret`) has less than that on the stack, and the walk by frame size reads
a word of the caller's frame as the return address: the stack ends there or, worse, skips a frame.
Sampled on a call-heavy loop, that was 1-3% of a JVM's stacks cut at the called method.

This module decodes, forward from the sampled pc, the few instructions HotSpot's C1 and C2 emit in
those places (MacroAssembler::verified_entry and build_frame: the stack bang, `push rbp`, `mov rbp,
rsp`, `sub rsp`, `mov [rsp+d], rbp`, the nmethod entry barrier; remove_frame and the return: `add rsp`,
`pop rbp`, the return safepoint poll, `vzeroupper`, `ret`), and says how far sp is from where the
whole frame (prologue) or the return (epilogue) has it. Any other instruction ends the decode with no
answer, and the reader walks by frame size as before: a wrong guess is worse than a cut stack.

Owns: the instruction table and the two decodes. Must not: read memory (the reader passes the code
bytes) or know the VM's structures.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes of code the reader reads at a sampled pc: the longest prologue tail or epilogue decoded here
# (stack bang 7, push 1, mov rbp 3, sub 7, mov [rsp] 8, entry barrier 8 + 6; add 7, pop 1, poll 7 + 6,
# vzeroupper 3, ret 1) fits with room.
EDGE_CODE_BYTES = 64
# Instructions an epilogue has from its `add rsp` to its `ret`, at most (add, pop, two of the poll,
# vzeroupper, ret, and slack for one more): a longer run of known instructions is not an epilogue.
MAX_EPILOGUE_INSNS = 8

# What an instruction does to the frame: sp moves by `sp` bytes (down: negative); `rbp_save`: it stores
# the caller's rbp (push rbp, mov [rsp+d], rbp); `rbp_load`: it restores it (pop rbp); `ret`: the return.
_OTHER, _RBP_SAVE, _RBP_LOAD, _RET = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class _Insn:
    prefix: bytes
    length: int
    effect: int = _OTHER
    sp: int = 0  # fixed sp change; for sub/add rsp the immediate's size below
    imm: int = 0  # bytes of an immediate at the end that is the sp change (1 or 4)
    imm_sign: int = 0  # -1: sub rsp (sp goes down by it), +1: add rsp


# Longest prefixes first where one is a prefix of another.
_PROLOGUE = (
    _Insn(b"\x89\x84\x24", 7),  # mov [rsp+disp32], eax: the stack bang
    _Insn(b"\x55", 1, _RBP_SAVE, sp=-8),  # push rbp
    _Insn(b"\x48\x8b\xec", 3),  # mov rbp, rsp (PreserveFramePointer)
    _Insn(b"\x48\x89\xe5", 3),  # mov rbp, rsp (other encoding)
    _Insn(b"\x48\x83\xec", 4, imm=1, imm_sign=-1),  # sub rsp, imm8
    _Insn(b"\x48\x81\xec", 7, imm=4, imm_sign=-1),  # sub rsp, imm32
    _Insn(b"\x48\x89\x6c\x24", 5, _RBP_SAVE),  # mov [rsp+disp8], rbp
    _Insn(b"\x48\x89\xac\x24", 8, _RBP_SAVE),  # mov [rsp+disp32], rbp
    _Insn(b"\x41\x81\x7f", 8),  # cmp dword [r15+disp8], imm32: entry barrier
    _Insn(b"\x41\x83\x7f", 5),  # cmp dword [r15+disp8], imm8
    _Insn(b"\x0f\x85", 6),  # jne rel32 (its slow path; falls through)
    _Insn(b"\x75", 2),  # jne rel8
)
_EPILOGUE = (
    _Insn(b"\x48\x83\xc4", 4, imm=1, imm_sign=1),  # add rsp, imm8
    _Insn(b"\x48\x81\xc4", 7, imm=4, imm_sign=1),  # add rsp, imm32
    _Insn(b"\x5d", 1, _RBP_LOAD, sp=8),  # pop rbp
    _Insn(b"\x49\x3b\xa7", 7),  # cmp rsp, [r15+disp32]: the return poll (JDK 16+)
    _Insn(b"\x49\x3b\x67", 4),  # cmp rsp, [r15+disp8]: the same, its word near the thread's start (JDK 25)
    _Insn(b"\x0f\x87", 6),  # ja rel32: its slow path (falls through)
    _Insn(b"\x4d\x8b\x97", 7),  # mov r10, [r15+disp32]: the poll page (JDK 11)
    _Insn(b"\x41\x85\x02", 3),  # test [r10], eax: the poll (JDK 11)
    _Insn(b"\x85\x05", 6),  # test [rip+rel32], eax: a global poll page
    _Insn(b"\xc5\xf8\x77", 3),  # vzeroupper
    _Insn(b"\xc3", 1, _RET),  # ret
)


def _decode(code: bytes, at: int, table: tuple[_Insn, ...]) -> tuple[_Insn, int] | None:
    """The instruction at code[at:] and its sp change, if it is one of the table's and whole in code."""
    for insn in table:
        if code.startswith(insn.prefix, at) and at + insn.length <= len(code):
            sp = insn.sp
            if insn.imm:
                end = at + insn.length
                sp = insn.imm_sign * int.from_bytes(code[end - insn.imm : end], "little", signed=True)
            return insn, sp
    return None


@dataclass(frozen=True, slots=True)
class Edge:
    """Where a sampled thread's frame stands, in bytes from its sp.

    ret_at: the return address's slot; caller_rbp_at: the slot that holds the caller's rbp, or None
    when rbp itself still does (not yet saved, or already restored)."""

    ret_at: int
    caller_rbp_at: int | None


def in_prologue(code: bytes, frame_complete: int, frame_bytes: int) -> Edge | None:
    """A thread at code[0] (its pc), which is before its method's frame is complete, `frame_complete`
    bytes on: decode up to there, counting the sp changes still to come. None if an instruction on the
    way is not one of the prologue's or the decode does not land on frame_complete."""
    at, still_down, saves_ahead = 0, 0, False
    while at < frame_complete:
        got = _decode(code, at, _PROLOGUE)
        if got is None:
            return None
        insn, sp = got
        if sp > 0:
            return None  # sp goes up in a prologue: not one
        still_down -= sp
        saves_ahead = saves_ahead or insn.effect == _RBP_SAVE
        at += insn.length
    if at != frame_complete:
        return None
    # Once whole, the frame's return address is its last word: frame_bytes - 8 above the sp it will have.
    ret_at = frame_bytes - 8 - still_down
    if ret_at < 0:
        return None
    return Edge(ret_at, None if saves_ahead else ret_at - 8)


def in_epilogue(code: bytes) -> Edge | None:
    """A thread at code[0] (its pc), if that is in its method's epilogue: decode up to the `ret`,
    counting the sp changes still to come. None if an instruction on the way is not one of the
    epilogue's, or there is no `ret` within MAX_EPILOGUE_INSNS."""
    at, still_up, rbp_at = 0, 0, None
    for _ in range(MAX_EPILOGUE_INSNS):
        got = _decode(code, at, _EPILOGUE)
        if got is None:
            return None
        insn, sp = got
        if insn.effect == _RET:
            return Edge(still_up, rbp_at)
        if sp < 0:
            return None
        if insn.effect == _RBP_LOAD:
            rbp_at = still_up
        still_up += sp
        at += insn.length
    return None
