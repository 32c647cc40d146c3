"""A Linear over [B, T, C] inputs is one GEMM each way: the forward folds B and T into
rows (no broadcast copy of the weight per batch item), the weight gradient contracts B
and T as one k = B*T (no batched GEMM then a sum over the batch); against numpy."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.kernel_ir import GemmKernel
from kiln.ir.parser import parse_graph
from kiln.passes.gemm_layout import gemm_layout


def test_layout_collapses_consecutive_contracting_dims():
    g = parse_graph("""
graph @g(%ct: f32[4, 6, 5], %x: f32[4, 6, 3]) -> f32[5, 3]
  %0 = dot_general(%ct, %x) {lhs_batch=(), lhs_contracting=(0, 1), rhs_batch=(), rhs_contracting=(0, 1)} : f32[5, 3]
  return %0
""")
    layout = gemm_layout(g.body.nodes[0])
    assert (layout.batch, layout.m, layout.n, layout.k) == (1, 5, 3, 24)
    assert tuple(layout.a_strides)[1:] == (1, 5) and tuple(layout.b_strides)[1:] == (3, 1)


def test_layout_refuses_contracting_dims_out_of_order():
    g = parse_graph("""
graph @g(%a: f32[4, 6, 5], %b: f32[6, 4, 3]) -> f32[5, 3]
  %0 = dot_general(%a, %b) {lhs_batch=(), lhs_contracting=(0, 1), rhs_batch=(), rhs_contracting=(1, 0)} : f32[5, 3]
  return %0
""")
    assert gemm_layout(g.body.nodes[0]) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_3d_forward_backward_is_plain_gemms(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7, 12)).astype(dtype)
    w = rng.standard_normal((9, 12)).astype(dtype)
    b = rng.standard_normal(9).astype(dtype)

    def loss(x, w, b):
        return (kn.tanh(kn.nn.functional.linear(x, w, b)) ** 2).sum()

    f = kn.compile(lambda x, w, b: kn.value_and_grad(loss, argnums=(0, 1, 2))(x, w, b))
    value, (gx, gw, gb) = f(kn.tensor(x), kn.tensor(w), kn.tensor(b))
    kernels = f.compiled_graphs()[0].program.kernels.values()
    gemms = [k for k in kernels if isinstance(k, GemmKernel)]
    assert len(gemms) == 3 and all(str(k.batch) == "1" for k in gemms)
    assert sorted(str(k.k) for k in gemms) == sorted(["12", "9", "35"])
    y = np.tanh(x @ w.T + b)
    dz = 2 * y * (1 - y ** 2)
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(value.numpy(), (y ** 2).sum(), **tol)
    np.testing.assert_allclose(gx.numpy(), dz @ w, **tol)
    np.testing.assert_allclose(gw.numpy(), dz.reshape(-1, 9).T @ x.reshape(-1, 12), **tol)
    np.testing.assert_allclose(gb.numpy(), dz.sum((0, 1)), **tol)
