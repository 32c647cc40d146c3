"""A compiled function may write a new result into an output array it handed out
before, but only once the caller has dropped every reference to it."""

import gc

import numpy as np

import kiln as kn


def test_kept_results_are_never_overwritten():
    f = kn.compile(lambda x: x * 2 + 1)
    kept = [f(kn.full((64,), float(i))) for i in range(5)]
    view = f(kn.full((64,), 100.0)).numpy()[::2]  # a view keeps its base alive
    for i, t in enumerate(kept):
        np.testing.assert_array_equal(t.numpy(), np.full(64, 2.0 * i + 1, np.float32))
    np.testing.assert_array_equal(view, np.full(32, 201.0, np.float32))
    for _ in range(3):
        f(kn.full((64,), -1.0))
    np.testing.assert_array_equal(view, np.full(32, 201.0, np.float32))
    assert len({id(t.numpy()) for t in kept}) == 5


def test_dropped_results_are_reused_without_allocating():
    f = kn.compile(lambda x: kn.exp(x) - 1)
    x = kn.randn(1 << 16, seed=0)
    f(x)
    gc.collect()
    allocator = f.compiled_graphs()[0].executable.allocator
    before = allocator.allocations
    for _ in range(5):
        result = f(x)
        np.testing.assert_allclose(result.numpy(), np.expm1(x.numpy()), rtol=1e-5, atol=1e-6)
        del result
    assert allocator.allocations == before
