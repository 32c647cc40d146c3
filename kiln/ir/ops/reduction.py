"""Reductions over axes, arg-reductions, cumulative scans and sort.

Reductions drop their axes (keepdim is a reshape in the frontend). Low-precision
floats accumulate in float32 and round once at the end, as every backend does; so do
the vjp rules that multiply or divide (prod, max/min, cumprod).

vjp conventions: reduce_max/min split the cotangent equally over tied positions (JAX);
cummax/cummin send it to the most recent position attaining the running value
(torch.cummax's index); products are exact at zeros (no division by x).
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.ir.ops.linalg import conj, upcast
from kiln.ir.ops.rules import (
    contiguous,
    INTEGRAL, NUMERIC, REAL, LOW_PRECISION, check_axes, check_dtype,
)
from kiln.ir.quiet_numpy import quietly
from kiln.ir.ops.shape import full_like, zeros
from kiln.ir.registry import PRIMITIVE, REQUIRED, defop
from kiln.ir.shapes import normalize_axis
from kiln.ir.sharding import (
    Partial, Shard, Strategy, all_but, kept_dim, partial_through, reduced_axes, shard_dims,
    sharding_rule,
)


def _reduced(op, x, axes):
    axes = check_axes(op, axes, x.rank)
    return x.with_shape(tuple(d for i, d in enumerate(x.shape) if i not in axes))


def _accumulating(fn):
    def reference(x, *, axes):
        axes = tuple(a % x.ndim for a in axes) if x.ndim else ()  # dim 0 of a scalar is itself
        if x.dtype in LOW_PRECISION:
            return fn(x.astype(np.float32), axis=axes).astype(x.dtype)
        return quietly(_in_dtype, fn, x, axes)  # np.errstate costs more than a small sum

    return reference


def _in_dtype(fn, x, axes):
    # a reduction's result is a new array: it is copied only where its dtype changed
    # (integer sums accumulate in int64)
    return np.asarray(fn(x, axis=axes)).astype(x.dtype, copy=False)


def _reduce(name: str, allowed: str, fn, differentiable=True, doc="", vjp=None):
    def type_rule(op, x, *, axes):
        check_dtype(op, x, allowed)
        return _reduced(op, x, axes)

    doc = doc or f"{name[len('reduce_'):].capitalize()} over `axes`, which leave the shape."
    cls = type(name, (), {"type": type_rule, "reference": _accumulating(fn), "vjp": vjp,
                          "__doc__": doc})
    return defop(name, family="reduction", kind=PRIMITIVE, num_operands=1,
                 attrs={"axes": REQUIRED}, differentiable=differentiable)(cls)


def _expand(b, r, x, axes):
    """A reduced value broadcast back over x's reduced axes."""
    shape = b.type_of(x).shape
    axes = {a % len(shape) for a in axes} if shape else set()
    if not axes:
        return r
    kept = tuple(i for i in range(len(shape)) if i not in axes)
    return b.broadcast_in_dim(r, shape=shape, broadcast_dimensions=kept)


def _sum_vjp(b, cts, xs, ys, *, axes):
    return [_expand(b, cts[0], xs[0], axes)]


def _zero_split(b, x):
    """(x == 0, x with its zeros made 1)."""
    t = b.type_of(x)
    zero = b.eq(x, zeros(b, t))
    return zero, b.select(zero, full_like(b, t, 1), x)


def product_of_others(b, x, combine):
    """For each element of x, the product of the others it is multiplied with, exact at
    zeros; `combine(v, "sum" or "prod")` reduces v over what is multiplied (axes, ranks)
    and broadcasts it back. Without zeros that is prod / x; with one zero, the product of
    the rest at the zero and 0 elsewhere; with more, 0 (also used by all_reduce prod)."""
    zero, safe = _zero_split(b, x)
    count, prod = combine(b.convert(zero, dt.int32), "sum"), combine(safe, "prod")
    none = b.eq(count, zeros(b, b.type_of(count)))
    one = b.call("and", zero, b.eq(count, full_like(b, b.type_of(count), 1)))
    return b.select(none, b.div(prod, safe), b.select(one, prod, zeros(b, b.type_of(x))))


