"""Routing of kn.linalg.cholesky/qr/eigh/svd: the documented rule (kn.linalg.path), the
same results on the CPU-kernel path eager and compiled as numpy's, and Metal's path
ending in the "needs a Mac" error on this machine."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import linalg_route
from kiln.codegen.metal import linalg_run
from kiln.codegen.metal.errors import KilnMetalArgumentError, KilnMetalUnavailableError

RNG = np.random.default_rng(150)


def test_rule():
    f32 = np.float32
    assert linalg_route.path("eigh", (4096, 8, 8), f32) == "native"
    assert linalg_route.path("eigh", (8, 8), f32) == "lapack"              # one matrix
    assert linalg_route.path("eigh", (linalg_route.MIN_BATCH - 1, 8, 8), f32) == "lapack"
    assert linalg_route.path("eigh", (4096, 32, 32), np.float64) == "native"  # tridiagonal QL there
    assert linalg_route.path("eigh", (4096, 32, 32), f32) == "native"
    assert linalg_route.path("qr", (64, 64, 64), np.float64) == "native"
    assert linalg_route.path("qr", (64, 65, 65), np.float64) == "lapack"   # n > 64
    assert linalg_route.path("qr", (64, 8, 8), np.complex64) == "lapack"
    assert linalg_route.path("svd", (4096, 64, 64), f32) == "native"       # bidiagonal QR there
    assert linalg_route.path("svd", (4096, 64, 65), f32) == "lapack"       # n > 64
    assert linalg_route.path("svd", (64, 8, 8), f32, "metal:1") == "metal"
    x = kn.tensor(RNG.standard_normal((64, 8, 8)).astype(f32))
    assert kn.linalg.path("qr", x) == "native" and kn.linalg.path("qr", x[:2]) == "lapack"
    with pytest.raises(kn.KilnArgumentError, match="cholesky, qr, eigh, svd.*'lu'"):
        kn.linalg.path("lu", x)


def _spd(b, n, dtype):
    x = RNG.standard_normal((b, n, n))
    return (x @ x.transpose(0, 2, 1) + n * np.eye(n)).astype(dtype)


@pytest.mark.parametrize("compiled", [False, True])
def test_native_path_matches_numpy(compiled):
    a = RNG.standard_normal((40, 8, 8)).astype(np.float32)
    s = _spd(40, 8, np.float32)
    s[7] = -s[7]  # not positive definite: a NaN slot, as the LAPACK path gives

    def fn(a, s):
        q, r = kn.linalg.qr(a)
        w, v = kn.linalg.eigh(s[8:])
        u, sv, vh = kn.linalg.svd(a)
        return kn.linalg.cholesky(s), q @ r, (v * w[:, None, :]) @ v.mT, (u * sv[:, None, :]) @ vh

    for op, shape in (("qr", a.shape), ("eigh", (32, 8, 8)), ("svd", a.shape), ("cholesky", s.shape)):
        assert linalg_route.path(op, shape, np.float32) == "native", op
    run = kn.compile(fn) if compiled else fn
    L, qr, eig, usv = (t.numpy() for t in run(kn.tensor(a), kn.tensor(s)))
    assert np.isnan(L[7]).all() and not np.isnan(np.delete(L, 7, 0)).any()
    np.testing.assert_allclose(np.delete(L, 7, 0), np.linalg.cholesky(np.delete(s, 7, 0)), atol=1e-5)
    np.testing.assert_allclose(qr, a, atol=1e-5)
    np.testing.assert_allclose(eig, s[8:], atol=1e-4)
    np.testing.assert_allclose(usv, a, atol=1e-5)


def test_cholesky_ex_info_on_both_paths():
    for n in (8, 66):  # the CPU kernels, then LAPACK with the minors bisected
        s = _spd(3, n, np.float64)
        s[1, 4, 4] = -1e4
        L, info = kn.linalg.cholesky_ex(kn.tensor(s))
        assert info.numpy().tolist() == [0, 5, 0], n
        np.testing.assert_allclose(L.numpy()[0], np.linalg.cholesky(s[0]), atol=1e-10)


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the error raised off macOS")
def test_metal_path_needs_a_mac():
    a = RNG.standard_normal((4, 8, 8)).astype(np.float32)
    for op in linalg_route.OPS:
        with pytest.raises(KilnMetalUnavailableError, match="macOS"):
            linalg_run.run(op, a)
    with pytest.raises(KilnMetalArgumentError, match="float32"):
        linalg_run.run("qr", a.astype(np.float64))


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the error raised off macOS")
def test_a_tensor_on_metal_takes_the_metal_kernels():
    """kn.linalg on a tensor whose device is metal:0 goes to the Metal kernels (no such
    tensor can exist off macOS, so one claims it), which end in K410 here."""
    class Metal0:
        def __str__(self):
            return "metal:0"

    t = kn.tensor(RNG.standard_normal((4, 8, 8)).astype(np.float32))
    t._device = Metal0()
    assert kn.linalg.path("svd", t) == "metal"
    for fn in (kn.linalg.cholesky, kn.linalg.qr, kn.linalg.eigh, kn.linalg.svd):
        with pytest.raises(KilnMetalUnavailableError, match="macOS"):
            fn(t)
