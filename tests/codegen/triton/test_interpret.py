"""Numerics of the generated Triton kernels under TRITON_INTERPRET=1 against the Kernel IR
oracle (kernel_eval, the registry's numpy references): every kernel kind, persistent and
looped, tails and symbolic sizes, every scalar primitive on every dtype with special
values, and `kn.compile(..., backend="cuda")` end to end.

The kernels run in the session's interpreter worker (conftest.py); the interpreter's
libdevice and low-precision casts are numpy/ml_dtypes there (runtime.py), so results
match the oracle to the last bit except for reassociated sums."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton backend tests need the triton package")
pytest.importorskip("torch", reason="Triton's interpreter needs CPU torch (the test extra torch==2.13.0)")

import kiln as kn  # noqa: E402
from kiln.codegen.kernel_eval import run_kernel  # noqa: E402
from kiln.ir import dtypes as dt  # noqa: E402
from kiln.ir.interpret import run_graph  # noqa: E402
from tests.codegen.triton import kernels as K  # noqa: E402
from tests.passes.examples import EXAMPLES, example  # noqa: E402

f32 = dt.float32


def check(worker, kernel, sizes, *, arrays=None, rtol=1e-6, atol=1e-6, seed=0, **ranges):
    arrays = arrays if arrays is not None else K.make_arrays(kernel, sizes, seed, **ranges)
    want = [a.copy() for a in arrays]
    with np.errstate(all="ignore"):
        run_kernel(kernel, want, sizes)
    got = worker.run_kernel(kernel, [a.copy() for a in arrays], sizes)
    for b, g, w in zip(kernel.buffers, got, want):
        if b.role != "out":
            continue
        if b.dtype.is_floating:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol,
                                       equal_nan=True, err_msg=f"{kernel.name}: buffer {b.name}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{kernel.name}: buffer {b.name}")
    return got


# -- kernel kinds -------------------------------------------------------------------------------

@pytest.mark.parametrize("b", [1, 5, 37])
def test_pointwise_broadcast_chain_symbolic_sizes(triton_interp, b):
    check(triton_interp, K.pointwise(), {"B": b})


def test_scalar_kernel_without_loops(triton_interp):
    check(triton_interp, K.scalar_kernel(), {"N": 13})


def test_split_full_reduction_through_lowering(triton_interp):
    """A large full reduction lowers to partial sums and a combining kernel."""
    x = kn.randn(512, 1024, seed=3)
    graph = kn.trace(lambda x: (x.sum(), x.max()), x)
    got = triton_interp.run_graph(graph, [x.numpy()], "cuda")
    np.testing.assert_allclose(got[0], x.numpy().astype(np.float64).sum(), rtol=1e-5)
    assert got[1] == x.numpy().max()


def test_pointwise_iota_and_index_arithmetic(triton_interp):
    check(triton_interp, K.iota_kernel(), {"N": 41})


@pytest.mark.parametrize("width,b", [(33, 9), (1024, 3), (5000, 2)], ids=["persistent", "block", "looped"])
def test_inner_reduction_softmax(triton_interp, width, b):
    check(triton_interp, K.softmax(width), {"B": b}, rtol=1e-5)


def test_two_dependent_reductions_layer_norm(triton_interp):
    check(triton_interp, K.layer_norm(), {"B": 6}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [100, 5000], ids=["persistent", "looped"])
def test_independent_reductions_share_a_pass(triton_interp, n):
    check(triton_interp, K.moments(), {"B": 3, "N": n}, rtol=1e-5)


@pytest.mark.parametrize("rows,sizes", [(40, {}), (K.N, {"N": 300})], ids=["persistent", "looped"])
def test_outer_reduction_column_sum(triton_interp, rows, sizes):
    check(triton_interp, K.column_sum(rows=rows), sizes, rtol=1e-5)


@pytest.mark.parametrize("rows,sizes", [(7, {}), (K.N, {"N": 301})], ids=["persistent", "looped"])
def test_full_reduction(triton_interp, rows, sizes):
    check(triton_interp, K.full_sum(rows=rows), sizes, rtol=1e-5)


def test_max_reduction_propagates_nan(triton_interp):
    kernel = K.full_sum(rows=K.N)
    arrays = K.make_arrays(kernel, {"N": 4})
    arrays[0][2, 7] = np.nan
    got = check(triton_interp, kernel, {"N": 4}, arrays=arrays)
    assert np.isnan(got[2][0])
    kernel = K.column_sum(rows=40)
    arrays = K.make_arrays(kernel, {})
    arrays[0][39, 5] = np.nan
    got = check(triton_interp, kernel, {}, arrays=arrays)
    assert np.isnan(got[2][5]) and not np.isnan(got[2][4])


@pytest.mark.parametrize("d,ops", [
    (f32, ("sum", "max", "min", "prod")), (dt.float64, ("sum", "max", "min", "prod")),
    (dt.int32, ("sum", "max", "min", "prod", "and", "or")), (dt.uint8, ("max", "min", "sum")),
    (dt.bool_, ("and", "or", "max", "min")),
], ids=lambda v: getattr(v, "short", None) or "-".join(v))
def test_every_reduction_op(triton_interp, d, ops):
    check(triton_interp, K.reductions(d, ops), {"B": 5}, rtol=1e-5, low=0.5, high=1.5)


@pytest.mark.parametrize("case", ["f32_bias_relu", "f32_batched_transposed", "f16_residual", "bf16",
                                  "i8_residual", "i32_fallback", "f64"])
def test_gemm_with_epilogue(triton_interp, case):
    kernel, sizes, tol = {
        "f32_bias_relu": (K.gemm(), {"M": 37}, 1e-5),
        "f32_batched_transposed": (K.gemm(f32, m=5, n=7, k=9, batch=3, transposed_b=True), {}, 1e-5),
        "f16_residual": (K.gemm(dt.float16, m=32, n=40, k=72, epilogue="residual"), {}, 2e-3),
        "bf16": (K.gemm(dt.bfloat16, m=K.M, n=16, k=33, epilogue="none"), {"M": 20}, 1e-2),
        "i8_residual": (K.gemm(dt.int8, m=20, n=24, k=40, epilogue="residual"), {}, 0),
        "i32_fallback": (K.gemm(dt.int32, m=20, n=24, k=40), {}, 0),
        "f64": (K.gemm(dt.float64, m=K.M, n=9, k=17), {"M": 18}, 1e-12),
    }[case]
    check(triton_interp, kernel, sizes, rtol=tol, atol=tol)


# -- every scalar primitive -----------------------------------------------------------------------

_SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 0.5, -2.5, 1.0, -1.0, 3.0, 2.5, -0.5], np.float64)


@pytest.mark.parametrize("d", [f32, dt.float64, dt.bfloat16, dt.float16], ids=lambda d: d.short)
def test_every_float_op(triton_interp, d):
    kernel = K.float_ops(d)
    arrays = K.make_arrays(kernel, {"N": 300}, 5, low=-2.0, high=2.0)
    n = _SPECIAL.size
    arrays[0][:n] = _SPECIAL.astype(d.np_dtype)
    arrays[1][:n] = _SPECIAL[::-1].astype(d.np_dtype)
    tol = {"f32": 4e-7, "f64": 1e-15}.get(d.short, 0)
    check(triton_interp, kernel, {"N": 300}, arrays=arrays, rtol=tol, atol=0)


@pytest.mark.parametrize("d", [dt.int8, dt.int16, dt.int32, dt.int64, dt.uint8, dt.uint32], ids=lambda d: d.short)
def test_every_integer_op(triton_interp, d):
    kernel = K.int_ops(d)
    arrays = K.make_arrays(kernel, {"N": 300}, 3)
    info = np.iinfo(d.np_dtype)
    # INT_MIN / -1, division by zero, the extremes
    arrays[0][:6] = [info.min, info.max, 0, -1 if info.min < 0 else 1, 5, info.min]
    arrays[1][:6] = [-1 if info.min < 0 else 1, 0, 0, 3, 0, 1]
    check(triton_interp, kernel, {"N": 300}, arrays=arrays)


def test_bool_ops(triton_interp):
    check(triton_interp, K.bool_ops(), {"N": 77})


@pytest.mark.parametrize("d", [dt.float16, dt.bfloat16, dt.float8_e4m3fn, dt.float8_e5m2], ids=lambda d: d.short)
def test_low_precision_rounds_after_every_op(triton_interp, d):
    check(triton_interp, K.low_precision(d), {"B": 11}, rtol=0, atol=0, low=-2.0, high=2.0)


def test_bitcast_convert(triton_interp):
    check(triton_interp, K.bitcasts(), {"N": 64})


# -- through kn.compile ---------------------------------------------------------------------------

def test_kn_compile_graph_end_to_end(triton_interp):
    """A traced function compiled for backend="cuda" runs through the interpreter."""
    def f(x, w, b):
        return kn.softmax(kn.gelu(x @ w + b), dim=-1).sum(dim=0)

    x, w, b = kn.randn(6, 32, seed=0), kn.randn(32, 24, seed=1), kn.randn(24, seed=2)
    graph = kn.trace(f, x, w, b)
    arrays = [x.numpy(), w.numpy(), b.numpy()]
    want = f(x, w, b).numpy()
    for backend in ("cuda", "rocm:gfx950"):
        got = triton_interp.run_graph(graph, arrays, backend)
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5, err_msg=backend)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_example_graph(triton_interp, name):
    """The pass tests' real graphs (MLP, attention, a transformer block, control flow, a
    symbolic batch, ...) compiled for backend="cuda" against the graph interpreter."""
    graph, arrays = example(name)
    want = run_graph(graph, *arrays)
    got = triton_interp.run_graph(graph, arrays, "cuda")
    for g, w in zip(got, want):
        w = np.asarray(w)
        if w.dtype.kind in "fV":
            np.testing.assert_allclose(np.asarray(g).astype(np.float64), w.astype(np.float64),
                                       rtol=1e-4, atol=1e-4, equal_nan=True)
        else:
            np.testing.assert_array_equal(g, w)


def test_grouped_matmul_and_its_gradient_run_the_persistent_kernel(triton_interp):
    """backend="cuda" runs kiln's grouped_matmul ops through the Triton grouped GEMM (the
    backend's templates, keyed by Kernel IR template kind), not their numpy references:
    ragged groups, an empty one."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 16)).astype(np.float32)
    w = rng.standard_normal((3, 16, 8)).astype(np.float32)
    sizes = np.array([5, 0, 7], np.int32)

    def loss(x, w, sizes):
        return (kn.grouped_matmul(x, w, sizes) ** 2).sum()

    graph = kn.trace(kn.value_and_grad(loss, argnums=(0, 1)), x, w, sizes)
    want = run_graph(graph, x, w, sizes)
    got = triton_interp.run_graph(graph, [x, w, sizes], "cuda")
    for g, ref in zip(got, want):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-4)
    used = triton_interp.request("eval", (
        "from kiln.codegen.backends import get_backend\n"
        "from kiln.codegen.kernel_ir import template_externs\n"
        "b = get_backend('cuda')\n"
        "result = [sorted(b.templates()), sorted(template_externs(b))]"))
    assert used == [["grouped_gemm", "grouped_gemm_dw"], ["grouped_matmul", "grouped_matmul_dw"]]


