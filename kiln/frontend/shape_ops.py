"""Shape functions with PyTorch's names and conventions: reshape/view, transpose,
permute, expand, squeeze/unsqueeze, flatten, cat/stack/split/chunk, gather,
scatter_add, index_select and pad. Each maps directly onto shape primitives."""

from __future__ import annotations

import sympy

from kiln.errors import KilnArgumentError, KilnShapeError
from kiln.ir.shapes import dim as as_dim
from kiln.ir.shapes import dims_equal, format_shape, normalize_axis, numel
from kiln.frontend.dispatch import apply, op_emitter as emitter_for, raw, wrap
from kiln.frontend.functional import _tensor

__all__ = [
    "reshape", "view", "flatten", "permute", "transpose", "movedim", "expand", "broadcast_to",
    "squeeze", "unsqueeze", "cat", "concat", "stack", "narrow", "split", "chunk", "gather",
    "take_along_dim", "scatter_add", "scatter", "index_select", "flip", "pad",
]


def _sizes(args) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


def reshape(x, *shape):
    """A view with a new shape; one dim may be -1 (inferred)."""
    x = _tensor(x)
    shape = [as_dim(d) if not (isinstance(d, int) and d == -1) else -1 for d in _sizes(shape)]
    if shape.count(-1) > 1:
        raise KilnArgumentError(f"reshape: only one dim may be -1, got {shape}")
    if -1 in shape:
        known = numel([d for d in shape if not (isinstance(d, int) and d == -1)])
        total = x.numel()
        if isinstance(known, int) and isinstance(total, int):
            if known == 0 or total % known:
                raise KilnShapeError(f"reshape: cannot reshape {x.dtype.short}{list(x.shape)} "
                                     f"({total} elements) to {shape}")
            inferred = total // known
        else:
            inferred = sympy.cancel(sympy.sympify(total) / known)
            if not inferred.is_polynomial() or sympy.denom(inferred) != 1:
                raise KilnShapeError(f"reshape: cannot infer -1 in {shape} for shape "
                                     f"{format_shape(x.shape)}: {total} is not a multiple of {known}")
            inferred = as_dim(inferred)
        shape[shape.index(-1)] = inferred
    shape = tuple(shape)
    if len(shape) == x.ndim and all(dims_equal(a, b) for a, b in zip(shape, x.shape)):
        return x
    return apply("reshape", x, shape=shape)


view = reshape


def flatten(x, start_dim: int = 0, end_dim: int = -1):
    x = _tensor(x)
    if x.ndim == 0:
        return reshape(x, (1,))
    s = normalize_axis("flatten", start_dim, x.ndim, "start_dim")
    e = normalize_axis("flatten", end_dim, x.ndim, "end_dim")
    if e < s:
        raise KilnArgumentError(f"flatten: end_dim {end_dim} comes before start_dim {start_dim}")
    return reshape(x, x.shape[:s] + (numel(x.shape[s:e + 1]),) + x.shape[e + 1:])


def permute(x, *dims):
    x = _tensor(x)
    dims = tuple(normalize_axis("permute", d, x.ndim, "dim") for d in _sizes(dims))
    if sorted(dims) != list(range(x.ndim)):
        raise KilnArgumentError(f"permute: {dims} is not a permutation of the {x.ndim} dims of "
                                f"{x.dtype.short}{list(x.shape)}")
    if dims == tuple(range(x.ndim)):
        return x
    return apply("transpose", x, permutation=dims)


