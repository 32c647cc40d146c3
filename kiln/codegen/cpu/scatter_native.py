"""`scatter_along` (mode "add") on the CPU as native code, bit for bit the op's reference.

`scatter_along` stays an extern step in compiled programs: which output position an
update lands on is data, and updates that meet on one position must be summed, so it is
no pointwise loop nest. Its numpy reference (kiln/ir/ops/indices.py, `scatter_add`)
builds index grids, checks every index, and sums by `np.bincount` in float64 (or
`np.add.at` where the output is much larger than the updates): a small GPT's
token-embedding gradient, 512 x 64 updates into a 65 x 64 table, took 0.2-0.5 ms of a
4-6 ms training step (benchmarks/profile_gpt_step.py), the step's largest single item.

This module is the CPU backend's implementation of the `scatter` template kind
(`CpuBackend.templates()`): one hand-written LLVM function per float dtype and sum
mode walks the updates in C order, checks each index (negative ones count from the end,
as the reference's), and adds the update to its position, with the reference's
arithmetic exactly:

    wide    out.size <= 4 * updates + 65536: the reference sums in float64 per position
            (bincount, in C order from 0.0), then rounds x + sum once; here the sums go
            to a float64 scratch (kept per thread) in the same order, and the function
            ends with the same rounding of x + sum into the output
    direct  otherwise: np.add.at's sequential adds in the output dtype, in C order, on
            a copy of x the function makes first

The native path takes float32/float64 `x` and `updates` and integer indices whose dims
other than `axis` equal x's (the take gradient's case: indices broadcast along the
rows); anything else, and mode "set", runs the reference. An index out of range is the
reference's K104, naming the first bad index in C order. The functions are built once per
machine (the glue cache keeps their object code).
"""

from __future__ import annotations

import ctypes
import math
import threading
from functools import lru_cache

import numpy as np

FLOATS = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_FN = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int64)
# a float64 scratch of up to this many elements is kept per thread for the wide sums
# (allocated per call, with numpy's temporaries for x + sums, its pages were faulted in
# each time: a small GPT's gradient took ~100 us in its step, ~90 with this); a larger
# one is allocated for its call only
KEEP_ACC = 1 << 20
_SCRATCH = threading.local()


def entry(ty: str, wide: bool) -> str:
    return f"kiln_scatter_add_{ty}_{'wide' if wide else 'direct'}"