def test_float_to_int_edges_match_the_reference(triton_interp):
    """NaN, infinities and out-of-range floats convert as eager mode (and torch) do."""
    edges = np.array([np.nan, np.inf, -np.inf, 1e20, -1e20, 3e9, -3e9, 2.0 ** 31, 300.7, -300.7,
                      70000.5, -129.9, 255.9, -0.5], np.float32)
    x = kn.tensor(edges)
    fn = lambda x: (x.to(kn.int8), x.to(kn.uint8), x.to(kn.int16), x.to(kn.int32), x.to(kn.int64))  # noqa: E731
    graph = kn.trace(fn, x)
    got = triton_interp.run_graph(graph, [edges], "cuda")
    for g, w in zip(got, fn(x)):
        np.testing.assert_array_equal(g, w.numpy())


@pytest.mark.parametrize("dtype, rtol", [(dt.float32, 4e-7), (dt.float64, 1e-13)])
def test_erfc_runs_through_its_decomposition(triton_interp, dtype, rtol):
    """erfc has no Triton code of its own: the legalize pass expands its registry
    decomposition (libdevice's exp and arithmetic), as for any backend lacking it."""
    import math

    from kiln.ir.emitter import GraphBuilder
    from kiln.ir.types import TensorType

    b = GraphBuilder()
    x = b.add_input(TensorType(dtype, (40,)), "x")
    b.graph.body.results = [b.call("erfc", x)]
    xs = np.concatenate([np.linspace(-5, 9, 36), [0.0, np.inf, -np.inf, np.nan]]).astype(dtype.np_dtype)
    (got,) = triton_interp.run_graph(b.graph, [xs], "cuda")
    want = np.asarray(np.frompyfunc(math.erfc, 1, 1)(xs.astype(np.float64)), np.float64).astype(dtype.np_dtype)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0, equal_nan=True)
