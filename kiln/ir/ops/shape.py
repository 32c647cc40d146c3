"""Shape primitives: reshape, broadcast, transpose, slicing, padding, joining,
indexing by tensors (take, take_along, scatter_along) and dynamic slices.

Type rules work on symbolic dims: a reshape of f32[B, T, 64] to [B*T, 64] is
checked by exact symbolic equality of element counts. So do the vjp rules: every size
they compute is a dim expression, and a symbolic pad amount (pad takes ints) becomes a
concatenated block of zeros.
"""

from __future__ import annotations

import numpy as np
import sympy

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnIndexError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.creation import _check_shape_attr
from kiln.ir.ops.indices import scatter_add
from kiln.ir.ops.rules import (  # noqa: F401  (full_like, zeros: used by other families too)
    contiguous, INTEGER, check_axes, check_dtype, check_int_tuple, full_like, zeros,
)
from kiln.ir.registry import PRIMITIVE, REQUIRED, defop
from kiln.ir.shapes import dim, dims_equal, format_shape, normalize_axis, numel, shapes_equal
from kiln.ir.sharding import (
    Partial, R, Shard, Strategy, moved_partials, partial_through, result_shape_attr, shard_dims,
    sharding_rule,
)


# -- pieces the vjp rules of every family share ----------------------------------------

def size(expr):
    """A dim from arithmetic on dims (sympy results expanded, integers made ints)."""
    return expr if isinstance(expr, int) else dim(sympy.expand(expr))


def reshape_to(b, x, shape):
    return x if shapes_equal(b.type_of(x).shape, tuple(shape)) else b.reshape(x, shape=tuple(shape))


def unbroadcast(b, ct, shape, broadcast_dimensions):
    """The transpose of broadcast_in_dim: ct summed over the result dims no operand dim
    maps to and over those broadcast from a static 1, then reshaped to `shape`."""
    ct_shape = b.type_of(ct).shape
    summed = {d for d in range(len(ct_shape)) if d not in broadcast_dimensions}
    summed |= {m for d, m in zip(shape, broadcast_dimensions)
               if d == 1 and not (isinstance(ct_shape[m], int) and ct_shape[m] == 1)}
    out = b.reduce_sum(ct, axes=tuple(sorted(summed))) if summed else ct
    return reshape_to(b, out, shape)


def sum_to(b, ct, shape):
    """ct summed down to `shape`, undoing numpy (right-aligned) broadcasting."""
    offset = b.type_of(ct).rank - len(shape)
    return unbroadcast(b, ct, tuple(shape), tuple(range(offset, offset + len(shape))))


def pad_zeros(b, x, low, high, interior=None):
    """x padded with zeros; a symbolic low or high (pad takes ints) becomes a
    concatenated block of zeros."""
    t = b.type_of(x)
    interior = tuple(interior or (0,) * t.rank)
    static = lambda v: v if isinstance(v, int) else 0  # noqa: E731
    if any(static(v) for v in (*low, *high)) or any(interior):
        x = b.pad(x, zeros(b, t.with_shape(())), low=tuple(map(static, low)),
                  high=tuple(map(static, high)), interior=interior)
    for i, (lo, hi) in enumerate(zip(low, high)):
        if isinstance(lo, int) and isinstance(hi, int):
            continue
        t = b.type_of(x)
        block = lambda n: zeros(b, t.with_shape(t.shape[:i] + (n,) + t.shape[i + 1:]))  # noqa: E731
        parts = ([] if isinstance(lo, int) else [block(lo)]) + [x] + \
            ([] if isinstance(hi, int) else [block(hi)])
        x = b.concatenate(*parts, dimension=i)
    return x


@defop("reshape", family="shape", kind=PRIMITIVE, num_operands=1, attrs={"shape": REQUIRED})
class reshape:
    """Same elements in row-major order, new shape."""

    def type(op, x, *, shape):
        dims = _check_shape_attr(op, shape)
        if not dims_equal(numel(dims), x.numel):
            raise KilnShapeError(
                f"reshape: cannot reshape {x} ({x.numel} elements) to {format_shape(dims)} "
                f"({numel(dims)} elements); the element counts must match")
        return x.with_shape(dims)

    def reference(x, *, shape):
        return np.reshape(x, shape)

    def vjp(b, cts, xs, ys, *, shape):
        return [b.reshape(cts[0], shape=b.type_of(xs[0]).shape)]


