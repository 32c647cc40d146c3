"""A large single GEMM split into row panels over kiln's threads, one BLAS thread each:
the cost model's panels, results against numpy (epilogue, transposed operands, symbolic
rows, one thread), claimed on OpenMP threads from native code (an atomic counter) or,
without libgomp, by kiln's pool: every panel runs exactly once, errors surface, and a
worker that never gets a core does not stall the call."""

import threading

import numpy as np
import pytest

import kiln as kn

from kiln.codegen.cpu import CpuBackend, CpuOptions
from kiln.codegen.cpu import autotune
from kiln.codegen.cpu import compiled as cc
from kiln.codegen.cpu.compiled import WorkerPool
from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, Const, GemmKernel, Load, Op, loop_var
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol
from kiln.runtime.threads import blas_num_threads

from tests.codegen.cpu_helpers import skip_if_no_blas
from tests.codegen.test_cpu_native_pool import two_threads  # noqa: F401 (2 threads, policy "always")

f32 = dt.float32
gj = loop_var("gj")


def big_gemm(m, n, k, *, ta=False, tb=False, sizes=()):
    """relu(a @ b + bias), a/b optionally stored transposed; m may be a symbol."""
    a_shape, a_str = ((k, m), (0, 1, m)) if ta else ((m, k), (0, k, 1))
    b_shape, b_str = ((n, k), (0, 1, k)) if tb else ((k, n), (0, n, 1))
    epi = Op("max", (Op("add", (Acc(f32), Load("bias", gj, f32)), f32), Const(0.0, f32)), f32)
    bufs = (BufferParam("a", f32, a_shape, IN), BufferParam("b", f32, b_shape, IN),
            BufferParam("bias", f32, (n,), IN), BufferParam("o", f32, (m, n), OUT))
    return GemmKernel("big", bufs, tuple(sizes), "a", "b", "o", 1, m, n, k, a_str, b_str, epi)


def run(g, m, threads, *, ta=False, tb=False, seed=0):
    n, k = 192, 160
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    be = CpuBackend(CpuOptions(threads=threads))
    plan = be._plan(g, set())
    compiled = be._compile_plans([plan])[0]
    compiled([a, b, bias, out], {"M": m} if g.sizes else {})
    want = np.maximum((a.T if ta else a) @ (b.T if tb else b) + bias, 0)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    return plan


def test_panel_rows_split_a_large_product_only():
    # small product or one thread: panels as before (up to 1024 rows, one call)
    assert autotune.panel_rows_for(512, 64, 64, threads=2) == 512
    assert autotune.panel_rows_for(512, 1024, 1024, threads=1) == 512
    # large single product, 2 threads: 2 panels per thread, multiples of 16
    rows = autotune.panel_rows_for(512, 1024, 1024, threads=2)
    assert rows == 128 and 512 // rows == 2 * autotune.CHUNKS_PER_THREAD
    # never below MIN_SPLIT_ROWS (B is re-packed per call), never for a batch
    assert autotune.panel_rows_for(100, 4096, 4096, threads=2) == autotune.MIN_SPLIT_ROWS
    assert autotune.panel_rows_for(512, 1024, 1024, threads=2, batch=8) == 512


@skip_if_no_blas
@pytest.mark.parametrize("native", [True, False], ids=["openmp", "pool"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True)])
def test_split_gemm_matches_numpy(monkeypatch, two_threads, ta, tb, native):
    # shrink the threshold so a test-sized product splits; 300 rows: a partial last panel
    monkeypatch.setattr(autotune, "SPLIT_MACS", 1 << 10)
    monkeypatch.setattr(autotune, "MIN_SPLIT_ROWS", 16)
    monkeypatch.setattr(cc, "SPLIT_MACS", 1 << 10)
    calls = []
    real = WorkerPool.run_claimed
    monkeypatch.setattr(WorkerPool, "run_claimed", lambda self, *a, **k: (calls.append(a[3]), real(self, *a, **k)))
    claim = cc.parallel_claim()
    if native and claim is None:
        pytest.skip("needs libgomp (GNU OpenMP runtime, Debian package libgomp1)")
    monkeypatch.setattr(cc, "parallel_claim", lambda: (
        (lambda *a: (calls.append(a[3:]), claim(*a))) if native else None))
    g = big_gemm(300, 192, 160, ta=ta, tb=tb)
    plan = run(g, 300, threads=2, ta=ta, tb=tb)
    assert plan.panel_rows == 80 and int(plan.outer_extents[0]) == 4
    # the four panels claimed one at a time: (total, unit, threads) by OpenMP's threads,
    # or the ranges by kiln's pool
    assert calls == [(4, 1, 2)] if native else calls == [[(0, 1), (1, 2), (2, 3), (3, 4)]]
    run(g, 300, threads=1, ta=ta, tb=tb)  # the same code with kiln on one thread


