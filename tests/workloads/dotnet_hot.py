"""A .NET runtime hosted in Python (pythonnet), running a JIT-compiled method hot.

Usage: dotnet_hot.py DOTNET_ROOT FRAMEWORK_VERSION MODE SECONDS
  hot:   HotLoopEbpfTest (a DynamicMethod, compiled by the JIT at its first call) runs in a loop,
         a fresh method FreshEbpfTest_<n> is compiled and called every FRESH_EVERY_S between runs;
  fresh: only the fresh methods, sleeping in between (a process that is mostly off CPU).
Prints "ready <pid>" once the runtime runs the method, then "fresh <n>" after each FreshEbpfTest_<n>
has been compiled and called. Ends by itself after SECONDS.
"""

import json
import os
import sys
import tempfile
import time

FRESH_EVERY_S = 0.5
HOT_ITERATIONS = 50_000_000

root, version, mode, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
deadline = time.monotonic() + seconds
from clr_loader import get_coreclr  # noqa: E402 - pythonnet's runtime is chosen before clr is imported
from pythonnet import set_runtime  # noqa: E402

with tempfile.NamedTemporaryFile("w", suffix=".runtimeconfig.json", delete=False) as cfg:
    json.dump({"runtimeOptions": {"framework": {"name": "Microsoft.NETCore.App", "version": version}}}, cfg)
set_runtime(get_coreclr(runtime_config=cfg.name, dotnet_root=root))
import clr  # noqa: E402,F401
from System import Array, Int64, Object, Type  # noqa: E402
from System.Reflection.Emit import DynamicMethod, OpCodes  # noqa: E402

os.unlink(cfg.name)


def method(name: str) -> DynamicMethod:
    """long name(long n) { long s = 0; for (long i = 0; i < n; i++) s = (s ^ i * i) + i; return s; }"""
    dm = DynamicMethod(name, Int64, Array[Type]([Int64]))
    il = dm.GetILGenerator()
    s, i = il.DeclareLocal(Int64), il.DeclareLocal(Int64)
    top, cond = il.DefineLabel(), il.DefineLabel()
    for local in (s, i):
        il.Emit(OpCodes.Ldc_I8, Int64(0))
        il.Emit(OpCodes.Stloc, local)
    il.Emit(OpCodes.Br, cond)
    il.MarkLabel(top)
    for op in (
        (OpCodes.Ldloc, s),
        (OpCodes.Ldloc, i),
        (OpCodes.Ldloc, i),
        (OpCodes.Mul,),
        (OpCodes.Xor,),
        (OpCodes.Ldloc, i),
        (OpCodes.Add,),
        (OpCodes.Stloc, s),
        (OpCodes.Ldloc, i),
    ):
        il.Emit(*op)
    il.Emit(OpCodes.Ldc_I8, Int64(1))
    for op in (OpCodes.Add,), (OpCodes.Stloc, i):
        il.Emit(*op)
    il.MarkLabel(cond)
    for op in (OpCodes.Ldloc, i), (OpCodes.Ldarg_0,), (OpCodes.Blt, top), (OpCodes.Ldloc, s), (OpCodes.Ret,):
        il.Emit(*op)
    return dm


def call(dm: DynamicMethod, n: int) -> None:
    dm.Invoke(None, Array[Object]([Int64(n)]))


hot = method("HotLoopEbpfTest")
call(hot, 1000)
print("ready", os.getpid(), flush=True)
fresh, next_fresh = 0, 0.0
while time.monotonic() < deadline:
    if time.monotonic() >= next_fresh:
        fresh += 1
        call(method(f"FreshEbpfTest_{fresh}"), 10)
        print("fresh", fresh, flush=True)
        next_fresh = time.monotonic() + FRESH_EVERY_S
    if mode == "hot":
        call(hot, HOT_ITERATIONS)
    else:
        time.sleep(FRESH_EVERY_S)
