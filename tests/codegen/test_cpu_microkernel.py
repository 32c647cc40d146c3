"""kiln's GEMM micro-kernel against numpy: odd edges around the MR x NR tile, transposed
operands, float32/float64 (and float16 operands), batched products, epilogues, k = 0,
symbolic rows; the cost model's choice between loop nest, micro-kernel and BLAS."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import CpuBackend, CpuOptions
from kiln.codegen.cpu.autotune import choose_gemm
from kiln.codegen.cpu.microkernel import tile, vector_bits
from kiln.codegen.kernel_eval import run_kernel
from kiln.ir import dtypes as dt

from tests.codegen.cpu_helpers import make_arrays
from tests.codegen.test_cpu_gemm import M, gemm

BACKEND = CpuBackend(CpuOptions())
MR, NR, W = tile(4)


def micro(g):
    return BACKEND._compile_plans([BACKEND._plan(g, set(), "micro")])[0]


def run(g, sizes=None, seed=0, rtol=1e-5, atol=1e-5, compiled=None):
    """Run `g` compiled (the micro-kernel unless `compiled` is given) and the Kernel IR
    evaluator on the same inputs; compare the outputs."""
    sizes = sizes or {}
    arrays = make_arrays(g, sizes, np.random.default_rng(seed), low=-1.0, high=1.0)
    ours, ref = [a.copy() for a in arrays], [a.copy() for a in arrays]
    (compiled or micro(g))(ours, sizes)
    run_kernel(g, ref, sizes)
    np.testing.assert_allclose(ours[-1], ref[-1], rtol=rtol, atol=atol)
    return arrays, ours


def test_tile_follows_the_host_vectors():
    assert vector_bits() in (128, 256, 512)
    assert (MR, NR, W) == (8 if vector_bits() == 512 else 6, 2 * vector_bits() // 32,
                           vector_bits() // 32)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (MR - 1, NR - 1, 3), (MR, NR, 16), (MR + 1, NR + 1, 17),
                                   (2 * MR + 5, 3 * NR + 7, 1), (37, 50, 29)])
def test_edges_match_numpy(m, n, k):
    arrays, ours = run(gemm(1, m, n, k))
    a, b = arrays[0][0].astype(np.float64), arrays[1][0].astype(np.float64)
    np.testing.assert_allclose(ours[-1][0], a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("d", [dt.float32, dt.float64])
def test_transposes_and_dtypes(ta, tb, d):
    tol = 1e-12 if d == dt.float64 else 1e-5
    run(gemm(3, 13, 21, 11, d=d, ta=ta, tb=tb), rtol=tol, atol=tol)


@pytest.mark.parametrize("epilogue", ["bias_relu", "bias_gelu", "residual_scale"])
def test_epilogues_batched(epilogue):
    run(gemm(5, 9, 40, 12, epilogue=epilogue))


def test_float16_operands_and_output():
    run(gemm(2, 7, 19, 24, d=dt.float16), rtol=2e-2, atol=2e-2)


def test_k0_and_symbolic_rows():
    run(gemm(2, 5, 6, 0, epilogue="bias_relu"))
    g = gemm(1, M, 20, 9, epilogue="bias_relu", sizes=("M",))
    for m in (0, 1, MR, 17):
        run(g, {"M": m})


def test_cost_model_picks_each_variant():
    assert choose_gemm(gemm(3, 4, 5, 3)).variant == "loop"          # tiny: no packing
    assert choose_gemm(gemm(1, 512, 512, 512), blas_available=True).use_blas
    assert choose_gemm(gemm(64, 32, 32, 16), blas_available=True).variant == \
        ("micro" if vector_bits() == 512 else "blas")  # see micro_beats_blas
    assert choose_gemm(gemm(4, 256, 256, 256), blas_available=True).variant == "blas"
    # without OpenBLAS the micro-kernel takes its place, small and large
    for shape in ((64, 32, 32, 16), (1, 512, 512, 512)):
        assert choose_gemm(gemm(*shape), blas_available=False).variant == "micro"
    assert choose_gemm(gemm(3, 4, 5, 3), blas_available=False).variant == "loop"


def test_max_autotune_measures_the_micro_kernel_too():
    g = gemm(4, 20, 40, 24, epilogue="bias_relu")
    run(g, seed=1, rtol=1e-4, atol=1e-4, compiled=BACKEND.compile(g, measure=True))


def test_batched_attention_scores_compiled_match_numpy(monkeypatch):
    """q @ k^T over (batch*heads) small items, end to end with the micro-kernel (as the
    cost model picks it when OpenBLAS is absent)."""
    from kiln.codegen.cpu import autotune

    real = autotune.choose_gemm
    monkeypatch.setattr(autotune, "choose_gemm", lambda g, *a, **k: real(g, blas_available=False))
    import kiln.codegen.cpu.backend as backend_module
    monkeypatch.setattr(backend_module, "choose_gemm", autotune.choose_gemm)
    rng = np.random.default_rng(3)
    q, k = (rng.standard_normal((48, 29, 13)).astype(np.float32) for _ in range(2))
    f = kn.compile(lambda q, k: (q @ k.transpose(1, 2)) * 0.25)
    out = f(kn.tensor(q), kn.tensor(k))
    np.testing.assert_allclose(out.numpy(), (q @ k.transpose(0, 2, 1)) * 0.25, rtol=1e-5, atol=1e-5)
    (gemm_kernel,) = f.compiled_graphs()[0].program.kernels.values()
    assert real(gemm_kernel, blas_available=False).variant == "micro"


def test_the_micro_kernel_takes_the_products_it_measured_faster_with_blas_present(monkeypatch):
    """With AVX-512's 8-row tile: every float32 product below 2^23 multiply-adds per item;
    with the 6-row tile (AVX2): only small batched NT products (attention scores, q @ k^T),
    where OpenBLAS's small NT path measured 1.1-1.6x slower. Larger products, float64 and
    the rest keep BLAS."""
    from kiln.codegen.cpu import microkernel
    from kiln.codegen.cpu.autotune import MICRO_MNK

    for bits in (512, 256):
        monkeypatch.setattr(microkernel, "vector_bits", lambda bits=bits: bits)
        wide = bits == 512
        for shape, ta, tb in [((64, 32, 32, 16), False, True), ((16, 64, 64, 64), False, True)]:
            assert choose_gemm(gemm(*shape, ta=ta, tb=tb), blas_available=True).variant == "micro"
        for shape, ta, tb in [((64, 32, 32, 16), False, False), ((64, 32, 32, 16), True, False),
                              ((16, 32, 64, 256), False, False), ((1, 128, 128, 128), False, False),
                              ((64, 32, 32, 16), True, True)]:
            want = "micro" if wide else "blas"
            assert choose_gemm(gemm(*shape, ta=ta, tb=tb), blas_available=True).variant == want, shape
        for shape, ta, tb in [((1, 256, 256, 256), False, True), ((4, 128, 256, 128), False, False),
                              ((16, 32, 32, 256), False, True), ((1, 512, 192, 64), False, False),
                              ((1, 256, 256, 128), True, False)]:
            variant = choose_gemm(gemm(*shape, ta=ta, tb=tb), blas_available=True).variant
            assert variant == ("micro" if wide and shape[1] * shape[2] * shape[3] <= MICRO_MNK else "blas"), shape
        assert choose_gemm(gemm(64, 32, 32, 16, d=dt.float64, tb=True), blas_available=True).variant == "blas"


def test_a_compiled_attention_score_product_runs_the_micro_kernel_and_matches_numpy():
    q, k = (np.random.default_rng(s).standard_normal((64, 32, 16)).astype(np.float32) for s in (1, 2))
    f = kn.compile(lambda q, k: q @ k.transpose(1, 2))
    for _ in range(2):
        out = f(q, k).numpy()
        np.testing.assert_allclose(out, np.matmul(q.astype(np.float64), k.transpose(0, 2, 1)),
                                   rtol=1e-4, atol=1e-4)
    (kernel,) = f.compiled_graphs()[0].executable.kernels.values()
    assert kernel.calls_blas is False  # the micro-kernel: no BLAS call, no BLAS thread toggle


@pytest.mark.parametrize("ranges", [[(0, 12)], [(0, 1), (1, 6), (6, 12)], [(5, 12), (0, 5)],
                                    [(i, i + 1) for i in range(12)][::-1]])
def test_any_cut_of_the_row_blocks_computes_the_product(ranges):
    """Every cut of the outer space [0, batch x row blocks) into ranges (as threads claim
    them, in any order; cuts inside a batch item, partial last blocks) gives the product."""
    import ctypes

    m = 6 * MR - 3  # six row blocks per item, the last one partial; two items
    g = gemm(2, m, NR + 5, 11)
    ck = micro(g)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((2, m, 11)).astype(np.float32)
    b = rng.standard_normal((2, 11, NR + 5)).astype(np.float32)
    out = np.full((2, m, NR + 5), np.nan, np.float32)
    arrays = [a, b, out]
    bufs = (ctypes.c_void_p * 3)(*[id(x) if ck._by_object else x.ctypes.data for x in arrays])
    sizes = (ctypes.c_int64 * 1)()
    for lo, hi in ranges:
        ck._fn(bufs, sizes, lo, hi)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)