def transpose(x, dim0: int, dim1: int):
    """Swap two dims (PyTorch's transpose, not numpy's)."""
    x = _tensor(x)
    a = normalize_axis("transpose", dim0, x.ndim, "dim0")
    b = normalize_axis("transpose", dim1, x.ndim, "dim1")
    perm = list(range(x.ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return permute(x, perm)


def movedim(x, source: int, destination: int):
    x = _tensor(x)
    s = normalize_axis("movedim", source, x.ndim, "source")
    d = normalize_axis("movedim", destination, x.ndim, "destination")
    order = [i for i in range(x.ndim) if i != s]
    order.insert(d, s)
    return permute(x, order)


def expand(x, *sizes):
    """Broadcast to `sizes` (-1 keeps a dim), as torch.Tensor.expand."""
    x = _tensor(x)
    sizes = _sizes(sizes)
    if len(sizes) < x.ndim:
        raise KilnShapeError(f"expand: {list(sizes)} has fewer dims than {x.dtype.short}{list(x.shape)}")
    offset = len(sizes) - x.ndim
    target = tuple(x.shape[i - offset] if (isinstance(s, int) and s == -1 and i >= offset) else as_dim(s)
                   for i, s in enumerate(sizes))
    em = emitter_for(x)
    return wrap(em, em.broadcast_to(raw(em, x), target))


def broadcast_to(x, shape):
    return expand(x, *shape)


def squeeze(x, dim=None):
    x = _tensor(x)
    if dim is None:
        axes = [i for i, d in enumerate(x.shape) if isinstance(d, int) and d == 1]
    else:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        axes = [normalize_axis("squeeze", d, x.ndim, "dim") for d in dims]
        axes = [a for a in axes if a < x.ndim and isinstance(x.shape[a], int) and x.shape[a] == 1]
    return reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))


def unsqueeze(x, dim: int):
    x = _tensor(x)
    d = normalize_axis("unsqueeze", dim, x.ndim + 1, "dim")
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def cat(tensors, dim: int = 0):
    tensors = list(tensors)
    if not tensors:
        raise KilnArgumentError("cat: needs at least one tensor")
    em = emitter_for(*tensors)
    values = [raw(em, t) for t in tensors]
    dtype = em.result_dtype(*values)
    values = [em.convert(v, dtype) for v in values]
    rank = em.type_of(values[0]).rank
    axis = normalize_axis("cat", dim, rank, "dim")
    if len(values) == 1:
        return wrap(em, values[0])
    return wrap(em, em.call("concatenate", *values, dimension=axis))


concat = cat


def stack(tensors, dim: int = 0):
    tensors = [_tensor(t) for t in tensors]
    if not tensors:
        raise KilnArgumentError("stack: needs at least one tensor")
    d = normalize_axis("stack", dim, tensors[0].ndim + 1, "dim")
    return cat([unsqueeze(t, d) for t in tensors], d)


def narrow(x, dim: int, start, length):
    x = _tensor(x)
    axis = normalize_axis("narrow", dim, x.ndim, "dim")
    starts = [0] * x.ndim
    limits = list(x.shape)
    starts[axis], limits[axis] = start, as_dim(start + length)
    return apply("slice", x, start=tuple(starts), limit=tuple(limits), stride=(1,) * x.ndim)


def split(x, split_size_or_sections, dim: int = 0):
    """torch.split: an int is the size of each chunk (the last may be smaller), a list
    gives every chunk's size."""
    x = _tensor(x)
    axis = normalize_axis("split", dim, x.ndim, "dim")
    size = x.shape[axis]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        if step <= 0:
            raise KilnArgumentError(f"split: split_size must be positive, got {step}")
        if not isinstance(size, int):
            raise KilnShapeError(f"split: dim {axis} has symbolic size {size}; give explicit sections")
        sections = [min(step, size - i) for i in range(0, size, step)] or [0]
    else:
        sections = [as_dim(s) for s in split_size_or_sections]
        if not dims_equal(as_dim(sympy.expand(sum(sections, sympy.Integer(0)))), size):
            raise KilnShapeError(f"split: sections {sections} do not add up to dim {axis} of size {size}")
    out, start = [], 0
    for n in sections:
        out.append(narrow(x, axis, start, n))
        start = as_dim(start + n)
    return tuple(out)


