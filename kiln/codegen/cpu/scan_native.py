"""`cumsum` on the CPU as a native loop, bit for bit the op's reference.

`cumsum` stays an extern step in compiled programs (a scan is no pointwise loop nest),
and its reference is `np.cumsum`, which sums each line in order in the operand's dtype:
a (1024, 1024) float32 cumsum along rows took 2.2 ms there, along columns 13 ms, against
torch's 0.33 (benchmarks/bench_nn_ops.py). This module is the CPU backend's `scan`
template kind (`CpuBackend.templates()`) for float32 and float64: with x viewed as
[P, X, Q] around the scanned axis, out[p, 0, :] = x[p, 0, :] and then
out[p, i, :] = out[p, i - 1, :] + x[p, i, :] (from the end where `reverse`), the same
additions in the same order as the reference, so the result is bit-identical; the Q
columns of a step are one vector loop, contiguous lines (Q = 1) are scanned LANES at a
time side by side (independent chains of additions: along the rows of (1024, 1024) 1.2
ms one at a time, 0.27 ms eight at a time), and the P lines are cut over kiln's threads.
Other dtypes (integers, whose reference widens; low precision) run the reference.
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, V, const
from kiln.codegen.cpu.llvm_emit import template_args
from kiln.codegen.cpu.native_pool import run_range

FLOATS = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
SIZE_NAMES = ("P", "X", "Q", "REVERSE")
SPLIT_ELEMS = 1 << 16  # a scan of fewer elements runs on the caller's thread
LANES = 8  # contiguous lines scanned side by side
_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_OBJECTS = ctypes.c_void_p * 2


def entry(ty: str) -> str:
    return f"kiln_cumsum_{ty}"


def i64(v) -> V:
    return const("i64", v)


def _preamble(module: Module):
    """A function's start, shared by both scans: (fn, x, out, sizes, step_of), step_of(i)
    the position of the i-th step of a line (counted from the end where `reverse`)."""
    fn = Fn(module)
    (x, out), s = template_args(fn, 2, SIZE_NAMES)
    reverse = fn.icmp("ne", s["REVERSE"], i64(0))
    last = fn.bin("sub", s["X"], i64(1))
    return fn, x, out, s, lambda i: fn.select(reverse, fn.bin("sub", last, i), i)


def _function(module: Module, ty: str) -> str:
    """fn(bufs = [x, out] (array objects), sizes, begin, end): lines p in [begin, end)."""
    fn, x, out, s, step_of = _preamble(module)
    size = 8 if ty == "double" else 4
    lines = CountedLoop(fn, V("%begin", "i64"), V("%end", "i64"), vectorize=False)
    p, _ = lines.begin()
    base = fn.bin("mul", fn.bin("mul", p, s["X"]), s["Q"])
    first = fn.bin("add", base, fn.bin("mul", step_of(i64(0)), s["Q"]))
    copy = CountedLoop(fn, i64(0), s["Q"], vectorize=None)  # the first step as it is
    q, _ = copy.begin()
    fn.store(fn.load(ty, fn.gep(ty, x, fn.bin("add", first, q)), size),
             fn.gep(ty, out, fn.bin("add", first, q)), size)
    copy.end()
    steps = CountedLoop(fn, i64(1), s["X"], vectorize=False)
    i, _ = steps.begin()
    here = fn.bin("add", base, fn.bin("mul", step_of(i), s["Q"]))
    before = fn.bin("add", base, fn.bin("mul", step_of(fn.bin("sub", i, i64(1))), s["Q"]))
    cols = CountedLoop(fn, i64(0), s["Q"], vectorize=None)
    q, _ = cols.begin()
    total = fn.fadd(fn.load(ty, fn.gep(ty, out, fn.bin("add", before, q)), size),
                    fn.load(ty, fn.gep(ty, x, fn.bin("add", here, q)), size))
    fn.store(total, fn.gep(ty, out, fn.bin("add", here, q)), size)
    cols.end()
    steps.end()
    lines.end()
    fn.stmt("ret void")
    return fn.define(f"define void @{entry(ty)}(ptr %bufs, ptr %sizes, i64 %begin, i64 %end) nounwind")


def _interleaved(module: Module, ty: str) -> str:
    """fn(bufs, sizes, begin, end) for Q == 1 (a scan along contiguous lines): groups g in
    [begin, end) of LANES lines each, their running sums side by side. One line's sum is a
    chain of dependent additions (4 cycles each); LANES chains at once keep the adder busy,
    and each line still adds in its own order (the reference's, bit for bit)."""
    fn, x, out, s, step_of = _preamble(module)
    size = 8 if ty == "double" else 4
    groups = CountedLoop(fn, V("%begin", "i64"), V("%end", "i64"), vectorize=False)
    g, _ = groups.begin()
    bases = [fn.bin("mul", fn.bin("add", fn.bin("mul", g, i64(LANES)), i64(lane)), s["X"]) for lane in range(LANES)]
    start = step_of(i64(0))
    firsts = []
    for base in bases:  # the first step as it is
        at = fn.bin("add", base, start)
        value = fn.load(ty, fn.gep(ty, x, at), size)
        fn.store(value, fn.gep(ty, out, at), size)
        firsts.append(value)
    steps = CountedLoop(fn, i64(1), s["X"], carried=firsts, vectorize=False)
    i, sums = steps.begin()
    here = step_of(i)
    nexts = []
    for base, total in zip(bases, sums):
        at = fn.bin("add", base, here)
        total = fn.fadd(total, fn.load(ty, fn.gep(ty, x, at), size))
        fn.store(total, fn.gep(ty, out, at), size)
        nexts.append(total)
    steps.end(nexts)
    groups.end()
    fn.stmt("ret void")
    return fn.define(f"define void @{entry(ty)}_lanes(ptr %bufs, ptr %sizes, i64 %begin, i64 %end) nounwind")


def module_text(ty: str) -> str:
    module = Module()
    module.functions.append(_function(module, ty))
    module.functions.append(_interleaved(module, ty))
    return module.text()


@lru_cache(maxsize=None)
def _entry(dtype: np.dtype):
    """(the jitted module, the address, a ctypes callable) of `dtype`'s scan, built on
    its first use (the glue cache keeps the object code across processes)."""
    from kiln.codegen.cpu.glue_cache import glue_module

    jitted = glue_module(module_text(FLOATS[dtype]), 2)
    address, lanes = jitted.address(entry(FLOATS[dtype])), jitted.address(entry(FLOATS[dtype]) + "_lanes")
    return jitted, address, _FN(address), lanes, _FN(lanes)


def cumsum(x: np.ndarray, axis: int, reverse: bool = False) -> np.ndarray | None:
    """np.cumsum(x, axis) (from the end where `reverse`) natively, or None (the caller
    runs the reference)."""
    if x.dtype not in FLOATS or x.ndim == 0:
        return None
    a = axis % x.ndim
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    P, X, Q = math.prod(x.shape[:a]), x.shape[a], math.prod(x.shape[a + 1:])
    if out.size == 0:
        return out
    sizes = (ctypes.c_int64 * len(SIZE_NAMES))(P, X, Q, int(bool(reverse)))
    bufs = _OBJECTS(id(x), id(out))  # alive until the call returns
    _, address, call, lanes, call_lanes = _entry(x.dtype)
    grouped = P // LANES if Q == 1 and X > 1 else 0
    if grouped:  # along contiguous lines: LANES lines at once, the rest one by one
        run_range(lanes, call_lanes, bufs, sizes, grouped, out.size >= SPLIT_ELEMS)
    if grouped * LANES < P:
        call(bufs, sizes, grouped * LANES, P)
    return out


def run_cumsum(arrays, attrs) -> list:
    """The CPU backend's extern `cumsum` (templates()["scan"])."""
    (x,) = arrays
    out = cumsum(x, attrs["axis"], attrs.get("reverse", False)) if isinstance(x, np.ndarray) else None
    if out is None:
        from kiln.ir.emitter import EAGER

        return EAGER.apply("cumsum", arrays, attrs)
    return [out]
