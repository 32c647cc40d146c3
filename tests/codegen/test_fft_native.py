"""The CPU's fft through MKL's DFTI (kiln/codegen/cpu/fft_native.py) against the op's
reference (pocketfft in complex128) over every axis, both directions and the three
norms, and compiled transforms and their gradients against torch; rows cut into one unit
per thread (their own descriptors, run on kiln's threads) match too; small calls and other
dtypes run the reference."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import blas, fft_native
from kiln.ir import registry

REFERENCE = registry.get("fft").reference
needs_mkl = pytest.mark.skipif(not blas.available("mkl"), reason="needs MKL (pip install 'kiln[mkl]')")


def _c(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


@needs_mkl
@pytest.mark.parametrize("shape", [(8, 1024), (4096,), (3, 17, 128), (2, 1000, 5), (100, 8, 8)])
def test_matches_the_reference(monkeypatch, shape):
    monkeypatch.setattr(fft_native, "MIN_POINTS", 1)
    x = _c(shape, 0)
    for axis in range(len(shape)):
        for inverse in (False, True):
            for norm in ("backward", "ortho", "forward"):
                got = fft_native.fft(x, axis, inverse, norm)
                want = REFERENCE(x, axis=axis, inverse=inverse, norm=norm)
                assert got is not None and got.dtype == np.complex64 and got.shape == want.shape
                assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


@needs_mkl
@pytest.mark.parametrize("rows", [2, 6, 7, 64])
def test_rows_cut_over_threads_match_the_reference(monkeypatch, rows):
    from kiln.runtime.threads import get_num_threads, set_num_threads

    monkeypatch.setattr(fft_native, "MIN_POINTS", 1)
    monkeypatch.setattr(fft_native, "SPLIT_POINTS", 1)
    before = get_num_threads()
    set_num_threads(2)
    try:
        units = fft_native._units(rows, 256)
        assert units == (1 if rows % 2 else 2)  # an odd count: whole, on one thread
        x = _c((rows, 256), 3)
        for inverse in (False, True):
            got = fft_native.fft(x, -1, inverse, "ortho")
            want = REFERENCE(x, axis=1, inverse=inverse, norm="ortho")
            assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
        if units > 1:  # one committed descriptor per unit
            assert all((256, rows // 2, 1, slot) in fft_native._kept for slot in range(units))
    finally:
        set_num_threads(before)


@needs_mkl
def test_a_descriptor_freed_after_it_was_found_is_never_used(monkeypatch):
    """MAX_DESCRIPTORS evicts the oldest: a call that found a descriptor just before sees
    it gone once it holds its lock (the handle emptied), and the reference runs."""
    monkeypatch.setattr(fft_native, "MIN_POINTS", 1)
    x = _c((4, 64), 4)
    lib = fft_native._mkl()
    handle, lock = fft_native._descriptor(lib, 64, 4, 1)
    monkeypatch.setattr(fft_native, "MAX_DESCRIPTORS", 1)
    fft_native._descriptor(lib, 32, 1, 1, slot=99)  # evicts the (64, 4) descriptor: freed
    assert handle.value is None and (64, 4, 1, 0) not in fft_native._kept
    monkeypatch.setattr(fft_native, "_descriptor", lambda *a, **k: (handle, lock))  # found before
    assert fft_native.fft(x, -1, False, "backward") is None
    (got,) = fft_native.run_fft([x], {"axis": 1, "inverse": False, "norm": "backward"})
    want = REFERENCE(x, axis=1, inverse=False, norm="backward")
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_small_calls_and_other_dtypes_run_the_reference(monkeypatch):
    x = _c((4, 8), 1)
    assert fft_native.fft(x, 1, False, "backward") is None  # below MIN_POINTS
    monkeypatch.setattr(fft_native, "MIN_POINTS", 1)
    assert fft_native.fft(x.astype(np.complex128), 1, False, "backward") is None
    (got,) = fft_native.run_fft([x.astype(np.complex128)], {"axis": 1, "inverse": False, "norm": "backward"})
    np.testing.assert_allclose(got, np.fft.fft(x.astype(np.complex128), axis=1), rtol=1e-6, atol=1e-6)


@needs_mkl
def test_compiled_fft_and_its_gradient_match_torch(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(fft_native, "MIN_POINTS", 1)
    z = _c((6, 64), 2)
    f = kn.compile(lambda a: kn.fft.fft(a, norm="ortho"))
    g = kn.compile(kn.grad(lambda a: kn.abs(kn.fft.ifft(a, dim=0)).sum()))
    tz = torch.from_numpy(z).requires_grad_()
    torch.abs(torch.fft.ifft(tz, dim=0)).sum().backward()
    for _ in range(3):
        want = torch.fft.fft(torch.from_numpy(z), norm="ortho").numpy()
        assert np.abs(f(z).numpy() - want).max() <= 1e-5 * np.abs(want).max()
        assert np.abs(g(z).numpy() - tz.grad.numpy()).max() <= 1e-4 * np.abs(tz.grad.numpy()).max()
