"""Complex matmul as complex BLAS tiles over kiln's threads (cpu/gemm_complex.py): the
tiles (rows, columns, batch items) against one cgemm/zgemm call of the same BLAS bit for
bit (numpy's for OpenBLAS, one whole-product call for MKL), for every BLAS installed,
operands read in place (transposed views, batch strides), the fallbacks (None where BLAS
cannot take the operands), and the compiled extern step using it."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import blas, gemm_complex
from kiln.codegen.cpu.gemm_complex import blas_matmul
from kiln.runtime.threads import blas_single_thread

from tests.codegen.cpu_helpers import skip_if_no_blas

pytestmark = skip_if_no_blas


def _c(*shape, dtype=np.complex64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def _one_call(a, b, provider="openblas"):
    """The product as one BLAS call per matrix: numpy's (OpenBLAS), or for MKL one tile
    of the whole product on one thread."""
    if provider == "openblas":
        with blas_single_thread():
            return np.matmul(a, b)
    return blas_matmul(a, b, threads=1, provider=provider)


PROVIDERS = [pytest.param(p, marks=pytest.mark.skipif(not blas.available(p), reason=f"BLAS {p!r} not installed"
                                                      + (" (pip install 'kiln[mkl]')" if p == "mkl" else "")))
             for p in blas.PROVIDERS]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("m,n,k", [(200, 96, 130), (72, 300, 130), (129, 131, 257)])
def test_tiles_match_one_blas_call_bit_for_bit(monkeypatch, split_always, dtype, m, n, k, provider):
    """Tall (row tiles), wide (column tiles) and odd sizes (partial tiles), split over two
    threads: bit-identical to numpy's single call, and right against complex128."""
    from kiln.codegen.cpu import native_pool

    claim = native_pool.parallel_claim()
    if claim is None:
        pytest.skip("needs libgomp (GNU OpenMP runtime, Debian package libgomp1)")
    claimed = []
    monkeypatch.setattr(native_pool, "parallel_claim", lambda: lambda *a: (claimed.append(a[3:]), claim(*a)))
    a, b = _c(m, k, dtype=dtype, seed=1), _c(k, n, dtype=dtype, seed=2)
    assert 4 * m * n * k >= gemm_complex.SPLIT_MACS  # large enough to split
    for threads in (1, 2):
        got = blas_matmul(a, b, threads=threads, provider=provider)
        assert got.dtype == dtype and got.shape == (m, n)
        np.testing.assert_array_equal(got, _one_call(a, b, provider))
    assert claimed == [(2, 1, 2)]  # two tiles (total, unit, threads), claimed by two threads
    want = a.astype(np.complex128) @ b.astype(np.complex128)
    tol = 1e-12 if dtype == np.complex128 else 1e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("ta,tb", [(True, False), (False, True), (True, True)])
def test_transposed_views_are_read_in_place(split_always, ta, tb):
    a = _c(130, 200, seed=3) if ta else _c(200, 130, seed=3)
    b = _c(150, 130, seed=4) if tb else _c(130, 150, seed=4)
    x, y = (a.T if ta else a), (b.T if tb else b)
    np.testing.assert_array_equal(blas_matmul(x, y, threads=2, provider="openblas"), _one_call(x, y))
    if blas.available("mkl"):  # MKL reads the same views in place: equal to its contiguous copies'
        np.testing.assert_array_equal(blas_matmul(x, y, threads=2, provider="mkl"),
                                      _one_call(np.ascontiguousarray(x), np.ascontiguousarray(y), "mkl"))


def test_batches_and_a_batch_of_rows(split_always):
    a, b = _c(3, 50, 60, seed=5), _c(3, 60, 70, seed=6)
    np.testing.assert_array_equal(blas_matmul(a, b, threads=2, provider="openblas"), _one_call(a, b))
    rows = _c(2, 3, 40, 60, seed=7)  # contiguous batch rows against one matrix: one GEMM
    np.testing.assert_array_equal(blas_matmul(rows, b[0], threads=2, provider="openblas"), _one_call(rows, b[0]))
    strided = _c(4, 40, 60, seed=8)[::2]  # a batch stride of two matrices
    np.testing.assert_array_equal(blas_matmul(strided, b[0], threads=2, provider="openblas"),
                                  _one_call(strided, b[0]))
    np.testing.assert_array_equal(blas_matmul(_c(0, 60), b[0]), np.zeros((0, 70), np.complex64))
    np.testing.assert_array_equal(blas_matmul(_c(5, 0), _c(0, 7)), np.zeros((5, 7), np.complex64))


def test_what_blas_cannot_take_falls_back():
    a, b = _c(20, 30), _c(30, 10)
    assert blas_matmul(a.real.copy(), b.real.copy()) is None  # real: not this module's
    assert blas_matmul(a, b.astype(np.complex128)) is None
    assert blas_matmul(_c(20, 60)[:, ::2], b) is None  # neither rows nor columns contiguous
    assert blas_matmul(_c(2, 20, 30), _c(3, 30, 10)) is None  # broadcast batch dims
    out = gemm_complex.run_matmul([_c(2, 20, 30), _c(1, 30, 10)], {})  # numpy's reference
    np.testing.assert_allclose(out[0], _c(2, 20, 30) @ _c(1, 30, 10), rtol=1e-5, atol=1e-5)


def test_compiled_complex_matmul_runs_the_tiles(monkeypatch):
    calls = []
    real = gemm_complex.blas_matmul
    monkeypatch.setattr(gemm_complex, "blas_matmul", lambda a, b, threads=None: calls.append(a.shape) or real(a, b))
    a, b = _c(64, 48, seed=9), _c(48, 40, seed=10)
    got = kn.compile(lambda x, y: (x @ y) * 2)(a, b).numpy()
    np.testing.assert_array_equal(got, _one_call(a, b, blas.default_name()) * np.complex64(2))
    assert calls == [(64, 48)]


def test_a_signature_is_prepared_once_and_each_call_reads_its_own_operands(monkeypatch):
    """The tile sizes and split are decided on a signature's first call; later calls of
    it (new data, same shapes and strides) run them on their own operands."""
    monkeypatch.setattr(gemm_complex, "_PREPARED", {})
    for seed in range(3):
        a, b = _c(40, 30, seed=seed), _c(30, 20, seed=seed + 10)
        got = blas_matmul(a, b, threads=1)
        np.testing.assert_allclose(got, a.astype(np.complex128) @ b, rtol=1e-5, atol=1e-5)
        assert not np.shares_memory(got, a) and not np.shares_memory(got, b)
    assert len(gemm_complex._PREPARED) == 1
    a = _c(30, 40, seed=4)
    np.testing.assert_allclose(blas_matmul(a.T, b, threads=1), a.T.astype(np.complex128) @ b, rtol=1e-5, atol=1e-5)
    assert len(gemm_complex._PREPARED) == 2  # a transposed view: a signature of its own
    monkeypatch.setattr(gemm_complex, "MAX_PREPARED", 2)
    blas_matmul(_c(5, 6), _c(6, 7), threads=1)
    assert len(gemm_complex._PREPARED) == 1  # the table was emptied, then this one kept


def test_calls_of_one_signature_from_threads_are_right():
    import threading

    pairs = [(_c(48, 40, seed=s), _c(40, 36, seed=s + 20)) for s in range(4)]
    errors = []

    def work(a, b):
        want = a.astype(np.complex128) @ b
        for _ in range(30):
            if not np.allclose(blas_matmul(a, b), want, rtol=1e-4, atol=1e-4):
                errors.append(a.shape)

    threads = [threading.Thread(target=work, args=pair) for pair in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and errors == []
