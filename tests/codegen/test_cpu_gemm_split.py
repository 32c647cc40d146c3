"""A large single GEMM split into tiles over kiln's threads, one BLAS thread each: the
cost model's tiles (row panels, column panels or a 2-D grid by shape), results against
numpy (epilogue, transposed operands, symbolic rows, one thread, bit-identical to the
unsplit call), claimed on OpenMP threads from native code (an atomic counter) or,
without libgomp, by kiln's pool: every panel runs exactly once, errors surface, and a
worker that never gets a core does not stall the call."""

import threading

import numpy as np
import pytest


from kiln.codegen.cpu import CpuBackend, CpuOptions
from kiln.codegen.cpu import autotune
from kiln.codegen.cpu import compiled as cc
from kiln.codegen.cpu.compiled import WorkerPool
from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, Const, GemmKernel, Load, Op, loop_var
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol
from kiln.runtime.threads import blas_num_threads

from tests.codegen.cpu_helpers import skip_if_no_blas

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


def run(g, m, threads, *, ta=False, tb=False, seed=0, n=192, k=160):
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


def test_panel_tiles_split_a_large_product_by_shape():
    # small product, one thread or a batch: full-width panels (up to 1024 rows, one call)
    assert autotune.panel_tiles_for(512, 64, 64, threads=2) == (512, 0)
    assert autotune.panel_tiles_for(512, 1024, 1024, threads=1) == (512, 0)
    assert autotune.panel_tiles_for(512, 1024, 1024, threads=2, batch=8) == (512, 0)
    assert autotune.panel_rows_for(4096, 1024, 1024, threads=1) == 1024
    # one tile per thread, along the dim that packs least (R*k*n + C*m*k elements):
    # wide outputs (an MLP's 512 x 4096 hidden layer) in columns, tall ones in rows
    assert autotune.panel_tiles_for(512, 4096, 1024, threads=2) == (512, 2048)
    assert autotune.panel_tiles_for(512, 1000, 1024, threads=2) == (512, 512)  # 16-column multiples
    assert autotune.panel_tiles_for(1024, 512, 512, threads=2) == (512, 0)
    # a square product on two threads: 2 row tiles (12M packed); 2 column tiles of 2048
    # rows are 2 calls of 1024 rows each, packing their B columns twice (16M)
    assert autotune.panel_tiles_for(2048, 2048, 2048, threads=2) == (1024, 0)
    # four threads on a square product: a 2 x 2 grid (16M packed, 20M for 4 x 1, 24M for 1 x 4)
    assert autotune.panel_tiles_for(2048, 2048, 2048, threads=4) == (1024, 1024)
    # too narrow for one tile per thread either way: row panels of MIN_SPLIT_ROWS
    assert autotune.panel_tiles_for(100, 100, 1 << 20, threads=2) == (autotune.MIN_SPLIT_ROWS, 0)
    # a symbolic dim (costed at a guess of 256) is never cut finer than unsplit: m keeps
    # 1024-row panels (not 2 of 128 rows, which a run at m = 8192 would make 64 of), a
    # static wide n is still cut in columns; a symbolic n is not cut
    assert autotune.panel_tiles_for(256, 4096, 1024, threads=2, static=(False, True)) == (1024, 2048)
    assert autotune.panel_tiles_for(256, 100, 1 << 20, threads=2, static=(False, True)) == (1024, 0)
    assert autotune.panel_tiles_for(1024, 256, 1024, threads=2, static=(True, False)) == (512, 0)
    assert autotune.panel_tiles_for(256, 256, 1024, threads=2, static=(False, False)) == (1024, 0)


