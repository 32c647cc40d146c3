"""The LAPACK-style extern calls of linear algebra: cholesky, qr, eigh, svd, solve and
triangular_solve (the contractions, dot_general and convolution, live in linalg.py).

Each takes float32, float64 or complex64 matrices in the last two dims, batched over the
leading dims; a matrix LAPACK rejects (not positive definite, singular) gives NaNs in its
slot instead of an exception, as JAX does.

vjp rules are the standard ones (JAX's lax.linalg, PyTorch's FunctionsManual). For
complex operands a cotangent is conjugate-linear, as torch's. The externs that read one
triangle (cholesky, eigh: the lower one; triangular_solve: the one it solves with) give a
cotangent in that triangle only.
"""

from __future__ import annotations

import numpy as np
import sympy

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.rules import conj, contiguous, full_like, zeros
from kiln.ir.ops.shape import sum_to
from kiln.ir.registry import EXTERN, defop
from kiln.ir.shapes import broadcast_shapes, dim, dims_equal
from kiln.ir.sharding import R, Shard, Strategy, partial_through, shard_dims, sharding_rule

# -- extern: LAPACK-style calls ----------------------------------------------------------

# Faster implementations a backend registers for some operands (the batched small-matrix
# CPU kernels: kiln/codegen/cpu/linalg_route.py): op -> fn(array) giving the op's results,
# or None to leave the operand to LAPACK. Eager calls and compiled extern steps both run
# the references below, so both take the registered path.
NATIVE: dict = {}


def _native(op: str, a):
    fn = NATIVE.get(op)
    return None if fn is None else fn(a)


_LAPACK_DTYPES = (dt.float32, dt.float64, dt.complex64)


def _matrix(op, t, square=False, what="operand"):
    if t.dtype not in _LAPACK_DTYPES:
        raise KilnDTypeError(f"{op}: {what} of type {t} is not supported; {op} takes float32, "
                             "float64 or complex64 (convert low-precision inputs to float32)")
    if t.rank < 2:
        raise KilnShapeError(f"{op}: {what} {t} must be a matrix or a batch of matrices "
                             "(rank >= 2)")
    if square and not dims_equal(t.shape[-1], t.shape[-2]):
        raise KilnShapeError(f"{op}: {what} {t} must be square in its last two dims, got "
                             f"{t.shape[-2]} x {t.shape[-1]}")


def _real(t):
    return t.with_dtype(dt.float32) if t.dtype.is_complex else t


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else dim(sympy.Min(a, b))


def _per_matrix(fn, a, *rest, outs):
    """Apply a LAPACK wrapper to the whole batch; on failure redo it matrix by matrix,
    filling the failing slots with NaN (JAX's behaviour) instead of raising."""
    with np.errstate(all="ignore"):
        try:
            result = fn(a, *rest)
            return result if isinstance(result, tuple) else (result,)
        except np.linalg.LinAlgError:
            pass
        batch = a.shape[:-2]
        results = [np.full(batch + s, np.nan, dtype=d) for s, d in outs]
        for index in np.ndindex(*batch):
            try:
                one = fn(a[index], *(r[index] for r in rest))
            except np.linalg.LinAlgError:
                continue
            for buf, value in zip(results, one if isinstance(one, tuple) else (one,)):
                buf[index] = value
        return tuple(results)


def _solve_shapes(op, a, b):
    _matrix(op, a, square=True, what="matrix a")
    _matrix(op, b, what="right-hand side b")
    if a.dtype != b.dtype:
        raise KilnDTypeError(f"{op}: a {a} and b {b} must have one dtype")
    if not dims_equal(a.shape[-1], b.shape[-2]):
        raise KilnShapeError(f"{op}: a {a} is {a.shape[-2]} x {a.shape[-1]} but b {b} has "
                             f"{b.shape[-2]} rows; b is [..., n, k] (a column per right-hand side)")
    batch = broadcast_shapes(op, a.shape[:-2], b.shape[:-2], describe=lambda: f"{a} with {b}")
    return b.with_shape(batch + b.shape[-2:])


def _broadcast_batch(a, b):
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return np.broadcast_to(a, batch + a.shape[-2:]), np.broadcast_to(b, batch + b.shape[-2:])


# -- matrix pieces of the extern vjp rules (batched over the leading dims) ---------------

def _mT(b, x):
    r = b.type_of(x).rank
    return b.transpose(x, permutation=tuple(range(r - 2)) + (r - 1, r - 2))


