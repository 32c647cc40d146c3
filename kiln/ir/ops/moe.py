"""Mixture of experts: the grouped matrix products of an MoE layer.

Tokens arrive sorted by expert: rows `offsets[e] : offsets[e] + group_sizes[e]` of x
belong to expert e (offsets the exclusive prefix sum of group_sizes). Then

    grouped_matmul(x [T, K], w [E, K, N], group_sizes [E]) -> y [T, N]
        y[rows of e] = x[rows of e] @ w[e]                   (w[e].T with transpose_rhs)
    grouped_matmul_dw(x [T, K], y [T, N], group_sizes [E]) -> z [E, K, N]
        z[e] = x[rows of e].T @ y[rows of e]                 (0 for an empty group)

The second is the weight-gradient form of the first, and the pair is closed under
differentiation: the vjp of each is made of the two ops again (module-level rules
below), so a second derivative needs no new op either. Both are externs: on the CPU
they run as a library call of their reference (an Extern step of the runtime); the
Triton backend runs them as one persistent grouped GEMM launch
(kiln/codegen/triton/grouped_gemm.py).

Group sizes are data, not shape: a type rule sees only that group_sizes is [E]. The
reference checks at run time that they are >= 0 and sum to T. Low-precision floats
accumulate in float32 and round once, as dot_general does.
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.registry import EXTERN, defop
from kiln.ir.shapes import dims_equal
from kiln.ir.sharding import Partial, R, Shard, Strategy, sharding_rule
from kiln.ir.types import TensorType

_SIZE_DTYPES = (dt.int32, dt.int64)


def _check_tokens(op: str, x: TensorType, what: str) -> None:
    if not x.dtype.is_floating:
        raise KilnDTypeError(f"{op}: {what} {x} is not supported; {op} takes float16, bfloat16, "
                             "float32, float64 or float8 operands")
    if x.rank != 2:
        raise KilnShapeError(f"{op}: {what} {x} must be a matrix [T, features] of tokens "
                             "sorted by expert (rank 2)")


def _check_group_sizes(op: str, group_sizes: TensorType) -> None:
    if group_sizes.dtype not in _SIZE_DTYPES:
        raise KilnDTypeError(f"{op}: group_sizes {group_sizes} must be int32 or int64 (one token "
                             "count per expert)")
    if group_sizes.rank != 1:
        raise KilnShapeError(f"{op}: group_sizes {group_sizes} must be a vector [E] (one token "
                             "count per expert)")


def _offsets(op: str, group_sizes: np.ndarray, tokens: int) -> np.ndarray:
    """Row offsets [E + 1] of each expert's tokens; the sizes checked against the data."""
    sizes = np.asarray(group_sizes, dtype=np.int64)
    if (sizes < 0).any():
        raise KilnArgumentError(f"{op}: group_sizes must be >= 0, got {sizes.tolist()}")
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    if offsets[-1] != tokens:
        raise KilnShapeError(f"{op}: group_sizes sum to {int(offsets[-1])} but x has {tokens} "
                             "rows; every token belongs to exactly one expert group")
    return offsets


def _accumulator(x: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)


@defop("grouped_matmul", family="moe", kind=EXTERN, num_operands=3,
       attrs={"transpose_rhs": False})
