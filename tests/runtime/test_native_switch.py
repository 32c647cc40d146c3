"""Compiled cond/switch steps dispatched natively (kiln/runtime/native_switch.py): the
eager results for every index (clamped as jax.lax.switch), outputs the caller owns,
reuse of dropped outputs without allocating, the Python way for branches native code
cannot run and for concurrent calls."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import kiln as kn
from kiln.runtime import native_loops
from tests.runtime.test_native_loops import count_python_runs


def four_way(i, x):
    return kn.switch(i, [lambda v: v * 2.0 + 1.0, lambda v: kn.exp(-v * v),
                         lambda v: kn.sqrt(kn.abs(v)), lambda v: kn.tanh(v) * 3.0], x)


def reference(k: int, x: np.ndarray) -> np.ndarray:
    k = min(max(k, 0), 3)
    return [x * 2 + 1, np.exp(-x * x), np.sqrt(np.abs(x)), np.tanh(x) * 3][k]


@pytest.fixture
def python_conds(monkeypatch):
    """How many times the executor ran a cond step the Python way."""
    return count_python_runs(monkeypatch, "cond", "conds")


def test_every_index_clamped_gives_the_eager_result(python_conds):
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    f = kn.compile(four_way)
    for k in (0, 1, 2, 3, -4, 9, 3, 2, 1, 0, 2**31 - 1):
        got = f(np.array(k, np.int32), x).numpy()
        eager = four_way(kn.tensor(k, dtype=kn.int32), kn.tensor(x)).numpy()
        np.testing.assert_allclose(got, eager, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(got, reference(k, x), rtol=1e-5, atol=1e-6)
    # the first call of a size binding runs the Python way; the capture is built on the second
    assert python_conds["conds"] == native_loops._BUILD_AFTER - 1


def test_held_results_are_never_overwritten_and_dropped_ones_are_reused():
    x = np.linspace(-3, 3, 1 << 14).astype(np.float32)
    f = kn.compile(four_way)
    kept = [f(np.array(k % 4, np.int32), x) for k in range(8)]
    for k, t in enumerate(kept):
        np.testing.assert_allclose(t.numpy(), reference(k % 4, x), rtol=1e-5, atol=1e-6)
    assert len({t.numpy().ctypes.data for t in kept}) == 8
    kept[5].numpy()[:] = 0  # the caller's own: nothing else changes
    np.testing.assert_allclose(kept[6].numpy(), reference(2, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f(np.array(1, np.int32), x).numpy(), reference(1, x), rtol=1e-5)
    del kept
    gc.collect()
    allocator = f.compiled_graphs()[0].executable.allocator
    before = allocator.allocations
    for k in range(8):  # every branch writes the one output the caller dropped
        result = f(np.array(k % 4, np.int32), x)
        np.testing.assert_allclose(result.numpy(), reference(k % 4, x), rtol=1e-5, atol=1e-6)
        del result
    assert allocator.allocations == before


def test_pass_through_constant_and_repeated_outputs_are_copies(python_conds):
    def f(p, x):
        return kn.cond(p, lambda v: (v, v * 3, v * 3, kn.ones_like(v)),
                       lambda v: (-v, v, v, v + 0.0), x)

    g = kn.compile(f)
    x = np.arange(16, dtype=np.float32)
    for p in (True, False, True, False, True):
        outs = [t.numpy() for t in g(np.array(p), x)]
        want = [t.numpy() for t in f(kn.tensor(p), kn.tensor(x))]
        for o, w in zip(outs, want):
            np.testing.assert_array_equal(o, w)
        for o in outs:  # no output is the input, and no two outputs share memory
            assert not np.shares_memory(o, x)
        assert not any(np.shares_memory(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])
        outs[0][:] = -7
        np.testing.assert_array_equal(x, np.arange(16, dtype=np.float32))
    assert python_conds["conds"] == native_loops._BUILD_AFTER - 1


def test_two_operands_and_several_kernels_per_branch():
    def f(i, x, y):
        return kn.switch(i, [lambda a, b: (kn.softmax(a * b, dim=-1), (a - b).sum(dim=0)),
                             lambda a, b: (kn.exp(a) / (1 + kn.exp(b)), kn.max(a, dim=0)[0] + 1)], x, y)

    g = kn.compile(f)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((6, 33)).astype(np.float32), rng.standard_normal((6, 33)).astype(np.float32)
    for k in (0, 1, 1, 0, 1, 0):
        got = g(np.array(k, np.int32), x, y)
        want = f(kn.tensor(k, dtype=kn.int32), kn.tensor(x), kn.tensor(y))
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_dynamic_sizes_get_a_capture_each():
    B = kn.ShapeVar("B", min=1, max=4096)
    g = kn.compile(four_way, dynamic_shapes=[None, kn.TensorSpec([B])])
    rng = np.random.default_rng(3)
    for n in (7, 100, 7, 100, 7, 1000, 100):
        x = rng.standard_normal(n).astype(np.float32)
        for k in range(4):
            np.testing.assert_allclose(g(np.array(k, np.int32), x).numpy(), reference(k, x),
                                       rtol=1e-5, atol=1e-6)
    assert g.stats()["compiles"] == 1


def test_a_branch_with_an_extern_keeps_the_python_way(python_conds):
    def f(p, x):
        return kn.cond(p, lambda v: kn.linalg.cholesky(v @ v.mT + 4 * kn.eye(4)), lambda v: v * 2, x)

    g = kn.compile(f)
    x = np.random.default_rng(4).standard_normal((4, 4)).astype(np.float32)
    for p in (True, False, True, False):
        np.testing.assert_allclose(g(np.array(p), x).numpy(), f(kn.tensor(p), kn.tensor(x)).numpy(),
                                   rtol=1e-5, atol=1e-5)
    assert python_conds["conds"] >= 2  # not captured: the executor runs every call


def test_a_switch_in_a_loop_body_with_python_trips():
    def f(x, n):
        def body(i, y):
            return i + 1, kn.switch(i % 3, [lambda v: v * 0.5, lambda v: v + 1.0, kn.sin], y)

        return kn.while_loop(lambda i, y: i < n, body, (kn.tensor(0, dtype=kn.int32), x))[1]

    g = kn.compile(f)
    x = np.linspace(-1, 1, 1 << 19).astype(np.float32)  # 2 MiB carried: the Python trips
    for n in (0, 1, 4, 7):
        np.testing.assert_allclose(g(x, np.array(n, np.int32)).numpy(),
                                   f(kn.tensor(x), kn.tensor(n, dtype=kn.int32)).numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_concurrent_calls_stay_correct():
    g = kn.compile(four_way)
    inputs = [np.random.default_rng(k).standard_normal(3000).astype(np.float32) for k in range(4)]
    for k, x in enumerate(inputs):  # build the capture
        g(np.array(k, np.int32), x)
        g(np.array(k, np.int32), x)
    errors = []

    def worker(k):
        for r in range(30):
            got = g(np.array((k + r) % 4, np.int32), inputs[k]).numpy()
            if not np.allclose(got, reference((k + r) % 4, inputs[k]), rtol=1e-5, atol=1e-6):
                errors.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_branch_asks_for_its_threads_each_call(threads, monkeypatch, split_always):
    """A branch large enough to split has a split version and one for when other processes
    keep CPUs busy (quiet workers on kiln's team, else one thread); which runs is asked of
    threads.parallel_threads() (the CPUs other processes leave idle) per call."""
    from kiln.codegen.cpu.launch_list import openmp_runtime

    asked = []
    monkeypatch.setattr(native_loops, "parallel_threads", lambda: asked.append(threads) or threads)
    g = kn.compile(four_way)
    x = np.random.default_rng(6).standard_normal(1 << 20).astype(np.float32)
    for k in (0, 1, 2, 3, 3, 2, 1, 0):
        np.testing.assert_allclose(g(np.array(k, np.int32), x).numpy(), reference(k, x),
                                   rtol=1e-5, atol=1e-6)
    # the first call runs the Python way, every later one natively and asks
    assert len(asked) == (7 if openmp_runtime() is not None else 0)


def test_beside_busy_processes_a_large_branch_splits_with_quiet_workers(monkeypatch, split_always):
    """While other processes keep CPUs busy (parallel_threads() is 1), a branch large
    enough to split still splits on kiln's team, its workers sleeping right after each
    region (a team region never waits for a worker that does not come); during a back-off
    (a split just waited for a core), and at kn.set_num_threads(1), it runs on one thread."""
    from kiln.codegen.cpu import native_pool, native_team
    from kiln.runtime import threads

    if not native_team.available():
        pytest.skip("kiln's native team needs Linux (futex) on x86-64 or AArch64")
    before = kn.get_num_threads()
    kn.set_num_threads(2)
    try:
        monkeypatch.setattr(native_loops, "parallel_threads", lambda: 1)
        g = kn.compile(four_way)
        x = np.random.default_rng(7).standard_normal(1 << 20).astype(np.float32)

        def regions(calls):
            assert native_team.start_trace()
            for k in calls:
                np.testing.assert_allclose(g(np.array(k, np.int32), x).numpy(), reference(k, x),
                                           rtol=1e-5, atol=1e-6)
            return native_team.stop_trace()

        regions([0])  # the first call of a size binding runs the Python way
        assert native_pool.on_team()
        seen = regions([1, 2, 3, 0])
        assert len(seen) == 4 and all(r["quiet"] and r["units"] == 2 for r in seen)
        monkeypatch.setattr(native_loops, "backing_off", lambda: True)
        assert regions([1, 2]) == []
        monkeypatch.setattr(native_loops, "backing_off", threads.backing_off)
        kn.set_num_threads(1)
        assert regions([3, 0]) == []
    finally:
        kn.set_num_threads(before)
