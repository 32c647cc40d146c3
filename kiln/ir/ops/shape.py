"""Shape primitives: reshape, broadcast, transpose, slicing, padding, joining,
indexing by tensors (take, take_along, scatter_along) and dynamic slices.

Type rules work on symbolic dims: a reshape of f32[B, T, 64] to [B*T, 64] is
checked by exact symbolic equality of element counts.
"""

from __future__ import annotations

import numpy as np
import sympy

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnIndexError, KilnShapeError
from kiln.ir.ops.creation import _check_shape_attr
from kiln.ir.ops.rules import contiguous, INTEGER, check_axes, check_dtype, check_int_tuple
from kiln.ir.registry import PRIMITIVE, REQUIRED, defop
from kiln.ir.shapes import dim, dims_equal, format_shape, normalize_axis, numel


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


@defop("reverse", family="shape", kind=PRIMITIVE, num_operands=1, attrs={"dims": REQUIRED})
class reverse:
    """Reverse the order of elements along `dims`."""

    def type(op, x, *, dims):
        check_axes(op, dims, x.rank, "dims")
        return x

    def reference(x, *, dims):
        return contiguous(np.flip(x, axis=tuple(dims))) if dims else x.copy()


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


def _checked_indices(op, indices, size):
    idx = indices.astype(np.int64)
    bad = (idx < -size) | (idx >= size)
    if bad.any():
        value = int(idx[bad].flat[0])
        raise KilnIndexError(f"{op}: index {value} is out of range for a dim of size {size}")
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
            if out.dtype.kind == "V" or out.dtype.itemsize < 4 and out.dtype.kind == "f":
                acc = out.astype(np.float32)
                np.add.at(acc, where, src.astype(np.float32))
                return acc.astype(x.dtype)
            np.add.at(out, where, src)
        else:
            out[where] = src
        return out