def _function(ty: str, wide: bool) -> str:
    """i64 fn(out, acc, idx, upd, x, P, X, I, Q): x and out viewed as [P, X, Q], indices
    and updates as [P, I, Q]. direct: out = x, then upd[p, i, q] added at [p, idx[p, i,
    q], q] of out in `ty`. wide: the float64 `acc` (as large as x) zeroed, the updates
    summed there in float64, then out = x + acc rounded once. Returns -1, or the C-order
    position of the first index outside [-X, X) (out is then unfinished)."""
    size = 4 if ty == "float" else 8
    if wide:
        prologue = ["  %acc.bytes = mul i64 %n, 8",
                    "  call void @llvm.memset.p0.i64(ptr %acc, i8 0, i64 %acc.bytes, i1 false)"]
        add = ["  %ap = getelementptr inbounds double, ptr %acc, i64 %o",
               "  %a = load double, ptr %ap, align 8",
               *(["  %ud = fpext float %u to double"] if ty == "float" else []),
               f"  %s = fadd double %a, {'%ud' if ty == 'float' else '%u'}",
               "  store double %s, ptr %ap, align 8"]
        widen = ["  %xd = fpext float %xk to double"] if ty == "float" else []
        narrow = ["  %rk = fptrunc double %sk to float"] if ty == "float" else []
        finish = f"""  %has.n = icmp sgt i64 %n, 0
  br i1 %has.n, label %fin, label %done

fin:
  %k = phi i64 [ 0, %ok ], [ %k.next, %fin ]
  %xp = getelementptr inbounds {ty}, ptr %x, i64 %k
  %xk = load {ty}, ptr %xp
{chr(10).join(widen)}
  %akp = getelementptr inbounds double, ptr %acc, i64 %k
  %ak = load double, ptr %akp, align 8
  %sk = fadd double {'%xd' if ty == 'float' else '%xk'}, %ak
{chr(10).join(narrow)}
  %op = getelementptr inbounds {ty}, ptr %out, i64 %k
  store {ty} {'%rk' if ty == 'float' else '%sk'}, ptr %op
  %k.next = add nuw nsw i64 %k, 1
  %k.more = icmp slt i64 %k.next, %n
  br i1 %k.more, label %fin, label %done, !llvm.loop !0

done:
  ret i64 -1"""
    else:
        prologue = [f"  %out.bytes = mul i64 %n, {size}",
                    "  call void @llvm.memcpy.p0.p0.i64(ptr %out, ptr %x, i64 %out.bytes, i1 false)"]
        add = [f"  %ap = getelementptr inbounds {ty}, ptr %out, i64 %o",
               f"  %a = load {ty}, ptr %ap",
               f"  %s = fadd {ty} %a, %u",
               f"  store {ty} %s, ptr %ap"]
        finish = "  ret i64 -1"
    nl = "\n"
    params = ("ptr noalias %out, ptr noalias %acc, ptr noalias %idx, ptr noalias %upd, "
              "ptr noalias %x, i64 %P, i64 %X, i64 %I, i64 %Q")
    return f"""define i64 @{entry(ty, wide)}({params}) nounwind {{
entry:
  %rows = mul i64 %P, %I
  %xq = mul i64 %X, %Q
  %n = mul i64 %P, %xq
{nl.join(prologue)}
  %has.rows = icmp sgt i64 %rows, 0
  %has.cols = icmp sgt i64 %Q, 0
  %go = and i1 %has.rows, %has.cols
  br i1 %go, label %row, label %ok

row:
  %r = phi i64 [ 0, %entry ], [ %r.next, %row.end ]
  %p = udiv i64 %r, %I
  %obase = mul i64 %p, %xq
  %ebase = mul i64 %r, %Q
  br label %col

col:
  %q = phi i64 [ 0, %row ], [ %q.next, %col.add ]
  %e = add i64 %ebase, %q
  %ip = getelementptr inbounds i64, ptr %idx, i64 %e
  %j0 = load i64, ptr %ip, align 8
  %neg = icmp slt i64 %j0, 0
  %jw = add i64 %j0, %X
  %j = select i1 %neg, i64 %jw, i64 %j0
  %bad = icmp uge i64 %j, %X
  br i1 %bad, label %fail, label %col.add

col.add:
  %jq = mul i64 %j, %Q
  %o0 = add i64 %obase, %jq
  %o = add i64 %o0, %q
  %up = getelementptr inbounds {ty}, ptr %upd, i64 %e
  %u = load {ty}, ptr %up
{nl.join(add)}
  %q.next = add i64 %q, 1
  %more = icmp slt i64 %q.next, %Q
  br i1 %more, label %col, label %row.end

row.end:
  %r.next = add i64 %r, 1
  %rows.more = icmp slt i64 %r.next, %rows
  br i1 %rows.more, label %row, label %ok

ok:
{finish}

fail:
  ret i64 %e
}}
"""


def module_text(keep: tuple = ()) -> str:
    """The module of the functions named in `keep` (every one when empty): each entry is
    built on its first use, a module of its own, so a program pays LLVM only for the
    dtype and sum mode it runs (the four together took ~60 ms of a cold GPT step's
    first call, inside its first step)."""
    return "\n".join([
        "declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)",
        "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)",
        *(_function(ty, wide) for ty in FLOATS.values() for wide in (True, False)
          if not keep or entry(ty, wide) in keep),
        "!0 = distinct !{!0, !1}",
        '!1 = !{!"llvm.loop.vectorize.enable", i1 true}'])


@lru_cache(maxsize=None)
def _entry(ty: str, wide: bool):
    """(the jitted module, a ctypes callable of its function), the module built once per
    process (the object code from the glue cache when a process before built it on this
    machine) and kept: the function is called by address."""
    from kiln.codegen.cpu.glue_cache import glue_module

    name = entry(ty, wide)
    jitted = glue_module(module_text((name,)), 2)
    return jitted, _FN(jitted.address(name))


