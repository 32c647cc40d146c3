"""fold_transpose: transposes absorbed into matrix products (before/expected in text IR),
then compiled programs with transposed operands against numpy, with no transpose kernel
left in the program."""

import numpy as np
import pytest

import kiln as kn
from kiln.passes.dce import dce
from kiln.passes.fold_transpose import fold_transpose
from tests.passes.examples import EXAMPLES, assert_rewrites, check_preserves


def folded(graph):
    return dce(fold_transpose(graph))


CASES = {
    "x @ w.T": ("""
graph @g(%x: f32[4, 8], %w: f32[16, 8]) -> f32[4, 16]
  %0 = transpose(%w) {permutation=(1, 0)} : f32[8, 16]
  %1 = dot_general(%x, %0) {lhs_batch=(), lhs_contracting=(1,), rhs_batch=(), rhs_contracting=(0,)} : f32[4, 16]
  return %1
""", """
graph @g(%x: f32[4, 8], %w: f32[16, 8]) -> f32[4, 16]
  %0 = dot_general(%x, %w) {lhs_batch=(), lhs_contracting=(1,), rhs_batch=(), rhs_contracting=(1,)} : f32[4, 16]
  return %0
"""),
    "g.T @ x through matmul": ("""
graph @g(%a: f32[8, 4], %b: f32[8, 16]) -> f32[4, 16]
  %0 = transpose(%a) {permutation=(1, 0)} : f32[4, 8]
  %1 = matmul(%0, %b) : f32[4, 16]
  return %1
""", """
graph @g(%a: f32[8, 4], %b: f32[8, 16]) -> f32[4, 16]
  %0 = dot_general(%a, %b) {lhs_batch=(), lhs_contracting=(0,), rhs_batch=(), rhs_contracting=(0,)} : f32[4, 16]
  return %0
"""),
    "batched q @ k^T": ("""
graph @g(%q: f32[3, 5, 8], %k: f32[3, 7, 8]) -> f32[3, 5, 7]
  %0 = transpose(%k) {permutation=(0, 2, 1)} : f32[3, 8, 7]
  %1 = matmul(%q, %0) : f32[3, 5, 7]
  return %1
""", """
graph @g(%q: f32[3, 5, 8], %k: f32[3, 7, 8]) -> f32[3, 5, 7]
  %0 = dot_general(%q, %k) {lhs_batch=(0,), lhs_contracting=(2,), rhs_batch=(0,), rhs_contracting=(2,)} : f32[3, 5, 7]
  return %0
"""),
    # a transpose that reorders the product's free dims cannot be folded
    "free dims reordered stay": ("""
graph @g(%x: f32[4, 8], %w: f32[6, 5, 8]) -> f32[4, 5, 6]
  %0 = transpose(%w) {permutation=(2, 1, 0)} : f32[8, 5, 6]
  %1 = dot_general(%x, %0) {lhs_batch=(), lhs_contracting=(1,), rhs_batch=(), rhs_contracting=(0,)} : f32[4, 5, 6]
  return %1
""", """
graph @g(%x: f32[4, 8], %w: f32[6, 5, 8]) -> f32[4, 5, 6]
  %0 = transpose(%w) {permutation=(2, 1, 0)} : f32[8, 5, 6]
  %1 = dot_general(%x, %0) {lhs_batch=(), lhs_contracting=(1,), rhs_batch=(), rhs_contracting=(0,)} : f32[4, 5, 6]
  return %1
"""),
    # integer products do not go to the GEMM template: left alone
    "int product stays": ("""
graph @g(%x: i32[4, 8], %w: i32[16, 8]) -> i32[4, 16]
  %0 = transpose(%w) {permutation=(1, 0)} : i32[8, 16]
  %1 = dot_general(%x, %0) {lhs_batch=(), lhs_contracting=(1,), rhs_batch=(), rhs_contracting=(0,)} : i32[4, 16]
  return %1
""", """
graph @g(%x: i32[4, 8], %w: i32[16, 8]) -> i32[4, 16]
  %0 = transpose(%w) {permutation=(1, 0)} : i32[8, 16]
  %1 = dot_general(%x, %0) {lhs_batch=(), lhs_contracting=(1,), rhs_batch=(), rhs_contracting=(0,)} : i32[4, 16]
  return %1
"""),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rewrite(name):
    before, expected = CASES[name]
    assert_rewrites(folded, before, expected)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_preserves_examples(name):
    check_preserves(fold_transpose, name, exact=False, rtol=1e-5, atol=1e-5)


def _program_ops(fn, *args):
    compiled = kn.compile(fn)
    out = compiled(*args)
    graph = compiled.compiled_graphs()[0].optimized
    ops = []

    def visit(region):
        for node in region.nodes:
            ops.append(node.op)
            for r in node.regions or ():
                visit(r)

    visit(graph)
    return out, ops


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_forward_and_backward_without_transpose_kernels(dtype):
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(dtype) for s in ((37, 19), (23, 19), (23,)))

    def loss(x, w, b):
        return (kn.relu(x @ w.T + b) ** 2).sum()

    (lx, (gx, gw, gb)), ops = _program_ops(
        lambda x, w, b: kn.value_and_grad(loss, argnums=(0, 1, 2))(x, w, b),
        kn.tensor(x), kn.tensor(w), kn.tensor(b))
    assert "transpose" not in ops
    y = x @ w.T + b
    r = np.maximum(y, 0)
    dy = 2 * r * (y > 0)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lx.numpy(), (r ** 2).sum(), **tol)
    np.testing.assert_allclose(gx.numpy(), dy @ w, **tol)
    np.testing.assert_allclose(gw.numpy(), dy.T @ x, **tol)
    np.testing.assert_allclose(gb.numpy(), dy.sum(0), **tol)


def test_batched_transposed_operands():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((4, 9, 16), np.float32), rng.standard_normal((4, 11, 16), np.float32)
    a = rng.standard_normal((9, 5), np.float32)
    out, ops = _program_ops(lambda q, k, a: (q @ k.transpose(1, 2), a.T @ q[0]),
                            kn.tensor(q), kn.tensor(k), kn.tensor(a))
    assert "transpose" not in ops
    np.testing.assert_allclose(out[0].numpy(), q @ k.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1].numpy(), a.T @ q[0], rtol=1e-5, atol=1e-5)
