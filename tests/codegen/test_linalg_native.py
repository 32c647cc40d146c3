"""The batched small-matrix CPU kernels (kiln/codegen/cpu/linalg_*.py) against numpy:
reconstruction and orthogonality (not raw vectors) on random, ill-conditioned,
rank-deficient and repeated-eigenvalue batches; Cholesky's info against the leading
minors; batches with a tail (not a multiple of the lane width W)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.cpu import linalg_native as N

DTYPES = [np.float32, np.float64]
RNG = np.random.default_rng(15)


def _batch(dtype) -> int:
    return 2 * N.lanes(dtype) + 3  # two full groups and a 3-matrix tail


def _tol(dtype, n: int) -> float:
    return 30 * n * np.finfo(dtype).eps


def _orthogonal(b, n, dtype):
    q, _ = np.linalg.qr(RNG.standard_normal((b, n, n)))
    return q.astype(dtype)


def _with_singular_values(b, m, n, s, dtype):
    """u diag(s) v^T with random orthogonal u, v (s [b, k])."""
    k = min(m, n)
    u = np.linalg.qr(RNG.standard_normal((b, m, k)))[0]
    v = np.linalg.qr(RNG.standard_normal((b, n, k)))[0]
    return ((u * s[:, None, :]) @ v.transpose(0, 2, 1)).astype(dtype)


def _kinds(b, m, n, dtype):
    """The test batches: random, ill-conditioned, rank-deficient (rank k//2), and one
    with a repeated singular value."""
    k = min(m, n)
    cond = 1e4 if dtype == np.float32 else 1e10
    ill = np.logspace(0, -np.log10(cond), k)[None, :].repeat(b, 0)
    deficient = np.concatenate([RNG.uniform(1, 2, (b, k - k // 2)), np.zeros((b, k // 2))], 1)
    repeated = np.concatenate([np.full((b, k - 1), 2.0), np.ones((b, 1))], 1)
    return {"random": RNG.standard_normal((b, m, n)).astype(dtype),
            "ill": _with_singular_values(b, m, n, ill, dtype),
            "deficient": _with_singular_values(b, m, n, deficient, dtype),
            "repeated": _with_singular_values(b, m, n, repeated, dtype)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [8, 13])
def test_cholesky_factor_and_info(dtype, n):
    b = _batch(dtype)
    x = RNG.standard_normal((b, n, n))
    spd = (x @ x.transpose(0, 2, 1) + n * np.eye(n)).astype(dtype)
    spd[:, np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = 7.0  # upper triangle is not read
    bad = spd.copy()
    bad[1, 3, 3] = -50.0            # leading minor of order 4 fails
    bad[b - 1, 0, 0] = np.nan       # a NaN pivot fails at order 1 (in the tail)
    bad[b - 2, n - 1, n - 1] = -1e3  # the last one
    L, info = N.cholesky(bad)
    want = np.zeros(b, np.int32)
    want[1], want[b - 1], want[b - 2] = 4, 1, n
    np.testing.assert_array_equal(info, want)
    ok = want == 0
    ref = np.linalg.cholesky(np.tril(spd) + np.tril(spd, -1).transpose(0, 2, 1))
    np.testing.assert_allclose(L[ok], ref[ok], rtol=0, atol=_tol(dtype, n) * np.abs(ref).max())
    assert np.all(np.triu(L[ok], 1) == 0)
    assert not np.isnan(L[1]).any()  # a failing lane continues on a unit pivot: no NaNs


def _check_qr(a, q, r):
    dtype, (m, n) = a.dtype, a.shape[-2:]
    k = min(m, n)
    scale = np.abs(a).max()
    np.testing.assert_allclose(q @ r, a, rtol=0, atol=_tol(dtype, max(m, n)) * scale)
    np.testing.assert_allclose(q.transpose(0, 2, 1) @ q, np.broadcast_to(np.eye(k), (a.shape[0], k, k)),
                               rtol=0, atol=_tol(dtype, m))
    assert np.all(np.tril(r, -1) == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 8), (13, 7), (7, 13), (40, 33), (33, 40)])  # >= 32: blocked
def test_qr(dtype, shape):
    b = _batch(dtype)
    for kind, a in _kinds(b, *shape, dtype).items():
        q, r = N.qr(a)
        assert q.shape == (b, shape[0], min(shape)) and r.shape == (b, min(shape), shape[1]), kind
        _check_qr(a, q, r)
        if kind == "random":  # LAPACK's Householder convention: the same R as numpy's
            np.testing.assert_allclose(r, np.linalg.qr(a)[1], rtol=0, atol=_tol(dtype, max(shape)) * 10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 8), (13, 7), (7, 13), (20, 14), (32, 32)])  # >= 14: bidiagonal QR
def test_svd(dtype, shape):
    b = _batch(dtype)
    m, n = shape
    k = min(shape)
    for kind, a in _kinds(b, m, n, dtype).items():
        u, s, vh = N.svd(a)
        scale = np.abs(a).max()
        tol = _tol(dtype, max(shape))
        np.testing.assert_allclose((u * s[:, None, :]) @ vh, a, rtol=0, atol=tol * scale, err_msg=kind)
        eye = np.broadcast_to(np.eye(k), (b, k, k))
        np.testing.assert_allclose(u.transpose(0, 2, 1) @ u, eye, rtol=0, atol=tol, err_msg=kind)
        np.testing.assert_allclose(vh @ vh.transpose(0, 2, 1), eye, rtol=0, atol=tol, err_msg=kind)
        ref = np.linalg.svd(a.astype(np.float64), compute_uv=False)
        np.testing.assert_allclose(s, ref, rtol=0, atol=tol * ref.max(), err_msg=kind)
        assert np.all(np.diff(s, axis=-1) <= 0)  # descending
        big = np.take_along_axis(vh, np.abs(vh).argmax(-1)[..., None], -1)
        assert np.all(big > 0), kind  # the sign convention


@pytest.mark.parametrize("n", [6, 16])  # Jacobi, bidiagonal QR
def test_svd_zero_matrix_and_zero_column(n):
    a = np.zeros((9, n, n))
    a[1:, :, 0] = RNG.standard_normal((8, n))  # rank one: n - 1 exactly-zero singular values
    u, s, vh = N.svd(a)
    np.testing.assert_allclose(u.transpose(0, 2, 1) @ u, np.broadcast_to(np.eye(n), (9, n, n)), atol=1e-12)
    np.testing.assert_allclose((u * s[:, None, :]) @ vh, a, atol=1e-12)


def _symmetric_kinds(b, n, dtype):
    q = _orthogonal(b, n, np.float64)
    cond = 1e4 if dtype == np.float32 else 1e10
    spectra = {"random": RNG.standard_normal((b, n)),
               "ill": np.logspace(0, -np.log10(cond), n)[None].repeat(b, 0) * RNG.choice([-1, 1], (b, n)),
               "deficient": np.concatenate([RNG.uniform(1, 2, (b, n - n // 2)), np.zeros((b, n // 2))], 1),
               "repeated": np.concatenate([np.full((b, n - 2), 3.0), [[-1.0, 0.5]] * b], 1)}
    return {k: ((q * w[:, None, :]) @ q.transpose(0, 2, 1)).astype(dtype) for k, w in spectra.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [8, 13, 32])  # Jacobi below 11, tridiagonal QL from there
def test_eigh(dtype, n):
    b = _batch(dtype)
    for kind, a in _symmetric_kinds(b, n, dtype).items():
        sym = a.copy()
        a = a.copy()
        a[:, np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -9.0  # only the lower triangle is read
        w, v = N.eigh(a)
        scale, tol = np.abs(sym).max(), _tol(dtype, n)
        np.testing.assert_allclose((v * w[:, None, :]) @ v.transpose(0, 2, 1), sym, rtol=0, atol=tol * scale,
                                   err_msg=kind)
        np.testing.assert_allclose(v.transpose(0, 2, 1) @ v, np.broadcast_to(np.eye(n), (b, n, n)), rtol=0,
                                   atol=tol, err_msg=kind)
        ref = np.linalg.eigvalsh(sym.astype(np.float64))
        np.testing.assert_allclose(w, ref, rtol=0, atol=tol * scale, err_msg=kind)
        assert np.all(np.diff(w, axis=-1) >= 0)
        big = np.take_along_axis(v, np.abs(v).argmax(-2)[:, None, :], -2)
        assert np.all(big > 0), kind


@pytest.mark.parametrize("dtype", DTYPES)
def test_eigh_lanes_that_split_or_are_done(dtype):
    """n >= 11 runs tridiagonal QL, whose lanes diverge: in one group, block-diagonal
    matrices (an exactly zero off-diagonal mid-way: QL splits there), diagonal ones
    (nothing to do from the start), a zero matrix and random ones, against numpy."""
    n, b = 16, _batch(dtype)
    a = RNG.standard_normal((b, n, n))
    a = a + a.transpose(0, 2, 1)
    a[0::4, :7, 7:] = a[0::4, 7:, :7] = 0                      # two blocks
    a[1::4] = np.eye(n) * RNG.standard_normal((len(a[1::4]), 1, n))  # diagonal
    a[2] = 0
    a[3::4, :, :] = np.diag(np.r_[np.ones(8), np.full(8, 2.0)])  # repeated, already diagonal
    a = a.astype(dtype)
    w, v = N.eigh(a)
    tol, scale = _tol(dtype, n), np.abs(a).max()
    np.testing.assert_allclose((v * w[:, None, :]) @ v.transpose(0, 2, 1), a, rtol=0, atol=tol * scale)
    np.testing.assert_allclose(v.transpose(0, 2, 1) @ v, np.broadcast_to(np.eye(n), (b, n, n)), rtol=0, atol=tol)
    np.testing.assert_allclose(w, np.linalg.eigvalsh(a.astype(np.float64)), rtol=0, atol=tol * scale)


@pytest.fixture
def jacobi_everywhere():
    """eigh and svd on their Jacobi kernels at every size (as the Metal kernels), the
    compiled-kernel cache cleared before and after (its key has no algorithm)."""
    from kiln.codegen.cpu import linalg_bidiag, linalg_tridiag

    saved = linalg_tridiag.QL_FROM, linalg_bidiag.GKR_FROM
    N._compiled.cache_clear()
    linalg_tridiag.QL_FROM = linalg_bidiag.GKR_FROM = 65
    yield
    linalg_tridiag.QL_FROM, linalg_bidiag.GKR_FROM = saved
    N._compiled.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_jacobi_kernels_at_32(dtype, jacobi_everywhere):
    """The Jacobi kernels at 32 x 32, where eigh replays the vectors' rotations in
    several column blocks and svd pairs its columns block by block."""
    b, n = _batch(dtype), 32
    tol = _tol(dtype, n)
    for kind, a in _symmetric_kinds(b, n, dtype).items():
        w, v = N.eigh(a)
        scale = np.abs(a).max()
        np.testing.assert_allclose((v * w[:, None, :]) @ v.transpose(0, 2, 1), a, rtol=0, atol=tol * scale,
                                   err_msg=kind)
        np.testing.assert_allclose(v.transpose(0, 2, 1) @ v, np.broadcast_to(np.eye(n), (b, n, n)), rtol=0,
                                   atol=tol, err_msg=kind)
    for kind, a in _kinds(b, n, n, dtype).items():
        u, s, vh = N.svd(a)
        np.testing.assert_allclose((u * s[:, None, :]) @ vh, a, rtol=0, atol=tol * np.abs(a).max(), err_msg=kind)
        np.testing.assert_allclose(u.transpose(0, 2, 1) @ u, np.broadcast_to(np.eye(n), (b, n, n)), rtol=0,
                                   atol=tol, err_msg=kind)
        assert np.all(np.diff(s, axis=-1) <= 0), kind


def test_extreme_scales_are_rescaled():
    """Entries whose squares overflow (or underflow) float64 still decompose."""
    base = RNG.standard_normal((10, 8, 8))
    for factor in (1e250, 1e-250):
        a = base * factor
        q, r = N.qr(a)
        np.testing.assert_allclose(q @ r, a, rtol=0, atol=1e-13 * factor)
        u, s, vh = N.svd(a)
        np.testing.assert_allclose(s, np.linalg.svd(base, compute_uv=False) * factor, rtol=1e-12)
        spd = base @ base.transpose(0, 2, 1) + 8 * np.eye(8)
        w, v = N.eigh(np.stack([np.kron(np.eye(2), x) for x in spd]) * factor)  # 16 x 16: QL
        np.testing.assert_allclose(w, np.repeat(np.linalg.eigvalsh(spd), 2, axis=-1) * factor, rtol=1e-12)
        L, info = N.cholesky(spd * factor)
        assert not info.any()
        np.testing.assert_allclose(L, np.linalg.cholesky(spd) * np.sqrt(factor), rtol=1e-12)


def test_leading_batch_dims_and_noncontiguous_input():
    a = RNG.standard_normal((3, 5, 8, 8)).transpose(0, 1, 3, 2)
    q, r = N.qr(a)
    assert q.shape == (3, 5, 8, 8)
    np.testing.assert_allclose(q @ r, a, atol=1e-13)


def test_object_code_comes_back_from_the_disk_cache():
    """A fresh process (here: the in-process cache cleared) loads the kernels' object
    code from kiln's artifact cache instead of compiling, with the same results."""
    from kiln.codegen import artifact_cache

    a = RNG.standard_normal((11, 6, 6))
    first = N.qr(a)
    N._compiled.cache_clear()
    hits = artifact_cache.STATS["hits"]
    again = N.qr(a)
    assert artifact_cache.STATS["hits"] >= hits + 2  # the W-lane kernel and the tail kernel
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])


@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (1, 5)])
def test_degenerate_shapes(shape):
    """One row or one column: the round-robin schedule has only a dummy pair, QR one
    reflector (or none), a wide SVD goes through the transpose."""
    a = RNG.standard_normal((11,) + shape)
    q, r = N.qr(a)
    np.testing.assert_allclose(q @ r, a, atol=1e-14)
    u, s, vh = N.svd(a)
    np.testing.assert_allclose((u * s[:, None, :]) @ vh, a, atol=1e-14)
    np.testing.assert_allclose(s[:, 0], np.linalg.norm(a.reshape(11, -1), axis=1), rtol=1e-14)
    if shape == (1, 1):
        w, v = N.eigh(a)
        np.testing.assert_array_equal(w[:, 0], a[:, 0, 0])
        np.testing.assert_array_equal(v, np.ones_like(a))
        L, info = N.cholesky(a)
        np.testing.assert_array_equal(info, (a[:, 0, 0] <= 0).astype(np.int32))
        ok = info == 0
        np.testing.assert_allclose(L[ok, 0, 0], np.sqrt(a[ok, 0, 0]), rtol=1e-15)
