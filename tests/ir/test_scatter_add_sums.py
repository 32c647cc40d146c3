"""scatter_along's reference sums float updates with np.bincount (kiln/ir/ops/indices.py
scatter_add_sums); checked against torch.scatter_add in float64 and np.add.at, with
repeated targets, every axis, updates larger than the indices, and the dtypes that keep
np.add.at (integers exact, complex)."""

import numpy as np
import pytest

from kiln.ir.ops.indices import scatter_add_sums
from kiln.ir.ops.shape import scatter_along

torch = pytest.importorskip("torch")
ref = scatter_along.reference


def oracle(x, indices, updates, axis):
    """torch.scatter_add in float64, rounded once to x's dtype."""
    src = updates[tuple(slice(0, n) for n in indices.shape)]
    out = torch.from_numpy(x.astype(np.float64)).scatter_add(
        axis, torch.from_numpy(indices.astype(np.int64)), torch.from_numpy(src.astype(np.float64)))
    return out.numpy().astype(x.dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_float_scatter_add_matches_torch(dtype, axis):
    rng = np.random.default_rng(axis)
    shape = (5, 6, 7)
    x = rng.standard_normal(shape).astype(dtype)
    ishape = list(shape)
    ishape[axis] = 11  # more updates than positions: every target repeats
    indices = rng.integers(-shape[axis], shape[axis], ishape)
    updates = rng.standard_normal([n + 1 for n in ishape]).astype(dtype)  # larger than indices
    got = ref(x, indices, updates, axis=axis, mode="add")
    want = oracle(x, np.where(indices < 0, indices + shape[axis], indices), updates, axis)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                               rtol={np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-14}[dtype],
                               atol={np.float16: 4e-3, np.float32: 1e-6, np.float64: 1e-14}[dtype])


def test_embedding_gradient_shape():
    """The take vjp's shape: rows of a table, indices broadcast along the row."""
    rng = np.random.default_rng(0)
    table = np.zeros((65, 64), np.float32)
    rows = np.broadcast_to(rng.integers(0, 65, (512, 1)), (512, 64))
    grads = rng.standard_normal((512, 64)).astype(np.float32)
    want = np.zeros((65, 64), np.float64)
    np.add.at(want, rows[:, 0], grads.astype(np.float64))
    np.testing.assert_allclose(ref(table, rows, grads, axis=0, mode="add"), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.complex64])
def test_integer_and_complex_keep_add_at(dtype):
    rng = np.random.default_rng(1)
    x = (rng.integers(-5, 5, (4, 3)) * (1 + 1j if dtype == np.complex64 else 1)).astype(dtype)
    indices = rng.integers(0, 4, (9, 3))
    updates = (rng.integers(-5, 5, (9, 3)) * (1 - 2j if dtype == np.complex64 else 1)).astype(dtype)
    where = (indices, np.arange(3)[None, :])
    assert scatter_add_sums(x.copy(), where, updates) is None
    want = x.copy()
    np.add.at(want, where, updates)
    got = ref(x, indices, updates, axis=0, mode="add")
    assert got.dtype == x.dtype and np.array_equal(got, want)


def test_large_target_keeps_add_at():
    """A few updates into a large tensor: no float64 sum per position of the target."""
    x = np.zeros((1000, 100), np.float32)
    indices, updates = np.array([[3, 3, 999]]), np.ones((1, 3), np.float32)
    assert scatter_add_sums(x.copy(), (indices, np.arange(3)[None, :]), updates) is None
    got = ref(x, indices, updates, axis=0, mode="add")
    assert got[3, 0] == 1 and got[3, 1] == 1 and got[999, 2] == 1 and got.sum() == 3
