"""Reductions over axes, arg-reductions, cumulative scans and sort.

Reductions drop their axes (keepdim is a reshape in the frontend). Low-precision
floats accumulate in float32 and round once at the end, as every backend does.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import dtypes as dt
from kiln.ir.ops.rules import (
    contiguous,
    INTEGRAL, NUMERIC, REAL, LOW_PRECISION, check_axes, check_dtype,
)
from kiln.ir.registry import PRIMITIVE, REQUIRED, defop
from kiln.ir.shapes import normalize_axis


def _reduced(op, x, axes):
    axes = check_axes(op, axes, x.rank)
    return x.with_shape(tuple(d for i, d in enumerate(x.shape) if i not in axes))


def _accumulating(fn):
    def reference(x, *, axes):
        axes = tuple(a % x.ndim for a in axes) if x.ndim else ()  # dim 0 of a scalar is itself
        if x.dtype in LOW_PRECISION:
            return fn(x.astype(np.float32), axis=axes).astype(x.dtype)
        with np.errstate(all="ignore"):
            return np.asarray(fn(x, axis=axes)).astype(x.dtype)

    return reference


def _reduce(name: str, allowed: str, fn, differentiable=True, doc=""):
    def type_rule(op, x, *, axes):
        check_dtype(op, x, allowed)
        return _reduced(op, x, axes)

    doc = doc or f"{name[len('reduce_'):].capitalize()} over `axes`, which leave the shape."
    cls = type(name, (), {"type": type_rule, "reference": _accumulating(fn), "__doc__": doc})
    return defop(name, family="reduction", kind=PRIMITIVE, num_operands=1,
                 attrs={"axes": REQUIRED}, differentiable=differentiable)(cls)


reduce_sum = _reduce("reduce_sum", NUMERIC, np.sum)
reduce_prod = _reduce("reduce_prod", NUMERIC, np.prod)
reduce_max = _reduce("reduce_max", REAL, np.max,
                     doc="Maximum over axes; NaN propagates; empty axes are an error.")
reduce_min = _reduce("reduce_min", REAL, np.min)
reduce_and = _reduce("reduce_and", INTEGRAL, np.bitwise_and.reduce, differentiable=False)
reduce_or = _reduce("reduce_or", INTEGRAL, np.bitwise_or.reduce, differentiable=False)


def _arg(name, fn):
    def type_rule(op, x, *, axis):
        check_dtype(op, x, REAL)
        a = normalize_axis(op, axis, x.rank, "axis")
        return x.with_shape(x.shape[:a] + x.shape[a + 1:]).with_dtype(dt.int64)

    def reference(x, *, axis):
        data = x.astype(np.float32) if x.dtype in LOW_PRECISION else x
        return fn(data, axis=axis % max(x.ndim, 1)).astype(np.int64)

    cls = type(name, (), {"type": type_rule, "reference": reference,
                          "__doc__": "Index of the first extreme value along axis (int64)."})
    return defop(name, family="reduction", kind=PRIMITIVE, num_operands=1,
                 attrs={"axis": REQUIRED}, differentiable=False)(cls)


argmax = _arg("argmax", np.argmax)
argmin = _arg("argmin", np.argmin)


def _scan(name, allowed, fn):
    def type_rule(op, x, *, axis, reverse):
        check_dtype(op, x, allowed)
        normalize_axis(op, axis, x.rank, "axis")
        return x

    def reference(x, *, axis, reverse):
        if x.ndim == 0:  # the scan of a scalar is the scalar
            return x.copy()
        a = axis % max(x.ndim, 1)
        data = x.astype(np.float32) if x.dtype in LOW_PRECISION else x
        if reverse:
            data = np.flip(data, a)
        with np.errstate(all="ignore"):
            out = fn(data, axis=a)
        if reverse:
            out = np.flip(out, a)
        return contiguous(out).astype(x.dtype)

    cls = type(name, (), {"type": type_rule, "reference": reference,
                          "__doc__": f"Inclusive {name[3:]} scan along axis (from the end if reverse)."})
    return defop(name, family="reduction", kind=PRIMITIVE, num_operands=1,
                 attrs={"axis": REQUIRED, "reverse": False})(cls)


cumsum = _scan("cumsum", NUMERIC, np.cumsum)
cumprod = _scan("cumprod", NUMERIC, np.cumprod)
cummax = _scan("cummax", REAL, np.maximum.accumulate)
cummin = _scan("cummin", REAL, np.minimum.accumulate)


@defop("sort", family="reduction", kind=PRIMITIVE, num_operands=1,
       attrs={"axis": -1, "descending": False})
class sort:
    """Stable sort along axis: (values, int64 indices). NaN sorts as the largest value
    (last ascending, first descending), as torch."""

    def type(op, x, *, axis, descending):
        check_dtype(op, x, REAL)
        normalize_axis(op, axis, x.rank, "axis")
        return x, x.with_dtype(dt.int64)

    def reference(x, *, axis, descending):
        a = axis % max(x.ndim, 1)
        data = x.astype(np.float32) if x.dtype in LOW_PRECISION else x
        if x.ndim == 0:
            return x.copy(), np.zeros((), np.int64)
        if descending:
            # stable descending: sort the negated keys (bools and unsigned via int64)
            key = -data.astype(np.float64) if data.dtype.kind != "f" else -data
            idx = np.lexsort((key, ~np.isnan(key)), axis=a)  # stable; NaN first
        else:
            idx = np.argsort(data, axis=a, kind="stable")
        return np.take_along_axis(x, idx, axis=a), idx.astype(np.int64)