@skip_if_no_blas
def test_split_gemm_symbolic_rows(monkeypatch, two_threads):
    monkeypatch.setattr(autotune, "SPLIT_MACS", 1 << 10)
    monkeypatch.setattr(autotune, "MIN_SPLIT_ROWS", 16)
    monkeypatch.setattr(cc, "SPLIT_MACS", 1 << 10)
    M = symbol("M")
    g = big_gemm(M, 192, 160, sizes=("M",))
    for m in (1, 17, 64, 333):
        run(g, m, threads=2, seed=m)


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(1)  # one worker for this file's tests (it idles on its queue)
    yield p
    p.close()  # its thread would be counted as one of kiln's pool's by test_threads


def test_claimed_ranges_each_run_once_and_blas_is_one_thread(pool):
    seen, lock, blas = [], threading.Lock(), set()

    def fn(bufs, sizes, lo, hi):
        with lock:
            seen.append((lo, hi))
            blas.add(blas_num_threads())

    ranges = [(i, i + 1) for i in range(7)]
    for _ in range(20):
        seen.clear()
        pool.run_claimed(fn, None, None, ranges, threads=2)
        assert sorted(seen) == ranges
    assert blas <= {None, 1}


def test_claimed_error_surfaces_after_every_range_ran(pool):
    seen = []

    def fn(bufs, sizes, lo, hi):
        seen.append(lo)
        if lo == 2:
            raise ValueError("range 2 failed")

    with pytest.raises(ValueError, match="range 2 failed"):
        pool.run_claimed(fn, None, None, [(i, i + 1) for i in range(5)], threads=2)
    assert sorted(seen) == list(range(5))


def test_claimed_does_not_wait_for_a_worker_without_a_core(pool):
    """The only worker is held by another task (as a descheduled thread would be): the
    caller runs every range itself and returns while the worker is still held."""
    held, release = threading.Event(), threading.Event()
    done = __import__("queue").SimpleQueue()
    pool._tasks.put((lambda: (held.set(), release.wait(30)), (), done))
    assert held.wait(30)
    seen = []
    try:
        pool.run_claimed(lambda b, s, lo, hi: seen.append(lo), None, None,
                         [(i, i + 1) for i in range(4)], threads=2)
        assert seen == [0, 1, 2, 3] and not release.is_set()
    finally:
        release.set()
    assert done.get(timeout=30) is None


@skip_if_no_blas
@pytest.mark.parametrize("ranges", [[(0, 4)], [(0, 1), (1, 3), (3, 4)], [(3, 4), (0, 3)]])
def test_any_cut_of_the_panels_computes_the_product(monkeypatch, ranges):
    """Consecutive panels of one range go to BLAS as one call: every cut of [0, panels)
    into ranges (as threads claim them, in any order) gives the same result."""
    import ctypes

    monkeypatch.setattr(autotune, "SPLIT_MACS", 1 << 10)
    monkeypatch.setattr(autotune, "MIN_SPLIT_ROWS", 16)
    g = big_gemm(300, 192, 160, ta=True)
    be = CpuBackend(CpuOptions(threads=2))
    ck = be._compile_plans([be._plan(g, set())])[0]
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((160, 300)).astype(np.float32), rng.standard_normal((160, 192)).astype(np.float32)
    bias = rng.standard_normal(192).astype(np.float32)
    out = np.full((300, 192), np.nan, np.float32)
    arrays = [a, b, bias, out]
    bufs = (ctypes.c_void_p * 4)(*[id(x) if ck._by_object else x.ctypes.data for x in arrays])
    sizes = (ctypes.c_int64 * 1)()
    for lo, hi in ranges:
        ck._fn(bufs, sizes, lo, hi)
    np.testing.assert_allclose(out, np.maximum(a.T @ b + bias, 0), rtol=1e-4, atol=1e-4)
