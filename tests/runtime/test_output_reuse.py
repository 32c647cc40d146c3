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


def _dispatch(i, x):
    return kn.switch(i, [lambda v: v * 2.0 + 1.0, lambda v: kn.exp(-v * v), lambda v: -v], x)


def test_a_branch_output_is_handed_out_without_a_copy_and_reused_once_dropped():
    f = kn.compile(_dispatch)
    x = kn.randn(1 << 12, seed=1)
    want = [x.numpy() * 2 + 1, np.exp(-x.numpy() ** 2), -x.numpy()]
    kept = [f(np.array(k % 3, np.int32), x) for k in range(6)]  # held: never overwritten
    for k, t in enumerate(kept):
        np.testing.assert_allclose(t.numpy(), want[k % 3], rtol=1e-6)
    assert len({id(t.numpy()) for t in kept}) == 6
    del kept
    gc.collect()
    allocator = f.compiled_graphs()[0].executable.allocator
    before = allocator.allocations
    for k in range(6):  # dropped results: each branch writes into its own last output
        result = f(np.array(k % 3, np.int32), x)
        np.testing.assert_allclose(result.numpy(), want[k % 3], rtol=1e-6)
        del result
    assert allocator.allocations == before


def test_one_fresh_branch_value_returned_twice_is_two_arrays():
    f = kn.compile(lambda p, x: kn.cond(p, lambda v: (v * 3, v * 3), lambda v: (v, -v), x))
    a, b = f(np.array(True), kn.ones(8))
    assert not np.shares_memory(a.numpy(), b.numpy())
    a.numpy()[:] = 0
    np.testing.assert_array_equal(b.numpy(), np.full(8, 3, np.float32))


def test_a_long_loop_holds_a_bounded_number_of_buffers():
    def f(x, n):  # the trip count is an input: the loop stays a loop
        return kn.while_loop(lambda i, y: i < n, lambda i, y: (i + 1, y * 0.5 + 1.0),
                             (kn.tensor(0, dtype=kn.int32), x))[1]

    g = kn.compile(f)
    x = kn.ones(1 << 16)  # 256 KiB a buffer
    g(x, np.array(2, np.int32))
    gc.collect()
    kn.memory.reset_peak_memory_stats("cpu")
    base = kn.memory.memory_allocated("cpu")
    out = g(x, np.array(300, np.int32))
    np.testing.assert_allclose(out.numpy(), np.full(1 << 16, 2.0, np.float32), rtol=1e-6)
    assert kn.memory.max_memory_allocated("cpu") - base < 16 * (1 << 18)