def _prod_vjp(b, cts, xs, ys, *, axes):
    # d prod / dx_k is the product of the others (conjugated for complex, as every rule)
    x, d = upcast(b, conj(b, xs[0]))
    others = product_of_others(
        b, x, lambda v, op: _expand(b, b.call("reduce_" + op, v, axes=axes), x, axes))
    return [b.convert(b.mul(_expand(b, upcast(b, cts[0])[0], x, axes), others), d)]


def _extreme_vjp(b, cts, xs, ys, *, axes):
    """The cotangent goes to the positions equal to the result, split equally on ties."""
    x, t = xs[0], b.type_of(xs[0])
    hit = b.eq(x, _expand(b, ys[0], x, axes))
    ct, d = upcast(b, cts[0])
    count = b.reduce_sum(b.convert(hit, b.type_of(ct).dtype), axes=axes)
    share = _expand(b, b.convert(b.div(ct, count), d), x, axes)
    return [b.select(hit, share, zeros(b, t))]


# the ufuncs' reduce, which np.sum / np.prod / np.max / np.min call after ~1.2 us of
# argument handling (the same dtypes and values)
reduce_sum = _reduce("reduce_sum", NUMERIC, np.add.reduce, vjp=_sum_vjp)
reduce_prod = _reduce("reduce_prod", NUMERIC, np.multiply.reduce, vjp=_prod_vjp)
reduce_max = _reduce("reduce_max", REAL, np.maximum.reduce,
                     doc="Maximum over axes; NaN propagates; empty axes are an error. "
                         "Its vjp splits the cotangent equally over tied maxima (JAX).",
                     vjp=_extreme_vjp)
reduce_min = _reduce("reduce_min", REAL, np.minimum.reduce,
                     doc="Min over `axes`, which leave the shape. Its vjp splits the "
                         "cotangent equally over tied minima (JAX).",
                     vjp=_extreme_vjp)
reduce_and = _reduce("reduce_and", INTEGRAL, np.bitwise_and.reduce, differentiable=False)
reduce_or = _reduce("reduce_or", INTEGRAL, np.bitwise_or.reduce, differentiable=False)


_PARTIAL_OF = {"reduce_sum": "sum", "reduce_prod": "prod", "reduce_max": "max",
               "reduce_min": "min"}


