"""vjp rules of the elementwise primitives: each against central finite differences of
its numpy reference (`kiln.testing.check_vjp_rule`) over hypothesis-drawn shapes, with
inputs away from the points where the op is not differentiable; the conventions at
those points (ties, zeros, clamp bounds) by hand; complex cotangents along imaginary
directions; low-precision cotangents; each rule built into a graph with a symbolic
dim; and a walk over the family that fails when a differentiable op lacks a rule."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln import ShapeVar
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER, GraphBuilder
from kiln.ir.shapes import evaluate, symbol
from kiln.ir.types import TensorType
from kiln.testing import check_vjp_rule

# small shapes: rank 0 to 3, size-1 dims included
SHAPES = st.lists(st.integers(1, 3), max_size=3).map(tuple)
SEEDS = st.integers(0, 2**32 - 1)


# -- input makers: (rng, shape) -> float64 array, away from non-differentiable points ------

def normal(rng, shape):
    return rng.standard_normal(shape)


def uniform(lo, hi):
    return lambda rng, shape: rng.uniform(lo, hi, shape)


def away_from_zero(lo=0.5, hi=3.0):
    return lambda rng, shape: rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)


def pred(rng, shape):
    return rng.random(shape) < 0.5


def rem_operands(rng, shape):
    """(x, y) with x / y at least 0.1 from an integer: fmod jumps at integers."""
    y = away_from_zero()(rng, shape)
    return (rng.integers(-3, 4, shape) + rng.uniform(0.1, 0.9, shape)) * y, y


def distinct(rng, shape):
    """(x, y) at least 0.1 apart: max and min are not differentiable at ties."""
    x = rng.standard_normal(shape)
    return x, x + away_from_zero(0.1, 1.0)(rng, shape)


def clamp_operands(rng, shape):
    """(x, lo, hi) with x below, inside or above [lo, hi] (or lo > hi), 0.1 or more from
    either bound."""
    lo = rng.uniform(-1, 0, shape)
    crossed = rng.random(shape) < 0.2  # lo > hi: the result is hi
    hi = lo + np.where(crossed, -rng.uniform(0.2, 1, shape), rng.uniform(0.5, 2, shape))
    low, high = np.minimum(lo, hi), np.maximum(lo, hi)
    where = rng.integers(0, 3, shape)
    x = np.select([where == 0, where == 1], [low - rng.uniform(0.1, 1, shape), (low + high) / 2],
                  high + rng.uniform(0.1, 1, shape))
    return x, lo, hi


# op, input makers (a maker returning a tuple fills several operands), attrs, and
# check_vjp_rule's options
LINEAR = {"eps": 0.05, "rtol": 1e-3, "atol": 1e-3}  # linear: only float32 rounding errs
CASES = [
    ("neg", [normal], {}, {}),
    ("abs", [away_from_zero(0.1)], {}, {}),
    ("exp", [uniform(-3, 3)], {}, {}),
    ("expm1", [uniform(-3, 3)], {}, {}),
    ("log", [uniform(0.1, 5)], {}, {}),
    ("log1p", [uniform(-0.9, 5)], {}, {}),
    ("sin", [uniform(-4, 4)], {}, {}),
    ("cos", [uniform(-4, 4)], {}, {}),
    ("tan", [uniform(-1.2, 1.2)], {}, {}),
    ("asin", [uniform(-0.9, 0.9)], {}, {}),
    ("acos", [uniform(-0.9, 0.9)], {}, {}),
    ("atan", [uniform(-4, 4)], {}, {}),
    ("sinh", [uniform(-3, 3)], {}, {}),
    ("cosh", [uniform(-3, 3)], {}, {}),
    ("tanh", [uniform(-3, 3)], {}, {}),
    ("sqrt", [uniform(0.1, 5)], {}, {}),
    ("rsqrt", [uniform(0.1, 5)], {}, {}),
    ("erf", [uniform(-3, 3)], {}, {}),
    ("erfc", [uniform(-3, 3)], {}, {}),
    ("add", [normal, normal], {}, {}),
    ("sub", [normal, normal], {}, {}),
    ("mul", [normal, normal], {}, {}),
    ("div", [normal, away_from_zero()], {}, {}),
    ("rem", [rem_operands], {}, {}),
    ("pow", [uniform(0.5, 3), uniform(-2, 2)], {}, {}),
    ("max", [distinct], {}, {}),
    ("min", [distinct], {}, {}),
    ("atan2", [normal, away_from_zero()], {}, {}),
    ("select", [pred, normal, normal], {}, {}),
    ("clamp", [clamp_operands], {}, {}),
    ("convert", [normal], {"dtype": dt.float64}, {}),
    ("convert", [normal], {"dtype": dt.float32}, LINEAR),
    ("convert", [normal], {"dtype": dt.complex64}, LINEAR),
]
IDS = [f"{op}-{attrs['dtype'].short}" if attrs else op for op, _, attrs, _ in CASES]


def make_inputs(makers, rng, shape):
    arrays = []
    for make in makers:
        made = make(rng, shape)
        arrays.extend(made if isinstance(made, tuple) else [made])
    return [np.asarray(a) for a in arrays]


@pytest.mark.parametrize("op, makers, attrs, options", CASES, ids=IDS)
@settings(max_examples=30)
@given(shape=SHAPES, seed=SEEDS)
def test_rule_matches_finite_differences(op, makers, attrs, options, shape, seed):
    rng = np.random.default_rng(seed)
    check_vjp_rule(op, make_inputs(makers, rng, shape), attrs, seed=seed % 1000, **options)


# -- complex operands -----------------------------------------------------------------------

def check_complex_vjp(op, inputs, attrs=None, *, eps=1e-3, tol=3e-3):
    """check_vjp_rule draws real cotangents and moves inputs along real directions only,
    so it sees only part of a complex cotangent: here cotangents are complex, and each
    coordinate moves along 1 and i. Cotangents are dL/dRe + i dL/dIm, so <v, g> (real
    part) is the derivative along v."""
    opdef = registry.get(op)
    attrs = opdef.normalize_attrs(attrs or {})
    rng = np.random.default_rng(0)
    ys = EAGER.apply(op, inputs, attrs)
    cts = [(rng.standard_normal(y.shape) + (1j * rng.standard_normal(y.shape) if y.dtype.kind == "c"
                                             else 0)).astype(y.dtype) for y in ys]
    grads = opdef.vjp(EAGER, cts, list(inputs), ys, **attrs)

    def objective(xs):
        return sum(np.vdot(c.astype(np.complex128), y.astype(np.complex128)).real
                   for c, y in zip(cts, EAGER.apply(op, xs, attrs)))

    for i, (x, g) in enumerate(zip(inputs, grads)):
        if x.dtype == np.bool_:
            assert g is None
            continue
        assert g.dtype == x.dtype and g.shape == x.shape
        for j in range(x.size):
            for unit in ((1, 1j) if x.dtype.kind == "c" else (1,)):
                v = np.zeros(x.shape, x.dtype)
                v.flat[j] = unit
                plus, minus = list(inputs), list(inputs)
                plus[i], minus[i] = x + eps * v, x - eps * v
                numeric = (objective(plus) - objective(minus)) / (2 * eps)
                analytic = np.vdot(v.astype(np.complex128), g.astype(np.complex128)).real
                assert math.isclose(analytic, numeric, rel_tol=tol, abs_tol=tol), \
                    f"{op} operand {i} entry {j} along {unit}: {analytic} vs {numeric}"


def complex_normal(rng, shape, re_low=None):
    re = rng.uniform(re_low, 2, shape) if re_low is not None else rng.standard_normal(shape)
    return (re + 1j * rng.standard_normal(shape)).astype(np.complex64)


COMPLEX_CASES = [  # log, sqrt, pow: right half-plane, away from the branch cut
    ("neg", [None]), ("abs", [None]), ("exp", [None]), ("log", [0.3]), ("sin", [None]),
    ("cos", [None]), ("tanh", [None]), ("sqrt", [0.3]), ("real", [None]), ("imag", [None]),
    ("add", [None, None]), ("sub", [None, None]), ("mul", [None, None]), ("div", [None, 0.5]),
    ("pow", [0.3, None]), ("select", ["pred", None, None]),
]


@pytest.mark.parametrize("op, lows", COMPLEX_CASES, ids=[c[0] for c in COMPLEX_CASES])
def test_complex_rules_conjugate(op, lows):
    rng = np.random.default_rng(1)
    inputs = [rng.random((2, 3)) < 0.5 if low == "pred" else complex_normal(rng, (2, 3), low)
              for low in lows]
    if op == "pow":
        inputs[1] = (inputs[1] * 0.5).astype(np.complex64)
    check_complex_vjp(op, inputs)


def test_complex_conversions():
    rng = np.random.default_rng(2)
    check_complex_vjp("complex", [rng.standard_normal((2, 2)).astype(np.float32)
                                  for _ in range(2)])
    for x in (rng.standard_normal((2, 2)).astype(np.float32), complex_normal(rng, (2, 2))):
        check_complex_vjp("convert", [x], {"dtype": dt.complex64})


# -- conventions at the non-differentiable points -----------------------------------------

def vjp(op, inputs, ct, **attrs):
    ys = EAGER.apply(op, inputs, attrs)
    return registry.get(op).vjp(EAGER, [np.asarray(ct, ys[0].dtype)], inputs, ys, **attrs)


def f64(*values):
    return [np.asarray(v, np.float64) for v in values]


def test_abs_at_zero_is_zero():
    (g,) = vjp("abs", f64([0.0, -2.0, 3.0]), [5.0, 5.0, 5.0])
    np.testing.assert_array_equal(g, [0.0, -5.0, 5.0])
    (g,) = vjp("abs", [np.array([0, 3 + 4j], np.complex64)], [5.0, 5.0])
    np.testing.assert_allclose(g, [0, 3 + 4j], rtol=1e-6)


@pytest.mark.parametrize("op", ["max", "min"])
def test_extremum_ties_split_and_nan_sends_nothing(op):
    x, y = f64([1.0, 2.0, 3.0, np.nan], [1.0, 5.0, -1.0, 0.0])
    gx, gy = vjp(op, [x, y], [4.0, 4.0, 4.0, 4.0])
    first = [4.0, 0.0, 4.0] if op == "max" else [4.0, 4.0, 0.0]
    np.testing.assert_array_equal(gx, [2.0] + first[1:] + [0.0])
    np.testing.assert_array_equal(gy, [2.0] + [4.0 - v for v in first[1:]] + [0.0])


def test_clamp_sends_each_cotangent_to_one_operand():
    # x == lo, x == hi, inside, below, above, lo == hi with x below and above, lo > hi
    x, lo, hi = f64([0, 1, 0.5, -1, 2, -1, 2, 0.5],
                    [0, 0, 0.0, 0, 0, 1, 1, 2.0],
                    [1, 1, 1.0, 1, 1, 1, 1, 1.0])
    gx, glo, ghi = vjp("clamp", [x, lo, hi], np.ones(8))
    np.testing.assert_array_equal(gx, [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(glo, [0, 0, 0, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(ghi, [0, 0, 0, 0, 1, 0, 1, 1])


def test_pow_at_zero_is_finite():
    # x == 0: y's gradient is 0; y == 0: x's gradient is 0, also at 0 ** 0
    x, y = f64([0, 0, 0, 0, 2, -2], [2, 1, 0.5, 0, 0, 3])
    gx, gy = vjp("pow", [x, y], np.ones(6))
    np.testing.assert_array_equal(gx, [0, 1, np.inf, 0, 0, 12])
    np.testing.assert_array_equal(gy[:5], [0, 0, 0, 0, math.log(2)])
    assert np.isnan(gy[5])  # (-2) ** y is real only at integer y


def test_rem_uses_the_truncated_quotient():
    x, y = f64([7.5, -7.5, 7.5, 0.3], [2, 2, -2, 0.1])
    gx, gy = vjp("rem", [x, y], np.ones(4))
    np.testing.assert_array_equal(gx, np.ones(4))
    # fmod(0.3, 0.1) is about 0.1 (0.3 / 0.1 rounds to 3.0, but 0.1 is above one tenth)
    np.testing.assert_array_equal(gy, [-3, 3, 3, -2])


def test_operands_without_cotangents():
    x = f64([1.0, -2.0])[0]
    assert vjp("select", [np.array([True, False]), x, x], [1.0, 1.0])[0] is None
    assert vjp("convert", [np.array([1, 2], np.int32)], [1.0, 1.0], dtype=dt.float32) == [None]
    (g,) = vjp("convert", [x], [1 + 2j, 3 - 1j], dtype=dt.complex64)  # the real part
    np.testing.assert_array_equal(g, [1.0, 3.0])


# -- low-precision floats ---------------------------------------------------------------------

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (BF16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("op, makers, attrs, options", CASES, ids=IDS)
def test_low_precision_cotangents(op, makers, attrs, options, dtype, tol):
    """Operand dtype and shape, and close to the float64 rule at the same (rounded) inputs;
    errors measured against the largest entry (1 - y^2 with a rounded y loses digits)."""
    rng = np.random.default_rng(3)
    low = [a if a.dtype == np.bool_ else a.astype(dtype) for a in make_inputs(makers, rng, (3, 4))]
    high = [a if a.dtype == np.bool_ else a.astype(np.float64) for a in low]
    ys = EAGER.apply(op, low, attrs)
    ct = rng.standard_normal(ys[0].shape).astype(ys[0].dtype)
    got = registry.get(op).vjp(EAGER, [ct], low, ys, **attrs)
    ct64 = ct.astype(np.complex128 if ct.dtype.kind == "c" else np.float64)
    want = registry.get(op).vjp(EAGER, [ct64], high, EAGER.apply(op, high, attrs), **attrs)
    for x, g, w in zip(low, got, want):
        if x.dtype == np.bool_:
            assert g is None
            continue
        assert g.dtype == x.dtype and g.shape == x.shape
        scale = np.max(np.abs(w))
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=tol, atol=tol * scale)


# -- graphs with symbolic dims ----------------------------------------------------------------

def _bind(value, bindings):
    if isinstance(value, (tuple, list)):
        return type(value)(_bind(v, bindings) for v in value)
    return evaluate(value, bindings) if isinstance(value, sympy.Basic) else value


def run_graph(graph, args, bindings):
    """A tiny interpreter: each node's reference with its symbols bound."""
    env = dict(zip(graph.inputs, args))
    for node in graph.nodes:
        attrs = {k: _bind(v, bindings) for k, v in node.attrs.items()}
        env.update(zip(node.results, EAGER.apply(node.op, [env[v] for v in node.operands], attrs)))
    return [env[v] for v in graph.outputs]


