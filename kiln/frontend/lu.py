"""LU with partial pivoting and what rests on it: `kn.linalg.lu`, `lu_factor`, `det`,
`slogdet`, `inv`, `solve_triangular`, `lstsq` (torch.linalg's signatures).

The factorization is a composite of kiln ops: n elimination steps (n static), each an
argmax over the pivot column, a row swap by gather, and a masked rank-1 update, so it
runs eagerly, traces, compiles (unrolled) and differentiates through the existing vjp
rules (the pivot choice is piecewise constant). `inv` is `solve(a, I)`, `lstsq` a QR
solve, `solve_triangular` the `triangular_solve` primitive.

    >>> P, L, U = kn.linalg.lu(a)           # a = P @ L @ U
    >>> sign, logabsdet = kn.linalg.slogdet(a)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kiln.errors import KilnArgumentError, KilnShapeError
from kiln.ir import dtypes as dt


def _square(op: str, a):
    from kiln.frontend.functional import _floating

    a = _floating(a)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or not isinstance(a.shape[-1], int):
        raise KilnShapeError(f"{op}: needs square matrices [..., n, n] with a static n, got "
                             f"{a.dtype.short}{list(a.shape)}")
    return a


def _factor(a):
    """(packed LU, permutation [..., n], pivots [..., n] 0-based, swap sign [...])."""
    from kiln.frontend.factories import arange, tensor
    from kiln.frontend.functional import abs as kabs
    from kiln.frontend.functional import eq, mul, where
    from kiln.frontend.reductions import argmax
    from kiln.frontend.shape_ops import expand, gather, stack, unsqueeze

    n = a.shape[-1]
    batch = tuple(a.shape[:-2])
    ar = arange(n)
    perm = expand(ar, *batch, n) if batch else ar
    sign = tensor(1.0, dtype=a.dtype)
    pivots = []
    rows = np.arange(n)[:, None]
    cols = np.arange(n)[None, :]
    for k in range(n):
        below = tensor(rows[:, 0] >= k)
        p = argmax(where(below, kabs(a[..., :, k]), -1.0), dim=-1)  # [...]
        pivots.append(p)
        pk = unsqueeze(p, -1)
        swap = where(eq(ar, k), pk, where(eq(ar, pk), k, ar))  # [..., n] row order
        a = gather(a, -2, expand(unsqueeze(swap, -1), *batch, n, n))
        perm = gather(perm, -1, swap)
        sign = mul(sign, where(eq(p, k), 1.0, -1.0))
        pivot = unsqueeze(a[..., k, k], -1)
        f = where(tensor(rows[:, 0] > k), a[..., :, k] / pivot, 0.0)  # multipliers
        top = where(tensor(cols[0] > k), a[..., k, :], 0.0)
        a = a - unsqueeze(f, -1) * unsqueeze(top, -2)
        a = where(tensor((cols == k) & (rows > k)), unsqueeze(f, -1), a)  # pack L below
    return a, perm, stack(pivots, dim=-1), sign


def lu_factor(A, *, pivot: bool = True):
    """(LU, pivots): L (unit lower) and U packed in one matrix, pivots 1-based (LAPACK)."""
    if not pivot:
        raise KilnArgumentError("lu_factor: pivot=False is not supported")
    a = _square("lu_factor", A)
    packed, _, pivots, _ = _factor(a)
    from kiln.frontend.functional import add, to

    return packed, to(add(pivots, 1), dt.int32)


class LU(NamedTuple):
    P: object
    L: object
    U: object


def lu(A, *, pivot: bool = True) -> LU:
    """(P, L, U) with A = P @ L @ U, L unit lower triangular (torch.linalg.lu)."""
    from kiln.frontend.factories import arange, eye
    from kiln.frontend.functional import eq, to
    from kiln.frontend.selection import tril, triu
    from kiln.frontend.shape_ops import unsqueeze

    if not pivot:
        raise KilnArgumentError("lu: pivot=False is not supported")
    a = _square("lu", A)
    packed, perm, _, _ = _factor(a)
    n = a.shape[-1]
    lower = tril(packed, -1) + eye(n, dtype=a.dtype)
    upper = triu(packed)
    p = to(eq(unsqueeze(perm, -2), unsqueeze(arange(n), -1)), a.dtype)  # P[j, i] = perm[i]==j
    return LU(p, lower, upper)


def _diagonal(a):
    from kiln.frontend.factories import eye
    from kiln.frontend.reductions import sum as ksum

    return ksum(a * eye(a.shape[-1], dtype=a.dtype), dim=-1)


def det(A):
    """The determinant of each square matrix (torch.linalg.det)."""
    from kiln.frontend.functional import mul
    from kiln.frontend.reductions import prod

    a = _square("det", A)
    packed, _, _, sign = _factor(a)
    return mul(prod(_diagonal(packed), dim=-1), sign)


class SlogDet(NamedTuple):
    sign: object
    logabsdet: object


def slogdet(A) -> SlogDet:
    """(sign, log|det|) of each square matrix (torch.linalg.slogdet)."""
    from kiln.frontend.functional import abs as kabs
    from kiln.frontend.functional import log, mul, sign
    from kiln.frontend.reductions import prod, sum as ksum

    a = _square("slogdet", A)
    packed, _, _, swaps = _factor(a)
    d = _diagonal(packed)
    return SlogDet(mul(prod(sign(d), dim=-1), swaps), ksum(log(kabs(d)), dim=-1))


def inv(A):
    """The inverse of each square matrix: solve(A, I) (singular A gives inf/NaN)."""
    from kiln.frontend.factories import eye
    from kiln.frontend.linalg import solve
    from kiln.frontend.shape_ops import expand

    a = _square("inv", A)
    n = a.shape[-1]
    return solve(a, expand(eye(n, dtype=a.dtype), *a.shape))


def solve_triangular(A, B, *, upper: bool, left: bool = True, unitriangular: bool = False):
    """X with A @ X = B (left) or X @ A = B (right), A triangular (torch.linalg)."""
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import to

    a = _square("solve_triangular", A)
    b = to(B, a.dtype)
    if b.ndim < 2:
        raise KilnShapeError(f"solve_triangular: B must be a matrix [..., n, k], got {list(b.shape)}")
    if left:
        return apply("triangular_solve", a, b, lower=not upper, unit_diagonal=bool(unitriangular))
    x = apply("triangular_solve", a.mT, b.mT, lower=bool(upper), unit_diagonal=bool(unitriangular))
    return x.mT


class LstsqResult(NamedTuple):
    solution: object
    residuals: object
    rank: object
    singular_values: object


def lstsq(A, B, rcond=None, *, driver=None) -> LstsqResult:
    """Least squares (tall A) or minimum-norm (wide A) solution for full-rank A, by QR;
    residuals, rank and singular_values are empty, as torch's default CPU driver gives."""
    from kiln.frontend.factories import zeros
    from kiln.frontend.functional import _floating, to
    from kiln.frontend.linalg import qr

    a = _floating(A)
    b = to(B, a.dtype)
    vector = b.ndim == a.ndim - 1
    if vector:
        b = b.unsqueeze(-1)
    if a.ndim < 2 or b.shape[-2] != a.shape[-2]:
        raise KilnShapeError(f"lstsq: A {list(a.shape)} and B {list(b.shape)} must have the same "
                             "number of rows")
    m, n = a.shape[-2], a.shape[-1]
    if isinstance(m, int) and isinstance(n, int) and m < n:
        q, r = qr(a.mT)  # A^T = Q R: x = Q R^-T b
        x = q @ solve_triangular(r.mT, b, upper=False)
    else:
        q, r = qr(a)
        x = solve_triangular(r, q.mT @ b, upper=True)
    if vector:
        x = x.squeeze(-1)
    empty = zeros(0, dtype=a.dtype)
    return LstsqResult(x, empty, zeros(0, dtype=dt.int64), empty)
