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
            to a float64 scratch in the same order and numpy does the same last step
    direct  otherwise: np.add.at's sequential adds in the output dtype, in C order

The native path takes float32/float64 `x` and `updates` and integer indices whose dims
other than `axis` equal x's (the take gradient's case: indices broadcast along the
rows); anything else, and mode "set", runs the reference. An index out of range is the
reference's K104, naming the first bad index in C order. The functions are built once per
machine (the glue cache keeps their object code).
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache

import numpy as np

FLOATS = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_FN = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64)


def entry(ty: str, wide: bool) -> str:
    return f"kiln_scatter_add_{ty}_{'wide' if wide else 'direct'}"


def _function(ty: str, wide: bool) -> str:
    """i64 fn(out, acc, idx, upd, P, X, I, Q): x viewed as [P, X, Q], indices and updates
    as [P, I, Q]; adds upd[p, i, q] at [p, idx[p, i, q], q] of `out` (direct, in `ty`) or
    of the float64 `acc` (wide). Returns -1, or the C-order position of the first index
    outside [-X, X) (nothing after it is added)."""
    if wide:
        add = ["  %ap = getelementptr inbounds double, ptr %acc, i64 %o",
               "  %a = load double, ptr %ap, align 8",
               *(["  %ud = fpext float %u to double"] if ty == "float" else []),
               f"  %s = fadd double %a, {'%ud' if ty == 'float' else '%u'}",
               "  store double %s, ptr %ap, align 8"]
    else:
        add = [f"  %ap = getelementptr inbounds {ty}, ptr %out, i64 %o",
               f"  %a = load {ty}, ptr %ap",
               f"  %s = fadd {ty} %a, %u",
               f"  store {ty} %s, ptr %ap"]
    nl = "\n"
    params = "ptr %out, ptr %acc, ptr %idx, ptr %upd, i64 %P, i64 %X, i64 %I, i64 %Q"
    return f"""define i64 @{entry(ty, wide)}({params}) nounwind {{
entry:
  %rows = mul i64 %P, %I
  %xq = mul i64 %X, %Q
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
  ret i64 -1

fail:
  ret i64 %e
}}
"""


def module_text() -> str:
    return "\n".join(_function(ty, wide) for ty in FLOATS.values() for wide in (True, False))


@lru_cache(maxsize=None)
def _jitted():
    """The jitted module (object code from the glue cache when a process before built it
    on this machine), kept for the process: its functions are called by address."""
    from kiln.codegen.cpu.glue_cache import glue_module

    return glue_module(module_text(), 2)


@lru_cache(maxsize=None)
def _fn(ty: str, wide: bool):
    return _FN(_jitted().address(entry(ty, wide)))


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
    acc = np.zeros(x.shape, np.float64) if wide else None
    out = None if wide else np.array(x, order="C", copy=True)
    bad = -1
    if src.size:
        bad = _fn(ty, wide)(out.ctypes.data if out is not None else None,
                            acc.ctypes.data if acc is not None else None,
                            idx.ctypes.data, src.ctypes.data, P, X, I, Q)
    if bad >= 0:
        raise index_error("scatter_along", "index", int(idx.flat[bad]), X, negative=True)
    return (x + acc).astype(x.dtype, copy=False) if wide else out


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
