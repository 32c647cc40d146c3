"""Linear algebra: the two contraction primitives (dot_general, convolution), the
composites users call on them (torch's matmul and conv2d), and the LAPACK-style extern
calls (cholesky, qr, eigh, svd, solve, triangular_solve).

dot_general follows JAX/StableHLO: result dims are the batch dims, then lhs free
dims, then rhs free dims. Contractions of low-precision floats accumulate in float32
and round once. Extern ops take float32, float64 or complex64 matrices in the last two
dims, batched over the leading dims; a matrix LAPACK rejects (not positive definite,
singular) gives NaNs in its slot instead of an exception, as JAX does.
"""

from __future__ import annotations

import math

import numpy as np
import sympy
from numpy.lib.stride_tricks import sliding_window_view

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.rules import contiguous, LOW_PRECISION, NUMERIC, check_axes, check_dtype, check_int_tuple, via_f32
from kiln.ir.registry import COMPOSITE, EXTERN, PRIMITIVE, REQUIRED, defop
from kiln.ir.shapes import broadcast_shapes, dim, dims_equal
from kiln.ir.types import TensorType


def _same_dtype(op, *types):
    if any(t.dtype != types[0].dtype for t in types[1:]):
        raise KilnDTypeError(f"{op}: operands must have one dtype, got "
                             f"{', '.join(map(str, types))}; insert a convert")
    check_dtype(op, types[0], NUMERIC, "operands")


def _accumulator(x: np.ndarray) -> np.dtype:
    """Low-precision floats accumulate in float32; integers in int64 (then wrap back)."""
    if x.dtype.kind in "iub":
        return np.dtype(np.int64)
    if x.dtype.kind == "V" or x.dtype.itemsize < 4:
        return np.dtype(np.float32)
    return x.dtype


# -- dot_general ---------------------------------------------------------------------

def dot_general_type(op, lhs, rhs, lc, rc, lb, rb) -> TensorType:
    _same_dtype(op, lhs, rhs)
    lc, lb = check_axes(op, lc, lhs.rank, "lhs_contracting"), check_axes(op, lb, lhs.rank, "lhs_batch")
    rc, rb = check_axes(op, rc, rhs.rank, "rhs_contracting"), check_axes(op, rb, rhs.rank, "rhs_batch")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise KilnArgumentError(f"{op}: lhs and rhs need as many contracting ({lc} vs {rc}) and "
                                f"batch ({lb} vs {rb}) dims")
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise KilnArgumentError(f"{op}: a dim cannot be both batch and contracting "
                                f"(lhs {lb}/{lc}, rhs {rb}/{rc})")
    for kind, ls, rs in (("contracting", lc, rc), ("batch", lb, rb)):
        for i, j in zip(ls, rs):
            if not dims_equal(lhs.shape[i], rhs.shape[j]):
                raise KilnShapeError(
                    f"{op}: {kind} dims differ: {lhs} has {lhs.shape[i]} in dim {i}, "
                    f"{rhs} has {rhs.shape[j]} in dim {j}")
    lfree = [d for i, d in enumerate(lhs.shape) if i not in lc and i not in lb]
    rfree = [d for i, d in enumerate(rhs.shape) if i not in rc and i not in rb]
    return lhs.with_shape(tuple(lhs.shape[i] for i in lb) + tuple(lfree) + tuple(rfree))


@defop("dot_general", family="linalg", kind=PRIMITIVE, num_operands=2,
       attrs={"lhs_contracting": REQUIRED, "rhs_contracting": REQUIRED,
              "lhs_batch": (), "rhs_batch": ()})
class dot_general:
    """Contract lhs_contracting with rhs_contracting, batched over the batch dims:
    result = batch dims + lhs free dims + rhs free dims (jax.lax.dot_general)."""

    def type(op, lhs, rhs, *, lhs_contracting, rhs_contracting, lhs_batch, rhs_batch):
        return dot_general_type(op, lhs, rhs, lhs_contracting, rhs_contracting, lhs_batch, rhs_batch)

    def reference(lhs, rhs, *, lhs_contracting, rhs_contracting, lhs_batch, rhs_batch):
        lc, rc = [a % lhs.ndim for a in lhs_contracting], [a % rhs.ndim for a in rhs_contracting]
        lb, rb = [a % lhs.ndim for a in lhs_batch], [a % rhs.ndim for a in rhs_batch]
        lfree = [i for i in range(lhs.ndim) if i not in lc + lb]
        rfree = [i for i in range(rhs.ndim) if i not in rc + rb]
        batch = [lhs.shape[i] for i in lb]
        m, n = [lhs.shape[i] for i in lfree], [rhs.shape[i] for i in rfree]
        k = math.prod(lhs.shape[i] for i in lc)
        acc = _accumulator(lhs)
        # one batched matmul: [batch, M, K] @ [batch, K, N]
        a = lhs.astype(acc).transpose(lb + lfree + lc).reshape(batch + [math.prod(m), k])
        b = rhs.astype(acc).transpose(rb + rc + rfree).reshape(batch + [k, math.prod(n)])
        return np.matmul(a, b).reshape(batch + m + n).astype(lhs.dtype)


