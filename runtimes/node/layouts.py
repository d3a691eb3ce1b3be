"""Node.js: what the v8dbg_ symbols do not say, per V8 version, as data (x86-64, no pointer compression).

Owns: per supported V8 major.minor, where the Isolate keeps its
ThreadLocalTop and fast-C-call caller frame pointer (IsolateData; the
numbers are v8::internal::Internals::kIsolateThreadLocalTopOffset and
kIsolateFastCCallCallerFpOffset of each release's include/node/v8-internal.h,
compiled and printed), and where ThreadLocalTop keeps c_entry_fp_, isolate_,
js_entry_sp_ and current_vm_state_ (V8 11.3's and 12.4+'s
src/execution/thread-local-top.h; confirmed on each runtime by reading a
process blocked in Atomics.wait: isolate_ points back at the isolate,
c_entry_fp_ and js_entry_sp_ into the stack, the VM state is ATOMICS_WAIT).
Everything else (frame slots, object fields, type numbers) is read from the
binary's v8dbg_ symbols.

Node 20 (V8 11.3), 22 (12.4), 24 (13.6) and 26 (14.6) are read end to end by
tests/integration/test_node_stacks.py.

Must not: read memory or decide which version a process runs (detect does).
"""

from __future__ import annotations

from dataclasses import dataclass

# v8::StateTag (include/v8-unwinder.h): the same numbers in every supported release.
VM_STATES = (
    "JS",
    "GC",
    "PARSER",
    "BYTECODE_COMPILER",
    "COMPILER",
    "OTHER",
    "EXTERNAL",
    "ATOMICS_WAIT",
    "IDLE",
    "LOGGING",
    "IDLE_EXTERNAL",
)


@dataclass(frozen=True)
class Layout:
    thread_local_top: int  # in the Isolate (IsolateData is its first member)
    fast_c_call_caller_fp: int  # in the Isolate: set while optimized code is in a fast API call
    stack_guard_isolate: int  # StackGuard::isolate_, the Isolate's first pointer back at itself
    tlt_c_entry_fp: int  # in ThreadLocalTop
    tlt_isolate: int
    tlt_js_entry_sp: int
    tlt_vm_state: int

    @property
    def tlt_bytes(self) -> int:
        return max(self.tlt_c_entry_fp, self.tlt_isolate, self.tlt_js_entry_sp, self.tlt_vm_state) + 8


def _v12(tlt: int, fast_fp: int) -> Layout:
    return Layout(
        thread_local_top=tlt,
        fast_c_call_caller_fp=fast_fp,
        stack_guard_isolate=8,
        tlt_c_entry_fp=0,
        tlt_isolate=96,
        tlt_js_entry_sp=152,
        tlt_vm_state=168,
    )


LAYOUTS: dict[tuple[int, int], Layout] = {
    (11, 3): Layout(
        thread_local_top=264,
        fast_c_call_caller_fp=232,
        stack_guard_isolate=8,
        tlt_c_entry_fp=120,
        tlt_isolate=8,
        tlt_js_entry_sp=152,
        tlt_vm_state=168,
    ),  # Node 20
    (12, 4): _v12(272, 240),  # Node 22
    (13, 6): _v12(320, 296),  # Node 24
    (14, 6): _v12(328, 304),  # Node 26
}

SUPPORTED = "V8 11.3, 12.4, 13.6 and 14.6 (Node 20, 22, 24, 26)"
