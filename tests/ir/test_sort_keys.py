"""`sort`'s reference orders (kiln/ir/ops/reduction.py): the packed-key stable argsort
and the reversed-ascending descending order give exactly numpy's stable orders (argsort
kind="stable"; lexsort of the negated keys with NaN first) over float32 with ties, NaN
of both signs, +-0.0 and +-inf, over integers of every width (the wide ones take
numpy's own path), bools and float64, along every axis."""

import numpy as np
import pytest

from kiln.ir.ops import reduction

SPECIAL = np.array([np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 1e-45, -1e-45], np.float32)


def _arrays(rng):
    yield rng.integers(-3, 3, size=(5, 7)).astype(np.float32)  # ties
    yield rng.choice(SPECIAL, size=(4, 6, 3))
    yield rng.standard_normal((3, 9)).astype(np.float32)
    x = rng.standard_normal((6, 5))
    x[x > 1] = np.nan
    yield x  # float64: numpy's path
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32):
        info = np.iinfo(dtype)
        yield rng.integers(info.min, info.max, size=(4, 8), endpoint=True, dtype=np.int64 if dtype != np.uint32
                           else np.uint64).astype(dtype)
    yield rng.integers(0, 2, size=(5, 5)).astype(bool)


@pytest.mark.parametrize("descending", [False, True])
def test_orders_are_numpys_stable_orders(descending):
    rng = np.random.default_rng(0)
    for x in _arrays(rng):
        for axis in range(-x.ndim, x.ndim):
            values, idx = reduction.sort.reference(x, axis=axis, descending=descending, limit=None)
            if descending:
                key = -x.astype(np.float64) if x.dtype.kind != "f" else -x
                want = np.lexsort((key, ~np.isnan(key)), axis=axis % x.ndim)
            else:
                want = np.argsort(x, axis=axis, kind="stable")
            np.testing.assert_array_equal(idx, want, err_msg=f"{x.dtype} axis {axis}")
            np.testing.assert_array_equal(values, np.take_along_axis(x, want, axis=axis))
            assert idx.dtype == np.int64


@pytest.mark.parametrize("descending", [False, True])
def test_a_limit_is_the_first_entries_of_the_full_order(descending):
    """topk's `limit`: a partition of the keys, then a sort of the `limit` kept, gives
    exactly the full stable order's first entries, for every limit from 0 to the size."""
    rng = np.random.default_rng(1)
    for x in _arrays(rng):
        for axis in range(x.ndim):
            full_v, full_i = reduction.sort.reference(x, axis=axis, descending=descending, limit=None)
            for k in range(x.shape[axis] + 1):
                v, i = reduction.sort.reference(x, axis=axis, descending=descending, limit=k)
                np.testing.assert_array_equal(i, np.take(full_i, np.arange(k), axis=axis))
                np.testing.assert_array_equal(v, np.take(full_v, np.arange(k), axis=axis))


def test_a_limit_outside_the_dim_is_a_numbered_error():
    import kiln as kn
    from kiln.errors import KilnArgumentError

    with pytest.raises(KilnArgumentError, match="sort: limit must be an int in"):
        kn.trace(lambda x: kn.frontend.dispatch.apply("sort", x, axis=0, descending=False, limit=5),
                 kn.ones(3))
