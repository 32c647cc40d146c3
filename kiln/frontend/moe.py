"""Mixture-of-experts functions: `kn.grouped_matmul`.

The routing around it (top-k, sorting tokens by expert, combining) is ordinary kiln
code; see examples/moe_layer.py and docs/moe.md.
"""

from __future__ import annotations

from kiln.errors import KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.frontend.dispatch import apply
from kiln.frontend.functional import _tensor, to


def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False):
    """One matrix product per expert over tokens sorted by expert.

    x is [T, K] with the tokens of expert 0 first, then expert 1, ...; w is [E, K, N]
    (or [E, N, K] with `transpose_rhs=True`, the layout of a stack of nn.Linear
    weights); group_sizes [E] counts each expert's tokens (ints >= 0, summing to T;
    empty experts are fine). Returns [T, N] where the rows of expert e are
    `x[rows of e] @ w[e]`. x and w are promoted to one dtype (integers compute in
    float32); float16/bfloat16 accumulate in float32. Differentiable in x and w.

    >>> x = kn.randn(5, 4, seed=0)                     # 5 tokens, sorted by expert
    >>> w = kn.randn(3, 4, 2, seed=1)                  # 3 experts, 4 -> 2 features
    >>> y = kn.grouped_matmul(x, w, [2, 0, 3])         # rows 0-1 by w[0], 2-4 by w[2]
    >>> y.shape
    (5, 2)
    """
    x, w = _tensor(x), _tensor(w)
    dtype = dt.promote_types(x.dtype, w.dtype)
    if not dtype.is_floating:
        dtype = dt.float32
    sizes = _tensor(group_sizes)
    if not (sizes.dtype.is_integer and not sizes.dtype.is_bool):
        raise KilnDTypeError(f"grouped_matmul: group_sizes must hold integers (token counts per "
                             f"expert), got {sizes.dtype.short}{list(sizes.shape)}")
    if sizes.dtype not in (dt.int32, dt.int64):
        sizes = to(sizes, dt.int64)
    return apply("grouped_matmul", to(x, dtype), to(w, dtype), sizes,
                 transpose_rhs=bool(transpose_rhs))
