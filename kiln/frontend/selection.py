"""Masking, picking and sampling, with PyTorch's names and signatures: `tril`/`triu`,
`masked_fill`, `topk`, `one_hot`, `multinomial`, `einsum`, and the handle helpers
`clone`/`contiguous`.

Each is a composition of registered ops (iota, compare, select, sort, slice,
dot_general through matmul), so it runs eagerly, traces, compiles and
differentiates through the existing vjp rules; nothing here has a rule of its own.

    >>> kn.tril(kn.ones(3, 3))
    >>> x.masked_fill(mask, float("-inf"))
    >>> values, indices = kn.topk(logits, 5)
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.shapes import normalize_axis
from kiln.frontend.dispatch import apply, creation_emitter, wrap
from kiln.frontend.functional import _tensor, add, ge, le, log, lt, to, where
from kiln.frontend.reductions import MaxMin, cumsum, sort, sum
from kiln.frontend.shape_ops import narrow, unsqueeze


def _band(op: str, x, diagonal: int, lower: bool):
    x = _tensor(x)
    if x.ndim < 2:
        raise KilnShapeError(f"{op}: needs a tensor of rank >= 2, got {x.dtype.short}{list(x.shape)}")
    if not isinstance(diagonal, (int, np.integer)) or isinstance(diagonal, bool):
        raise KilnArgumentError(f"{op}: diagonal must be an int, got {diagonal!r}")
    n, m = x.shape[-2], x.shape[-1]
    em = creation_emitter()
    rows = em.call("iota", dtype=dt.int64, shape=(n, m), dimension=0)
    cols = em.call("iota", dtype=dt.int64, shape=(n, m), dimension=1)
    offset = em.binary("sub", cols, rows)  # j - i
    keep = wrap(em, em.binary("le" if lower else "ge", offset, int(diagonal)))
    return where(keep, x, 0 if not x.dtype.is_bool else False)


def tril(x, diagonal: int = 0):
    """The lower triangle of the last two dims (j - i <= diagonal), zeros elsewhere.

    >>> kn.tril(kn.ones(3, 3)).numpy()[0]
    array([1., 0., 0.], dtype=float32)
    """
    return _band("tril", x, diagonal, lower=True)


def triu(x, diagonal: int = 0):
    """The upper triangle of the last two dims (j - i >= diagonal), zeros elsewhere."""
    return _band("triu", x, diagonal, lower=False)


def masked_fill(x, mask, value):
    """`value` where `mask` (a bool tensor broadcastable to `x`) is True, `x` elsewhere;
    the result keeps `x`'s dtype and shape (torch.Tensor.masked_fill).

    >>> att.masked_fill(causal == 0, float("-inf"))
    """
    x = _tensor(x)
    mask = _tensor(mask)
    if not mask.dtype.is_bool:
        raise KilnDTypeError(f"masked_fill: the mask must be a bool tensor, got "
                             f"{mask.dtype.short}{list(mask.shape)}",
                             hint="compare to make one: x.masked_fill(m == 0, v)")
    from kiln.ir.shapes import broadcast_shapes, shapes_equal

    shape = broadcast_shapes("masked_fill", mask.shape, x.shape)
    if not shapes_equal(shape, x.shape):
        raise KilnShapeError(f"masked_fill: the mask {mask.dtype.short}{list(mask.shape)} must "
                             f"broadcast to the tensor's shape {list(x.shape)}, not enlarge it")
    if not isinstance(value, (bool, int, float)):
        value = _tensor(value)
        if value.ndim != 0:
            raise KilnShapeError(f"masked_fill: value must be a number or a 0-d tensor, got "
                                 f"{value.dtype.short}{list(value.shape)}")
        value = to(value, x.dtype)
    elif x.dtype.is_integer and isinstance(value, float) and not float(value).is_integer():
        raise KilnDTypeError(f"masked_fill: cannot fill the {x.dtype} tensor with {value!r}")
    return to(where(mask, value, x), x.dtype)


def topk(x, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """The `k` largest (or smallest) entries along `dim` and their indices, as
    `(values, indices)` in descending (ascending) order (torch.topk).

    >>> values, indices = kn.topk(kn.tensor([1.0, 5.0, 3.0]), 2)    # [5, 3], [1, 2]
    """
    x = _tensor(x)
    axis = normalize_axis("topk", dim, max(x.ndim, 1), "dim")
    size = x.shape[axis] if x.ndim else 1
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
        raise KilnArgumentError(f"topk: k must be an int >= 0, got {k!r}")
    if isinstance(size, int) and k > size:
        raise KilnArgumentError(f"topk: k ({k}) is larger than dim {axis} of size {size}")
    if isinstance(size, int) and x.ndim:  # the first k of sort's order, by a partition
        values, indices = apply("sort", x, axis=axis, descending=bool(largest), limit=int(k))
        return MaxMin((values, indices))
    values, indices = sort(x, axis, descending=bool(largest))
    return MaxMin((narrow(values, axis, 0, int(k)), narrow(indices, axis, 0, int(k))))


def one_hot(x, num_classes: int = -1):
    """int64 one-hot rows: `out[..., c] = (x[...] == c)` (torch.nn.functional.one_hot);
    `num_classes=-1` takes max(x) + 1, which needs a concrete tensor."""
    x = _tensor(x)
    if not x.dtype.is_integer:
        raise KilnDTypeError(f"one_hot: needs an integer tensor of class indices, got {x.dtype}")
    if num_classes == -1:
        if x.is_traced:
            raise KilnArgumentError("one_hot: num_classes=-1 reads max(x), which is not known "
                                    "while tracing; pass num_classes")
        values = x.numpy()
        num_classes = int(values.max()) + 1 if values.size else 0
    if not isinstance(num_classes, (int, np.integer)) or num_classes < 0:
        raise KilnArgumentError(f"one_hot: num_classes must be an int >= 0 (or -1), got "
                                f"{num_classes!r}")
    # the compare below would give an all-zero row for a class out of range: check first,
    # eager and compiled alike (K104, kiln/ir/ops/indices.py)
    x = apply("check_index", x, size=int(num_classes), caller="one_hot", what="class index",
              negative=False, ignore=None)
    em = creation_emitter()
    classes = wrap(em, em.call("iota", dtype=dt.int64, shape=(int(num_classes),)))
    from kiln.frontend.functional import eq

    return to(eq(unsqueeze(to(x, dt.int64), -1), classes), dt.int64)


def multinomial(input, num_samples: int, replacement: bool = False, *, generator=None,
                seed: int | None = None):
    """Draw `num_samples` category indices per row of `input` (non-negative weights,
    1-D or 2-D, not necessarily normalized), as torch.multinomial; int64 result.

    With replacement each draw inverts the row's CDF at a uniform sample; without, the
    Gumbel-top-k trick picks distinct categories. Random bits come from `seed`, else
    kiln's global stream (`kn.manual_seed`)."""
    from kiln.frontend.factories import rand

    if generator is not None:
        raise KilnArgumentError("multinomial: generator= is not supported; seed with "
                                "kn.manual_seed(n) or pass seed=n")
    p = _tensor(input)
    if p.ndim not in (1, 2) or not p.dtype.is_floating:
        raise KilnShapeError(f"multinomial: input must be a 1-D or 2-D float tensor of weights, "
                             f"got {p.dtype.short}{list(p.shape)}")
    n = p.shape[-1]
    if not isinstance(num_samples, (int, np.integer)) or num_samples <= 0:
        raise KilnArgumentError(f"multinomial: num_samples must be a positive int, got "
                                f"{num_samples!r}")
    if not replacement and isinstance(n, int) and num_samples > n:
        raise KilnArgumentError(f"multinomial: cannot draw {num_samples} samples without "
                                f"replacement from {n} categories")
    if not p.is_traced:
        w = p.numpy().astype(np.float64)
        if not np.isfinite(w).all() or (w < 0).any():
            raise KilnArgumentError("multinomial: weights must be finite and >= 0")
        if (w.sum(axis=-1) <= 0).any():
            raise KilnArgumentError("multinomial: a row of weights sums to 0")
        if not replacement and ((w > 0).sum(axis=-1) < num_samples).any():
            raise KilnArgumentError(f"multinomial: a row has fewer than {num_samples} nonzero "
                                    "weights to draw without replacement")
    p32 = to(p, dt.float32)
    rows = p.shape[:-1]
    if replacement:
        cdf = cumsum(p32, -1)
        cdf = cdf / unsqueeze(sum(p32, dim=-1), -1)
        u = rand(*rows, int(num_samples), seed=seed)  # [..., S]
        below = le(unsqueeze(cdf, -2), unsqueeze(u, -1))  # [..., S, n]: cdf_j <= u
        index = sum(below, dim=-1)
        return where(lt(index, n), index, n - 1)  # u close to 1 and rounding in the cdf
    u = rand(*p.shape, seed=seed)
    gumbel = -log(-log(add(u * (1.0 - 2e-7), 1e-7)))
    keys = where(ge(p32, 0.0) & (p32 > 0), log(p32) + gumbel, float("-inf"))
    return topk(keys, int(num_samples), dim=-1)[1]


def clone(x):
    """A new tensor with the same values (its own storage); gradients flow through."""
    x = _tensor(x)
    from kiln.frontend.tensor import Tensor

    if x._view is not None:  # a view re-reads its base if that changed (mutation.py)
        x._view.refresh(x)
    data = x._x if x.is_traced else np.array(x._x, copy=True)
    out = Tensor._make(data, x._builder)
    out._node = x._grad_ref()
    return out


def contiguous(x, memory_format=None):
    """`x` itself: kiln tensors are always laid out densely (torch.Tensor.contiguous)."""
    return _tensor(x)


def einsum(equation: str, *operands):
    """Einstein summation (torch.einsum / numpy.einsum), as transposes, broadcasts, a
    batched matmul and sums; `...` stands for leading broadcast dims.

    >>> kn.einsum("bij,bjk->bik", a, b)
    """
    from kiln.frontend.einsum import contract

    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return contract(equation, [_tensor(t) for t in operands])


__all__ = ["tril", "triu", "masked_fill", "topk", "one_hot", "multinomial", "clone",
           "contiguous", "einsum"]