# -- convolution -----------------------------------------------------------------------

def conv_attrs(op, n, window_strides, padding, rhs_dilation, feature_group_count):
    """Attributes with defaults filled in (strides and dilation 1, no padding)."""
    strides = check_int_tuple(op, "window_strides", window_strides or (1,) * n, n)
    dilation = check_int_tuple(op, "rhs_dilation", rhs_dilation or (1,) * n, n)
    padding = tuple(padding) if padding is not None else ((0, 0),) * n
    if len(padding) != n or not all(
            isinstance(p, (tuple, list)) and len(p) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in p)
            for p in padding):
        raise KilnArgumentError(f"{op}: padding must be {n} (lo, hi) pairs of ints >= 0, "
                                f"got {padding!r}")
    if any(s < 1 for s in strides) or any(d < 1 for d in dilation):
        raise KilnArgumentError(f"{op}: strides {strides} and dilation {dilation} must be >= 1")
    if not isinstance(feature_group_count, int) or feature_group_count < 1:
        raise KilnArgumentError(f"{op}: feature_group_count must be an int >= 1, "
                                f"got {feature_group_count!r}")
    return strides, tuple(tuple(p) for p in padding), dilation, feature_group_count


def conv_type(op, x, w, window_strides, padding, rhs_dilation, feature_group_count):
    """x [N, C, *spatial] (*) w [O, C/groups, *kernel] -> [N, O, *out]."""
    _same_dtype(op, x, w)
    if x.rank < 3 or w.rank != x.rank:
        raise KilnShapeError(f"{op}: input {x} and kernel {w} must have one rank >= 3 "
                             "([N, C, *spatial] and [O, C/groups, *kernel])")
    n = x.rank - 2
    strides, padding, dilation, groups = conv_attrs(
        op, n, window_strides, padding, rhs_dilation, feature_group_count)
    if not dims_equal(x.shape[1], w.shape[1] * groups):
        raise KilnShapeError(f"{op}: input {x} has {x.shape[1]} channels but kernel {w} "
                             f"takes {w.shape[1]} x {groups} groups")
    if isinstance(w.shape[0], int) and w.shape[0] % groups:
        raise KilnShapeError(f"{op}: kernel {w} has {w.shape[0]} output channels, not a "
                             f"multiple of {groups} groups")
    out = []
    for i, (d, k, s, (lo, hi), r) in enumerate(zip(x.shape[2:], w.shape[2:], strides, padding,
                                                    dilation)):
        span = d + lo + hi - r * (k - 1) - 1  # padded length minus the dilated kernel
        if isinstance(span, int):
            if span < 0:
                raise KilnShapeError(
                    f"{op}: spatial dim {i} of {x} is {d} (padded {d + lo + hi}), smaller than "
                    f"the dilated kernel {r * (k - 1) + 1} of {w}")
            out.append(span // s + 1)
        else:
            out.append(dim(sympy.floor(sympy.expand(span) / s) + 1))
    return x.with_shape((x.shape[0], w.shape[0]) + tuple(out))


def conv_reference(x, w, strides, padding, dilation, groups):
    n = x.ndim - 2
    acc = _accumulator(x)
    xp = np.pad(x.astype(acc), [(0, 0), (0, 0)] + [tuple(p) for p in padding])
    kernel = w.shape[2:]
    span = [r * (k - 1) + 1 for r, k in zip(dilation, kernel)]
    win = sliding_window_view(xp, span, axis=tuple(range(2, 2 + n)))  # [N, C, *pos, *span]
    win = win[(slice(None),) * 2 + tuple(slice(None, None, s) for s in strides)
              + tuple(slice(None, None, r) for r in dilation)]  # [N, C, *out, *kernel]
    N, C, out = x.shape[0], x.shape[1], win.shape[2:2 + n]
    O, G = w.shape[0], groups
    win = win.reshape((N, G, C // G) + out + kernel)
    wg = w.astype(acc).reshape((G, O // G, C // G) + kernel)
    sp, kk = "hijklm"[:n], "stuvwx"[:n]
    y = np.einsum(f"ngc{sp}{kk},goc{kk}->ngo{sp}", win, wg, optimize=True)
    return contiguous(y.reshape((N, O) + out)).astype(x.dtype)


@defop("convolution", family="linalg", kind=PRIMITIVE, num_operands=2,
       attrs={"window_strides": None, "padding": None, "rhs_dilation": None,
              "feature_group_count": 1})
class convolution:
    """N-d cross-correlation (no kernel flip): x [N, C, *spatial], w [O, C/groups, *kernel],
    zero `padding` (lo, hi) per spatial dim, strides and kernel dilation per dim."""

    def type(op, x, w, *, window_strides, padding, rhs_dilation, feature_group_count):
        return conv_type(op, x, w, window_strides, padding, rhs_dilation, feature_group_count)

    def reference(x, w, *, window_strides, padding, rhs_dilation, feature_group_count):
        attrs = conv_attrs("convolution", x.ndim - 2, window_strides, padding, rhs_dilation,
                           feature_group_count)
        return conv_reference(x, w, *attrs)


# -- composites over the contractions (torch's matmul and conv2d) -----------------------

def upcast(b, x):
    """(x in its compute dtype, the dtype to round back to): float32 for low precision."""
    d = b.type_of(x).dtype
    return (b.convert(x, dt.float32) if d.np_dtype in LOW_PRECISION else x), d


def _matmul_reference(x, y):
    acc = _accumulator(x)
    return np.matmul(x.astype(acc), y.astype(acc)).astype(x.dtype)


@defop("matmul", family="linalg", kind=COMPOSITE, num_operands=2)
class matmul:
    """torch.matmul: a 1-D operand is a vector (its dim dropped from the result); batch
    dims broadcast; same-dtype numeric operands."""

    def type(op, a, b):
        _same_dtype(op, a, b)
        if a.rank == 0 or b.rank == 0:
            raise KilnShapeError(f"matmul: operands must have rank >= 1, got {a} and {b}")
        ka, kb = a.shape[-1], b.shape[-2] if b.rank > 1 else b.shape[0]
        if not dims_equal(ka, kb):
            raise KilnShapeError(f"matmul: contracting dims differ: {a} has {ka}, {b} has {kb}")
        batch = broadcast_shapes(op, a.shape[:-2], b.shape[:-2], describe=lambda: f"{a} with {b}")
        return a.with_shape(batch + a.shape[-2:-1] + (b.shape[-1:] if b.rank > 1 else ()))

    reference = _matmul_reference

    def decompose(b, x, y):
        xt, yt = b.type_of(x), b.type_of(y)
        if xt.rank == 1 or yt.rank == 1:  # a vector contracts directly, no batch dims
            return b.dot_general(x, y, lhs_contracting=(xt.rank - 1,),
                                 rhs_contracting=(max(yt.rank - 2, 0),))
        batch = broadcast_shapes("matmul", xt.shape[:-2], yt.shape[:-2])
        bd = tuple(range(len(batch)))
        x, y = b.broadcast_to(x, batch + xt.shape[-2:]), b.broadcast_to(y, batch + yt.shape[-2:])
        return b.dot_general(x, y, lhs_contracting=(len(batch) + 1,),
                             rhs_contracting=(len(batch),), lhs_batch=bd, rhs_batch=bd)


def _conv2d_attrs(op, stride, padding, dilation):
    def pair(name, v):
        return (v, v) if isinstance(v, int) and not isinstance(v, bool) else check_int_tuple(
            op, name, v, 2)

    ph, pw = pair("padding", padding)
    return pair("stride", stride), ((ph, ph), (pw, pw)), pair("dilation", dilation)


def _conv2d_reference(x, w, *bias, stride, padding, dilation, groups, has_bias):
    s, p, r = _conv2d_attrs("conv2d", stride, padding, dilation)
    y = conv_reference(x, w, s, p, r, groups)
    return y + bias[0][:, None, None] if has_bias else y


@defop("conv2d", family="linalg", kind=COMPOSITE,
       attrs={"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1,
              "has_bias": False})
class conv2d:
    """torch conv2d: x [N, C, H, W], w [O, C/groups, kh, kw], optional bias [O];
    symmetric zero padding; int or pair stride/padding/dilation."""

    def type(op, x, w, *bias, stride, padding, dilation, groups, has_bias):
        if x.rank != 4:
            raise KilnShapeError(f"conv2d: input {x} must be [N, C, H, W] (rank 4)")
        out = conv_type(op, x, w, *_conv2d_attrs(op, stride, padding, dilation), groups)
        if len(bias) != bool(has_bias):
            raise KilnArgumentError(f"conv2d: has_bias={has_bias} but {len(bias)} bias operand(s)")
        if bias and bias[0] != x.with_shape(w.shape[:1]):
            raise KilnShapeError(f"conv2d: bias {bias[0]} must be {x.with_shape(w.shape[:1])}, "
                                 f"one per output channel of kernel {w}")
        return out

    reference = via_f32(_conv2d_reference)

    def decompose(b, x, w, *bias, stride, padding, dilation, groups, has_bias):
        (x, d), (w, _) = upcast(b, x), upcast(b, w)
        s, p, r = _conv2d_attrs("conv2d", stride, padding, dilation)
        y = b.convolution(x, w, window_strides=s, padding=p, rhs_dilation=r,
                          feature_group_count=groups)
        if has_bias:
            bias = b.broadcast_in_dim(upcast(b, bias[0])[0], shape=b.type_of(y).shape,
                                      broadcast_dimensions=(1,))
            y = b.add(y, bias)
        return b.convert(y, d)


# -- extern: LAPACK-style calls ----------------------------------------------------------

_LAPACK_DTYPES = (dt.float32, dt.float64, dt.complex64)


def _matrix(op, t, square=False, what="operand"):
    if t.dtype not in _LAPACK_DTYPES:
        raise KilnDTypeError(f"{op}: {what} of type {t} is not supported; {op} takes float32, "
                             "float64 or complex64 (convert low-precision inputs to float32)")
    if t.rank < 2:
        raise KilnShapeError(f"{op}: {what} {t} must be a matrix or a batch of matrices "
                             "(rank >= 2)")
    if square and not dims_equal(t.shape[-1], t.shape[-2]):
        raise KilnShapeError(f"{op}: {what} {t} must be square in its last two dims, got "
                             f"{t.shape[-2]} x {t.shape[-1]}")


def _real(t):
    return t.with_dtype(dt.float32) if t.dtype.is_complex else t


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else dim(sympy.Min(a, b))


def _per_matrix(fn, a, *rest, outs):
    """Apply a LAPACK wrapper to the whole batch; on failure redo it matrix by matrix,
    filling the failing slots with NaN (JAX's behaviour) instead of raising."""
    with np.errstate(all="ignore"):
        try:
            result = fn(a, *rest)
            return result if isinstance(result, tuple) else (result,)
        except np.linalg.LinAlgError:
            pass
        batch = a.shape[:-2]
        results = [np.full(batch + s, np.nan, dtype=d) for s, d in outs]
        for index in np.ndindex(*batch):
            try:
                one = fn(a[index], *(r[index] for r in rest))
            except np.linalg.LinAlgError:
                continue
            for buf, value in zip(results, one if isinstance(one, tuple) else (one,)):
                buf[index] = value
        return tuple(results)


def _solve_shapes(op, a, b):
    _matrix(op, a, square=True, what="matrix a")
    _matrix(op, b, what="right-hand side b")
    if a.dtype != b.dtype:
        raise KilnDTypeError(f"{op}: a {a} and b {b} must have one dtype")
    if not dims_equal(a.shape[-1], b.shape[-2]):
        raise KilnShapeError(f"{op}: a {a} is {a.shape[-2]} x {a.shape[-1]} but b {b} has "
                             f"{b.shape[-2]} rows; b is [..., n, k] (a column per right-hand side)")
    batch = broadcast_shapes(op, a.shape[:-2], b.shape[:-2], describe=lambda: f"{a} with {b}")
    return b.with_shape(batch + b.shape[-2:])


def _broadcast_batch(a, b):
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return np.broadcast_to(a, batch + a.shape[-2:]), np.broadcast_to(b, batch + b.shape[-2:])


@defop("cholesky", family="linalg", kind=EXTERN, num_operands=1, differentiable=True)
class cholesky:
    """Lower Cholesky factor L of a Hermitian positive-definite a (a = L @ L^H);
    reads the lower triangle; not positive definite gives NaNs."""

    def type(op, a):
        _matrix(op, a, square=True)
        return a

    def reference(a):
        (out,) = _per_matrix(np.linalg.cholesky, a, outs=[(a.shape[-2:], a.dtype)])
        return out.astype(a.dtype)


@defop("qr", family="linalg", kind=EXTERN, num_operands=1, differentiable=True)
class qr:
    """Reduced QR of a [..., m, n]: q [..., m, k] with orthonormal columns, r [..., k, n]
    upper triangular, k = min(m, n)."""

    def type(op, a):
        _matrix(op, a)
        m, n = a.shape[-2:]
        k = _min(m, n)
        return a.with_shape(a.shape[:-2] + (m, k)), a.with_shape(a.shape[:-2] + (k, n))

    def reference(a):
        q, r = np.linalg.qr(a, mode="reduced")
        return q.astype(a.dtype), r.astype(a.dtype)


@defop("eigh", family="linalg", kind=EXTERN, num_operands=1, differentiable=True)
class eigh:
    """Eigen-decomposition of a Hermitian a (lower triangle read): real eigenvalues
    ascending [..., n] and eigenvectors as columns [..., n, n]."""

    def type(op, a):
        _matrix(op, a, square=True)
        return _real(a).with_shape(a.shape[:-1]), a

    def reference(a):
        w, v = np.linalg.eigh(a, UPLO="L")
        return w.astype(_real_np(a.dtype)), v.astype(a.dtype)


def _real_np(d):
    return np.dtype(np.float32) if d == np.complex64 else d


@defop("svd", family="linalg", kind=EXTERN, num_operands=1, differentiable=True)
class svd:
    """Reduced SVD a = u @ diag(s) @ vh: u [..., m, k], s [..., k] real descending,
    vh [..., k, n], k = min(m, n)."""

    def type(op, a):
        _matrix(op, a)
        m, n = a.shape[-2:]
        k = _min(m, n)
        lead = a.shape[:-2]
        return a.with_shape(lead + (m, k)), _real(a).with_shape(lead + (k,)), a.with_shape(lead + (k, n))

    def reference(a):
        m, n = a.shape[-2:]
        k, real = min(m, n), _real_np(a.dtype)
        u, s, vh = _per_matrix(lambda x: tuple(np.linalg.svd(x, full_matrices=False)), a,
                               outs=[((m, k), a.dtype), ((k,), real), ((k, n), a.dtype)])
        return u.astype(a.dtype), s.astype(real), vh.astype(a.dtype)


@defop("solve", family="linalg", kind=EXTERN, num_operands=2, differentiable=True)
class solve:
    """x with a @ x = b for square a [..., n, n] and b [..., n, k] (always a matrix: a
    vector b is b[..., None]); batch dims broadcast; singular a gives NaNs."""

    def type(op, a, b):
        return _solve_shapes(op, a, b)

    def reference(a, b):
        a, b = _broadcast_batch(a, b)
        (x,) = _per_matrix(np.linalg.solve, a, b, outs=[(b.shape[-2:], b.dtype)])
        return contiguous(x).astype(b.dtype)


@defop("triangular_solve", family="linalg", kind=EXTERN, num_operands=2,
       attrs={"lower": True, "unit_diagonal": False}, differentiable=True)
class triangular_solve:
    """x with a @ x = b, reading only the lower (or upper) triangle of a [..., n, n]
    (its diagonal taken as ones if unit_diagonal); b [..., n, k]; batch dims broadcast."""

    def type(op, a, b, *, lower, unit_diagonal):
        if not isinstance(lower, bool) or not isinstance(unit_diagonal, bool):
            raise KilnArgumentError(f"{op}: lower and unit_diagonal must be bools, got "
                                    f"{lower!r}, {unit_diagonal!r}")
        return _solve_shapes(op, a, b)

    def reference(a, b, *, lower, unit_diagonal):
        a, b = _broadcast_batch(a, b)
        n = a.shape[-1]
        x = np.zeros(b.shape, dtype=b.dtype)
        # substitution, row by row; rows not solved yet are zero in x, so a full-row
        # product only picks up the triangle already solved
        with np.errstate(all="ignore"):
            for i in (range(n) if lower else reversed(range(n))):
                row = b[..., i, :] - np.einsum("...j,...jk->...k", a[..., i, :], x)
                x[..., i, :] = row if unit_diagonal else row / a[..., i, i][..., None]
        return x