def warmer(node):
    """A callable that builds the entry a `scatter_along` graph node will run, ahead of
    the program's first call (a cold compile runs it on a thread while its graph passes
    leave a core idle: ~25 ms of LLVM that was inside the first step); None where the
    node's operands are not static or the reference will run."""
    if node.op != "scatter_along" or node.attrs.get("mode", "add") != "add":
        return None
    x, indices, updates = (v.type for v in node.operands)
    np_dtype = np.dtype(x.dtype.np_dtype) if x.dtype.np_dtype is not None else None
    if np_dtype not in FLOATS or updates.dtype != x.dtype or not x.shape:
        return None
    if not all(isinstance(d, int) for d in (*x.shape, *indices.shape)):
        return None
    wide = math.prod(x.shape) <= 4 * math.prod(indices.shape) + 65536  # as scatter_add's
    ty = FLOATS[np_dtype]
    return lambda: _entry(ty, wide)


def supports(x: np.ndarray, indices: np.ndarray, updates: np.ndarray, axis: int) -> bool:
    """Whether the native path takes these operands (see the module docstring)."""
    return (isinstance(x, np.ndarray) and isinstance(indices, np.ndarray)
            and isinstance(updates, np.ndarray) and x.dtype in FLOATS
            and updates.dtype == x.dtype and indices.dtype.kind in "iu"
            and x.ndim == indices.ndim == updates.ndim and x.ndim > 0
            and all(n == d for i, (n, d) in enumerate(zip(indices.shape, x.shape)) if i != axis)
            and all(u >= n for u, n in zip(updates.shape, indices.shape)))


def scatter_add(x: np.ndarray, indices: np.ndarray, updates: np.ndarray, axis: int) -> np.ndarray:
    """x with updates[..i..] added at x[..indices[..i..]..] along `axis`: the
    `scatter_along` reference's result, bit for bit, for operands `supports` takes."""
    from kiln.ir.ops.indices import index_error

    axis %= x.ndim
    src = updates if updates.shape == indices.shape else \
        updates[tuple(slice(0, n) for n in indices.shape)]
    src = np.ascontiguousarray(src)
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    shape = x.shape
    P = math.prod(shape[:axis])
    X, I = int(shape[axis]), int(indices.shape[axis])
    Q = math.prod(shape[axis + 1:])
    ty = FLOATS[x.dtype]
    wide = x.size <= 4 * src.size + 65536  # the reference's bincount regime
    base = np.ascontiguousarray(x)
    out = np.empty(x.shape, x.dtype)
    acc = _scratch(x.size) if wide else None
    bad = _entry(ty, wide)[1](out.ctypes.data, acc.ctypes.data if acc is not None else None,
                              idx.ctypes.data, src.ctypes.data, base.ctypes.data, P, X, I, Q)
    if bad >= 0:
        raise index_error("scatter_along", "index", int(idx.flat[bad]), X, negative=True)
    return out


def _scratch(n: int) -> np.ndarray:
    """A float64 scratch of at least n elements (the function zeroes what it uses): this
    thread's kept one where it is small enough (KEEP_ACC), else a new one."""
    if n > KEEP_ACC:
        return np.empty(n, np.float64)
    acc = getattr(_SCRATCH, "acc", None)
    if acc is None or acc.size < n:
        acc = _SCRATCH.acc = np.empty(max(n, 4096), np.float64)
    return acc


def run_scatter_along(arrays, attrs) -> list:
    """The CPU backend's extern `scatter_along` (templates()["scatter"]): mode "add" on
    operands `supports` takes natively, anything else by the op's numpy reference."""
    x, indices, updates = arrays
    if attrs.get("mode", "add") == "add" and isinstance(x, np.ndarray) and x.ndim:
        axis = int(attrs["axis"]) % x.ndim
        if supports(x, indices, updates, axis):
            return [scatter_add(x, indices, updates, axis)]
    from kiln.ir.emitter import EAGER

    return EAGER.apply("scatter_along", arrays, attrs)
