"""`kn.linalg`: decompositions and solvers over the last two dims (batched), as
torch.linalg. Integer inputs compute in float32."""

from __future__ import annotations

from kiln.frontend.dispatch import apply
from kiln.frontend.functional import _floating, to


def cholesky(a):
    """Lower-triangular L with a = L @ L.mT, for symmetric positive-definite a."""
    return apply("cholesky", _floating(a))


def qr(a):
    """Reduced QR: (q, r) with a = q @ r."""
    return apply("qr", _floating(a))


def eigh(a):
    """(eigenvalues ascending, eigenvectors) of a symmetric matrix (lower triangle used)."""
    return apply("eigh", _floating(a))


def svd(a, full_matrices: bool = False):
    """Reduced SVD: (u, s, vh) with a = u @ diag(s) @ vh."""
    if full_matrices:
        from kiln.errors import KilnArgumentError

        raise KilnArgumentError("svd: kiln computes the reduced SVD; pass full_matrices=False")
    return apply("svd", _floating(a))


def solve(a, b):
    """x with a @ x = b; b is [..., n, k] (a vector b of shape [..., n] is treated as k=1)."""
    a = _floating(a)
    b = to(b, a.dtype)
    if b.ndim == a.ndim - 1:
        from kiln.frontend.shape_ops import squeeze, unsqueeze

        return squeeze(apply("solve", a, unsqueeze(b, -1)), -1)
    return apply("solve", a, b)


from kiln.frontend.lu import (  # noqa: E402,F401  (LU-based functions, kiln/frontend/lu.py)
    det, inv, lstsq, lu, lu_factor, slogdet, solve_triangular,
)