@skip_if_no_blas
@pytest.mark.parametrize("native", [True, False], ids=["openmp", "pool"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True)])
def test_split_gemm_matches_numpy(monkeypatch, split_always, ta, tb, native):
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
    assert (plan.panel_rows, plan.panel_cols) == (160, 0) and int(plan.outer_extents[0]) == 2
    # the two panels claimed one at a time: (total, unit, threads) by OpenMP's threads,
    # or the ranges by kiln's pool
    assert calls == [(2, 1, 2)] if native else calls == [[(0, 1), (1, 2)]]
    run(g, 300, threads=1, ta=ta, tb=tb)  # the same code with kiln on one thread
    # a wide product: two column tiles (208 + 192 columns), the epilogue's bias by column
    calls.clear()
    g = big_gemm(120, 400, 200, ta=ta, tb=tb)  # above the micro-kernel's 2^23 multiply-adds
    plan = run(g, 120, threads=2, ta=ta, tb=tb, n=400, k=200)
    assert (plan.panel_rows, plan.panel_cols) == (128, 208) and int(plan.outer_extents[0]) == 2
    assert calls == [(2, 1, 2)] if native else calls == [[(0, 1), (1, 2)]]


@skip_if_no_blas
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_split_gemm_is_bit_identical_to_one_call(monkeypatch, split_always, ta, tb):
    """Tiles only cut m and n: every output sums k in BLAS's own order, so the split
    product equals one whole BLAS call (numpy's, one BLAS thread) bit for bit, in a 2-D
    grid with partial tiles too."""
    from kiln.runtime.threads import blas_single_thread

    monkeypatch.setattr(autotune, "SPLIT_MACS", 1 << 10)
    monkeypatch.setattr(autotune, "MIN_SPLIT_ROWS", 16)
    monkeypatch.setattr(autotune, "MIN_SPLIT_COLS", 16)
    monkeypatch.setattr(cc, "SPLIT_MACS", 1 << 10)
    m, n, k = 333, 250, 300
    rng = np.random.default_rng(7)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    a_str = (0, 1, m) if ta else (0, k, 1)
    b_str = (0, 1, k) if tb else (0, n, 1)
    bufs = (BufferParam("a", f32, a.shape, IN), BufferParam("b", f32, b.shape, IN),
            BufferParam("o", f32, (m, n), OUT))
    g = GemmKernel("bare", bufs, (), "a", "b", "o", 1, m, n, k, a_str, b_str, Acc(f32))
    with blas_single_thread():
        want = np.matmul(a.T if ta else a, b.T if tb else b)
    for threads in (2, 4, 6):  # 2 and 4 tiles (1 x 2, 2 x 2), 6: 2 x 3 with partial tiles
        be = CpuBackend(CpuOptions(threads=threads))
        plan = be._plan(g, set())
        tiles = int(plan.outer_extents[0])
        assert tiles == threads
        ck = be._compile_plans([plan])[0]
        out = np.full((m, n), np.nan, np.float32)
        ck([a, b, out], {})
        np.testing.assert_array_equal(out, want)


@skip_if_no_blas
@pytest.mark.parametrize("dtype", [dt.bfloat16, dt.float16, dt.float64])
def test_split_gemm_packed_operands_and_residual(monkeypatch, split_always, dtype):
    """Column tiles where BLAS cannot take the operands as they are (low precision: each
    tile packs its own columns of B) and an epilogue that reads the output (residual:
    the product goes through scratch), against numpy in float64."""
    monkeypatch.setattr(autotune, "SPLIT_MACS", 1 << 10)
    monkeypatch.setattr(autotune, "MIN_SPLIT_COLS", 16)
    monkeypatch.setattr(cc, "SPLIT_MACS", 1 << 10)
    m, n, k = 90, 500, 230  # 2 column tiles of 256 + 244
    npd = dtype.np_dtype
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(s).astype(npd) for s in ((m, k), (n, k)))  # b stored transposed
    o0 = rng.standard_normal((m, n)).astype(npd)
    acc = dt.float64 if dtype == dt.float64 else f32
    epi = Op("add", (Acc(acc), Op("convert", (Load("o", loop_var("gi") * n + gj, dtype),), acc)), acc)
    bufs = (BufferParam("a", dtype, (m, k), IN), BufferParam("b", dtype, (n, k), IN),
            BufferParam("o", dtype, (m, n), OUT))
    g = GemmKernel("res", bufs, (), "a", "b", "o", 1, m, n, k, (0, k, 1), (0, 1, k), epi)
    be = CpuBackend(CpuOptions(threads=2))
    plan = be._plan(g, set())
    assert plan.blas and (plan.panel_rows, plan.panel_cols, int(plan.outer_extents[0])) == (96, 256, 2)
    out = o0.copy()
    be._compile_plans([plan])[0]([a, b, out], {})
    want = a.astype(np.float64) @ b.astype(np.float64).T + o0.astype(np.float64)
    tol = 1e-10 if dtype == dt.float64 else 2e-2
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol * 8)


