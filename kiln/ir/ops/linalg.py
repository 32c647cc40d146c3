"""Linear algebra: the two contraction primitives (dot_general, convolution), the
composites users call on them (torch's matmul and conv2d), and the LAPACK-style extern
calls (cholesky, qr, eigh, svd, solve, triangular_solve).

dot_general follows JAX/StableHLO: result dims are the batch dims, then lhs free
dims, then rhs free dims. Contractions of low-precision floats accumulate in float32
and round once. Extern ops take float32, float64 or complex64 matrices in the last two
dims, batched over the leading dims; a matrix LAPACK rejects (not positive definite,
singular) gives NaNs in its slot instead of an exception, as JAX does.

vjp rules are the standard ones (JAX's lax.linalg, PyTorch's FunctionsManual). For
complex operands a cotangent is conjugate-linear, as torch's: for y = a @ x it is
a^H @ ct. The externs that read one triangle (cholesky, eigh: the lower one;
triangular_solve: the one it solves with) give a cotangent in that triangle only.
"""

from __future__ import annotations

import math

import numpy as np
import sympy
from numpy.lib.stride_tricks import sliding_window_view

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.rules import (  # noqa: F401  (conj: used by other families too)
    contiguous, LOW_PRECISION, NUMERIC, check_axes, check_dtype, check_int_tuple, conj, via_f32,
)
from kiln.ir.ops.shape import full_like, size, sum_to, zeros
from kiln.ir.registry import COMPOSITE, EXTERN, PRIMITIVE, REQUIRED, defop
from kiln.ir.shapes import broadcast_shapes, dim, dims_equal, shapes_equal
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


def _inverse(perm):
    return tuple(list(perm).index(i) for i in range(len(perm)))


def _permute(b, x, perm):
    perm = tuple(perm)
    return x if perm == tuple(range(len(perm))) else b.transpose(x, permutation=perm)


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

    def vjp(b, cts, xs, ys, *, lhs_contracting, rhs_contracting, lhs_batch, rhs_batch):
        lhs, rhs = xs
        lr, rr = b.type_of(lhs).rank, b.type_of(rhs).rank
        lc, lb = [a % lr for a in lhs_contracting], [a % lr for a in lhs_batch]
        rc, rb = [a % rr for a in rhs_contracting], [a % rr for a in rhs_batch]
        return [_dot_ct(b, cts[0], lr, conj(b, rhs), rr, lc, rc, lb, rb, swap=False),
                _dot_ct(b, cts[0], rr, conj(b, lhs), lr, rc, lc, rb, lb, swap=True)]


def _dot_ct(b, ct, x_rank, y, y_rank, xc, yc, xb, yb, swap):
    """The cotangent of x in dot_general(x, y) (of y in dot_general(y, x) with swap):
    ct contracted with y over y's free dims, then x's dims put back in order (JAX's
    _dot_general_transpose_lhs)."""
    x_free = [i for i in range(x_rank) if i not in xc and i not in xb]
    y_free = [i for i in range(y_rank) if i not in yc and i not in yb]
    nb = len(xb)
    first = nb if swap else nb + len(x_free)  # where y's free dims sit in ct
    out = b.dot_general(ct, y, lhs_contracting=tuple(range(first, first + len(y_free))),
                        rhs_contracting=tuple(y_free), lhs_batch=tuple(range(nb)),
                        rhs_batch=tuple(yb))
    # out is batch, x's free dims, then x's contracting dims in the order of y's
    order = list(xb) + x_free + [xc[j] for j in sorted(range(len(yc)), key=yc.__getitem__)]
    return _permute(b, out, _inverse(order))


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

    def vjp(b, cts, xs, ys, *, window_strides, padding, rhs_dilation, feature_group_count):
        """Both cotangents are convolutions: x's of the stride-dilated cotangent with the
        flipped kernel, w's of x with the cotangent as kernel (strides and dilation
        swap roles)."""
        x, w = xs
        if not all(isinstance(k, int) for k in b.type_of(w).shape[2:]):
            raise KilnShapeError(f"convolution: its vjp needs a static kernel size, got "
                                 f"{b.type_of(w)}")
        attrs = conv_attrs("convolution", b.type_of(x).rank - 2, window_strides, padding,
                           rhs_dilation, feature_group_count)
        return [_conv_input_ct(b, cts[0], conj(b, w), b.type_of(x), *attrs),
                _conv_kernel_ct(b, cts[0], conj(b, x), b.type_of(w), *attrs)]