@sharding_rule("reshape", local_attrs=result_shape_attr)
def _reshape_sharding(spec):
    """Shard(d) -> Shard(j) when chunk c of d and of j are the same elements (even cuts)."""
    (x,), (out,) = spec.in_shapes, spec.out_shapes
    found = []
    for d in range(len(x)):
        for j in range(len(out)):
            if (numel(x[:d]) == numel(out[:j]) and numel(x[d:]) == numel(out[j:])
                    and spec.even(x[d]) and spec.even(out[j]) and x[d] > 0 and out[j] > 0):
                found.append(Strategy((Shard(d),), (Shard(j),)))
                break
    return found + moved_partials(spec)


@defop("broadcast_in_dim", family="shape", kind=PRIMITIVE, num_operands=1,
       attrs={"shape": REQUIRED, "broadcast_dimensions": REQUIRED})
class broadcast_in_dim:
    """Operand dim i becomes output dim broadcast_dimensions[i]; it must equal it or be 1."""

    def type(op, x, *, shape, broadcast_dimensions):
        dims = _check_shape_attr(op, shape)
        mapping = check_int_tuple(op, "broadcast_dimensions", broadcast_dimensions, x.rank)
        if any(not 0 <= m < len(dims) for m in mapping) or list(mapping) != sorted(set(mapping)):
            raise KilnArgumentError(
                f"broadcast_in_dim: broadcast_dimensions {mapping} must be increasing dims of "
                f"the rank-{len(dims)} result")
        for i, m in enumerate(mapping):
            d = x.shape[i]
            if not (d == 1 or dims_equal(d, dims[m])):
                raise KilnShapeError(
                    f"broadcast_in_dim: cannot broadcast {x} to {format_shape(dims)}: operand "
                    f"dim {i} is {d}, result dim {m} is {dims[m]}; it must be equal or 1")
        return x.with_shape(dims)

    def reference(x, *, shape, broadcast_dimensions):
        view = [1] * len(shape)
        for i, m in enumerate(broadcast_dimensions):
            view[m] = x.shape[i]
        return contiguous(np.broadcast_to(x.reshape(view), shape))

    def vjp(b, cts, xs, ys, *, shape, broadcast_dimensions):
        return [unbroadcast(b, cts[0], b.type_of(xs[0]).shape, broadcast_dimensions)]


@sharding_rule("broadcast_in_dim", local_attrs=result_shape_attr)
def _broadcast_in_dim_sharding(spec):
    """A dim whose size the broadcast keeps stays sharded, at its new position."""
    dims, (x,), (out,) = spec.attrs["broadcast_dimensions"], spec.in_shapes, spec.out_shapes
    return [Strategy((Shard(i),), (Shard(dims[i]),)) for i in range(len(x)) if x[i] == out[dims[i]]
            ] + moved_partials(spec)


@defop("transpose", family="shape", kind=PRIMITIVE, num_operands=1,
       attrs={"permutation": REQUIRED})
class transpose:
    """Output dim i is operand dim permutation[i]."""

    def type(op, x, *, permutation):
        perm = check_int_tuple(op, "permutation", permutation)
        if sorted(perm) != list(range(x.rank)):
            raise KilnArgumentError(
                f"transpose: permutation {perm} is not a permutation of the {x.rank} dims of {x}")
        return x.with_shape(tuple(x.shape[p] for p in perm))

    def reference(x, *, permutation):
        return contiguous(np.transpose(x, permutation))

    def vjp(b, cts, xs, ys, *, permutation):
        perm = list(permutation)
        return [b.transpose(cts[0], permutation=tuple(perm.index(i) for i in range(len(perm))))]


@sharding_rule("transpose")
def _transpose_sharding(spec):
    perm = spec.attrs["permutation"]
    return [Strategy((Shard(p),), (Shard(j),)) for j, p in enumerate(perm)] + moved_partials(spec)


