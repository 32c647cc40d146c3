"""Custom vjp rules of the nn composites (activations, softmax, logsumexp, the norms):
each against central finite differences of the composite's reference over
hypothesis-drawn shapes and attributes (axes, dims, eps, optional weight and bias);
the values where the rule is better than the decomposition's derivative (-inf
entries) and the conventions (relu'(0) = 0); low-precision cotangents; and each rule
built into a graph with a symbolic dim."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.ir import registry
from kiln.ir.emitter import EAGER
from kiln.ir.shapes import symbol
from kiln.testing import check_vjp_rule
from tests.autodiff.test_rules_elementwise import check_rule_in_graph

SHAPES = st.lists(st.integers(1, 3), max_size=3).map(tuple)  # rank 0 to 3, size-1 dims
SEEDS = st.integers(0, 2**32 - 1)


def away_from(rng, shape, point, lo=0.1, hi=4.0):
    return point + rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)


def softplus_input(rng, shape, beta, threshold):
    """beta * x on both sides of the threshold, 0.1 or more from it (softplus switches
    to x there)."""
    bx = rng.uniform(-6, threshold + 3, shape)
    bx = np.where(np.abs(bx - threshold) < 0.1, bx - 0.2, bx)
    return bx / beta


ACTIVATIONS = [
    ("sigmoid", {}), ("relu", {}), ("gelu", {}), ("gelu", {"approximate": "tanh"}),
    ("silu", {}), ("softplus", {}), ("softplus", {"beta": 2.0, "threshold": 3.0}),
    ("softplus", {"beta": -1.5, "threshold": 1.0}),
]


def activation_input(op, attrs, rng, shape):
    if op == "relu":
        return away_from(rng, shape, 0.0)
    if op == "softplus":
        return softplus_input(rng, shape, attrs.get("beta", 1.0), attrs.get("threshold", 20.0))
    return rng.standard_normal(shape) * 3


@pytest.mark.parametrize("op, attrs", ACTIVATIONS, ids=lambda v: str(v))
@settings(max_examples=30)
@given(shape=SHAPES, seed=SEEDS)
def test_activation_rules(op, attrs, shape, seed):
    rng = np.random.default_rng(seed)
    check_vjp_rule(op, [np.asarray(activation_input(op, attrs, rng, shape))], attrs,
                   seed=seed % 1000)


@st.composite
def dim_cases(draw):
    shape = draw(SHAPES)
    rank = len(shape)
    return shape, draw(st.integers(-max(rank, 1), max(rank, 1) - 1))


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@settings(max_examples=40)
@given(case=dim_cases(), seed=SEEDS)
def test_softmax_rules(op, case, seed):
    shape, dim = case
    x = np.asarray(np.random.default_rng(seed).standard_normal(shape) * 2)
    check_vjp_rule(op, [x], {"dim": dim}, seed=seed % 1000)


@st.composite
def axes_cases(draw):
    shape = draw(SHAPES)
    rank = len(shape)
    if draw(st.booleans()):
        return shape, None
    axes = draw(st.lists(st.integers(0, max(rank - 1, 0)), unique=True, max_size=rank))
    negate = draw(st.lists(st.booleans(), min_size=len(axes), max_size=len(axes)))
    return shape, tuple(a - rank if n else a for a, n in zip(axes, negate))


@settings(max_examples=40)
@given(case=axes_cases(), seed=SEEDS)
def test_logsumexp_rule(case, seed):
    shape, axes = case
    x = np.asarray(np.random.default_rng(seed).standard_normal(shape) * 3)
    check_vjp_rule("logsumexp", [x], {"axes": axes}, seed=seed % 1000)


@st.composite
def norm_cases(draw, op):
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple))
    attrs = {"normalized_ndim": draw(st.integers(1, len(shape))),
             "has_weight": draw(st.booleans())}
    if op == "layer_norm":
        attrs["has_bias"] = draw(st.booleans())
        attrs["eps"] = draw(st.sampled_from([1e-5, 0.1]))
    else:
        attrs["eps"] = draw(st.sampled_from([None, 0.1]))
    return shape, attrs


def norm_inputs(rng, shape, attrs):
    params = shape[len(shape) - attrs["normalized_ndim"]:]
    count = attrs["has_weight"] + attrs.get("has_bias", False)
    return [np.asarray(rng.standard_normal(shape) * 2)] + \
        [np.asarray(rng.standard_normal(params)) for _ in range(count)]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@settings(max_examples=40)
@given(data=st.data(), seed=SEEDS)
def test_norm_rules(op, data, seed):
    shape, attrs = data.draw(norm_cases(op))
    inputs = norm_inputs(np.random.default_rng(seed), shape, attrs)
    # a row of near-equal values makes 1 / std large and its finite differences coarse
    check_vjp_rule(op, inputs, attrs, seed=seed % 1000, rtol=1e-4, atol=1e-6)


# -- where the rules beat the decomposition, and the conventions ---------------------------

def vjp(op, inputs, ct, **attrs):
    attrs = registry.get(op).normalize_attrs(attrs)
    ys = EAGER.apply(op, inputs, attrs)
    return registry.get(op).vjp(EAGER, [np.asarray(ct, ys[0].dtype)], inputs, ys, **attrs)


def test_masked_entries_keep_gradients_finite():
    """-inf entries (attention masks): softmax and logsumexp send them 0, log_softmax
    its cotangent (ct - softmax * sum(ct) with softmax 0), and the rest stay finite."""
    x = np.array([[0.0, -np.inf, 1.0], [2.0, 0.5, -np.inf]])
    ct = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 4.0]])
    (soft,) = vjp("softmax", [x], ct, dim=1)
    (log_soft,) = vjp("log_softmax", [x], ct, dim=-1)
    (lse,) = vjp("logsumexp", [x], ct[:, 0], axes=(1,))
    for g in (soft, log_soft, lse):
        assert np.all(np.isfinite(g))
    assert soft[0, 1] == soft[1, 2] == lse[0, 1] == lse[1, 2] == 0
    assert log_soft[0, 1] == 2.0 and log_soft[1, 2] == 4.0


def test_relu_at_zero_and_softplus_past_the_threshold():
    (g,) = vjp("relu", [np.array([-1.0, 0.0, 2.0])], [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(g, [0.0, 0.0, 3.0])
    (g,) = vjp("softplus", [np.array([30.0, 0.0])], [3.0, 3.0])
    np.testing.assert_array_equal(g, [3.0, 1.5])


def test_scalar_softmax_has_zero_gradient():
    for op in ("softmax", "log_softmax"):
        (g,) = vjp(op, [np.array(1.5)], 2.0, dim=0)
        assert g.shape == () and g == 0


# -- low-precision floats --------------------------------------------------------------------

BF16 = np.dtype(ml_dtypes.bfloat16)
CASES = [(op, attrs, lambda rng, op=op, attrs=attrs: [activation_input(op, attrs, rng, (3, 4))])
         for op, attrs in ACTIVATIONS] + [
    ("softmax", {"dim": 0}, lambda rng: [rng.standard_normal((3, 4)) * 2]),
    ("log_softmax", {"dim": -1}, lambda rng: [rng.standard_normal((3, 4)) * 2]),
    ("logsumexp", {"axes": (1,)}, lambda rng: [rng.standard_normal((3, 4)) * 2]),
    # large values: a logsumexp rounded to bfloat16 is off by up to 0.25 here
    ("logsumexp", {"axes": None}, lambda rng: [rng.standard_normal((3, 4)) + 100]),
    ("layer_norm", {"normalized_ndim": 1, "has_weight": True, "has_bias": True},
     lambda rng: [rng.standard_normal((3, 4)) * 2, rng.standard_normal(4), rng.standard_normal(4)]),
    ("rms_norm", {"normalized_ndim": 2, "has_weight": True},
     lambda rng: [rng.standard_normal((3, 4)) * 2, rng.standard_normal((3, 4))]),
]
IDS = [f"{op}-{i}" for i, (op, _, _) in enumerate(CASES)]


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (BF16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("op, attrs, make", CASES, ids=IDS)
def test_low_precision_cotangents(op, attrs, make, dtype, tol):
    """Operand dtype and shape, and close to the float64 rule at the same rounded inputs
    (errors against the largest entry: a rounded y loses digits in 1 - y)."""
    rng = np.random.default_rng(3)
    low = [np.asarray(a).astype(dtype) for a in make(rng)]
    high = [a.astype(np.float64) for a in low]
    attrs = registry.get(op).normalize_attrs(attrs)
    ys = EAGER.apply(op, low, attrs)
    ct = rng.standard_normal(ys[0].shape).astype(dtype)
    got = registry.get(op).vjp(EAGER, [ct], low, ys, **attrs)
    want = registry.get(op).vjp(EAGER, [ct.astype(np.float64)], high,
                                EAGER.apply(op, high, attrs), **attrs)
    assert len(got) == len(low)
    for x, g, w in zip(low, got, want):
        assert g.dtype == x.dtype and g.shape == x.shape
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=tol, atol=tol * np.max(np.abs(w)))


# -- graphs with symbolic dims ----------------------------------------------------------------

@pytest.mark.parametrize("op, attrs, make", CASES, ids=IDS)
def test_rule_builds_a_graph_with_symbolic_dims(op, attrs, make):
    inputs = [np.asarray(a, np.float32) for a in make(np.random.default_rng(5))]
    # the leading dim symbolic; a norm's weight and bias span the trailing dims
    shapes = [(symbol("B"),) + a.shape[1:] if i == 0 or a.ndim == 2 else a.shape
              for i, a in enumerate(inputs)]
    check_rule_in_graph(op, inputs, attrs, shapes, {"B": 3})


def test_every_nn_rule_is_tested_here():
    with_rules = {name for name, op in registry.all_ops().items()
                  if op.family == "nn" and op.vjp is not None}
    tested = {op for op, _, _ in CASES}
    assert with_rules == tested, f"rules without tests: {sorted(with_rules - tested)}"