def _crop(b, y, start, shape):
    """y[start : start + shape] on every dim, when that is not all of y."""
    if shapes_equal(b.type_of(y).shape, shape) and not any(start):
        return y
    return b.slice(y, start=tuple(start), limit=tuple(size(s + n) for s, n in zip(start, shape)))


def _per_group(d, groups):
    return d // groups if isinstance(d, int) else dim(sympy.sympify(d) / groups)


def _conv_input_ct(b, ct, w, xt, strides, padding, dilation, groups):
    # dx[i] = sum_k ct'[i + lo - k*r] w[k], ct' the cotangent with stride - 1 zeros between
    # entries: a stride-1 convolution of ct' with the flipped kernel, channels swapped
    n, wt = xt.rank - 2, b.type_of(w)
    spatial = tuple(range(2, 2 + n))
    out_ch, in_per_group = wt.shape[:2]
    flipped = b.reverse(w, dims=spatial)
    if groups == 1:
        kernel = b.transpose(flipped, permutation=(1, 0) + spatial)
    else:  # [G, O/G, C/G, *k] -> [G, C/G, O/G, *k]
        per = _per_group(out_ch, groups)
        kernel = b.reshape(flipped, shape=(groups, per, in_per_group) + wt.shape[2:])
        kernel = b.transpose(kernel, permutation=(0, 2, 1) + tuple(range(3, 3 + n)))
        kernel = b.reshape(kernel, shape=(xt.shape[1], per) + wt.shape[2:])
    ctt = b.type_of(ct)
    if any(s > 1 for s in strides):
        ct = b.pad(ct, zeros(b, ctt.with_shape(())), low=(0,) * ctt.rank, high=(0,) * ctt.rank,
                   interior=(0, 0) + tuple(s - 1 for s in strides))
    low, high, skip = [], [], []
    for d, k, t, s, (lo, hi), r in zip(xt.shape[2:], wt.shape[2:], ctt.shape[2:], strides,
                                      padding, dilation):
        span = r * (k - 1)
        before = span - lo  # zeros ct' needs in front; negative: its first entries only fed padding
        after = size(d + lo - (t - 1) * s - 1)
        low.append(max(before, 0))
        skip.append(max(-before, 0))
        # a symbolic `after` lies in [span - hi, span - hi + s - 1]: pad the most, crop after
        high.append(max(after, 0) if isinstance(after, int) else max(span - hi + s - 1, 0))
    y = b.convolution(ct, kernel, window_strides=(1,) * n, padding=tuple(zip(low, high)),
                      rhs_dilation=dilation, feature_group_count=groups)
    return _crop(b, y, [0, 0] + skip, xt.shape)


def _conv_kernel_ct(b, ct, x, wt, strides, padding, dilation, groups):
    # dw[o, c, k] = sum_{n, t} ct[n, o, t] xp[n, c, t*s + k*r]: a convolution of x (batch
    # as channels) with ct as kernel, at stride r and kernel dilation s
    xt, n = b.type_of(x), wt.rank - 2
    spatial = tuple(range(2, 2 + n))
    batch = xt.shape[0]
    if groups == 1:
        lhs = b.transpose(x, permutation=(1, 0) + spatial)  # [C, N, *d]
    else:  # [N, G, C/G, *d] -> [C/G, G*N, *d]: group g's channels see group g's kernels
        lhs = b.reshape(x, shape=(batch, groups, wt.shape[1]) + xt.shape[2:])
        lhs = b.transpose(lhs, permutation=(2, 1, 0) + tuple(range(3, 3 + n)))
        lhs = b.reshape(lhs, shape=(wt.shape[1], size(groups * batch)) + xt.shape[2:])
    kernel = b.transpose(ct, permutation=(1, 0) + spatial)  # [O, N, *t]
    y = b.convolution(lhs, kernel, window_strides=dilation, padding=padding,
                      rhs_dilation=strides, feature_group_count=groups)  # [C/G, O, >= k]
    y = _crop(b, y, [0] * (n + 2), (wt.shape[1], wt.shape[0]) + wt.shape[2:])
    return b.transpose(y, permutation=(1, 0) + spatial)


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


