"""`kn.linalg`: decompositions and solvers over the last two dims (batched), as
torch.linalg. Integer inputs compute in float32.

cholesky, qr, eigh and svd run LAPACK, the batched small-matrix CPU kernels, or (for
tensors on metal:N) the Metal kernels; `path(op, a)` says which, by the rule in
docs/linalg.md."""

from __future__ import annotations

from kiln.frontend.dispatch import apply
from kiln.frontend.functional import _floating, to


def _routed(op: str, a):
    """Run `op` on the path the rule picks: the Metal kernels for a tensor on metal:N,
    else the op (whose reference takes the CPU kernels where they win, LAPACK otherwise)."""
    from kiln.codegen.cpu import linalg_route

    linalg_route.install()
    a = _floating(a)
    device = str(getattr(a, "device", "cpu"))
    if device.split(":")[0] in ("metal", "mps"):
        from kiln.codegen.metal import linalg_run
        from kiln.frontend.factories import tensor

        index = int(device.split(":")[1]) if ":" in device else 0
        out = linalg_run.run(op, a.numpy(), index)
        out = tuple(tensor(o, device=device) for o in out)
        return out[0] if len(out) == 1 else out
    return apply(op, a)


def path(op: str, a) -> str:
    """Which implementation kn.linalg.`op` (cholesky, qr, eigh, svd) runs for `a`:
    'native' (the batched CPU kernels), 'lapack' or 'metal'.

    >>> kn.linalg.path("eigh", kn.randn(4096, 8, 8))   # 'native'
    """
    from kiln.codegen.cpu import linalg_route

    a = _floating(a)
    return linalg_route.path(op, tuple(a.shape), a.dtype.np_dtype, str(getattr(a, "device", "cpu")))


def cholesky(a):
    """Lower-triangular L with a = L @ L.mT, for symmetric positive-definite a (lower
    triangle read); a matrix that is not positive definite gives NaNs in its slot (see
    cholesky_ex for torch's `info`)."""
    return _routed("cholesky", a)


def cholesky_ex(a):
    """(L, info) as torch.linalg.cholesky_ex (eager): info[...] is 0 where a's matrix is
    positive definite, else the order k of its first leading minor that is not (L is
    then not a factor, and holds no NaNs)."""
    from kiln.codegen.cpu import linalg_route
    from kiln.frontend.factories import tensor

    a = _floating(a)
    L, info = linalg_route.cholesky_ex(a.numpy())
    return tensor(L), tensor(info)


def qr(a):
    """Reduced QR: (q, r) with a = q @ r."""
    return _routed("qr", a)


def eigh(a):
    """(eigenvalues ascending, eigenvectors as columns) of a symmetric matrix (lower
    triangle read). On the CPU-kernel and Metal paths each eigenvector's largest-magnitude
    entry is positive; LAPACK's signs are its own."""
    return _routed("eigh", a)


def svd(a, full_matrices: bool = False):
    """Reduced SVD: (u, s, vh) with a = u @ diag(s) @ vh."""
    if full_matrices:
        from kiln.errors import KilnArgumentError

        raise KilnArgumentError("svd: kiln computes the reduced SVD; pass full_matrices=False")
    return _routed("svd", a)


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
