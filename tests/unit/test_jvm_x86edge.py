"""Where a compiled Java frame's return address is while its method enters or returns, on code recorded
from the JVMs the integration tests run (tests/integration/test_jvm_cpu.py's JvmSpin.step, C2, a
four-word frame) and on HotSpot's stack-bang prologue as its assembler emits it.

Given the bytes at a sampled pc, when x86edge decodes them, then:
- on a prologue's first instruction the return address is at sp, and the caller's rbp is still in rbp;
- part way through it, the sp changes still to come are counted (after `sub rsp, 0x18`: 24 bytes up);
- in an epilogue, the sp changes up to the `ret` are counted, and where `pop rbp` will read is named;
- the method's body, an inline-cache check and a decode that overshoots frame_complete are not edges
  (None: the reader walks by frame size, as for any whole frame).
"""

from __future__ import annotations

import pytest

from runtimes.jvm.x86edge import Edge, in_epilogue, in_prologue

FRAME_BYTES = 32  # step's frame: 4 words (return address, rbp, two of its own)

# C2's verified entry of step (sub rsp, 0x18; mov [rsp+0x10], rbp), then, from JDK 21, the nmethod entry
# barrier (cmp dword [r15+0x20], 1; jne), then the body (from `mov r11d, 1` / `mov r10, imm64`).
PROLOGUE = {
    "11": (12, bytes.fromhex("4881ec1800000048896c241049ba4f8167f77e7b051449bb2d7f954c2df45158490faff34903f249")),
    "17": (12, bytes.fromhex("4881ec1800000048896c241041bb0100000049ba2d7f954c2df45158490faff249b84f8167f77e7b")),
    "21": (26, bytes.fromhex("4881ec1800000048896c241041817f20010000000f858a00000041bb0100000049ba2d7f954c2df4")),
    "25": (26, bytes.fromhex("4881ec1800000048896c241041817f20010000000f858700000041bb0100000049ba2d7f954c2df4")),
}
# C2's return of step: add rsp, 0x10; pop rbp; the return poll (JDK 11: mov r10, [r15+0x108]; test [r10],
# eax; JDK 16+: cmp rsp, [r15+disp]; ja); ret. JDK 21's recorded whole; JDK 11's recorded from its poll
# on, its add and pop as JDK 21's (the same frame).
EPILOGUE_11 = bytes.fromhex("4883c4105d4d8b9708010000418502c3f4f4f4f4")
EPILOGUE_21 = bytes.fromhex("4883c4105d493ba7480400000f8701000000c349ba00028d70437f0000")
# JDK 25's, recorded from its pop rbp on (an AMD EPYC host; its add as JDK 21's): the poll word at
# [r15+0x28], so cmp rsp, [r15+disp8].
EPILOGUE_25 = bytes.fromhex("4883c410") + bytes.fromhex("5d493b67280f8701000000c349ba8ffd8cf4ce7f0000")
# The loop of step's body (imul, add), recorded from JDK 17.
BODY = bytes.fromhex("490faff24903f0490faff24903f0490faff24903f0458bcb4183c1044183f93d7cd4")


@pytest.mark.parametrize("jdk", sorted(PROLOGUE))
def test_on_the_first_instruction_the_return_address_is_at_sp(jdk: str) -> None:
    complete, code = PROLOGUE[jdk]
    assert in_prologue(code, complete, FRAME_BYTES) == Edge(ret_at=0, caller_rbp_at=None)


@pytest.mark.parametrize("jdk", sorted(PROLOGUE))
def test_after_sub_rsp_the_frame_is_counted_and_rbp_is_not_yet_saved(jdk: str) -> None:
    complete, code = PROLOGUE[jdk]
    assert in_prologue(code[7:], complete - 7, FRAME_BYTES) == Edge(ret_at=24, caller_rbp_at=None)


@pytest.mark.parametrize("jdk", ["21", "25"])
def test_on_the_entry_barrier_the_frame_is_whole_and_rbp_saved_below_the_return_address(jdk: str) -> None:
    complete, code = PROLOGUE[jdk]
    assert in_prologue(code[12:], complete - 12, FRAME_BYTES) == Edge(ret_at=24, caller_rbp_at=16)


def test_a_stack_bang_prologue_counts_push_rbp_and_sub_rsp() -> None:
    # mov [rsp-0x14000], eax; push rbp; sub rsp, 0x30: verified_entry with a stack bang, a 64-byte frame.
    code = bytes.fromhex("89842400c0feff554883ec30") + BODY
    assert in_prologue(code, 12, 64) == Edge(ret_at=0, caller_rbp_at=None)  # on the bang
    assert in_prologue(code[7:], 5, 64) == Edge(ret_at=0, caller_rbp_at=None)  # on push rbp
    assert in_prologue(code[8:], 4, 64) == Edge(ret_at=8, caller_rbp_at=0)  # pushed, on sub rsp


@pytest.mark.parametrize("code", [EPILOGUE_11, EPILOGUE_21, EPILOGUE_25], ids=["11", "21", "25"])
def test_an_epilogue_counts_what_is_popped_before_the_ret(code: bytes) -> None:
    assert in_epilogue(code) == Edge(ret_at=24, caller_rbp_at=16)  # on add rsp, 0x10: still whole
    assert in_epilogue(code[4:]) == Edge(ret_at=8, caller_rbp_at=0)  # on pop rbp
    assert in_epilogue(code[5:]) == Edge(ret_at=0, caller_rbp_at=None)  # on the poll: rbp restored
    ret = code.index(b"\xc3")
    assert in_epilogue(code[ret:]) == Edge(ret_at=0, caller_rbp_at=None)


def test_the_body_and_unknown_code_are_not_edges() -> None:
    assert in_epilogue(BODY) is None
    assert in_prologue(BODY, 12, FRAME_BYTES) is None
    # An instance method's inline-cache check before its verified entry: not decoded, not guessed.
    uep = bytes.fromhex("448b5608493bc20f85") + PROLOGUE["17"][1]
    assert in_prologue(uep, 9 + 12, FRAME_BYTES) is None
    # frame_complete inside an instruction: the decode overshoots it, so it is not this prologue.
    complete, code = PROLOGUE["21"]
    assert in_prologue(code, complete - 1, FRAME_BYTES) is None
    # sp going up in a prologue, or down in an epilogue.
    assert in_prologue(bytes.fromhex("4883c410") + BODY, 4, FRAME_BYTES) is None
    assert in_epilogue(bytes.fromhex("4883ec10c3")) is None
    # Code that ends before its ret or before frame_complete.
    assert in_epilogue(EPILOGUE_21[:10]) is None
    assert in_prologue(code[:10], complete, FRAME_BYTES) is None
