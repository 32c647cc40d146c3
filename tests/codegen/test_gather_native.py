"""The CPU's native `take` and `take_along` (kiln/codegen/cpu/gather_native.py) against
the ops' numpy references over dtypes (bytes copied: floats, integers, bools, complex),
axes, index shapes, negative indices and empty ones; an index out of range raises the
reference's K104 (the blocked check finds the first bad index, wherever it lies); compiled
embeddings and torch.gather take them and match torch, and a compiled embedding hands its
lookup to the caller reshaped, not copied."""

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


def test_the_check_finds_the_first_index_out_of_range():
    check = gather_native._entry("kiln_gather_check")[2]
    big = np.iinfo(np.int64)
    for n in (1, 5, gather_native.CHECK_BLOCK - 1, gather_native.CHECK_BLOCK, 3 * gather_native.CHECK_BLOCK + 7):
        idx = np.random.default_rng(n).integers(-10, 10, n)
        assert check(idx.ctypes.data, n, 10) == -1  # [-X, X) all in range
        for at in sorted({0, n // 2, n - 1}):
            for value in (10, -11, big.max, big.min):
                bad = idx.copy()
                bad[at] = value
                assert check(bad.ctypes.data, n, 10) == at, (n, at, value)
                if at + 1 < n:  # the first of two is the one reported
                    bad[-1] = -100
                    assert check(bad.ctypes.data, n, 10) == at


def test_split_gathers_match_on_two_threads(split_always, monkeypatch):
    monkeypatch.setattr(gather_native, "SPLIT_BYTES", 1)
    rng = np.random.default_rng(2)
    table = rng.standard_normal((500, 48)).astype(np.float32)
    tokens = rng.integers(-500, 500, (16, 20))
    np.testing.assert_array_equal(gather_native.take(table, tokens, 0), take.reference(table, tokens, axis=0))
    x = rng.standard_normal((40, 30, 3)).astype(np.float32)
    idx = rng.integers(0, 30, (40, 9, 3))
    np.testing.assert_array_equal(gather_native.take_along(x, idx, 1), take_along.reference(x, idx, axis=1))
    for p in (0, 39):  # a bad index in the first or the last thread's rows: the reference's K104
        bad = idx.copy()
        bad[p, 4, 1] = 30
        assert gather_native.take_along(x, bad, 1) is None
        with pytest.raises(KilnIndexError, match="K104"):
            gather_native.run_take_along([x, bad], {"axis": 1})


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


def test_a_compiled_embedding_returns_its_lookup_uncopied():
    rng = np.random.default_rng(4)
    table = rng.standard_normal((300, 64)).astype(np.float32)
    tokens, others = rng.integers(0, 300, (2, 8, 16))
    emb = kn.compile(lambda e, t: kn.nn.functional.embedding(t, e))
    for _ in range(3):  # the general path, then the prepared call
        first, second = emb(table, tokens).numpy(), emb(table, others).numpy()
        np.testing.assert_array_equal(first, table[tokens])  # not overwritten by the next call
        np.testing.assert_array_equal(second, table[others])
        # the take's own [128, 64] result, shown as [8, 16, 64]: no copy of it was made
        assert not first.flags.owndata and first.base.shape == (128, 64)