def check_rule_in_graph(op, inputs, attrs, sym_shapes, bindings):
    """Build op's rule into a graph whose operands have `sym_shapes`: each cotangent has its
    operand's type, and run with `bindings` it equals the rule run eagerly."""
    opdef = registry.get(op)
    attrs = opdef.normalize_attrs(attrs)
    builder = GraphBuilder()
    for name in bindings:
        builder.graph.shape_vars[name] = ShapeVar(name)
    xs = [builder.add_input(TensorType(dt.from_numpy(a.dtype), s))
          for a, s in zip(inputs, sym_shapes)]
    ys = [builder.add_input(t) for t in opdef.infer([x.type for x in xs], attrs)]
    cts = [builder.add_input(y.type) for y in ys]
    grads = opdef.vjp(builder, cts, xs, ys, **attrs)
    assert len(grads) == len(xs)
    for x, g in zip(xs, grads):
        assert g is None or g.type == x.type, f"{op}: cotangent {g.type} for operand {x.type}"
    builder.graph.body.results = [g for g in grads if g is not None]
    eager_ys = EAGER.apply(op, inputs, attrs)
    rng = np.random.default_rng(4)
    eager_cts = [rng.standard_normal(y.shape).astype(y.dtype) for y in eager_ys]
    actual = run_graph(builder.graph, [*inputs, *eager_ys, *eager_cts], bindings)
    expected = [g for g in opdef.vjp(EAGER, eager_cts, inputs, eager_ys, **attrs) if g is not None]
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        np.testing.assert_allclose(a, e, rtol=1e-12)