# -- matrix pieces of the extern vjp rules (batched over the leading dims) ---------------

def _mT(b, x):
    r = b.type_of(x).rank
    return b.transpose(x, permutation=tuple(range(r - 2)) + (r - 1, r - 2))


def _mH(b, x):
    return conj(b, _mT(b, x))


def _mm(b, x, y):
    """x @ y for operands with one batch shape."""
    r = b.type_of(x).rank
    batch = tuple(range(r - 2))
    return b.dot_general(x, y, lhs_contracting=(r - 1,), rhs_contracting=(r - 2,),
                         lhs_batch=batch, rhs_batch=batch)


def _add(b, *xs):
    """The sum of the values given (None: zero)."""
    xs = [x for x in xs if x is not None]
    out = xs[0]
    for x in xs[1:]:
        out = b.add(out, x)
    return out


def _positions(b, x, pick):
    """The bool mask of the entries (i, j) of x's matrices where pick(i, j) holds."""
    t = b.type_of(x)
    return pick(b.iota(dtype=dt.int64, shape=t.shape, dimension=t.rank - 2),
                b.iota(dtype=dt.int64, shape=t.shape, dimension=t.rank - 1))


def _where(b, x, pick):
    """x where pick(row index, column index) holds, else 0."""
    return b.select(_positions(b, x, pick), x, zeros(b, b.type_of(x)))


def _triangle(b, x, lower=True, strict=False):
    pick = {(True, False): "ge", (True, True): "gt", (False, False): "le", (False, True): "lt"}
    return _where(b, x, lambda i, j: b.call(pick[lower, strict], i, j))


def _diagonal(b, x):
    """The diagonal of square matrices, as [..., n]."""
    return b.reduce_sum(_where(b, x, b.eq), axes=(b.type_of(x).rank - 1,))


def _diag_matrix(b, v):
    """[..., n] -> the diagonal matrices [..., n, n]."""
    t = b.type_of(v)
    full = b.broadcast_in_dim(v, shape=t.shape + t.shape[-1:],
                              broadcast_dimensions=tuple(range(t.rank)))
    return _where(b, full, b.eq)


def _scale(b, x, v, axis):
    """x times the vector v [..., n] along x's rows (axis -2) or columns (axis -1)."""
    t = b.type_of(x)
    dims = tuple(range(t.rank - 2)) + ((t.rank - 2,) if axis == -2 else (t.rank - 1,))
    return b.mul(x, b.broadcast_in_dim(b.convert(v, t.dtype), shape=t.shape,
                                       broadcast_dimensions=dims))


def _scalar(b, x, value):
    return full_like(b, b.type_of(x), value)


def _halve_diagonal(b, x):
    return b.select(_positions(b, x, b.eq), b.mul(x, _scalar(b, x, 0.5)), x)


def _read_lower(b, g):
    """The cotangent of an operand whose lower triangle stands for a Hermitian matrix,
    from g, the cotangent of that matrix: each strict-lower entry stands for itself and
    its mirror (g + g^H there), the diagonal for its real part."""
    return _triangle(b, _halve_diagonal(b, b.add(g, _mH(b, g))))


def _right_solve(b, x, r, lower):
    """x @ r^-H for triangular r: (r^-1 @ x^H)^H."""
    return _mH(b, b.triangular_solve(r, _mH(b, x), lower=lower))


def _reciprocal_gaps(b, v):
    """f[..., i, j] = 1 / (v_j - v_i), 0 where v_j == v_i (the diagonal, and repeated
    values: there only the part of the cotangent that ignores the basis is defined)."""
    t = b.type_of(v)
    shape, lead = t.shape + t.shape[-1:], tuple(range(t.rank - 1))
    gaps = b.sub(b.broadcast_in_dim(v, shape=shape, broadcast_dimensions=lead + (t.rank,)),
                 b.broadcast_in_dim(v, shape=shape, broadcast_dimensions=lead + (t.rank - 1,)))
    same = b.eq(gaps, zeros(b, b.type_of(gaps)))
    one = full_like(b, b.type_of(gaps), 1)
    return b.select(same, zeros(b, b.type_of(gaps)), b.div(one, b.select(same, one, gaps)))


