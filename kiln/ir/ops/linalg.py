"""Linear algebra's contractions: the two primitives (dot_general, convolution) and the
composites users call on them (torch's matmul and conv2d). The LAPACK-style extern calls
(cholesky, qr, eigh, svd, solve, triangular_solve) live in lapack.py.

dot_general follows JAX/StableHLO: result dims are the batch dims, then lhs free
dims, then rhs free dims. Contractions of low-precision floats accumulate in float32
and round once.

vjp rules are the standard ones (JAX's lax.linalg, PyTorch's FunctionsManual). For
complex operands a cotangent is conjugate-linear, as torch's: for y = a @ x it is
a^H @ ct.
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
from kiln.ir.ops.shape import size, zeros
from kiln.ir.registry import COMPOSITE, PRIMITIVE, REQUIRED, defop
from kiln.ir.shapes import broadcast_shapes, dim, dims_equal, shapes_equal
from kiln.ir.sharding import Partial, R, Shard, Strategy, partial_through, sharding_rule
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


def _linear(spec, operands=((0,), (1,))):
    """A contraction is linear in each operand: a Partial(sum) one, the other replicated."""
    if not all(d.is_inexact for d in spec.in_dtypes[:2]):
        return []
    return [partial_through(spec, "sum", ops) for ops in operands]


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


@sharding_rule("dot_general")
def _dot_general_sharding(spec):
    """Megatron's parallelisms: batch dims of both -> Shard(b); a free dim of one
    (the other replicated) -> its result dim; contracted dims of both -> Partial(sum)."""
    a, (lhs, rhs) = spec.attrs, spec.in_shapes
    lb, rb = tuple(a.get("lhs_batch") or ()), tuple(a.get("rhs_batch") or ())
    lc, rc = tuple(a["lhs_contracting"]), tuple(a["rhs_contracting"])
    lfree = [d for d in range(len(lhs)) if d not in lb and d not in lc]
    rfree = [d for d in range(len(rhs)) if d not in rb and d not in rc]
    found = [Strategy((Shard(x), Shard(y)), (Shard(i),)) for i, (x, y) in enumerate(zip(lb, rb))]
    found += [Strategy((Shard(d), R), (Shard(len(lb) + k),)) for k, d in enumerate(lfree)]
    found += [Strategy((R, Shard(d)), (Shard(len(lb) + len(lfree) + k),))
              for k, d in enumerate(rfree)]
    if spec.in_dtypes[0].is_inexact or spec.in_dtypes[0].is_integer:
        found += [Strategy((Shard(x), Shard(y)), (Partial("sum"),)) for x, y in zip(lc, rc)]
    return found + _linear(spec)


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


@sharding_rule("convolution")
def _convolution_sharding(spec):
    """The batch; without groups also the output channels (through w) or the input
    channels of both (contracted: Partial(sum))."""
    found = [Strategy((Shard(0), R), (Shard(0),))]
    if (spec.attrs.get("feature_group_count") or 1) == 1:
        found += [Strategy((R, Shard(0)), (Shard(1),)),
                  Strategy((Shard(1), Shard(1)), (Partial("sum"),))]
    return found + _linear(spec)


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
    acc = _accumulator(x)  # copies only where the accumulator differs (a copy each cost ~0.3 us)
    return np.matmul(x.astype(acc, copy=False), y.astype(acc, copy=False)).astype(x.dtype, copy=False)


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
        if yt.rank == 2:  # x's batch dims are rows of one GEMM: no broadcast copy of y
            return b.dot_general(x, y, lhs_contracting=(xt.rank - 1,), rhs_contracting=(0,))
        batch = broadcast_shapes("matmul", xt.shape[:-2], yt.shape[:-2])
        bd = tuple(range(len(batch)))
        x, y = b.broadcast_to(x, batch + xt.shape[-2:]), b.broadcast_to(y, batch + yt.shape[-2:])
        return b.dot_general(x, y, lhs_contracting=(len(batch) + 1,),
                             rhs_contracting=(len(batch),), lhs_batch=bd, rhs_batch=bd)


@sharding_rule("matmul")
def _matmul_sharding(spec):
    """torch.matmul: [..., M, K] @ [..., K, N]; vectors drop their dim."""
    (lhs, rhs), (out,), p = spec.in_shapes, spec.out_shapes, Partial("sum")
    found, numeric = [], not spec.in_dtypes[0].is_bool
    if len(lhs) >= 2 and len(rhs) >= 2:
        for d in range(len(lhs) - 2):  # lhs batch dims (rhs broadcasts or matches)
            od, rd = len(out) - len(lhs) + d, d - (len(lhs) - len(rhs))
            if rd >= 0 and rhs[rd] == lhs[d]:
                found.append(Strategy((Shard(d), Shard(rd)), (Shard(od),)))
            elif rd < 0 or rhs[rd] == 1 and lhs[d] != 1:
                found.append(Strategy((Shard(d), R), (Shard(od),)))
        found.append(Strategy((Shard(len(lhs) - 2), R), (Shard(len(out) - 2),)))
        found.append(Strategy((R, Shard(len(rhs) - 1)), (Shard(len(out) - 1),)))
        if numeric:
            found.append(Strategy((Shard(len(lhs) - 1), Shard(len(rhs) - 2)), (p,)))
    elif len(lhs) == 1 and len(rhs) >= 2:  # [K] @ [..., K, N] -> [..., N]
        found.append(Strategy((R, Shard(len(rhs) - 1)), (Shard(len(out) - 1),)))
        if numeric:
            found.append(Strategy((Shard(0), Shard(len(rhs) - 2)), (p,)))
    elif len(rhs) == 1 and len(lhs) >= 2:  # [..., M, K] @ [K] -> [..., M]
        found += [Strategy((Shard(d), R), (Shard(d),)) for d in range(len(lhs) - 1)]
        if numeric:
            found.append(Strategy((Shard(len(lhs) - 1), Shard(0)), (p,)))
    elif numeric:  # dot of two vectors
        found.append(Strategy((Shard(0), Shard(0)), (p,)))
    return found + _linear(spec)


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


@sharding_rule("conv2d")
def _conv2d_sharding(spec):
    """As convolution's; with a bias it follows the output channels, and the contracted
    split is gone (each rank would add the bias)."""
    groups, bias = spec.attrs.get("groups") or 1, spec.attrs.get("has_bias")
    b = (R,) if bias else ()
    found = [Strategy((Shard(0), R) + b, (Shard(0),))]
    if groups == 1:
        found.append(Strategy((R, Shard(0)) + ((Shard(0),) if bias else ()), (Shard(1),)))
        if not bias:
            found.append(Strategy((Shard(1), Shard(1)), (Partial("sum"),)))
    return found if bias else found + _linear(spec)
