"""CPU GEMM template: BLAS panels + fused epilogues, transposes, batch, dtypes, tiny sizes."""

import numpy as np
import pytest

from kiln.codegen.cpu import CpuBackend, CpuOptions
from kiln.codegen.cpu.autotune import choose_gemm
from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, Const, GemmKernel, Load, Op, loop_var
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

from tests.codegen.cpu_helpers import BACKEND, check, skip_if_no_blas

gb, gi, gj = (loop_var(v) for v in ("gb", "gi", "gj"))
M = symbol("M")
f32 = dt.float32


def gemm(batch, m, n, k, *, d=f32, out_d=None, ta=False, tb=False, epilogue="none", sizes=()):
    """out[b] = epi(a[b] @ b[b]); ta/tb store the operand transposed in memory."""
    acc_d = dt.float64 if d == dt.float64 else f32
    out_d = out_d or d
    a_shape = (batch, k, m) if ta else (batch, m, k)
    b_shape = (batch, n, k) if tb else (batch, k, n)
    a_str = (m * k, 1, m) if ta else (m * k, k, 1)
    b_str = (k * n, 1, k) if tb else (k * n, n, 1)
    acc = Acc(acc_d)
    bufs = [BufferParam("a", d, a_shape, IN), BufferParam("b", d, b_shape, IN)]
    if epilogue in ("bias_relu", "bias_gelu"):
        bufs.append(BufferParam("bias", f32, (n,), IN))
        v = Op("add", (acc, Load("bias", gj, f32)), acc_d) if acc_d == f32 else \
            Op("add", (acc, Op("convert", (Load("bias", gj, f32),), acc_d)), acc_d)
        if epilogue == "bias_relu":
            v = Op("max", (v, Const(0.0, acc_d)), acc_d)
        else:
            v = Op("mul", (v, Op("mul", (Const(0.5, acc_d), Op("add", (Const(1.0, acc_d), Op(
                "erf", (Op("mul", (v, Const(0.7071067811865476, acc_d)), acc_d),), acc_d)), acc_d)), acc_d)), acc_d)
    elif epilogue == "residual_scale":
        bufs.append(BufferParam("res", d, (batch, m, n), IN))
        r = Load("res", (gb * m + gi) * n + gj, d)
        r = r if d == acc_d else Op("convert", (r,), acc_d)
        v = Op("add", (Op("mul", (acc, Const(0.5, acc_d)), acc_d), r), acc_d)
    else:
        v = acc
    if out_d != acc_d:
        v = Op("convert", (v,), out_d)
    bufs.append(BufferParam("o", out_d, (batch, m, n), OUT))
    return GemmKernel("g", tuple(bufs), tuple(sizes), "a", "b", "o", batch, m, n, k, a_str, b_str, v)


def _blas_backend():
    return CpuBackend(CpuOptions())


def compile_blas(g, blas=True):
    be = _blas_backend()
    return be._compile_plans([be._plan(g, set(), blas)])[0]


@skip_if_no_blas
@pytest.mark.parametrize("epilogue", ["none", "bias_relu", "bias_gelu", "residual_scale"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_blas_gemm_epilogues_and_transposes(epilogue, ta, tb):
    g = gemm(2, 70, 45, 33, ta=ta, tb=tb, epilogue=epilogue)
    rng = np.random.default_rng(0)
    from tests.codegen.cpu_helpers import make_arrays
    from kiln.codegen.kernel_eval import run_kernel
    arrays = make_arrays(g, {}, rng)
    ours, ref = [a.copy() for a in arrays], [a.copy() for a in arrays]
    compile_blas(g)(ours, {})
    run_kernel(g, ref, {})
    np.testing.assert_allclose(ours[-1], ref[-1], rtol=1e-4, atol=1e-4)


@skip_if_no_blas
@pytest.mark.parametrize("d,out_d", [(dt.float64, None), (dt.float16, None), (dt.bfloat16, None),
                                     (f32, dt.bfloat16), (dt.float8_e4m3fn, f32)],
                         ids=lambda d: getattr(d, "short", "same"))
def test_blas_gemm_dtypes(d, out_d):
    g = gemm(1, 40, 24, 16, d=d, out_d=out_d, epilogue="bias_relu")
    tol = 1e-10 if d == dt.float64 and out_d is None else 2e-2
    check(g, {}, rtol=tol, atol=tol, low=-1.0, high=1.0)


@skip_if_no_blas
def test_gemm_symbolic_rows_multiple_panels_and_k0():
    g = gemm(1, M, 20, 9, epilogue="bias_relu", sizes=("M",))
    for m in (0, 1, 17, 300):
        check(g, {"M": m}, rtol=1e-5, atol=1e-5)
    check(gemm(2, 5, 6, 0, epilogue="bias_relu"), {})


def test_generated_gemm_small_and_integer():
    g = gemm(3, 4, 5, 3, epilogue="bias_relu")
    assert not choose_gemm(g).use_blas  # tiny: the model picks the loop nest
    check(g, {}, rtol=1e-5, atol=1e-5)
    gi32 = GemmKernel("gi", (BufferParam("a", dt.int32, (1, 6, 7), IN), BufferParam("b", dt.int32, (1, 7, 5), IN),
                             BufferParam("o", dt.int32, (1, 6, 5), OUT)), (), "a", "b", "o", 1, 6, 5, 7,
                      (42, 7, 1), (35, 5, 1), Acc(dt.int32))
    check(gi32, {})


@skip_if_no_blas
def test_model_prefers_blas_for_large_and_measure_runs():
    assert choose_gemm(gemm(1, 256, 256, 256)).use_blas
    g = gemm(1, 48, 40, 32, epilogue="bias_relu")
    compiled = BACKEND.compile(g, measure=True)
    from tests.codegen.cpu_helpers import make_arrays
    from kiln.codegen.kernel_eval import run_kernel
    arrays = make_arrays(g, {}, np.random.default_rng(1))
    ours, ref = [a.copy() for a in arrays], [a.copy() for a in arrays]
    compiled(ours, {})
    run_kernel(g, ref, {})
    np.testing.assert_allclose(ours[-1], ref[-1], rtol=1e-4, atol=1e-4)


def test_out_of_bounds_strides_are_rejected():
    from kiln.errors import KilnShapeError
    bad = GemmKernel("mm", (BufferParam("a", f32, (4, 3), IN), BufferParam("b", f32, (3, 5), IN),
                            BufferParam("o", f32, (4, 5), OUT)), (), "a", "b", "o", 1, 4, 5, 3,
                     (12, 3, 1), (15, 1, 5), Acc(f32))
    with pytest.raises(KilnShapeError, match="past its 15 elements"):
        BACKEND.compile(bad)