def _known(op, relation, what):
    """A static decision on dims (m < n, ...), or an error where symbols leave it open."""
    value = sympy.sympify(relation)
    if value in (sympy.true, sympy.false):
        return bool(value)
    raise KilnShapeError(f"{op}: its vjp needs to know whether {what} ({relation}); the "
                         "symbolic dims leave it open; make one of them static")


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

    def vjp(b, cts, xs, ys):
        """G = L^-H phi(L^H gL) L^-1, phi taking the lower triangle with its diagonal
        halved and mirroring it (PyTorch's cholesky_backward); then read as a's lower
        triangle."""
        (l,), (gl,) = ys, cts
        lh = _mH(b, l)
        m = _triangle(b, _mm(b, lh, gl))
        phi = b.mul(b.add(m, _mH(b, _triangle(b, m, strict=True))), _scalar(b, m, 0.5))
        y = b.triangular_solve(lh, phi, lower=False)
        return [_read_lower(b, _right_solve(b, y, lh, lower=False))]  # y @ L^-1


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

    def vjp(b, cts, xs, ys):
        """m >= n: gA = (gQ + Q sym(triu(gR R^H - Q^H gQ))) R^-H, sym mirroring the upper
        triangle and halving the (real) diagonal (Liao et al. 2019; PyTorch). m < n:
        a = [x | y] with x square; y = Q R[:, m:] adds its part to gQ."""
        (a,), (q, r), (gq, gr) = xs, ys, cts
        if gq is None and gr is None:
            return [None]
        t = b.type_of(a)
        m, n = t.shape[-2:]
        if not _known("qr", sympy.sympify(m) < n, "a has fewer rows than columns"):
            return [_qr_tall_ct(b, q, r, gq, gr)]
        cols = lambda x, lo, hi: b.slice(  # noqa: E731
            x, start=(0,) * (t.rank - 1) + (lo,), limit=b.type_of(x).shape[:-1] + (hi,))
        u, gu, gv = cols(r, 0, m), None, None
        if gr is not None:
            gu, gv = cols(gr, 0, m), cols(gr, m, n)
            gq = _add(b, gq, _mm(b, cols(a, m, n), _mH(b, gv)))
        gx = _qr_tall_ct(b, q, u, gq, gu)
        gy = _mm(b, q, gv) if gv is not None else zeros(b, b.type_of(cols(a, m, n)))
        return [b.concatenate(gx, gy, dimension=t.rank - 1)]


