"""`tensor[index]`: ints, slices (any step), None, Ellipsis, integer arrays/tensors
(advanced indexing, broadcast together) and, in eager mode, boolean masks.

Placement of advanced-index dims follows PyTorch, which agrees with numpy except
when an int stands beside index arrays (`x[0, :, [0, 1]]`): PyTorch treats the int as
a basic index, numpy as one more index array. Basic indexing becomes
slice/reverse/reshape; advanced indexing becomes one `take` on a flattened view of
the indexed dims."""

from __future__ import annotations

import numpy as np
import sympy

from kiln.errors import KilnIndexError, KilnTraceError, user_location
from kiln.ir import dtypes as dt
from kiln.ir.ops.rules import contiguous
from kiln.ir.shapes import dim as as_dim
from kiln.ir.shapes import numel
from kiln.frontend.dispatch import apply, to_array
from kiln.frontend.functional import _tensor, add, lt, mul, to, where
from kiln.frontend.shape_ops import permute, reshape


def _is_index_array(item) -> bool:
    from kiln.frontend.tensor import Tensor

    return isinstance(item, (Tensor, np.ndarray, list)) and not isinstance(item, bool)


def _bool_mask(item) -> bool:
    from kiln.frontend.tensor import Tensor

    if isinstance(item, Tensor):
        return item.dtype.is_bool
    if isinstance(item, (np.ndarray, list)):
        return np.asarray(item).dtype == np.bool_
    return False


def getitem(x, index):
    from kiln.frontend.tensor import Tensor

    x = _tensor(x)
    items = index if isinstance(index, tuple) else (index,)
    if any(_bool_mask(it) for it in items):
        return _mask_index(x, items)
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    if consumed > x.ndim:
        raise KilnIndexError(f"index {index!r}: too many indices for a tensor of rank {x.ndim}")
    if sum(1 for it in items if it is Ellipsis) > 1:
        raise KilnIndexError("an index can only have a single ellipsis ('...')")
    expanded = []
    for it in items:
        if it is Ellipsis:
            expanded.extend([slice(None)] * (x.ndim - consumed))
        else:
            expanded.append(it)
    expanded.extend([slice(None)] * (x.ndim - sum(1 for it in expanded if it is not None)))

    # basic indexing first: slices, ints and None; remember advanced positions
    starts, limits, strides, flips = [], [], [], []
    out_shape: list = []
    advanced: list[tuple[int, object]] = []  # (dim of the sliced tensor, index)
    axis = 0
    kept = 0
    for it in expanded:
        if it is None:
            out_shape.append(1)
            continue
        size = x.shape[axis]
        if isinstance(it, slice):
            start, limit, stride, flip = _slice_bounds(size, it, axis)
            starts.append(start), limits.append(limit), strides.append(stride), flips.append(flip)
            out_shape.append(("dim", axis))
            kept += 1
        elif _is_index_array(it):
            starts.append(0), limits.append(size), strides.append(1), flips.append(False)
            advanced.append((len(out_shape), it))
            out_shape.append(("dim", axis))
        else:
            i = _int_index(it, size, axis)
            starts.append(i), limits.append(as_dim(i + 1)), strides.append(1), flips.append(False)
        axis += 1
    y = x
    if not x.is_traced and any(_symbolic_bound(v) for v in starts + limits):
        from kiln.frontend.dispatch import current_builder  # a constant sliced by a traced size

        builder = current_builder()
        if builder is not None:
            y = Tensor._make(builder.constant(x.numpy()), builder)
    if any(flips):  # negative steps: reverse first; their bounds are in reversed coordinates
        y = apply("reverse", y, dims=tuple(i for i, f in enumerate(flips) if f))
    if any(s != 0 for s in starts) or any(not _same(l, d) for l, d in zip(limits, x.shape)) \
            or any(s != 1 for s in strides):
        y = apply("slice", y, start=tuple(starts), limit=tuple(limits), stride=tuple(strides))
    # drop int-indexed dims and insert None dims
    sliced_shape = y.shape
    shape = [sliced_shape[entry[1]] if isinstance(entry, tuple) else 1 for entry in out_shape]
    y = reshape(y, tuple(shape))
    if advanced:
        y = _advanced(y, advanced)
    return y


def _same(a, b) -> bool:
    from kiln.ir.shapes import dims_equal

    return dims_equal(a, b)


def _int_index(it, size, axis):
    from kiln.frontend.tensor import Tensor

    if isinstance(it, Tensor):
        raise KilnIndexError("a 0-d tensor index must be an integer array index here")
    try:
        i = int(it.__index__())
    except (AttributeError, TypeError):
        raise KilnIndexError(f"unsupported index {it!r} of type {type(it).__name__}: use ints, "
                             "slices, None, ..., integer arrays or boolean masks") from None
    if isinstance(size, int):
        if not -size <= i < size:
            raise KilnIndexError(f"index {i} is out of range for dim {axis} of size {size}")
        return i % size if size else i
    return i if i >= 0 else as_dim(size + i)