@skip_if_no_blas
def test_an_unsplit_bare_product_is_one_call_of_every_row():
    """Panels of 1024 rows exist for the epilogue's sake: the bare product in place runs
    its 3 panels of 2100 rows as one BLAS call (no merge limit in its tile loop), an
    epilogue keeps 1024-row calls; both match numpy."""
    m, n, k = 2100, 64, 128  # above the micro-kernel's 2^23 multiply-adds
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    bufs = (BufferParam("a", f32, (m, k), IN), BufferParam("b", f32, (k, n), IN), BufferParam("o", f32, (m, n), OUT))
    be = CpuBackend(CpuOptions(threads=1))
    for epi, want in ((Acc(f32), a @ b), (Op("max", (Acc(f32), Const(0.0, f32)), f32), np.maximum(a @ b, 0))):
        g = GemmKernel("whole", bufs, (), "a", "b", "o", 1, m, n, k, (0, k, 1), (0, n, 1), epi)
        plan = be._plan(g, set())
        assert plan.blas and plan.panel_rows == 1024 and int(plan.outer_extents[0]) == 3
        text = be._module_text([plan])
        assert (str(1 << 40) in text) == isinstance(epi, Acc)
        out = np.full((m, n), np.nan, np.float32)
        be._compile_plans([plan])[0]([a, b, out], {})
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@skip_if_no_blas
def test_split_gemm_symbolic_rows(monkeypatch, split_always):
    monkeypatch.setattr(autotune, "SPLIT_MACS", 1 << 10)
    monkeypatch.setattr(autotune, "MIN_SPLIT_ROWS", 16)
    monkeypatch.setattr(cc, "SPLIT_MACS", 1 << 10)
    M = symbol("M")
    g = big_gemm(M, 192, 200, sizes=("M",))  # k = 200: BLAS, not the micro-kernel, at M ~ 256
    for m in (1, 17, 64, 333, 2100):  # 1024-row panels x 2 column tiles (n = 192)
        plan = run(g, m, threads=2, seed=m, k=200)
    assert plan.blas and (plan.panel_rows, plan.panel_cols) == (1024, 96)


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
@pytest.mark.parametrize("ranges", [[(0, 6)], [(0, 3), (3, 6)], [(0, 1), (1, 4), (4, 6)],
                                    [(5, 6), (0, 2), (2, 5)]])
def test_any_cut_of_the_tiles_computes_the_product(monkeypatch, ranges):
    """Whole rows of tiles in one range go to BLAS as one call, lone tiles as their own:
    every cut of a 3 x 2 grid's [0, 6) into ranges (as threads claim them, in any order)
    gives the same result."""
    import ctypes

    monkeypatch.setattr(autotune, "SPLIT_MACS", 1 << 10)
    monkeypatch.setattr(autotune, "MIN_SPLIT_ROWS", 16)
    monkeypatch.setattr(autotune, "MIN_SPLIT_COLS", 16)
    g = big_gemm(300, 192, 160, ta=True)
    be = CpuBackend(CpuOptions(threads=6))
    plan = be._plan(g, set())
    assert (plan.panel_rows, plan.panel_cols, int(plan.outer_extents[0])) == (112, 96, 6)  # 3 x 2
    ck = be._compile_plans([plan])[0]
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