def _mH(b, x):
    return conj(b, _mT(b, x))


def _mm(b, x, y):
    """x @ y for operands with one batch shape."""
    r = b.type_of(x).rank
    batch = tuple(range(r - 2))
    return b.dot_general(x, y, lhs_contracting=(r - 1,), rhs_contracting=(r - 2,),
                         lhs_batch=batch, rhs_batch=batch)


def _add(b, *xs):
    """The sum of the values given (None: zero)."""
    xs = [x for x in xs if x is not None]
    out = xs[0]
    for x in xs[1:]:
        out = b.add(out, x)
    return out


def _positions(b, x, pick):
    """The bool mask of the entries (i, j) of x's matrices where pick(i, j) holds."""
    t = b.type_of(x)
    return pick(b.iota(dtype=dt.int64, shape=t.shape, dimension=t.rank - 2),
                b.iota(dtype=dt.int64, shape=t.shape, dimension=t.rank - 1))


def _where(b, x, pick):
    """x where pick(row index, column index) holds, else 0."""
    return b.select(_positions(b, x, pick), x, zeros(b, b.type_of(x)))


def _triangle(b, x, lower=True, strict=False):
    pick = {(True, False): "ge", (True, True): "gt", (False, False): "le", (False, True): "lt"}
    return _where(b, x, lambda i, j: b.call(pick[lower, strict], i, j))


def _diagonal(b, x):
    """The diagonal of square matrices, as [..., n]."""
    return b.reduce_sum(_where(b, x, b.eq), axes=(b.type_of(x).rank - 1,))


def _diag_matrix(b, v):
    """[..., n] -> the diagonal matrices [..., n, n]."""
    t = b.type_of(v)
    full = b.broadcast_in_dim(v, shape=t.shape + t.shape[-1:],
                              broadcast_dimensions=tuple(range(t.rank)))
    return _where(b, full, b.eq)


def _scale(b, x, v, axis):
    """x times the vector v [..., n] along x's rows (axis -2) or columns (axis -1)."""
    t = b.type_of(x)
    dims = tuple(range(t.rank - 2)) + ((t.rank - 2,) if axis == -2 else (t.rank - 1,))
    return b.mul(x, b.broadcast_in_dim(b.convert(v, t.dtype), shape=t.shape,
                                       broadcast_dimensions=dims))


def _scalar(b, x, value):
    return full_like(b, b.type_of(x), value)


def _halve_diagonal(b, x):
    return b.select(_positions(b, x, b.eq), b.mul(x, _scalar(b, x, 0.5)), x)


def _read_lower(b, g):
    """The cotangent of an operand whose lower triangle stands for a Hermitian matrix,
    from g, the cotangent of that matrix: each strict-lower entry stands for itself and
    its mirror (g + g^H there), the diagonal for its real part."""
    return _triangle(b, _halve_diagonal(b, b.add(g, _mH(b, g))))


def _right_solve(b, x, r, lower):
    """x @ r^-H for triangular r: (r^-1 @ x^H)^H."""
    return _mH(b, b.triangular_solve(r, _mH(b, x), lower=lower))


def _reciprocal_gaps(b, v):
    """f[..., i, j] = 1 / (v_j - v_i), 0 where v_j == v_i (the diagonal, and repeated
    values: there only the part of the cotangent that ignores the basis is defined)."""
    t = b.type_of(v)
    shape, lead = t.shape + t.shape[-1:], tuple(range(t.rank - 1))
    gaps = b.sub(b.broadcast_in_dim(v, shape=shape, broadcast_dimensions=lead + (t.rank,)),
                 b.broadcast_in_dim(v, shape=shape, broadcast_dimensions=lead + (t.rank - 1,)))
    same = b.eq(gaps, zeros(b, b.type_of(gaps)))
    one = full_like(b, b.type_of(gaps), 1)
    return b.select(same, zeros(b, b.type_of(gaps)), b.div(one, b.select(same, one, gaps)))


def _known(op, relation, what):
    """A static decision on dims (m < n, ...), or an error where symbols leave it open."""
    value = sympy.sympify(relation)
    if value in (sympy.true, sympy.false):
        return bool(value)
    raise KilnShapeError(f"{op}: its vjp needs to know whether {what} ({relation}); the "
                         "symbolic dims leave it open; make one of them static")