def chunk(x, chunks: int, dim: int = 0):
    x = _tensor(x)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        raise KilnArgumentError(f"chunk: chunks must be a positive int, got {chunks!r}")
    size = x.shape[normalize_axis("chunk", dim, x.ndim, "dim")]
    if not isinstance(size, int):
        raise KilnShapeError(f"chunk: dim {dim} has symbolic size {size}")
    return split(x, -(-size // chunks) if size else 1, dim)


def gather(x, dim: int, index):
    """out[i][j] = x[i][index[i][j]] for dim=1 (torch.gather)."""
    x = _tensor(x)
    return apply("take_along", x, _tensor(index), axis=normalize_axis("gather", dim, x.ndim, "dim"))


def take_along_dim(x, indices, dim: int | None = None):
    """torch.take_along_dim: `gather` along `dim` after broadcasting `x` and `indices`
    against each other in every other dim; with `dim=None`, both are flattened first.
    Indices out of range raise K104 (negative ones count from the end)."""
    from kiln.ir.shapes import broadcast_shapes

    x, indices = _tensor(x), _tensor(indices)
    if dim is None:
        return apply("take_along", reshape(x, (-1,)), reshape(indices, (-1,)), axis=0)
    axis = normalize_axis("take_along_dim", dim, x.ndim, "dim")
    if indices.ndim != x.ndim:
        raise KilnShapeError(f"take_along_dim: indices {indices.dtype.short}{list(indices.shape)} "
                             f"must have the rank of x {x.dtype.short}{list(x.shape)}")
    rest = broadcast_shapes("take_along_dim",
                            tuple(1 if i == axis else d for i, d in enumerate(x.shape)),
                            tuple(1 if i == axis else d for i, d in enumerate(indices.shape)))
    xs = tuple(x.shape[i] if i == axis else d for i, d in enumerate(rest))
    ids = tuple(indices.shape[i] if i == axis else d for i, d in enumerate(rest))
    return apply("take_along", expand(x, xs), expand(indices, ids), axis=axis)


def scatter_add(x, dim: int, index, src):
    x = _tensor(x)
    from kiln.frontend.functional import to

    return apply("scatter_along", x, _tensor(index), to(src, x.dtype),
                 axis=normalize_axis("scatter_add", dim, x.ndim, "dim"), mode="add")


def scatter(x, dim: int, index, src):
    x = _tensor(x)
    from kiln.frontend.functional import to

    return apply("scatter_along", x, _tensor(index), to(src, x.dtype),
                 axis=normalize_axis("scatter", dim, x.ndim, "dim"), mode="set")


def index_select(x, dim: int, index):
    x = _tensor(x)
    index = _tensor(index)
    if index.ndim != 1:
        raise KilnShapeError(f"index_select: index must be 1-D, got {index.dtype.short}{list(index.shape)}")
    return apply("take", x, index, axis=normalize_axis("index_select", dim, x.ndim, "dim"))


def flip(x, dims):
    x = _tensor(x)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return apply("reverse", x, dims=tuple(normalize_axis("flip", d, x.ndim, "dim") for d in dims))


def pad(x, pad, mode: str = "constant", value: float = 0.0):
    """torch.nn.functional.pad: `pad` lists (left, right) pairs from the last dim
    backwards; negative amounts crop. Only mode="constant" is supported."""
    x = _tensor(x)
    if mode != "constant":
        raise KilnArgumentError(f"pad: mode {mode!r} is not supported; kiln pads with "
                                "mode='constant' (use cat with flipped slices for reflection)")
    pad = tuple(pad)
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise KilnArgumentError(f"pad: {pad} must hold (left, right) pairs for at most {x.ndim} dims")
    low, high = [0] * x.ndim, [0] * x.ndim
    for i in range(len(pad) // 2):
        low[x.ndim - 1 - i], high[x.ndim - 1 - i] = pad[2 * i], pad[2 * i + 1]
    if any(p < 0 for p in low + high):
        starts = [-min(p, 0) for p in low]
        limits = [as_dim(d + min(p, 0)) for d, p in zip(x.shape, high)]
        x = apply("slice", x, start=tuple(starts), limit=tuple(limits), stride=(1,) * x.ndim)
        low, high = [max(p, 0) for p in low], [max(p, 0) for p in high]
    em = emitter_for(x)
    fill = em.full(value, x.dtype, ())
    return wrap(em, em.call("pad", raw(em, x), fill, low=tuple(low), high=tuple(high),
                            interior=(0,) * x.ndim))