@sharding_rule("reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "reduce_and", "reduce_or")
def _reduce_sharding(spec):
    """A kept dim stays sharded (at its place in the result); a reduced dim's shards
    reduce to Partial(sum|prod|max|min) (max/min only when every chunk is non-empty)."""
    axes = reduced_axes(spec)
    found = shard_dims(spec, range(spec.ndim), kept_dim(axes))
    red = _PARTIAL_OF.get(spec.op)
    if red is not None and not spec.in_dtypes[0].is_bool:
        for d in axes:
            if red in ("max", "min") and not spec.full_chunks(spec.in_shapes[0][d]):
                continue  # an empty chunk has no max
            found.append(Strategy((Shard(d),), (Partial(red),)))
        if red != "prod":
            found.append(partial_through(spec, red))
    return found


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


@sharding_rule("argmax", "argmin")
def _arg_sharding(spec):
    """The kept dims stay sharded; the searched one must be whole (an index is global)."""
    return shard_dims(spec, range(spec.ndim), kept_dim(reduced_axes(spec, "axis")))


def _scan(name, allowed, fn, vjp):
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

    doc = f"Inclusive {name[3:]} scan along axis (from the end if reverse)."
    cls = type(name, (), {"type": type_rule, "reference": reference, "vjp": vjp, "__doc__": doc})
    return defop(name, family="reduction", kind=PRIMITIVE, num_operands=1,
                 attrs={"axis": REQUIRED, "reverse": False})(cls)


def _cumsum_vjp(b, cts, xs, ys, *, axis, reverse):
    return [b.cumsum(cts[0], axis=axis, reverse=not reverse)]


def _cumprod_vjp(b, cts, xs, ys, *, axis, reverse):
    """dx_k = sum over i >= k (in scan order) of ct_i * prod_{j <= i, j != k} x_j, exact
    at zeros, from q, the scan of x with its zeros made 1: before the first zero it is
    the reverse scan of ct * q, over x_k; at the first zero, the reverse scan of ct * q
    over the positions whose prefix holds that one zero; after it, 0."""
    x, d = upcast(b, conj(b, xs[0]))
    zero, safe = _zero_split(b, x)
    q = b.cumprod(safe, axis=axis, reverse=reverse)
    seen = b.cumsum(b.convert(zero, dt.int32), axis=axis, reverse=reverse)
    w, nothing = b.mul(upcast(b, cts[0])[0], q), zeros(b, b.type_of(x))

    def gather(k):  # sum of w over the positions at or after each one that saw k zeros
        at_k = b.eq(seen, full_like(b, b.type_of(seen), k))
        return at_k, b.cumsum(b.select(at_k, w, nothing), axis=axis, reverse=not reverse)

    (clean, before), (once, at) = gather(0), gather(1)
    first_zero = b.call("and", zero, once)
    return [b.convert(b.select(clean, b.div(before, safe), b.select(first_zero, at, nothing)), d)]


def _running_extreme_vjp(b, cts, xs, ys, *, axis, reverse):
    """ct_i goes to the most recent position, in scan order, holding the running value
    (torch.cummax's index; a NaN holds it from where it appears)."""
    x, t = xs[0], b.type_of(xs[0])
    if t.rank == 0:
        return [cts[0]]
    a = axis % t.rank
    holds = b.call("or", b.eq(x, ys[0]), b.ne(x, x))
    pos = b.iota(dtype=dt.int64, shape=t.shape, dimension=a)
    # the scan's first position always holds, so the fill never survives
    fill = b.full(-1 if not reverse else 2**62, dt.int64, t.shape)
    last = (b.cummin if reverse else b.cummax)(b.select(holds, pos, fill), axis=a, reverse=reverse)
    return [b.scatter_along(zeros(b, t), last, cts[0], axis=a, mode="add")]


cumsum = _scan("cumsum", NUMERIC, np.cumsum, _cumsum_vjp)
cumprod = _scan("cumprod", NUMERIC, np.cumprod, _cumprod_vjp)
cummax = _scan("cummax", REAL, np.maximum.accumulate, _running_extreme_vjp)
cummin = _scan("cummin", REAL, np.minimum.accumulate, _running_extreme_vjp)


@sharding_rule("cumsum", "cumprod", "cummax", "cummin")
def _scan_sharding(spec):
    """Any dim but the scanned one; a cumulative sum is linear (Partial(sum) through)."""
    found = all_but(spec, *reduced_axes(spec, "axis"))
    if spec.op == "cumsum" and spec.in_dtypes[0].is_inexact:
        found.append(partial_through(spec, "sum"))
    return found


def _sort_image(data: np.ndarray):
    """An order-preserving uint64 image of `data` of at most 32 bits (NaN largest, -0.0
    equal to 0.0), or None where the dtype has none: 32-bit floats, integers of up to 32
    bits (unsigned: 16) and bools."""
    if data.dtype == np.float32:
        f = np.where(np.isnan(data), np.float32(np.nan), data + np.float32(0.0)).astype(np.float32, copy=False)
        u = f.view(np.uint32).astype(np.uint64)
        return np.where(u >> np.uint64(31) != 0, u ^ np.uint64(0xFFFFFFFF), u | np.uint64(0x80000000))
    if data.dtype.kind == "b" or data.dtype.kind in "iu" and \
            data.dtype.itemsize <= (4 if data.dtype.kind == "i" else 2):
        return (data.astype(np.int64) + (1 << 31)).astype(np.uint64)
    return None


def _keys(image: np.ndarray, a: int) -> np.ndarray:
    """Distinct uint64 keys: the image above each position's index along `a`, so that
    their (any) sort is the stable order."""
    shape = [1] * image.ndim
    shape[a] = image.shape[a]
    return (image << np.uint64(32)) | np.arange(image.shape[a], dtype=np.uint64).reshape(shape)


_LOW32 = np.uint64(0xFFFFFFFF)


def _stable_argsort(data: np.ndarray, a: int) -> np.ndarray:
    """np.argsort(data, axis=a, kind="stable"), where `_sort_image` has an image by one
    unstable sort of distinct keys (2x faster than numpy's stable argsort of float32)."""
    image = _sort_image(data)
    if image is None:
        return np.argsort(data, axis=a, kind="stable")
    return (np.sort(_keys(image, a), axis=a) & _LOW32).astype(np.int64)


def _stable_first(data: np.ndarray, a: int, descending: bool, limit: int) -> np.ndarray:
    """The first `limit` positions of the stable order along `a` (ties in index order,
    NaN largest): a partition of the keys, then a sort of those `limit` (topk's k of n
    in O(n), not O(n log n))."""
    image = _sort_image(data)
    n = data.shape[a]
    if image is None or limit >= n:
        order = _stable_order(data, a, descending)
        return np.take(order, np.arange(limit), axis=a)
    if descending:
        image = _LOW32 - image  # largest first, NaN first; the index stays ascending
    keys = _keys(image, a)
    if limit:
        keys = np.take(np.partition(keys, limit - 1, axis=a), np.arange(limit), axis=a)
    else:
        keys = np.take(keys, np.arange(0), axis=a)
    return (np.sort(keys, axis=a) & _LOW32).astype(np.int64)


def _stable_order(data: np.ndarray, a: int, descending: bool) -> np.ndarray:
    if descending:
        # stable descending (ties in index order, NaN first): the ascending stable
        # order of the reversed data, reversed (as np.lexsort of the negated keys
        # gave, at half the time)
        n = data.shape[a]
        return (n - 1) - np.flip(_stable_argsort(np.flip(data, a), a), a)
    return _stable_argsort(data, a)


@defop("sort", family="reduction", kind=PRIMITIVE, num_operands=1,
       attrs={"axis": -1, "descending": False, "limit": None})
class sort:
    """Stable sort along axis: (values, int64 indices). NaN sorts as the largest value
    (last ascending, first descending), as torch. `limit`: only the first `limit`
    entries of that order (topk), found by a partition."""

    def type(op, x, *, axis, descending, limit=None):
        check_dtype(op, x, REAL)
        a = normalize_axis(op, axis, x.rank, "axis")
        if limit is None:
            return x, x.with_dtype(dt.int64)
        size = x.shape[a] if x.rank else 1
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0 or \
                not isinstance(size, int) or limit > size:
            raise KilnArgumentError(f"{op}: limit must be an int in [0, {size}] (a static dim "
                                    f"{a} of {x}), got {limit!r}")
        shape = tuple(limit if i == a else d for i, d in enumerate(x.shape))
        return x.with_shape(shape), x.with_shape(shape).with_dtype(dt.int64)

    def reference(x, *, axis, descending, limit=None):
        a = axis % max(x.ndim, 1)
        data = x.astype(np.float32) if x.dtype in LOW_PRECISION else x
        if x.ndim == 0:
            return x.copy(), np.zeros((), np.int64)
        if limit is None:
            idx = _stable_order(data, a, descending)
        else:
            idx = _stable_first(data, a, descending, int(limit))
        return np.take_along_axis(x, idx, axis=a), idx.astype(np.int64)

    def vjp(b, cts, xs, ys, *, axis, descending, limit=None):
        """The values' cotangent scattered back through the permutation (ties are
        distinct positions, so each keeps its own)."""
        ct, t = cts[0], b.type_of(xs[0])
        if ct is None or t.rank == 0:
            return [ct]
        return [b.scatter_along(zeros(b, t), ys[1], ct, axis=axis, mode="add")]


sharding_rule("sort")(lambda spec: all_but(spec, *reduced_axes(spec, "axis")))