@defop("cholesky", family="linalg", kind=EXTERN, num_operands=1, differentiable=True)
class cholesky:
    """Lower Cholesky factor L of a Hermitian positive-definite a (a = L @ L^H);
    reads the lower triangle; not positive definite gives NaNs."""

    def type(op, a):
        _matrix(op, a, square=True)
        return a

    def reference(a):
        if (fast := _native("cholesky", a)) is not None:
            return fast
        (out,) = _per_matrix(np.linalg.cholesky, a, outs=[(a.shape[-2:], a.dtype)])
        return out.astype(a.dtype)

    def vjp(b, cts, xs, ys):
        """G = L^-H phi(L^H gL) L^-1, phi taking the lower triangle with its diagonal
        halved and mirroring it (PyTorch's cholesky_backward); then read as a's lower
        triangle."""
        (l,), (gl,) = ys, cts
        lh = _mH(b, l)
        m = _triangle(b, _mm(b, lh, gl))
        phi = b.mul(b.add(m, _mH(b, _triangle(b, m, strict=True))), _scalar(b, m, 0.5))
        y = b.triangular_solve(lh, phi, lower=False)
        return [_read_lower(b, _right_solve(b, y, lh, lower=False))]  # y @ L^-1


def _batch_sharding(spec):
    """A batch of matrices shards its batch dims; each matrix stays whole."""
    return shard_dims(spec, range(spec.ndim - 2))


sharding_rule("cholesky")(_batch_sharding)


@defop("qr", family="linalg", kind=EXTERN, num_operands=1, differentiable=True)
class qr:
    """Reduced QR of a [..., m, n]: q [..., m, k] with orthonormal columns, r [..., k, n]
    upper triangular, k = min(m, n)."""

    def type(op, a):
        _matrix(op, a)
        m, n = a.shape[-2:]
        k = _min(m, n)
        return a.with_shape(a.shape[:-2] + (m, k)), a.with_shape(a.shape[:-2] + (k, n))

    def reference(a):
        if (fast := _native("qr", a)) is not None:
            return fast
        q, r = np.linalg.qr(a, mode="reduced")
        return q.astype(a.dtype), r.astype(a.dtype)

    def vjp(b, cts, xs, ys):
        """m >= n: gA = (gQ + Q sym(triu(gR R^H - Q^H gQ))) R^-H, sym mirroring the upper
        triangle and halving the (real) diagonal (Liao et al. 2019; PyTorch). m < n:
        a = [x | y] with x square; y = Q R[:, m:] adds its part to gQ."""
        (a,), (q, r), (gq, gr) = xs, ys, cts
        if gq is None and gr is None:
            return [None]
        t = b.type_of(a)
        m, n = t.shape[-2:]
        if not _known("qr", sympy.sympify(m) < n, "a has fewer rows than columns"):
            return [_qr_tall_ct(b, q, r, gq, gr)]
        cols = lambda x, lo, hi: b.slice(  # noqa: E731
            x, start=(0,) * (t.rank - 1) + (lo,), limit=b.type_of(x).shape[:-1] + (hi,))
        u, gu, gv = cols(r, 0, m), None, None
        if gr is not None:
            gu, gv = cols(gr, 0, m), cols(gr, m, n)
            gq = _add(b, gq, _mm(b, cols(a, m, n), _mH(b, gv)))
        gx = _qr_tall_ct(b, q, u, gq, gu)
        gy = _mm(b, q, gv) if gv is not None else zeros(b, b.type_of(cols(a, m, n)))
        return [b.concatenate(gx, gy, dimension=t.rank - 1)]


sharding_rule("qr")(_batch_sharding)


def _qr_tall_ct(b, q, r, gq, gr):
    """The m >= n rule (either cotangent may be None)."""
    terms = [_mm(b, gr, _mH(b, r)) if gr is not None else None,
             b.neg(_mm(b, _mH(b, q), gq)) if gq is not None else None]
    upper = _triangle(b, _add(b, *terms), lower=False)
    sym = _halve_diagonal(b, b.add(upper, _mH(b, upper)))
    return _right_solve(b, _add(b, gq, _mm(b, q, sym)), r, lower=False)