def _qr_tall_ct(b, q, r, gq, gr):
    """The m >= n rule (either cotangent may be None)."""
    terms = [_mm(b, gr, _mH(b, r)) if gr is not None else None,
             b.neg(_mm(b, _mH(b, q), gq)) if gq is not None else None]
    upper = _triangle(b, _add(b, *terms), lower=False)
    sym = _halve_diagonal(b, b.add(upper, _mH(b, upper)))
    return _right_solve(b, _add(b, gq, _mm(b, q, sym)), r, lower=False)


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

    def vjp(b, cts, xs, ys):
        """G = V (diag(gw) + F o skew(V^H gV)) V^H with F_ij = 1 / (w_j - w_i), read as
        a's lower triangle. Needs distinct eigenvalues when gV is used: for repeated ones
        F is 0 there, which is right for functions that ignore the choice of basis in an
        eigenspace (eigenvalues, projectors) and the basis-free part otherwise."""
        (w, v), (gw, gv) = ys, cts
        if gw is None and gv is None:
            return [None]
        inner = [_diag_matrix(b, b.convert(gw, b.type_of(v).dtype)) if gw is not None else None]
        if gv is not None:
            x = _mm(b, _mH(b, v), gv)
            skew = b.mul(b.sub(x, _mH(b, x)), _scalar(b, x, 0.5))
            inner.append(b.mul(skew, b.convert(_reciprocal_gaps(b, w), b.type_of(x).dtype)))
        return [_read_lower(b, _mm(b, _mm(b, v, _add(b, *inner)), _mH(b, v)))]



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

    def vjp(b, cts, xs, ys):
        """gA = U [F o (J - J^H) S + S F o (K - K^H) + diag(gs)] V^H, J = U^H gU,
        K = V^H gV, F_ij = 1 / (s_j^2 - s_i^2), plus the parts of gU (gV) outside U's
        (V's) span when m > n (m < n), times S^-1 (Townsend 2016; PyTorch's
        svd_backward; complex adds i Im(diag J) / s on the diagonal). Repeated singular
        values get F = 0 (as eigh), zero ones a zero S^-1 (JAX's pseudo-inverse)."""
        (a,), (u, s, vh), (gu, gs, gvh) = xs, ys, cts
        if gu is None and gs is None and gvh is None:
            return [None]
        t = b.type_of(a)
        m, n = t.shape[-2:]
        v, gv = _mH(b, vh), (_mH(b, gvh) if gvh is not None else None)
        f = b.convert(_reciprocal_gaps(b, b.mul(s, s)), t.dtype)
        zero = b.eq(s, zeros(b, b.type_of(s)))
        one = full_like(b, b.type_of(s), 1)
        s_inv = b.select(zero, zeros(b, b.type_of(s)), b.div(one, b.select(zero, one, s)))
        inner = [_diag_matrix(b, b.convert(gs, t.dtype)) if gs is not None else None]
        if gu is not None:
            j = _mm(b, _mH(b, u), gu)
            inner.append(_scale(b, b.mul(f, b.sub(j, _mH(b, j))), s, -1))
            if t.dtype.is_complex:  # the phase shared by u's and v's columns
                im = b.complex(zeros(b, b.type_of(s)), b.mul(b.imag(_diagonal(b, j)), s_inv))
                inner.append(_diag_matrix(b, im))
        if gv is not None:
            kk = _mm(b, _mH(b, v), gv)
            inner.append(_scale(b, b.mul(f, b.sub(kk, _mH(b, kk))), s, -2))
        ga = _mm(b, _mm(b, u, _add(b, *inner)), vh)
        if gu is not None and _known("svd", sympy.sympify(m) > n, "a has more rows than columns"):
            rest = b.sub(gu, _mm(b, u, _mm(b, _mH(b, u), gu)))  # (I - U U^H) gU S^-1 V^H
            ga = b.add(ga, _mm(b, _scale(b, rest, s_inv, -1), vh))
        if gv is not None and _known("svd", sympy.sympify(m) < n, "a has fewer rows than columns"):
            # U S^-1 gV^H (I - V V^H)
            rest = b.sub(_mH(b, gv), _mm(b, _mm(b, _mH(b, gv), v), vh))
            ga = b.add(ga, _mm(b, u, _scale(b, rest, s_inv, -2)))
        return [ga]


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

    def vjp(b, cts, xs, ys):
        """gb = a^-H ct, ga = -gb x^H, each summed over the batch dims it was broadcast in."""
        a, rhs = xs
        g_rhs = b.solve(_mH(b, a), cts[0])
        g_a = b.neg(_mm(b, g_rhs, _mH(b, ys[0])))
        return [sum_to(b, g_a, b.type_of(a).shape), sum_to(b, g_rhs, b.type_of(rhs).shape)]


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

    def vjp(b, cts, xs, ys, *, lower, unit_diagonal):
        """As solve's, with a^H solved from the other triangle, and a's cotangent kept in
        the entries the solve reads (the triangle, less the diagonal if unit)."""
        a, rhs = xs
        g_rhs = b.triangular_solve(_mH(b, a), cts[0], lower=not lower, unit_diagonal=unit_diagonal)
        g_a = _triangle(b, b.neg(_mm(b, g_rhs, _mH(b, ys[0]))), lower=lower, strict=unit_diagonal)
        return [sum_to(b, g_a, b.type_of(a).shape), sum_to(b, g_rhs, b.type_of(rhs).shape)]
