"""The CPU's native cumsum (kiln/codegen/cpu/scan_native.py): bit for bit the op's
reference (np.cumsum's additions in order) over float32 and float64, every axis, both
directions, -0.0 first entries, NaN and inf, one and two threads; compiled cumsums and
their gradients (a reversed cumsum) take it and match torch."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import scan_native
from kiln.ir import registry

REFERENCE = registry.get("cumsum").reference


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lines_side_by_side_are_bit_for_bit_the_reference(split_always, monkeypatch, dtype):
    """Contiguous lines run LANES at a time (then the rest one by one): every count of
    lines around the group size, both directions, split and not."""
    monkeypatch.setattr(scan_native, "SPLIT_ELEMS", 1)
    rng = np.random.default_rng(3)
    for lines in (1, 7, 8, 9, 16, 17, 33):
        x = (rng.standard_normal((lines, 29)) * 100).astype(dtype)
        for reverse in (False, True):
            got = scan_native.cumsum(x, 1, reverse)
            want = REFERENCE(x, axis=1, reverse=reverse)
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bit_for_bit_the_reference(split_always, monkeypatch, dtype):
    monkeypatch.setattr(scan_native, "SPLIT_ELEMS", 1)
    rng = np.random.default_rng(0)
    for trial in range(60):
        shape = tuple(int(v) for v in rng.integers(1, 7, size=int(rng.integers(1, 4))))
        x = rng.standard_normal(shape).astype(dtype) * 10 ** float(rng.integers(-3, 4))
        x.flat[0] = -0.0 if trial % 3 == 0 else x.flat[0]
        if trial % 4 == 1:
            x.flat[-1] = np.nan
        if trial % 5 == 2:
            x.flat[len(x.flat) // 2] = np.inf
        for axis in range(x.ndim):
            for reverse in (False, True):
                got = scan_native.cumsum(x, axis, reverse)
                want = REFERENCE(x, axis=axis, reverse=reverse)
                assert got.dtype == want.dtype and got.shape == want.shape
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_other_dtypes_run_the_reference():
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert scan_native.cumsum(x, 1) is None
    (got,) = scan_native.run_cumsum([x], {"axis": 1, "reverse": False})
    np.testing.assert_array_equal(got, REFERENCE(x, axis=1, reverse=False))


def test_compiled_cumsum_and_its_gradient_match_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32)
    f = kn.compile(lambda a: kn.cumsum(a, dim=1))
    g = kn.compile(kn.grad(lambda a: (kn.cumsum(a, dim=0) ** 2).sum()))
    tx = torch.from_numpy(x).requires_grad_()
    (torch.cumsum(tx, 0) ** 2).sum().backward()
    for _ in range(3):
        np.testing.assert_allclose(f(x).numpy(), torch.cumsum(torch.from_numpy(x), 1).numpy(), rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_allclose(g(x).numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-5)
