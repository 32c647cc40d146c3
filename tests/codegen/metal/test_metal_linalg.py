"""The batched small-matrix decompositions as MSL kernels (kiln/codegen/metal/linalg.py),
run under the threadgroup simulator: checked by reconstruction and orthogonality (not
raw vectors) on random, ill-conditioned, rank-deficient and repeated-eigenvalue batches,
plus Cholesky's info on a non-positive-definite input and the documented sign
convention."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.metal import linalg
from kiln.errors import KilnError
from tests.codegen.metal.conftest import needs_clang
from tests.codegen.metal.simulator import check_msl, simulate_emitted

RNG = np.random.default_rng(1515)


def _orthonormal(b, n):
    q, _ = np.linalg.qr(RNG.standard_normal((b, n, n)))
    return q


def _batch(kind: str, b: int, m: int, n: int) -> np.ndarray:
    """b matrices m x n of a kind: random, ill-conditioned (singular values 1 .. 1e-6),
    rank-deficient (rank n // 2)."""
    if kind == "random":
        return RNG.standard_normal((b, m, n)).astype(np.float32)
    u = np.linalg.qr(RNG.standard_normal((b, m, n)))[0]
    v = _orthonormal(b, n)
    s = np.logspace(0, -6, n) if kind == "ill" else np.r_[RNG.uniform(1, 2, n // 2), np.zeros(n - n // 2)]
    return ((u * s[None, None, :]) @ v.transpose(0, 2, 1)).astype(np.float32)


def _sym(kind: str, b: int, n: int) -> np.ndarray:
    """Symmetric batches: random, ill-conditioned, and with repeated eigenvalues."""
    if kind == "random":
        x = RNG.standard_normal((b, n, n))
        return ((x + x.transpose(0, 2, 1)) / 2).astype(np.float32)
    q = _orthonormal(b, n)
    w = np.logspace(0, -6, n) if kind == "ill" else np.repeat([-1.0, 2.0, 3.0, 3.0], n // 4 + 1)[:n]
    return ((q * w[None, None, :]) @ q.transpose(0, 2, 1)).astype(np.float32)


def _run(tmp_path, kernel, inputs, outputs):
    arrays = [np.ascontiguousarray(a) for a in inputs] + [np.zeros(s, d) for s, d in outputs]
    check_msl(kernel.source)
    _, arrays = simulate_emitted(kernel, arrays, {"batch": len(inputs[0])}, str(tmp_path))
    return arrays[len(inputs):]


def _eye_err(q):
    n = q.shape[-1]
    return np.abs(q.transpose(0, 2, 1) @ q - np.eye(n)).max()


@needs_clang
@pytest.mark.parametrize("n", [8])
def test_cholesky_reconstructs_and_reports_info_like_torch(tmp_path, n):
    x = RNG.standard_normal((6, n, n))
    a = (x @ x.transpose(0, 2, 1) + n * np.eye(n)).astype(np.float32)
    a[2, 3, 3] = -50.0  # leading minor of order 4 is not positive definite
    a[4] = np.diag(np.r_[np.ones(n - 1), 0.0])  # singular: the last minor fails
    l, info = _run(tmp_path, linalg.cholesky(n), [a], [((6, n, n), np.float32), ((6,), np.int32)])
    assert info.tolist() == [0, 0, 4, 0, n, 0]
    assert np.isfinite(l).all()  # no NaNs on the failed ones
    ok = [0, 1, 3, 5]
    np.testing.assert_allclose(l[ok] @ l[ok].transpose(0, 2, 1), a[ok], atol=2e-4 * n)
    assert np.all(np.triu(l[ok], 1) == 0)


@needs_clang
@pytest.mark.parametrize("kind", ["random", "ill", "rank"])
def test_householder_qr(tmp_path, kind):
    m, n = 12, 8
    a = _batch(kind, 5, m, n)
    q, r = _run(tmp_path, linalg.qr(m, n), [a], [((5, m, n), np.float32), ((5, n, n), np.float32)])
    assert np.abs(q @ r - a).max() < 1e-5 * max(1, np.abs(a).max()) * 10
    assert _eye_err(q) < 1e-5
    assert np.all(np.tril(r, -1) == 0)


@needs_clang
@pytest.mark.parametrize("kind", ["random", "ill", "rank"])
def test_jacobi_svd(tmp_path, kind):
    m, n = 10, 8
    a = _batch(kind, 5, m, n)
    u, s, v = _run(tmp_path, linalg.svd(m, n),
                   [a], [((5, m, n), np.float32), ((5, n), np.float32), ((5, n, n), np.float32)])
    assert np.abs((u * s[:, None, :]) @ v.transpose(0, 2, 1) - a).max() < 2e-5 * max(1, np.abs(a).max()) * 10
    assert _eye_err(v) < 1e-5
    np.testing.assert_allclose(s, np.linalg.svd(a.astype(np.float64), compute_uv=False), atol=2e-5)
    assert np.all(np.diff(s, axis=1) <= 0)  # descending
    nonzero = s > 1e-3  # U's columns are orthonormal where the singular value is not 0
    for i in range(5):
        ui = u[i][:, nonzero[i]]
        assert np.abs(ui.T @ ui - np.eye(ui.shape[1])).max() < 1e-4
    idx = np.abs(v).argmax(axis=1)  # the documented sign convention
    assert np.all(np.take_along_axis(v, idx[:, None, :], 1) > 0)


@needs_clang
@pytest.mark.parametrize("kind,n", [("random", 8), ("ill", 8), ("repeated", 8), ("random", 7)])
def test_jacobi_eigh(tmp_path, kind, n):
    a = _sym(kind, 5, n)
    w, v = _run(tmp_path, linalg.eigh(n), [a], [((5, n), np.float32), ((5, n, n), np.float32)])
    assert np.abs(v @ (w[:, :, None] * v.transpose(0, 2, 1)) - a).max() < 2e-5 * max(1, np.abs(a).max()) * n
    assert _eye_err(v) < 1e-5
    np.testing.assert_allclose(w, np.linalg.eigvalsh(a.astype(np.float64)), atol=2e-5 * n)
    assert np.all(np.diff(w, axis=1) >= 0)  # ascending
    idx = np.abs(v).argmax(axis=1)
    assert np.all(np.take_along_axis(v, idx[:, None, :], 1) > 0)


def test_shapes_a_kernel_cannot_take_are_k412():
    with pytest.raises(KilnError, match="K412"):
        linalg.qr(4, 8)  # wide
    with pytest.raises(KilnError, match="K412"):
        linalg.eigh(80)  # 2 x 80 x 80 floats: more than 32 KiB of threadgroup memory