@pytest.mark.parametrize("op, makers, attrs, options", CASES, ids=IDS)
def test_rule_builds_a_graph_with_symbolic_dims(op, makers, attrs, options):
    inputs = make_inputs(makers, np.random.default_rng(5), (3, 2))
    check_rule_in_graph(op, inputs, attrs, [(symbol("B"), 2)] * len(inputs), {"B": 3})


def test_complex_rules_build_graphs():
    rng = np.random.default_rng(6)
    z = [complex_normal(rng, (3,), 0.3) for _ in range(2)]
    for op in ("mul", "div", "pow", "exp", "abs", "real"):
        n = registry.get(op).num_operands
        check_rule_in_graph(op, z[:n], {}, [(symbol("B"),)] * n, {"B": 3})


# -- the family walk --------------------------------------------------------------------------

ELEMENTWISE = {name: op for name, op in registry.all_ops().items() if op.family == "elementwise"}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_differentiable_ops_have_a_tested_rule(name):
    op = ELEMENTWISE[name]
    tested = {case[0] for case in CASES} | {case[0] for case in COMPLEX_CASES} | {"complex"}
    if op.differentiable:
        assert callable(op.vjp), f"{name} is differentiable but has no vjp rule"
        assert name in tested, f"{name}'s vjp rule has no test in {__name__}"
    else:
        assert op.vjp is None, f"{name} is not differentiable but has a vjp rule"
