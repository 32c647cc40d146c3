"""Reductions, scans and sorting: `kn.sum`, `kn.mean`, `kn.max`, `kn.argmax`, `kn.cumsum`,
`kn.sort`, ... with PyTorch's `dim` / `keepdim` conventions.

Each normalizes `dim` (an int, a tuple, or None for every dim), states its dtype policy
(bool and integer sums and products in int64, means and variances only of floats) and
applies one registered op; `keepdim=True` reshapes the result back to the input's rank.

    >>> kn.sum(x, dim=-1, keepdim=True); x.max(dim=0).indices
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.shapes import normalize_axis
from kiln.frontend.dispatch import apply, binary
from kiln.frontend.functional import _floating, _tensor, sqrt, to

__all__ = [
    "sum", "prod", "mean", "var", "std", "logsumexp", "all", "any", "max", "min", "amax",
    "amin", "argmax", "argmin", "cumsum", "cumprod", "sort", "argsort",
]


def _axes(op: str, x, dim) -> tuple[int, ...]:
    rank = x.ndim
    if dim is None:
        return tuple(range(rank))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    axes = [normalize_axis(op, d, rank, "dim") for d in dims]
    if len(set(axes)) != len(axes):
        raise KilnArgumentError(f"{op}: dim {dim} repeats a dim of a tensor of rank {rank}")
    return tuple(sorted(axes)) if rank else ()  # dim 0 / -1 of a scalar: nothing to reduce


def _keep(x, result, axes, keepdim):
    if not keepdim:
        return result
    from kiln.frontend.shape_ops import reshape

    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return reshape(result, shape)


def _reduce(op, x, dim, keepdim, dtype=None):
    x = _tensor(x)
    if dtype is not None:
        x = to(x, dtype)
    axes = _axes(op, x, dim)
    return _keep(x, apply(op, x, axes=axes), axes, keepdim)


def sum(x, dim=None, keepdim: bool = False, dtype=None):  # noqa: A001
    """Sum over `dim` (all dims if None); bool and integer inputs sum in int64."""
    x = _tensor(x)
    if dtype is None and (x.dtype.is_bool or x.dtype.is_integer):
        dtype = dt.int64
    return _reduce("reduce_sum", x, dim, keepdim, dtype)


def prod(x, dim=None, keepdim: bool = False, dtype=None):
    x = _tensor(x)
    if dtype is None and (x.dtype.is_bool or x.dtype.is_integer):
        dtype = dt.int64
    return _reduce("reduce_prod", x, dim, keepdim, dtype)


def mean(x, dim=None, keepdim: bool = False, dtype=None):
    x = _tensor(x)
    if dtype is not None:
        x = to(x, dtype)
    if not x.dtype.is_inexact:
        raise KilnDTypeError(f"mean: input dtype {x.dtype} is not floating; pass dtype=kn.float32 "
                             "or convert with .to(kn.float32)")
    axes = _axes("mean", x, dim)
    return _keep(x, apply("mean", x, axes=axes), axes, keepdim)


def var(x, dim=None, keepdim: bool = False, correction: int = 1, unbiased: bool | None = None):
    x = _tensor(x)
    if unbiased is not None:
        correction = 1 if unbiased else 0
    if not x.dtype.is_floating:
        raise KilnDTypeError(f"var: input dtype {x.dtype} is not floating; convert it first")
    axes = _axes("var", x, dim)
    return _keep(x, apply("var", x, axes=axes, correction=correction), axes, keepdim)


def std(x, dim=None, keepdim: bool = False, correction: int = 1, unbiased: bool | None = None):
    x = _tensor(x)
    if not x.dtype.is_floating:
        raise KilnDTypeError(f"std: input dtype {x.dtype} is not floating; convert it first")
    return sqrt(var(x, dim, keepdim, correction, unbiased))


def logsumexp(x, dim=None, keepdim: bool = False):
    x = _floating(x)
    axes = _axes("logsumexp", x, dim)
    return _keep(x, apply("logsumexp", x, axes=axes), axes, keepdim)


def all(x, dim=None, keepdim: bool = False):  # noqa: A001
    return _reduce("reduce_and", to(x, dt.bool_), dim, keepdim)


def any(x, dim=None, keepdim: bool = False):  # noqa: A001
    return _reduce("reduce_or", to(x, dt.bool_), dim, keepdim)


class MaxMin(tuple):
    """(values, indices) of `max(dim)` / `min(dim)`, as torch's named tuple."""

    @property
    def values(self):
        return self[0]

    @property
    def indices(self):
        return self[1]


