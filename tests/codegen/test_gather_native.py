"""The CPU's native `take` and `take_along` (kiln/codegen/cpu/gather_native.py) against
the ops' numpy references over dtypes (bytes copied: floats, integers, bools, complex),
axes, index shapes, negative indices and empty ones; an index out of range raises the
reference's K104; compiled embeddings and torch.gather take them and match torch."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import gather_native
from kiln.errors import KilnIndexError
from kiln.ir.ops.shape import take, take_along

DTYPES = [np.float32, np.float64, np.int8, np.int16, np.int64, bool, np.complex64, np.complex128]


def _cases(dtype, seed):
    """(x, axis) pairs: random shapes of rank 1-3, values of `dtype`."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        shape = tuple(int(v) for v in rng.integers(1, 6, size=int(rng.integers(1, 4))))
        yield rng, (rng.standard_normal(shape) * 5).astype(dtype), int(rng.integers(0, len(shape)))


@pytest.fixture(autouse=True)
def every_take_native(monkeypatch):
    """Small takes run the reference (SMALL_TAKE): these tests' are taken natively."""
    monkeypatch.setattr(gather_native, "SMALL_TAKE", 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_take_matches_the_reference(dtype):
    for rng, x, a in _cases(dtype, 0):
        shape = x.shape
        idx_shape = tuple(int(v) for v in rng.integers(0, 4, size=int(rng.integers(0, 3))))
        idx = rng.integers(-shape[a], shape[a], size=idx_shape)
        got = gather_native.take(x, idx, a)
        want = take.reference(x, idx, axis=a)
        assert got is not None and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_take_along_matches_the_reference(dtype):
    for trial, (rng, x, a) in enumerate(_cases(dtype, 1)):
        shape = x.shape
        idx_shape = list(shape)
        idx_shape[a] = int(rng.integers(0, 7))
        idx = rng.integers(-shape[a], shape[a], size=tuple(idx_shape)).astype(np.int32 if trial % 2 else np.int64)
        got = gather_native.take_along(x, idx, a)
        want = take_along.reference(x, idx, axis=a)
        if np.dtype(dtype).itemsize == 16:
            assert got is None  # 16-byte elements: the reference
            continue
        assert got is not None and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    x = np.arange(12.0).reshape(3, 4)
    assert gather_native.take_along(x, np.zeros((2, 4), np.int64), 1) is None  # smaller dims: the reference


def test_an_index_out_of_range_is_the_references_error():
    x = np.arange(12.0).reshape(3, 4)
    for run, attrs, idx in [(gather_native.run_take, {"axis": 0}, np.array([0, 3])),
                            (gather_native.run_take_along, {"axis": 1}, np.array([[0], [-5], [1]]))]:
        with pytest.raises(KilnIndexError, match="K104"):
            run([x, idx], attrs)


def test_split_gathers_match_on_two_threads(split_always, monkeypatch):
    monkeypatch.setattr(gather_native, "SPLIT_BYTES", 1)
    rng = np.random.default_rng(2)
    table = rng.standard_normal((500, 48)).astype(np.float32)
    tokens = rng.integers(-500, 500, (16, 20))
    np.testing.assert_array_equal(gather_native.take(table, tokens, 0), take.reference(table, tokens, axis=0))
    x = rng.standard_normal((40, 30, 3)).astype(np.float32)
    idx = rng.integers(0, 30, (40, 9, 3))
    np.testing.assert_array_equal(gather_native.take_along(x, idx, 1), take_along.reference(x, idx, axis=1))


def test_compiled_embedding_and_gather_match_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    table = rng.standard_normal((100, 16)).astype(np.float32)
    tokens = rng.integers(0, 100, (4, 7))
    x = rng.standard_normal((8, 12)).astype(np.float32)
    idx = rng.integers(0, 12, (8, 5))
    emb = kn.compile(lambda e, t: kn.nn.functional.embedding(t, e))
    gat = kn.compile(lambda a, i: kn.gather(a, 1, i))
    for _ in range(3):  # the general path, then the prepared call
        np.testing.assert_array_equal(emb(table, tokens).numpy(),
                                      torch.nn.functional.embedding(torch.from_numpy(tokens),
                                                                    torch.from_numpy(table)).numpy())
        np.testing.assert_array_equal(gat(x, idx).numpy(),
                                      torch.gather(torch.from_numpy(x), 1, torch.from_numpy(idx)).numpy())