@defop("eigh", family="linalg", kind=EXTERN, num_operands=1, differentiable=True)
class eigh:
    """Eigen-decomposition of a Hermitian a (lower triangle read): real eigenvalues
    ascending [..., n] and eigenvectors as columns [..., n, n]."""

    def type(op, a):
        _matrix(op, a, square=True)
        return _real(a).with_shape(a.shape[:-1]), a

    def reference(a):
        if (fast := _native("eigh", a)) is not None:
            return fast
        w, v = np.linalg.eigh(a, UPLO="L")
        return w.astype(_real_np(a.dtype)), v.astype(a.dtype)

    def vjp(b, cts, xs, ys):
        """G = V (diag(gw) + F o skew(V^H gV)) V^H with F_ij = 1 / (w_j - w_i), read as
        a's lower triangle. Needs distinct eigenvalues when gV is used: for repeated ones
        F is 0 there, which is right for functions that ignore the choice of basis in an
        eigenspace (eigenvalues, projectors) and the basis-free part otherwise."""
        (w, v), (gw, gv) = ys, cts
        if gw is None and gv is None:
            return [None]
        inner = [_diag_matrix(b, b.convert(gw, b.type_of(v).dtype)) if gw is not None else None]
        if gv is not None:
            x = _mm(b, _mH(b, v), gv)
            skew = b.mul(b.sub(x, _mH(b, x)), _scalar(b, x, 0.5))
            inner.append(b.mul(skew, b.convert(_reciprocal_gaps(b, w), b.type_of(x).dtype)))
        return [_read_lower(b, _mm(b, _mm(b, v, _add(b, *inner)), _mH(b, v)))]


sharding_rule("eigh")(_batch_sharding)



def _real_np(d):
    return np.dtype(np.float32) if d == np.complex64 else d


@defop("svd", family="linalg", kind=EXTERN, num_operands=1, differentiable=True)
class svd:
    """Reduced SVD a = u @ diag(s) @ vh: u [..., m, k], s [..., k] real descending,
    vh [..., k, n], k = min(m, n)."""

    def type(op, a):
        _matrix(op, a)
        m, n = a.shape[-2:]
        k = _min(m, n)
        lead = a.shape[:-2]
        return a.with_shape(lead + (m, k)), _real(a).with_shape(lead + (k,)), a.with_shape(lead + (k, n))

    def reference(a):
        if (fast := _native("svd", a)) is not None:
            return fast
        m, n = a.shape[-2:]
        k, real = min(m, n), _real_np(a.dtype)
        u, s, vh = _per_matrix(lambda x: tuple(np.linalg.svd(x, full_matrices=False)), a,
                               outs=[((m, k), a.dtype), ((k,), real), ((k, n), a.dtype)])
        return u.astype(a.dtype), s.astype(real), vh.astype(a.dtype)

    def vjp(b, cts, xs, ys):
        """gA = U [F o (J - J^H) S + S F o (K - K^H) + diag(gs)] V^H, J = U^H gU,
        K = V^H gV, F_ij = 1 / (s_j^2 - s_i^2), plus the parts of gU (gV) outside U's
        (V's) span when m > n (m < n), times S^-1 (Townsend 2016; PyTorch's
        svd_backward; complex adds i Im(diag J) / s on the diagonal). Repeated singular
        values get F = 0 (as eigh), zero ones a zero S^-1 (JAX's pseudo-inverse)."""
        (a,), (u, s, vh), (gu, gs, gvh) = xs, ys, cts
        if gu is None and gs is None and gvh is None:
            return [None]
        t = b.type_of(a)
        m, n = t.shape[-2:]
        v, gv = _mH(b, vh), (_mH(b, gvh) if gvh is not None else None)
        f = b.convert(_reciprocal_gaps(b, b.mul(s, s)), t.dtype)
        zero = b.eq(s, zeros(b, b.type_of(s)))
        one = full_like(b, b.type_of(s), 1)
        s_inv = b.select(zero, zeros(b, b.type_of(s)), b.div(one, b.select(zero, one, s)))
        inner = [_diag_matrix(b, b.convert(gs, t.dtype)) if gs is not None else None]
        if gu is not None:
            j = _mm(b, _mH(b, u), gu)
            inner.append(_scale(b, b.mul(f, b.sub(j, _mH(b, j))), s, -1))
            if t.dtype.is_complex:  # the phase shared by u's and v's columns
                im = b.complex(zeros(b, b.type_of(s)), b.mul(b.imag(_diagonal(b, j)), s_inv))
                inner.append(_diag_matrix(b, im))
        if gv is not None:
            kk = _mm(b, _mH(b, v), gv)
            inner.append(_scale(b, b.mul(f, b.sub(kk, _mH(b, kk))), s, -2))
        ga = _mm(b, _mm(b, u, _add(b, *inner)), vh)
        if gu is not None and _known("svd", sympy.sympify(m) > n, "a has more rows than columns"):
            rest = b.sub(gu, _mm(b, u, _mm(b, _mH(b, u), gu)))  # (I - U U^H) gU S^-1 V^H
            ga = b.add(ga, _mm(b, _scale(b, rest, s_inv, -1), vh))
        if gv is not None and _known("svd", sympy.sympify(m) < n, "a has fewer rows than columns"):
            # U S^-1 gV^H (I - V V^H)
            rest = b.sub(_mH(b, gv), _mm(b, _mm(b, _mH(b, gv), v), vh))
            ga = b.add(ga, _mm(b, u, _scale(b, rest, s_inv, -2)))
        return [ga]


