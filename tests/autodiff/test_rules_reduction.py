"""vjp rules of the reduction family against central finite differences: reductions,
scans and sort over hypothesis-drawn shapes and axes, inputs away from the points
where they are not differentiable (distinct values for max/min/sort); products exact
at zeros; ties of reduce_max split equally."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.ir import registry
from kiln.ir.emitter import EAGER
from kiln.testing import check_vjp_rule
from tests.autodiff.test_rules_shape import BF16, assert_rules_complete, traced_vjp

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
nonscalar = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
seeds = st.integers(0, 2**16)


def distinct(rng, shape):
    """Values at least 0.5 apart (a shuffled ramp, jittered): finite differences of max,
    min and sort never cross a tie."""
    n = int(np.prod(shape))
    return (rng.permutation(n) + rng.uniform(-0.2, 0.2, n)).reshape(shape) / 2


def away_from_zero(rng, shape):
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1.5, shape)


@st.composite
def reductions(draw):
    shape = draw(shapes)
    rank = len(shape)
    axes = draw(st.lists(st.integers(-rank, rank - 1), unique_by=lambda a: a % rank)) if rank else \
        draw(st.sampled_from([[], [0]]))
    return shape, tuple(axes)


def test_every_differentiable_reduction_op_has_a_rule():
    assert_rules_complete("reduction")


@settings(max_examples=20)
@given(reductions(), seeds)
def test_reduce_sum(problem, seed):
    shape, axes = problem
    x = np.random.default_rng(seed).standard_normal(shape)
    check_vjp_rule("reduce_sum", [x], {"axes": axes})


@settings(max_examples=20)
@given(reductions(), seeds)
def test_reduce_prod(problem, seed):
    shape, axes = problem
    x = away_from_zero(np.random.default_rng(seed), shape)
    check_vjp_rule("reduce_prod", [x], {"axes": axes})


@pytest.mark.parametrize("zeros", [1, 2, 3])
def test_reduce_prod_is_exact_at_zeros(zeros):
    # [a, 0, ...] over axis 1: one zero gives the product of the rest there, more give 0
    x = np.array([[2.0, 3.0, 5.0, 7.0]] * 2)
    x[0, :zeros] = 0.0
    check_vjp_rule("reduce_prod", [x], {"axes": (1,)})
    y = EAGER.reduce_prod(x, axes=(1,))
    (g,) = registry.get("reduce_prod").vjp(EAGER, [np.ones(2)], [x], [y], axes=(1,))
    np.testing.assert_array_equal(g[0], [3.0 * 5 * 7, 0, 0, 0] if zeros == 1 else [0.0] * 4)
    np.testing.assert_array_equal(g[1], [105.0, 70.0, 42.0, 30.0])


@pytest.mark.parametrize("op", ["reduce_max", "reduce_min"])
@settings(max_examples=15)
@given(problem=reductions(), seed=seeds)
def test_reduce_max_min(op, problem, seed):
    shape, axes = problem
    check_vjp_rule(op, [distinct(np.random.default_rng(seed), shape)], {"axes": axes})


@pytest.mark.parametrize("op", ["reduce_max", "reduce_min"])
def test_reduce_max_min_split_ties_equally(op):
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    if op == "reduce_min":
        x = -x
    y = EAGER.call(op, x, axes=(1,))
    (g,) = registry.get(op).vjp(EAGER, [np.array([1.0, 6.0])], [x], [y], axes=(1,))
    np.testing.assert_array_equal(g, [[0.0, 0.5, 0.5, 0.0], [1.5, 1.5, 1.5, 1.5]])


@st.composite
def scans(draw):
    shape = draw(shapes)
    axis = draw(st.integers(-max(len(shape), 1), max(len(shape), 1) - 1))
    return shape, dict(axis=axis, reverse=draw(st.booleans()))


@settings(max_examples=15)
@given(scans(), seeds)
def test_cumsum(problem, seed):
    shape, attrs = problem
    check_vjp_rule("cumsum", [np.random.default_rng(seed).standard_normal(shape)], attrs)


@settings(max_examples=20)
@given(scans(), seeds, st.booleans())
def test_cumprod(problem, seed, with_zeros):
    shape, attrs = problem
    rng = np.random.default_rng(seed)
    x = away_from_zero(rng, shape)
    if with_zeros:  # exact at zeros: finite differences of a product through 0 are exact
        x = np.where(rng.random(shape) < 0.3, 0.0, x)
    check_vjp_rule("cumprod", [x], attrs)


@pytest.mark.parametrize("op", ["cummax", "cummin"])
@settings(max_examples=15)
@given(problem=scans(), seed=seeds)
def test_cummax_cummin(op, problem, seed):
    shape, attrs = problem
    check_vjp_rule(op, [distinct(np.random.default_rng(seed), shape)], attrs)


def test_cummax_sends_ties_to_the_most_recent_holder():
    x = np.array([1.0, 3.0, 2.0, 3.0, 0.0])
    ct = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    rule = registry.get("cummax").vjp
    (g,) = rule(EAGER, [ct], [x], [EAGER.cummax(x, axis=0)], axis=0, reverse=False)
    np.testing.assert_array_equal(g, [1.0, 6.0, 0.0, 24.0, 0.0])
    (g,) = rule(EAGER, [ct], [x], [EAGER.cummax(x, axis=0, reverse=True)], axis=0, reverse=True)
    np.testing.assert_array_equal(g, [0.0, 3.0, 0.0, 12.0, 16.0])  # scanned 4, 3, ..., 0


@settings(max_examples=20)
@given(shapes, seeds, st.booleans(), st.data())
def test_sort(shape, seed, descending, data):
    axis = data.draw(st.integers(-max(len(shape), 1), max(len(shape), 1) - 1))
    grads = check_vjp_rule("sort", [distinct(np.random.default_rng(seed), shape)],
                           {"axis": axis, "descending": descending})
    assert len(grads) == 1


def test_sort_without_value_cotangent_gives_none():
    x = np.array([3.0, 1.0])
    values, indices = EAGER.sort(x)
    assert registry.get("sort").vjp(EAGER, [None, None], [x], [values, indices], axis=-1,
                                    descending=False) == [None]


@pytest.mark.parametrize("op, attrs", [
    ("reduce_sum", {"axes": (0,)}), ("reduce_prod", {"axes": (0, 1)}),
    ("reduce_max", {"axes": (1,)}), ("cumsum", {"axis": 0}), ("cumprod", {"axis": 0}),
    ("cummax", {"axis": 0, "reverse": True}), ("sort", {"axis": 0}),
])
def test_rules_trace_on_symbolic_dims(op, attrs):
    x = distinct(np.random.default_rng(0), (5, 3))
    traced_vjp(op, [x], attrs, {(0, 0): "B"})


@pytest.mark.parametrize("op, attrs", [
    ("reduce_prod", {"axes": (1,)}), ("reduce_max", {"axes": (1,)}), ("cumprod", {"axis": 1}),
    ("cummin", {"axis": 1}), ("sort", {"axis": 1}), ("reduce_sum", {"axes": (0, 1)}),
])
def test_low_precision_rules_keep_the_dtype(op, attrs):
    """bf16 cotangents stay bf16 and agree with the float64 rule on the same values."""
    rule, attrs = registry.get(op).vjp, registry.get(op).normalize_attrs(attrs)
    grads = []
    for dtype in (BF16, np.dtype(np.float64)):
        x = (distinct(np.random.default_rng(0), (3, 4)) + 0.25).astype(BF16).astype(dtype)
        ys = EAGER.apply(op, [x], attrs)
        (g,) = rule(EAGER, [np.ones(y.shape, dtype) if y.dtype == dtype else None for y in ys],
                    [x], ys, **attrs)
        assert g.dtype == dtype and g.shape == x.shape
        grads.append(g.astype(np.float64))
    np.testing.assert_allclose(grads[0], grads[1], rtol=2e-2, atol=2e-2)
