"""A kernel launch split over threads runs from native code on kiln's native team (or
OpenMP threads; kiln/codegen/cpu/native_pool.py): the same cut of the range as kiln's
pool, the same results as numpy, kiln's pool where neither is available, and a forked
child that still computes (the team's, libgomp's and the pool's threads do not survive
`fork`: the child starts a team of its own). The split policy is
"always" here (every launch the model calls large splits); test_cpu_split_rule.py tests
the measured one."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import compiled as cc
from kiln.codegen.cpu import native_pool, native_team

needs_gomp = pytest.mark.skipif(native_pool.parallel_for() is None,
                                reason="needs libgomp (GNU OpenMP runtime, Debian package libgomp1)")


def split_runs(f) -> list[bool]:
    """For each native run of f's prepared calls: does it hold a split launch?"""
    return [part[3][6] for call in f._fast.values() if call
            for part in call.plan._parts if part[0] == "launches" and part[3] is not None]


@pytest.fixture
def launches(monkeypatch):
    """Counts of native and pool splits."""
    seen = {"native": 0, "pool": 0}
    native, run = cc.parallel_for, cc.WorkerPool.run

    def counted_native():
        fn = native()
        if fn is None:
            return None

        def call(*args):
            seen["native"] += 1
            return fn(*args)

        return call

    def counted_run(self, *args):
        seen["pool"] += 1
        return run(self, *args)

    monkeypatch.setattr(cc, "parallel_for", counted_native)
    monkeypatch.setattr(cc.WorkerPool, "run", counted_run)
    return seen


def _check(f, n: int, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    got = f(kn.tensor(x)).numpy()
    want = (np.exp(x.astype(np.float64)) * 2.0 + 1.0).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@needs_gomp
@pytest.mark.parametrize("n", [(1 << 20) + 37, 200_003, 1 << 18])
def test_split_launch_runs_natively_and_matches_numpy(n, split_always, launches):
    f = kn.compile(lambda x: kn.exp(x) * 2.0 + 1.0)
    for seed in range(2):  # the general path (the second call prepares the fast one)
        _check(f, n, seed)
    assert launches["native"] == 2 and launches["pool"] == 0
    for seed in range(2, 4):  # prepared calls: the trampoline enters the region natively
        _check(f, n, seed)
    assert launches["native"] == 2 and launches["pool"] == 0
    assert split_runs(f) == [True]


def test_without_libgomp_the_pool_splits(monkeypatch, split_always, launches):
    monkeypatch.setattr(native_pool, "parallel_for", lambda: None)
    monkeypatch.setattr(cc, "parallel_for", lambda: None)
    f = kn.compile(lambda x: kn.exp(x) * 2.0 + 1.0)
    for seed in range(2):
        _check(f, (1 << 20) + 37, seed)
    assert launches["pool"] == 2
    assert True not in split_runs(f)  # the prepared call's launch is the kernel's own call


def _in_child(body) -> int:
    """Fork; the child runs body() under a 30 s alarm and exits 0 when it returned True.
    The child's exit status (a bounded wait: the child is killed after 60 s)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            signal.alarm(30)
            code = 0 if body() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


@pytest.mark.parametrize("native", [True, False], ids=["after-openmp", "after-pool"])
def test_a_forked_child_still_computes_split_launches(native, monkeypatch, split_always):
    if native and native_pool.parallel_for() is None:
        pytest.skip("needs libgomp (GNU OpenMP runtime, Debian package libgomp1)")
    if not native:
        monkeypatch.setattr(cc, "parallel_for", lambda: None)
    f = kn.compile(lambda x: kn.exp(x) * 2.0 + 1.0)
    _check(f, (1 << 20) + 37, 0)  # the parent's threads are running (or spinning)

    def child() -> bool:
        if native and native_pool._built().get("team"):  # kiln's team: the child's own
            _check(f, (1 << 20) + 37, 1)
            assert native_team._state["team"].pid == os.getpid()
            assert all(t.is_alive() for t in native_team._state["team"].threads)
        else:
            assert native_pool.parallel_for() is None or not native  # OpenMP's team is gone
        _check(f, (1 << 20) + 37, 1)
        g = kn.compile(lambda x: kn.exp(x) * 2.0 + 1.0)  # a new program too
        _check(g, (1 << 19) + 5, 2)
        return True

    assert _in_child(child) == 0