sharding_rule("svd")(_batch_sharding)


@defop("solve", family="linalg", kind=EXTERN, num_operands=2, differentiable=True)
class solve:
    """x with a @ x = b for square a [..., n, n] and b [..., n, k] (always a matrix: a
    vector b is b[..., None]); batch dims broadcast; singular a gives NaNs."""

    def type(op, a, b):
        return _solve_shapes(op, a, b)

    def reference(a, b):
        a, b = _broadcast_batch(a, b)
        (x,) = _per_matrix(np.linalg.solve, a, b, outs=[(b.shape[-2:], b.dtype)])
        return contiguous(x).astype(b.dtype)

    def vjp(b, cts, xs, ys):
        """gb = a^-H ct, ga = -gb x^H, each summed over the batch dims it was broadcast in."""
        a, rhs = xs
        g_rhs = b.solve(_mH(b, a), cts[0])
        g_a = b.neg(_mm(b, g_rhs, _mH(b, ys[0])))
        return [sum_to(b, g_a, b.type_of(a).shape), sum_to(b, g_rhs, b.type_of(rhs).shape)]


def _solve_sharding(spec):
    """Batch dims a and b share, or b's columns (each solved alone); x is linear in b."""
    a, b = spec.in_shapes
    found = []
    if len(a) == len(b):
        found = shard_dims(spec, [d for d in range(len(a) - 2) if a[d] == b[d]])
    found.append(Strategy((R, Shard(len(b) - 1)), (Shard(len(spec.out_shapes[0]) - 1),)))
    if spec.in_dtypes[1].is_inexact:
        found.append(partial_through(spec, "sum", (1,)))
    return found


sharding_rule("solve")(_solve_sharding)


@defop("triangular_solve", family="linalg", kind=EXTERN, num_operands=2,
       attrs={"lower": True, "unit_diagonal": False}, differentiable=True)
class triangular_solve:
    """x with a @ x = b, reading only the lower (or upper) triangle of a [..., n, n]
    (its diagonal taken as ones if unit_diagonal); b [..., n, k]; batch dims broadcast."""

    def type(op, a, b, *, lower, unit_diagonal):
        if not isinstance(lower, bool) or not isinstance(unit_diagonal, bool):
            raise KilnArgumentError(f"{op}: lower and unit_diagonal must be bools, got "
                                    f"{lower!r}, {unit_diagonal!r}")
        return _solve_shapes(op, a, b)

    def reference(a, b, *, lower, unit_diagonal):
        a, b = _broadcast_batch(a, b)
        n = a.shape[-1]
        x = np.zeros(b.shape, dtype=b.dtype)
        # substitution, row by row; rows not solved yet are zero in x, so a full-row
        # product only picks up the triangle already solved
        with np.errstate(all="ignore"):
            for i in (range(n) if lower else reversed(range(n))):
                row = b[..., i, :] - np.einsum("...j,...jk->...k", a[..., i, :], x)
                x[..., i, :] = row if unit_diagonal else row / a[..., i, i][..., None]
        return x

    def vjp(b, cts, xs, ys, *, lower, unit_diagonal):
        """As solve's, with a^H solved from the other triangle, and a's cotangent kept in
        the entries the solve reads (the triangle, less the diagonal if unit)."""
        a, rhs = xs
        g_rhs = b.triangular_solve(_mH(b, a), cts[0], lower=not lower, unit_diagonal=unit_diagonal)
        g_a = _triangle(b, b.neg(_mm(b, g_rhs, _mH(b, ys[0]))), lower=lower, strict=unit_diagonal)
        return [sum_to(b, g_a, b.type_of(a).shape), sum_to(b, g_rhs, b.type_of(rhs).shape)]


sharding_rule("triangular_solve")(_solve_sharding)