def _nonempty(op, x, axes):
    """max/min/argmax/argmin of no elements has no value (torch raises too)."""
    for a in axes:
        if isinstance(x.shape[a], int) and x.shape[a] == 0:
            raise KilnShapeError(f"{op}: cannot reduce {x.dtype.short}{list(x.shape)} over its "
                                 f"empty dim {a}; the {op} of no elements is undefined")


def _extreme(op, arg_op, x, dim=None, keepdim=False):
    from kiln.frontend.tensor import Tensor

    if isinstance(dim, (Tensor,)) or (dim is not None and not isinstance(dim, int)):
        return binary("max" if op == "reduce_max" else "min", x, dim)
    x = _tensor(x)
    name = "max" if op == "reduce_max" else "min"
    _nonempty(name, x, _axes(name, x, dim))
    if dim is None:
        return _reduce(op, x, None, False)
    values = _reduce(op, x, dim, keepdim)
    axis = normalize_axis(op, dim, x.ndim, "dim")
    indices = _keep(x, apply(arg_op, x, axis=axis), (axis,), keepdim)
    return MaxMin((values, indices))


def max(x, dim=None, keepdim: bool = False):  # noqa: A001
    """Without dim: the maximum as a scalar tensor. With dim: (values, indices).
    With a tensor second argument: elementwise maximum (torch.max(a, b))."""
    return _extreme("reduce_max", "argmax", x, dim, keepdim)


def min(x, dim=None, keepdim: bool = False):  # noqa: A001
    return _extreme("reduce_min", "argmin", x, dim, keepdim)


def amax(x, dim=None, keepdim: bool = False):
    x = _tensor(x)
    _nonempty("amax", x, _axes("amax", x, dim))
    return _reduce("reduce_max", x, dim, keepdim)


def amin(x, dim=None, keepdim: bool = False):
    x = _tensor(x)
    _nonempty("amin", x, _axes("amin", x, dim))
    return _reduce("reduce_min", x, dim, keepdim)


def _arg(op, x, dim, keepdim):
    x = _tensor(x)
    _nonempty(op, x, _axes(op, x, dim))
    if dim is None:
        from kiln.frontend.shape_ops import reshape

        flat = reshape(x, (-1,))
        return apply(op, flat, axis=0)
    axis = normalize_axis(op, dim, x.ndim, "dim")
    return _keep(x, apply(op, x, axis=axis), (axis,), keepdim)


def argmax(x, dim=None, keepdim: bool = False):
    return _arg("argmax", x, dim, keepdim)


def argmin(x, dim=None, keepdim: bool = False):
    return _arg("argmin", x, dim, keepdim)


def _scan(op, x, dim):
    x = _tensor(x)
    if op in ("cumsum", "cumprod") and (x.dtype.is_bool or x.dtype.is_integer):
        x = to(x, dt.int64)
    return apply(op, x, axis=normalize_axis(op, dim, x.ndim, "dim"), reverse=False)


def cumsum(x, dim: int):
    return _scan("cumsum", x, dim)


def cumprod(x, dim: int):
    return _scan("cumprod", x, dim)


def sort(x, dim: int = -1, descending: bool = False):
    x = _tensor(x)
    return MaxMin(apply("sort", x, axis=normalize_axis("sort", dim, x.ndim, "dim"),
                        descending=bool(descending)))


def argsort(x, dim: int = -1, descending: bool = False):
    return sort(x, dim, descending)[1]
