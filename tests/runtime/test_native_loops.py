"""Compiled while_loops replayed as native launch lists (kiln/runtime/native_loops.py):
the same results as eager mode and as the executor's Python trips, no Python per trip
once a size binding repeats, the Python way for large carried tensors and busy captures."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kiln as kn
from kiln.runtime import executor, native_loops


def sqrt_to_tolerance(x, tol):
    """Newton until |y^2 - x| <= tol: a data-dependent trip count (never unrolled)."""
    def body(i, y):
        return i + 1, 0.5 * (y + x / y)

    def cond(i, y):
        return (kn.max(kn.abs(y * y - x)) > tol) & (i < 100)

    return kn.while_loop(cond, body, (kn.tensor(0, dtype=kn.int32), kn.ones_like(x)))


def with_branch(x, n):
    """A loop whose body switches on the trip's parity, carrying two dtypes."""
    def body(i, y, s):
        y = kn.cond(i % 2 == 0, lambda v: v * 0.5 + 1.0, lambda v: kn.sin(v), y)
        return i + 1, y, s + y.sum().to(kn.float64)

    return kn.while_loop(lambda i, y, s: i < n, body,
                         (kn.tensor(0, dtype=kn.int32), x, kn.tensor(0.0, dtype=kn.float64)))


def count_python_runs(monkeypatch, step: str, key: str) -> dict:
    """{key: how many times the executor ran a `step` ("while_loop", "cond") the Python way}."""
    count = {key: 0}
    original = executor._run_control

    def counting(op, *args, **kwargs):
        if op == step:
            count[key] += 1
        return original(op, *args, **kwargs)

    monkeypatch.setattr(executor, "_run_control", counting)
    return count


@pytest.fixture
def python_trips(monkeypatch):
    """How many times the executor ran a while_loop the Python way."""
    return count_python_runs(monkeypatch, "while_loop", "loops")


def test_a_repeated_loop_runs_natively_with_the_eager_result(python_trips):
    x = np.random.default_rng(0).uniform(0.5, 100, 300).astype(np.float32)
    tol = np.array(1e-3, np.float32)
    f = kn.compile(sqrt_to_tolerance)
    want = [t.numpy() for t in sqrt_to_tolerance(kn.tensor(x), kn.tensor(tol))]
    for call in range(4):
        got = [t.numpy() for t in f(x, tol)]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert python_trips["loops"] == native_loops._BUILD_AFTER - 1  # then native every call
    got[1][:] = 0  # the results are the caller's own: the next call is unaffected
    np.testing.assert_array_equal(f(x, tol)[1].numpy(), want[1])


def test_a_branch_inside_the_loop_and_two_carried_dtypes(python_trips):
    x = np.linspace(-2, 2, 64).astype(np.float32)
    f = kn.compile(with_branch)
    for n in (0, 1, 5, 5, 5, 2):
        got = [t.numpy() for t in f(x, np.array(n, np.int32))]
        want = [t.numpy() for t in with_branch(kn.tensor(x), kn.tensor(n, dtype=kn.int32))]
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    assert python_trips["loops"] < 6


def test_large_carried_tensors_keep_the_python_trips(python_trips, monkeypatch):
    monkeypatch.setattr(native_loops, "MAX_CARRIED_BYTES", 1024)
    x = np.random.default_rng(1).uniform(0.5, 100, 4096).astype(np.float32)  # 16 KiB
    f = kn.compile(sqrt_to_tolerance)
    for _ in range(3):
        f(x, np.array(1e-3, np.float32))
    assert python_trips["loops"] == 3


def test_concurrent_calls_stay_correct():
    f = kn.compile(sqrt_to_tolerance)
    tol = np.array(1e-3, np.float32)
    inputs = [np.random.default_rng(k).uniform(0.5, 100, 200).astype(np.float32) for k in range(4)]
    want = [sqrt_to_tolerance(kn.tensor(x), kn.tensor(tol))[1].numpy() for x in inputs]
    for x in inputs:  # build the capture
        f(x, tol)
    errors = []

    def worker(k):
        for _ in range(25):
            got = f(inputs[k], tol)[1].numpy()
            if not np.array_equal(got, want[k]):
                errors.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors


@pytest.mark.parametrize("threads", [1, 2])
def test_a_loop_of_large_launches_splits_only_while_cpus_are_idle(threads, python_trips, monkeypatch,
                                                                  split_always):
    """A native loop whose launches are large enough to split has a split and a
    one-thread version; which runs is asked of threads.parallel_threads() per call."""
    from kiln.codegen.cpu.launch_list import openmp_runtime

    asked = []
    monkeypatch.setattr(native_loops, "parallel_threads", lambda: asked.append(threads) or threads)
    x = np.random.default_rng(7).uniform(0.5, 100, 100_000).astype(np.float32)  # x and y: 800 KB
    tol = np.array(1e-2, np.float32)
    f = kn.compile(sqrt_to_tolerance)
    want = sqrt_to_tolerance(kn.tensor(x), kn.tensor(tol))[1].numpy()
    for _ in range(4):
        np.testing.assert_allclose(f(x, tol)[1].numpy(), want, rtol=1e-6, atol=1e-6)
    assert python_trips["loops"] == native_loops._BUILD_AFTER - 1
    assert bool(asked) == (openmp_runtime() is not None)  # a split version exists with libgomp