class grouped_matmul:
    """Per-expert matrix products over tokens sorted by expert: x [T, K], w [E, K, N]
    (or [E, N, K] with transpose_rhs), group_sizes [E] int (sum T) -> [T, N]; rows of
    group e are multiplied by w[e] (w[e].T)."""

    def type(op, x, w, group_sizes, *, transpose_rhs):
        if not isinstance(transpose_rhs, bool):
            raise KilnArgumentError(f"{op}: transpose_rhs must be a bool, got {transpose_rhs!r}")
        _check_tokens(op, x, "x")
        if w.dtype != x.dtype:
            raise KilnDTypeError(f"{op}: x {x} and w {w} must have one dtype; insert a convert "
                                 "(kn.grouped_matmul does this for you)")
        layout = "[E, N, K]" if transpose_rhs else "[E, K, N]"
        if w.rank != 3:
            raise KilnShapeError(f"{op}: w {w} must be {layout}, one matrix per expert (rank 3)")
        _check_group_sizes(op, group_sizes)
        e, k, n = (w.shape[0], w.shape[2], w.shape[1]) if transpose_rhs else w.shape
        if not dims_equal(group_sizes.shape[0], e):
            raise KilnShapeError(f"{op}: group_sizes {group_sizes} has {group_sizes.shape[0]} "
                                 f"entries but w {w} holds {e} experts; give one size per expert")
        if not dims_equal(x.shape[1], k):
            raise KilnShapeError(f"{op}: contracting dims differ: x {x} has {x.shape[1]} features, "
                                 f"w {w} ({layout}) takes {k}")
        return x.with_shape((x.shape[0], n))

    def reference(x, w, group_sizes, *, transpose_rhs):
        offsets = _offsets("grouped_matmul", group_sizes, x.shape[0])
        acc = _accumulator(x)
        n = w.shape[1] if transpose_rhs else w.shape[2]
        out = np.zeros((x.shape[0], n), dtype=acc)
        for e in range(w.shape[0]):
            lo, hi = offsets[e], offsets[e + 1]
            if hi > lo:
                we = w[e].T if transpose_rhs else w[e]
                out[lo:hi] = x[lo:hi].astype(acc) @ we.astype(acc)
        return out.astype(x.dtype)

    def vjp(b, cts, xs, ys, *, transpose_rhs):
        """dx = grouped_matmul(ct, w) with w's transposition flipped; dw[e] = x_e^T ct_e
        (ct_e^T x_e when w is [E, N, K]); group_sizes are integers (no cotangent)."""
        x, w, group_sizes = xs
        (ct,) = cts
        dx = b.grouped_matmul(ct, w, group_sizes, transpose_rhs=not transpose_rhs)
        dw = (b.grouped_matmul_dw(ct, x, group_sizes) if transpose_rhs
              else b.grouped_matmul_dw(x, ct, group_sizes))
        return [dx, dw, None]


@sharding_rule("grouped_matmul")
def _grouped_matmul_sharding(spec):
    """w's output columns (column parallel), or K on x and w (Partial sum); tokens and
    the group sizes stay whole."""
    n_dim, k_dim = (1, 2) if spec.attrs.get("transpose_rhs") else (2, 1)
    found = [Strategy((R, Shard(n_dim), R), (Shard(1),))]
    if spec.in_dtypes[0].is_inexact:
        p = Partial("sum")
        found += [Strategy((Shard(1), Shard(k_dim), R), (p,)),
                  Strategy((p, R, R), (p,)), Strategy((R, p, R), (p,))]
    return found


@defop("grouped_matmul_dw", family="moe", kind=EXTERN, num_operands=3)
class grouped_matmul_dw:
    """Per-expert products contracting the tokens: x [T, K], y [T, N], group_sizes [E]
    int (sum T) -> [E, K, N] with result[e] = x_e^T @ y_e over the rows of group e (zero
    for an empty group); the weight gradient of grouped_matmul."""

    def type(op, x, y, group_sizes):
        _check_tokens(op, x, "x")
        _check_tokens(op, y, "y")
        if y.dtype != x.dtype:
            raise KilnDTypeError(f"{op}: x {x} and y {y} must have one dtype; insert a convert")
        _check_group_sizes(op, group_sizes)
        if not dims_equal(x.shape[0], y.shape[0]):
            raise KilnShapeError(f"{op}: x {x} and y {y} must have one row per token, got "
                                 f"{x.shape[0]} and {y.shape[0]} rows")
        return x.with_shape((group_sizes.shape[0], x.shape[1], y.shape[1]))

    def reference(x, y, group_sizes):
        offsets = _offsets("grouped_matmul_dw", group_sizes, x.shape[0])
        acc = _accumulator(x)
        out = np.zeros((len(offsets) - 1, x.shape[1], y.shape[1]), dtype=acc)
        for e in range(len(offsets) - 1):
            lo, hi = offsets[e], offsets[e + 1]
            if hi > lo:
                out[e] = x[lo:hi].astype(acc).T @ y[lo:hi].astype(acc)
        return out.astype(x.dtype)

    def vjp(b, cts, xs, ys):
        """Bilinear in (x, y): dx_e = y_e g_e^T, dy_e = x_e g_e, both grouped_matmuls."""
        x, y, group_sizes = xs
        (g,) = cts
        return [b.grouped_matmul(y, g, group_sizes, transpose_rhs=True),
                b.grouped_matmul(x, g, group_sizes), None]


@sharding_rule("grouped_matmul_dw")
def _grouped_matmul_dw_sharding(spec):
    """x [T, K], y [T, N] -> [E, K, N]: K and N split freely; tokens stay whole."""
    found = [Strategy((Shard(1), R, R), (Shard(1),)), Strategy((R, Shard(1), R), (Shard(2),))]
    if spec.in_dtypes[0].is_inexact:
        p = Partial("sum")
        found += [Strategy((p, R, R), (p,)), Strategy((R, p, R), (p,))]
    return found
