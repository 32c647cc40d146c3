"""A numpy evaluator of Kernel IR: the oracle that backends are tested against.

It evaluates every expression over whole index grids at once (outer loops x inner
loops), so it is exact to the semantics and reasonably fast on test sizes. Scalar ops
run through the registry's numpy references, so Kernel IR means exactly what the
graph ops mean.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import sympy

from kiln.codegen.kernel_ir import (
    GEMM_VARS, Acc, AnyKernel, Const, GemmKernel, IndexValue, Kernel, Load, Op, Reduce, ReduceRef,
    Store, loop_var,
)
from kiln.ir import registry
from kiln.ir.emitter import EAGER
from kiln.ir.ops.rules import LOW_PRECISION
from kiln.ir.shapes import evaluate

_REDUCERS = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min,
             "and": np.bitwise_and.reduce, "or": np.bitwise_or.reduce}


def _index(expr, env: dict, sizes: dict) -> np.ndarray:
    """Integer value of an index expression over loop-variable grids (exact int64)."""
    values = dict(env)
    values.update(sizes)
    return np.asarray(_int_eval(sympy.sympify(expr), values), dtype=np.int64)


def _int_eval(e, values):
    if e.is_Integer:
        return int(e)
    if e.is_Symbol:
        return values[e.name]
    if e.is_Add:
        total = 0
        for a in e.args:
            total = total + _int_eval(a, values)
        return total
    if e.is_Mul:
        num, den = sympy.fraction(e)
        if den != 1:
            raise ValueError(f"index expression {e} is not an integer")
        product = 1
        for a in e.args:
            product = product * _int_eval(a, values)
        return product
    if e.is_Pow and e.exp.is_Integer and e.exp >= 0:
        return _int_eval(e.base, values) ** int(e.exp)
    if isinstance(e, sympy.floor):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        return np.floor_divide(_int_eval(num, values), _int_eval(den, values))
    if isinstance(e, sympy.ceiling):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        return -np.floor_divide(-_int_eval(num, values), _int_eval(den, values))
    if isinstance(e, sympy.Mod):
        return np.mod(_int_eval(e.args[0], values), _int_eval(e.args[1], values))
    if isinstance(e, (sympy.Min, sympy.Max)):
        combine = np.minimum if isinstance(e, sympy.Min) else np.maximum
        return functools.reduce(combine, [_int_eval(a, values) for a in e.args])
    raise ValueError(f"unsupported index expression {e}")


class _Evaluator:
    def __init__(self, arrays: dict, sizes: dict, env: dict, refs: dict, acc=None):
        self.arrays, self.sizes, self.env, self.refs, self.acc = arrays, sizes, env, refs, acc
        self.memo: dict = {}

    def __call__(self, e):
        if e in self.memo:
            return self.memo[e]
        if isinstance(e, Const):
            value = np.asarray(e.value).astype(e.dtype.np_dtype)
        elif isinstance(e, Load):
            value = self.arrays[e.buffer].reshape(-1)[_index(e.index, self.env, self.sizes)]
        elif isinstance(e, IndexValue):
            value = _index(e.expr, self.env, self.sizes).astype(e.dtype.np_dtype)
        elif isinstance(e, ReduceRef):
            value = self.refs[e.name]
        elif isinstance(e, Acc):
            value = self.acc.astype(e.dtype.np_dtype)
        elif isinstance(e, Op):
            args = [self(a) for a in e.args]
            shape = np.broadcast_shapes(*[np.shape(a) for a in args]) if args else ()
            # reshape: ascontiguousarray turns a 0-d array into a 1-d one
            args = [np.ascontiguousarray(np.broadcast_to(a, shape)).reshape(shape) for a in args]
            attrs = {"dtype": e.dtype} if "dtype" in registry.get(e.op).attrs else {}
            (value,) = EAGER.apply(e.op, args, attrs)
        else:
            raise TypeError(f"not a Kernel IR expression: {e!r}")
        self.memo[e] = value
        return value


def _grid(loops, sizes, prefix_shape=()):
    extents = [evaluate(l.extent, sizes) for l in loops]
    grids = np.meshgrid(*[np.arange(n, dtype=np.int64) for n in extents], indexing="ij") if loops else []
    pad = (1,) * len(prefix_shape)
    return {l.var: g.reshape(pad + g.shape) for l, g in zip(loops, grids)}, extents


def run_kernel(kernel: AnyKernel, arrays: Sequence[np.ndarray], sizes: dict[str, int]) -> None:
    """Execute `kernel` in place on `arrays` (ordered as kernel.buffers)."""
    named = {b.name: a for b, a in zip(kernel.buffers, arrays)}
    if isinstance(kernel, GemmKernel):
        return _run_gemm(kernel, named, sizes)
    outer_env, outer_extents = _grid(kernel.outer, sizes)
    outer_shape = tuple(outer_extents)
    refs: dict = {}
    for stage in kernel.stages:
        inner_env, inner_extents = _grid(stage.loops, sizes)
        env = {k: v.reshape(v.shape + (1,) * len(inner_extents)) for k, v in outer_env.items()}
        env.update({k: v.reshape((1,) * len(outer_shape) + v.shape) for k, v in inner_env.items()})
        ev = _Evaluator(named, sizes, env, {k: r.reshape(r.shape + (1,) * len(inner_extents))
                                            for k, r in refs.items()})
        value = ev(stage.value)
        full_shape = outer_shape + tuple(inner_extents)
        value = np.broadcast_to(value, full_shape)
        if isinstance(stage, Reduce):
            data = value.astype(stage.dtype.np_dtype)
            axes = tuple(range(len(outer_shape), len(full_shape)))
            with np.errstate(all="ignore"):
                refs[stage.name] = np.asarray(_REDUCERS[stage.op](data, axis=axes)).astype(stage.dtype.np_dtype)
        else:
            index = np.broadcast_to(_index(stage.index, env, sizes), full_shape)
            out = named[stage.buffer].reshape(-1)
            out[index.reshape(-1)] = value.reshape(-1).astype(out.dtype)


def _run_gemm(k: GemmKernel, named: dict, sizes: dict) -> None:
    batch, m, n, kk = (evaluate(d, sizes) for d in (k.batch, k.m, k.n, k.k))
    strides_a = [evaluate(s, sizes) for s in k.a_strides]
    strides_b = [evaluate(s, sizes) for s in k.b_strides]
    a = np.lib.stride_tricks.as_strided(
        named[k.a].reshape(-1), (batch, m, kk), [s * named[k.a].itemsize for s in strides_a])
    b = np.lib.stride_tricks.as_strided(
        named[k.b].reshape(-1), (batch, kk, n), [s * named[k.b].itemsize for s in strides_b])
    acc_np = k.acc_dtype.np_dtype if k.acc_dtype else _acc_np(a.dtype)
    acc = np.matmul(a.astype(acc_np), b.astype(acc_np))
    env = {v: g for v, g in zip(GEMM_VARS, np.meshgrid(np.arange(batch), np.arange(m), np.arange(n),
                                                       indexing="ij"))}
    value = _Evaluator(named, sizes, env, {}, acc=acc)(k.epilogue)
    out = named[k.out]
    out.reshape(batch, m, n)[...] = np.broadcast_to(value, (batch, m, n)).astype(out.dtype)


def _acc_np(np_dtype):
    return np.float32 if np_dtype in LOW_PRECISION else np_dtype