def _symbolic_bound(v) -> bool:
    return isinstance(v, sympy.Basic) and not v.is_Integer


def _slice_bounds(size, it: slice, axis):
    it = slice(*(v._sympy_() if hasattr(v, "_sympy_") and not isinstance(v, sympy.Basic) else v
                 for v in (it.start, it.stop, it.step)))
    step = 1 if it.step is None else int(it.step)
    if isinstance(size, int) and (_symbolic_bound(it.start) or _symbolic_bound(it.stop)):
        size = sympy.Integer(size)  # bounds by a symbolic length: the symbolic path below
    if step == 0:
        raise KilnIndexError("slice step cannot be zero")
    if isinstance(size, int):
        start, stop, step = slice(it.start, it.stop, step).indices(size)
        if step > 0:
            return start, max(start, stop), step, False
        # a negative step: reverse the dim, then slice forward
        count = len(range(start, stop, step))
        first = size - 1 - start
        return first, first + (count - 1) * (-step) + 1 if count else first, -step, True
    if step < 0:
        if it.start is None and it.stop is None:
            return 0, size, -step, True
        raise KilnIndexError(f"dim {axis} has symbolic size {size}: a negative-step slice must "
                             "span the whole dim")

    def bound(v, default):
        if v is None:
            return default
        from kiln.frontend.symsize import range_max, range_min

        if _symbolic_bound(v):  # a symbolic length (x[:, :T]): its sign must be known
            if v.is_nonnegative:
                return as_dim(range_min(v, size))
            if v.is_negative:
                return as_dim(range_max(0, size + v))
            raise KilnIndexError(f"dim {axis}: the slice bound {v} may be negative or not; "
                                 "slice by a size (nonnegative) or its negation")
        v = int(v)
        return as_dim(range_max(0, size + v)) if v < 0 else as_dim(range_min(v, size))

    start, stop = bound(it.start, 0), bound(it.stop, size)
    return start, stop, step, False


def _index_tensor(it, size, axis, check: bool):
    if isinstance(it, list):
        it = np.asarray(it)
        it = it.astype(np.int64) if it.size == 0 else it  # [] is an empty index, as numpy
    t = _tensor(it)
    if not (t.dtype.is_integer):
        raise KilnIndexError(f"tensors used as indices must be integer or bool, got {t.dtype}")
    if check and not t.is_traced and isinstance(size, int):
        # several indices are combined into one linear index (checked by take), where an
        # out-of-range index could land on another element: check each one against its dim
        values = t.numpy()
        bad = (values < -size) | (values >= size)
        if bad.any():
            raise KilnIndexError(f"index {int(values[bad].flat[0])} is out of range for dim "
                                 f"{axis} of size {size}")
    return to(t, dt.int64)


def _advanced(y, advanced):
    positions = [p for p, _ in advanced]
    indices = [_index_tensor(it, y.shape[p], p, len(advanced) > 1) for p, it in advanced]
    if len(advanced) == 1:
        (p, _), (idx,) = advanced[0], indices
        return apply("take", y, idx, axis=p)
    # several index arrays: move their dims to the front, flatten them into one,
    # and take with the broadcast linear index (numpy's rules for their placement)
    rest = [i for i in range(y.ndim) if i not in positions]
    moved = permute(y, positions + rest)
    sizes = [y.shape[p] for p in positions]
    flat = reshape(moved, (numel(sizes),) + tuple(y.shape[i] for i in rest))
    linear = None
    for k, idx in enumerate(indices):
        stride = 1
        for s in sizes[k + 1:]:
            stride = stride * s
        size = sizes[k]
        idx = where(lt(idx, 0), add(idx, size), idx)  # negative indices count from the end
        term = mul(idx, stride) if not (isinstance(stride, int) and stride == 1) else idx
        linear = term if linear is None else add(linear, term)
    out = apply("take", flat, linear, axis=0)
    adjacent = positions == list(range(positions[0], positions[0] + len(positions)))
    if adjacent and positions[0] != 0:
        nidx = linear.ndim
        order = list(range(nidx, nidx + positions[0])) + list(range(nidx)) + \
            list(range(nidx + positions[0], out.ndim))
        out = permute(out, order)
    return out


def _mask_index(x, items):
    from kiln.frontend.tensor import Tensor

    if x.is_traced or any(isinstance(it, Tensor) and it.is_traced for it in items):
        raise KilnTraceError(
            "boolean-mask indexing has a data-dependent result shape and cannot be traced",
            where=user_location(),
            hint="use kn.where(mask, x, fill) to keep the shape, or index outside the compiled function")
    array = x.numpy()
    index = tuple(to_array(it) if isinstance(it, (Tensor, list)) else it for it in items)
    try:
        result = array[index]
    except IndexError as exc:
        raise KilnIndexError(f"boolean mask index: {exc}") from None
    return Tensor._make(contiguous(result))
