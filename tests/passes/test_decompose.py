"""decompose: before/expected pairs in text IR, every composite of the registry
expanded against its numpy reference, and the pass over real graphs (outputs within
a tight tolerance: a decomposition may round differently from the fused reference)."""

import numpy as np
import pytest

from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder
from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.passes.decompose import composites, decompose
from tests.passes.examples import EXAMPLES, assert_rewrites, check_preserves

TOL = {"rtol": 2e-6, "atol": 2e-6}


def test_relu_becomes_max_with_zero():
    assert_rewrites(decompose, """
graph @g(%x: f32[4]) -> f32[4]
  %0 = relu(%x) : f32[4]
  return %0
""", """
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=0} : f32[4]
  %1 = max(%x, %0) : f32[4]
  return %1
""")


def test_keep_leaves_named_composites_whole():
    before = """
graph @g(%x: f32[2, 3], %w: f32[3, 3]) -> f32[2, 3]
  %0 = matmul(%x, %w) : f32[2, 3]
  %1 = relu(%0) : f32[2, 3]
  return %1
"""
    assert_rewrites(lambda g: decompose(g, keep={"matmul"}), before, """
graph @g(%x: f32[2, 3], %w: f32[3, 3]) -> f32[2, 3]
  %0 = matmul(%x, %w) : f32[2, 3]
  %1 = full() {dtype=f32, shape=(2, 3), value=0} : f32[2, 3]
  %2 = max(%0, %1) : f32[2, 3]
  return %2
""")
    assert_rewrites(decompose, before, """
graph @g(%x: f32[2, 3], %w: f32[3, 3]) -> f32[2, 3]
  %0 = dot_general(%x, %w) {lhs_batch=(), lhs_contracting=(1,), rhs_batch=(), rhs_contracting=(0,)} : f32[2, 3]
  %1 = full() {dtype=f32, shape=(2, 3), value=0} : f32[2, 3]
  %2 = max(%0, %1) : f32[2, 3]
  return %2
""")


def test_composites_inside_regions_expand():
    assert_rewrites(decompose, """
graph @g(%p: i1[], %x: f32[3]) -> f32[3]
  %0 = cond(%p, %x) : f32[3]
    region(%1: f32[3]):
      yield %1
    region(%2: f32[3]):
      %3 = relu(%2) : f32[3]
      yield %3
    end
  return %0
""", """
graph @g(%p: i1[], %x: f32[3]) -> f32[3]
  %0 = cond(%p, %x) : f32[3]
    region(%1: f32[3]):
      yield %1
    region(%2: f32[3]):
      %3 = full() {dtype=f32, shape=(3,), value=0} : f32[3]
      %4 = max(%2, %3) : f32[3]
      yield %4
    end
  return %0
""")


def test_no_composite_returns_the_same_graph_and_bad_keep_is_refused():
    g = parse_graph("graph @g(%x: f32[3]) -> f32[3]\n  %0 = exp(%x) : f32[3]\n  return %0\n")
    assert decompose(g) is g
    with pytest.raises(KilnArgumentError, match="exp"):
        decompose(g, keep={"exp"})


F32 = dt.float32


def _t(*shape, dtype=F32):
    return TensorType(dtype, shape)


# one small instance of every composite: operand types and attributes
COMPOSITE_CASES = {
    "stop_gradient": [([_t(3, 4)], {}), ([_t(5, dtype=dt.int32)], {})],
    "sigmoid": [([_t(3, 4)], {})],
    "relu": [([_t(3, 4)], {}), ([_t(5, dtype=dt.int32)], {})],
    "gelu": [([_t(3, 4)], {"approximate": "none"}), ([_t(3, 4, dtype=dt.bfloat16)], {"approximate": "tanh"})],
    "silu": [([_t(3, 4)], {})],
    "softplus": [([_t(3, 4)], {"beta": 2.0, "threshold": 1.0})],
    "mean": [([_t(3, 4)], {"axes": (1,)}), ([_t(3, 4, dtype=dt.float16)], {})],
    "var": [([_t(3, 4)], {"axes": (0,), "correction": 1})],
    "logsumexp": [([_t(3, 4)], {"axes": (1,)})],
    "softmax": [([_t(3, 4)], {"dim": 1}), ([_t(2, 3, dtype=dt.float16)], {"dim": 0})],
    "log_softmax": [([_t(3, 4)], {"dim": -1})],
    "layer_norm": [([_t(3, 4), _t(4), _t(4)], {"normalized_ndim": 1, "has_weight": True,
                                                 "has_bias": True})],
    "rms_norm": [([_t(2, 3, 4), _t(3, 4)], {"normalized_ndim": 2, "has_weight": True})],
    "scaled_dot_product_attention": [
        ([_t(2, 3, 4), _t(2, 5, 4), _t(2, 5, 6)], {"is_causal": False}),
        ([_t(2, 4, 4), _t(2, 4, 4), _t(2, 4, 4)], {"is_causal": True}),
        ([_t(3, 4), _t(5, 4), _t(5, 2), _t(3, 5, dtype=dt.bool_)], {"has_mask": True}),
    ],
    "matmul": [([_t(2, 3, 4), _t(4, 5)], {}), ([_t(4), _t(4, 5)], {}), ([_t(3, 4), _t(4)], {})],
    "conv2d": [([_t(1, 2, 5, 5), _t(4, 1, 3, 3), _t(4)], {"groups": 2, "padding": 1,
                                                          "has_bias": True})],
    "floor_divide": [([_t(6), _t(6)], {}), ([_t(6, dtype=dt.int32), _t(6, dtype=dt.int32)], {})],
    "remainder": [([_t(6), _t(6)], {}), ([_t(6, dtype=dt.int32), _t(6, dtype=dt.int32)], {})],
    "uniform": [([_t(2, dtype=dt.uint32)], {"shape": (3, 4), "low": -1.0, "high": 2.0})],
    "normal": [([_t(2, dtype=dt.uint32)], {"shape": (5,), "dtype": dt.bfloat16})],
}


def _sample(t, rng):
    if t.dtype == dt.bool_:
        return rng.random(t.shape) > 0.3
    if t.dtype.is_integer:
        values = rng.integers(-9, 10, size=t.shape)
        return np.where(values == 0, 3, values).astype(t.dtype.np_dtype)
    return rng.standard_normal(t.shape).astype(t.dtype.np_dtype)


def test_every_composite_has_a_case():
    assert set(COMPOSITE_CASES) == composites()


@pytest.mark.parametrize("op", sorted(COMPOSITE_CASES))
def test_every_composite_decomposes_to_primitives(op):
    rng = np.random.default_rng(0)
    for types, attrs in COMPOSITE_CASES[op]:
        b = GraphBuilder()
        inputs = [b.add_input(t, f"a{i}") for i, t in enumerate(types)]
        b.graph.body.results = [b.call(op, *inputs, **attrs)]
        result = decompose(b.graph)
        verify(result)
        assert not composites() & set(result.op_counts()), str(result)
        args = [_sample(t, rng) for t in types]
        (want,), (got,) = run_graph(b.graph, *args), run_graph(result, *args)
        assert got.dtype == want.dtype and got.shape == want.shape
        if want.dtype.kind in "iub" or op in ("uniform", "normal"):
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                       rtol=1e-2 if want.dtype.itemsize < 4 else 1e-5,
                                       atol=1e-2 if want.dtype.itemsize < 4 else 1e-6)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_real_graphs_keep_their_results(name):
    result = check_preserves(decompose, name, exact=False, **TOL)
    assert not composites() & set(result.op_counts())