def _slice_size(start, limit, stride):
    if all(isinstance(v, int) for v in (start, limit)):
        return max(0, -(-(limit - start) // stride))
    # ceil(n / s) as floor((n + s - 1) / s): floor division is what every backend lowers
    return dim(sympy.floor((sympy.sympify(limit) - start + stride - 1) / stride))


@defop("slice", family="shape", kind=PRIMITIVE, num_operands=1,
       attrs={"start": REQUIRED, "limit": REQUIRED, "stride": None})
class slice_:
    """x[start:limit:stride] on every dim; starts and limits are in range, strides >= 1."""

    def type(op, x, *, start, limit, stride):
        stride = stride if stride is not None else (1,) * x.rank
        for name, v in (("start", start), ("limit", limit), ("stride", stride)):
            if not isinstance(v, (tuple, list)) or len(v) != x.rank:
                raise KilnArgumentError(f"slice: {name} must have one entry per dim of {x}, got {v!r}")
        out = []
        for i, (s, l, st, d) in enumerate(zip(start, limit, stride, x.shape)):
            s, l = dim(s), dim(l)
            if not isinstance(st, int) or st < 1:
                raise KilnArgumentError(f"slice: stride {st} of dim {i} must be an int >= 1")
            if isinstance(s, int) and s < 0 or isinstance(l, int) and isinstance(s, int) and l < s:
                raise KilnArgumentError(f"slice: dim {i} needs 0 <= start <= limit, got {s}:{l}")
            if isinstance(l, int) and isinstance(d, int) and l > d:
                raise KilnIndexError(f"slice: limit {l} of dim {i} exceeds its size {d} in {x}")
            out.append(_slice_size(s, l, st))
        return x.with_shape(tuple(out))

    def reference(x, *, start, limit, stride):
        stride = stride or (1,) * x.ndim
        return contiguous(x[tuple(slice(s, l, st) for s, l, st in zip(start, limit, stride))])

    def vjp(b, cts, xs, ys, *, start, limit, stride):
        """The cotangent back in place: zeros around it, stride - 1 zeros between."""
        x_shape, out = b.type_of(xs[0]).shape, b.type_of(ys[0]).shape
        stride = stride or (1,) * len(out)
        high = [size(d - dim(s) - ((n - 1) * st + 1)) if not (isinstance(n, int) and n == 0)
                else size(d - dim(s)) for d, s, n, st in zip(x_shape, start, out, stride)]
        return [pad_zeros(b, cts[0], [dim(s) for s in start], high, [st - 1 for st in stride])]


def _slice_attrs(attrs, in_global, in_local, out_global, out_local):
    """A dim taken whole is sliced to its local size."""
    limit = tuple(in_local[0][d] if attrs["limit"][d] == in_global[0][d] and attrs["start"][d] == 0
                  else attrs["limit"][d] for d in range(len(in_global[0])))
    return {**attrs, "limit": limit}


@sharding_rule("slice", local_attrs=_slice_attrs)
def _slice_sharding(spec):
    """The dims the slice takes whole stay sharded."""
    x, a = spec.in_shapes[0], spec.attrs
    stride = a.get("stride") or (1,) * len(x)
    whole = [d for d in range(len(x)) if a["start"][d] == 0 and a["limit"][d] == x[d]
             and stride[d] == 1]
    return shard_dims(spec, whole) + moved_partials(spec)


@defop("pad", family="shape", kind=PRIMITIVE, num_operands=2,
       attrs={"low": REQUIRED, "high": REQUIRED, "interior": None})
class pad:
    """Pad with the scalar operand: `low`/`high` elements at each end, `interior`
    between elements (all >= 0)."""

    def type(op, x, value, *, low, high, interior):
        if value.rank != 0 or value.dtype != x.dtype:
            raise KilnDTypeError(f"pad: padding value must be a {x.dtype.short}[] scalar, got {value}")
        interior = interior if interior is not None else (0,) * x.rank
        for name, v in (("low", low), ("high", high), ("interior", interior)):
            check_int_tuple(op, name, v, x.rank)
            if any(p < 0 for p in v):
                raise KilnArgumentError(f"pad: {name} {tuple(v)} must be >= 0")
        out = []
        for d, lo, hi, it in zip(x.shape, low, high, interior):
            grown = d + (d - 1) * it if it and not (isinstance(d, int) and d == 0) else d
            out.append(dim(sympy.expand(lo + grown + hi)) if not isinstance(d, int) else lo + grown + hi)
        return x.with_shape(tuple(out))

    def reference(x, value, *, low, high, interior):
        interior = interior or (0,) * x.ndim
        shape = [lo + (d + (d - 1) * it if d else 0) + hi
                 for d, lo, hi, it in zip(x.shape, low, high, interior)]
        out = np.full(shape, value, dtype=x.dtype)
        index = tuple(slice(lo, lo + (d - 1) * (it + 1) + 1 if d else lo, it + 1)
                      for d, lo, it in zip(x.shape, low, interior))
        out[index] = x
        return out

    def vjp(b, cts, xs, ys, *, low, high, interior):
        """x's cotangent is the strided slice where x landed; the padding value's is the
        sum of the cotangent over every padded position."""
        x, value = xs
        t = b.type_of(x)
        interior = interior or (0,) * t.rank
        limit = tuple(lo if isinstance(d, int) and d == 0 else size(lo + (d - 1) * (it + 1) + 1)
                      for d, lo, it in zip(t.shape, low, interior))
        ct_x = b.slice(cts[0], start=tuple(low), limit=limit,
                       stride=tuple(it + 1 for it in interior))
        padded = b.pad(zeros(b, t), full_like(b, b.type_of(value), 1), low=low, high=high,
                       interior=interior)  # 1 where the padding value went, 0 where x did
        return [ct_x, b.reduce_sum(b.mul(cts[0], padded), axes=tuple(range(t.rank)))]


@sharding_rule("pad")
def _pad_sharding(spec):
    """The dims without padding stay sharded (the pad value is replicated)."""
    a, x = spec.attrs, spec.in_shapes[0]
    interior = a.get("interior") or (0,) * len(x)
    return shard_dims(spec, [d for d in range(len(x)) if a["low"][d] == a["high"][d] == 0
                             and interior[d] == 0], operands=(0,))


@defop("concatenate", family="shape", kind=PRIMITIVE, attrs={"dimension": REQUIRED})
class concatenate:
    """Join operands along `dimension`; the other dims must agree."""

    def type(op, *xs, dimension):
        if not xs:
            raise KilnArgumentError("concatenate: needs at least one operand")
        first = xs[0]
        axis = normalize_axis(op, dimension, first.rank, "dimension")
        total = 0
        for x in xs:
            if x.dtype != first.dtype or x.rank != first.rank:
                raise KilnShapeError(f"concatenate: operands {', '.join(map(str, xs))} must share "
                                     "dtype and rank")
            for i, (a, b) in enumerate(zip(x.shape, first.shape)):
                if i != axis and not dims_equal(a, b):
                    raise KilnShapeError(
                        f"concatenate: operands {first} and {x} differ in dim {i} ({b} vs {a}); "
                        f"only dim {axis} may differ")
            total = total + x.shape[axis]
        shape = list(first.shape)
        shape[axis] = dim(sympy.expand(total)) if not isinstance(total, int) else total
        return first.with_shape(tuple(shape))

    def reference(*xs, dimension):
        return np.concatenate(xs, axis=dimension)

    def vjp(b, cts, xs, ys, *, dimension):
        shape = b.type_of(ys[0]).shape
        axis = dimension % len(shape)
        out, offset = [], 0
        for x in xs:
            end = size(offset + b.type_of(x).shape[axis])
            start = (0,) * axis + (offset,) + (0,) * (len(shape) - axis - 1)
            out.append(b.slice(cts[0], start=start, limit=shape[:axis] + (end,) + shape[axis + 1:]))
            offset = end
        return out


@sharding_rule("concatenate")
def _concatenate_sharding(spec):
    axis = spec.attrs["dimension"] % spec.ndim
    found = shard_dims(spec, [d for d in range(spec.ndim) if d != axis])
    return found + moved_partials(spec, tuple(range(len(spec.in_shapes))))


@defop("reverse", family="shape", kind=PRIMITIVE, num_operands=1, attrs={"dims": REQUIRED})
class reverse:
    """Reverse the order of elements along `dims`."""

    def type(op, x, *, dims):
        check_axes(op, dims, x.rank, "dims")
        return x

    def reference(x, *, dims):
        return contiguous(np.flip(x, axis=tuple(dims))) if dims else x.copy()

    def vjp(b, cts, xs, ys, *, dims):
        return [b.reverse(cts[0], dims=dims)]


@sharding_rule("reverse")
def _reverse_sharding(spec):
    dims = {d % max(spec.ndim, 1) for d in spec.attrs["dims"]}
    return shard_dims(spec, [d for d in range(spec.ndim) if d not in dims]) + moved_partials(spec)


def _check_start_indices(op, x, starts):
    if len(starts) != x.rank:
        raise KilnArgumentError(f"{op}: needs one start index per dim of {x}, got {len(starts)}")
    for s in starts:
        if s.rank != 0 or not s.dtype.is_integer:
            raise KilnDTypeError(f"{op}: start indices must be integer scalars, got {s}")


def _clamped_starts(x_shape, sizes, starts):
    return tuple(int(min(max(int(s), 0), d - n)) for s, d, n in zip(starts, x_shape, sizes))


@defop("dynamic_slice", family="shape", kind=PRIMITIVE, attrs={"sizes": REQUIRED})
class dynamic_slice:
    """A `sizes` window at runtime start indices (scalar operands), each clamped so
    that the window stays inside the operand (as XLA)."""

    def type(op, x, *starts, sizes):
        _check_start_indices(op, x, starts)
        sizes = tuple(dim(s) for s in sizes)
        if len(sizes) != x.rank:
            raise KilnArgumentError(f"dynamic_slice: sizes {sizes} must have one entry per dim of {x}")
        for s, d in zip(sizes, x.shape):
            if isinstance(s, int) and isinstance(d, int) and not 0 <= s <= d:
                raise KilnShapeError(f"dynamic_slice: window {sizes} does not fit in {x}")
        return x.with_shape(sizes)

    def reference(x, *starts, sizes):
        begin = _clamped_starts(x.shape, sizes, starts)
        return contiguous(x[tuple(slice(b, b + n) for b, n in zip(begin, sizes))])

    def vjp(b, cts, xs, ys, *, sizes):
        """The cotangent written into zeros at the same (equally clamped) starts."""
        x, *starts = xs
        ct_x = b.dynamic_update_slice(zeros(b, b.type_of(x)), cts[0], *starts)
        return [ct_x] + [None] * len(starts)


@sharding_rule("dynamic_slice", local_attrs=lambda a, ig, il, og, ol: {**a, "sizes": tuple(ol[0])})
def _dynamic_slice_sharding(spec):
    """The dims taken whole stay sharded; the start indices are replicated."""
    x, sizes = spec.in_shapes[0], spec.attrs["sizes"]
    found = shard_dims(spec, [d for d in range(len(x)) if sizes[d] == x[d]], operands=(0,))
    return found + moved_partials(spec)


@defop("dynamic_update_slice", family="shape", kind=PRIMITIVE)
class dynamic_update_slice:
    """Operand with `update` written at runtime start indices (clamped, as XLA)."""

    def type(op, x, update, *starts):
        _check_start_indices(op, x, starts)
        if update.dtype != x.dtype or update.rank != x.rank:
            raise KilnShapeError(f"dynamic_update_slice: update {update} must match {x} in dtype and rank")
        for u, d in zip(update.shape, x.shape):
            if isinstance(u, int) and isinstance(d, int) and u > d:
                raise KilnShapeError(f"dynamic_update_slice: update {update} does not fit in {x}")
        return x

    def reference(x, update, *starts):
        begin = _clamped_starts(x.shape, update.shape, starts)
        out = x.copy()
        out[tuple(slice(b, b + n) for b, n in zip(begin, update.shape))] = update
        return out

    def vjp(b, cts, xs, ys):
        """x gets the cotangent with the overwritten window zeroed, update that window."""
        x, update, *starts = xs
        ut = b.type_of(update)
        return [b.dynamic_update_slice(cts[0], zeros(b, ut), *starts),
                b.dynamic_slice(cts[0], *starts, sizes=ut.shape)] + [None] * len(starts)


@sharding_rule("dynamic_update_slice")
def _dynamic_update_slice_sharding(spec):
    x, upd = spec.in_shapes[0], spec.in_shapes[1]
    found = shard_dims(spec, [d for d in range(len(x)) if upd[d] == x[d]], operands=(0, 1))
    if spec.in_dtypes[0].is_inexact:
        found.append(partial_through(spec, "sum", (0, 1)))
    return found


def _checked_indices(op, indices, size):
    """Indices in [-size, size) counted from the end made non-negative; else K104
    (`kiln/ir/ops/indices.py`: every index-taking op checks its indices)."""
    from kiln.ir.ops.indices import first_out_of_range, index_error

    bad = first_out_of_range(indices, size, negative=True)
    if bad is not None:
        raise index_error(op, "index", bad, size, negative=True)
    idx = indices.astype(np.int64)
    return np.where(idx < 0, idx + size, idx)


@defop("take", family="shape", kind=PRIMITIVE, num_operands=2, attrs={"axis": 0})
class take:
    """Gather whole slices: result shape is x.shape[:axis] + indices.shape +
    x.shape[axis+1:] (np.take). Negative indices count from the end."""

    def type(op, x, indices, *, axis):
        check_dtype(op, indices, INTEGER, "indices")
        if x.rank == 0:
            raise KilnShapeError(f"take: cannot index a scalar {x}")
        a = normalize_axis(op, axis, x.rank, "axis")
        return x.with_shape(x.shape[:a] + indices.shape + x.shape[a + 1:])

    def reference(x, indices, *, axis):
        a = axis % x.ndim
        return np.take(x, _checked_indices("take", indices, x.shape[a]), axis=a)

    def vjp(b, cts, xs, ys, *, axis):
        """Scatter-add of the cotangent's slices: an index taken twice gets both."""
        x, indices = xs
        xt = b.type_of(x)
        a = axis % xt.rank
        k = numel(b.type_of(indices).shape)
        shape = xt.shape[:a] + (k,) + xt.shape[a + 1:]
        where = b.broadcast_in_dim(reshape_to(b, indices, (k,)), shape=shape,
                                   broadcast_dimensions=(a,))
        return [b.scatter_along(zeros(b, xt), where, reshape_to(b, cts[0], shape), axis=a,
                                mode="add"), None]


@sharding_rule("take")
def _take_sharding(spec):
    """The source's non-indexed dims, or the indices' dims, stay sharded."""
    x, idx = spec.in_shapes
    axis = spec.attrs["axis"] % len(x)
    found = [Strategy((Shard(d), R), (Shard(d if d < axis else d + len(idx) - 1),))
             for d in range(len(x)) if d != axis]
    found += [Strategy((R, Shard(j)), (Shard(axis + j),)) for j in range(len(idx))]
    return found + moved_partials(spec)


def _along_index(op, x, indices, axis):
    a = axis % x.ndim
    idx = _checked_indices(op, indices, x.shape[a])
    grids = list(np.ogrid[tuple(slice(0, n) for n in indices.shape)])
    grids[a] = idx
    return tuple(grids)


def _check_along(op, x, indices, axis):
    check_dtype(op, indices, INTEGER, "indices")
    if x.rank == 0:
        raise KilnShapeError(f"{op}: cannot index a scalar {x} along a dim")
    if indices.rank != x.rank:
        raise KilnShapeError(f"{op}: indices {indices} must have the rank of {x}")
    a = normalize_axis(op, axis, x.rank, "axis")
    for i, (n, d) in enumerate(zip(indices.shape, x.shape)):
        if i != a and isinstance(n, int) and isinstance(d, int) and n > d:
            raise KilnShapeError(f"{op}: indices {indices} exceed {x} in dim {i} ({n} > {d})")
    return a


@defop("take_along", family="shape", kind=PRIMITIVE, num_operands=2, attrs={"axis": REQUIRED})
class take_along:
    """out[i][j][k] = x[i][indices[i][j][k]][k] for axis=1 (torch.gather)."""

    def type(op, x, indices, *, axis):
        _check_along(op, x, indices, axis)
        return x.with_shape(indices.shape)

    def reference(x, indices, *, axis):
        return contiguous(x[_along_index("take_along", x, indices, axis)])

    def vjp(b, cts, xs, ys, *, axis):
        """Scatter-add: an index taken twice gets both cotangents."""
        x, indices = xs
        return [b.scatter_along(zeros(b, b.type_of(x)), indices, cts[0], axis=axis, mode="add"),
                None]


@sharding_rule("take_along")
def _take_along_sharding(spec):
    x, idx = spec.in_shapes
    axis = spec.attrs["axis"] % len(x)
    found = shard_dims(spec, [d for d in range(len(x)) if d != axis and x[d] == idx[d]])
    return found + moved_partials(spec)


@defop("scatter_along", family="shape", kind=PRIMITIVE, num_operands=3,
       attrs={"axis": REQUIRED, "mode": "add"})
class scatter_along:
    """x with updates[i][j][k] added to (mode="add") or written at (mode="set")
    x[i][indices[i][j][k]][k] for axis=1 (torch.scatter_add / scatter)."""

    def type(op, x, indices, updates, *, axis, mode):
        _check_along(op, x, indices, axis)
        if mode not in ("add", "set"):
            raise KilnArgumentError(f"scatter_along: mode must be 'add' or 'set', got {mode!r}")
        if updates.dtype != x.dtype or updates.rank != x.rank or any(
                isinstance(u, int) and isinstance(n, int) and u < n
                for u, n in zip(updates.shape, indices.shape)):
            raise KilnShapeError(f"scatter_along: updates {updates} must have x's dtype "
                                 f"({x.dtype.short}) and cover indices {indices}")
        return x

    def reference(x, indices, updates, *, axis, mode):
        out = x.copy()
        where = _along_index("scatter_along", x, indices, axis)
        src = updates[tuple(slice(0, n) for n in indices.shape)]
        if mode == "add":
            return scatter_add(out, where, src)
        out[where] = src
        return out

    def vjp(b, cts, xs, ys, *, axis, mode):
        """add: x gets the cotangent, updates gather it. set: the written positions of x
        get nothing, and of updates written to one position only the one that landed
        gets the cotangent (found by scattering update ids with the same scatter)."""
        x, indices, updates = xs
        ct, it = cts[0], b.type_of(indices)
        gathered = b.take_along(ct, indices, axis=axis)
        if mode == "add":
            ct_x, ct_u = ct, gathered
        else:
            ids = reshape_to(b, b.iota(dtype=dt.int64, shape=(numel(it.shape),)), it.shape)
            landed = b.scatter_along(b.full(-1, dt.int64, b.type_of(x).shape), indices, ids,
                                     axis=axis, mode="set")
            won = b.eq(b.take_along(landed, indices, axis=axis), ids)
            nothing = zeros(b, b.type_of(gathered))
            ct_u = b.select(won, gathered, nothing)
            ct_x = b.scatter_along(ct, indices, nothing, axis=axis, mode="set")
        # updates may be larger than indices; the rest of it is unused
        u_shape = b.type_of(updates).shape
        ct_u = pad_zeros(b, ct_u, [0] * len(u_shape),
                         [size(u - n) for u, n in zip(u_shape, it.shape)])
        return [ct_x, None, ct_u]


@sharding_rule("scatter_along")
def _scatter_along_sharding(spec):
    """The dims not scattered along stay sharded; scatter-add is linear in x and updates."""
    x, idx, upd = spec.in_shapes
    axis = spec.attrs["axis"] % len(x)
    found = shard_dims(spec, [d for d in range(len(x))
                              if d != axis and x[d] == idx[d] == upd[d]])
    if spec.attrs.get("mode", "add") == "add" and spec.in_dtypes[0].is_inexact:
        found.append(Strategy((Partial("sum"), R, Partial("sum")), (Partial("sum"),)))
    return found
