"""vjp rules of the shape family against central finite differences (kiln.testing), over
hypothesis-drawn shapes and attributes; duplicate indices accumulate; the rules also
trace into graphs on symbolic dims and agree there with their eager run.

`traced_vjp` and `assert_rules_complete` are shared with the other test_rules_* files.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER, GraphBuilder
from kiln.ir.interpret import concrete_attrs, run_graph
from kiln.ir.registry import COMPOSITE
from kiln.ir.shapes import ShapeVar, symbol
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.testing import check_vjp_rule

BF16 = np.dtype(ml_dtypes.bfloat16)


# -- shared helpers ---------------------------------------------------------------------

def assert_rules_complete(family: str) -> None:
    """Every differentiable op of the family has a vjp rule (composites are
    differentiated through their decomposition), and no non-differentiable one has."""
    ops = {n: op for n, op in registry.all_ops().items() if op.family == family}
    assert ops, f"no ops in family {family}"
    missing = sorted(n for n, op in ops.items()
                     if op.differentiable and op.kind != COMPOSITE and not callable(op.vjp))
    assert not missing, f"differentiable {family} ops without a vjp rule: {missing}"
    stray = sorted(n for n, op in ops.items() if not op.differentiable and op.vjp is not None)
    assert not stray, f"non-differentiable ops with a vjp rule: {stray}"


def traced_vjp(op, inputs, attrs=None, symbols=None, seed=0):
    """Trace `op` and its vjp rule into one graph, run it with the interpreter and check
    it against the rule's eager run on the same cotangents. symbols maps
    (operand, dim) to a shape-variable name, making that dim symbolic; attrs may use
    the symbols. Returns the graph."""
    opdef = registry.get(op)
    symbols = symbols or {}
    attrs = opdef.normalize_attrs(dict(attrs or {}))
    b = GraphBuilder()
    bindings = {}
    for (i, axis), name in symbols.items():
        b.graph.shape_vars[name] = ShapeVar(name)
        bindings[name] = inputs[i].shape[axis]
    xs = [b.add_input(TensorType(dt.from_numpy(x.dtype), tuple(
        symbol(symbols[i, a]) if (i, a) in symbols else n for a, n in enumerate(x.shape))))
        for i, x in enumerate(inputs)]
    ys = b.apply(op, xs, attrs)
    floats = [y.type.dtype.is_inexact for y in ys]
    cts = [b.add_input(y.type) if f else None for y, f in zip(ys, floats)]
    grads = opdef.vjp(b, cts, xs, ys, **attrs)
    assert len(grads) == len(xs)
    for g, x in zip(grads, xs):
        assert g is None or g.type == x.type, f"{op}: cotangent {g.type} for operand {x.type}"
    b.graph.body.results = [g for g in grads if g is not None]
    verify(b.graph)

    eager_attrs = concrete_attrs(attrs, bindings)
    results = EAGER.apply(op, list(inputs), eager_attrs)
    rng = np.random.default_rng(seed)
    ct_arrays = [rng.standard_normal(r.shape).astype(r.dtype) for r, f in zip(results, floats) if f]
    ct_iter = iter(ct_arrays)
    eager_cts = [next(ct_iter) if f else None for f in floats]
    expected = [g for g in opdef.vjp(EAGER, eager_cts, list(inputs), results, **eager_attrs)
                if g is not None]
    got = run_graph(b.graph, *inputs, *ct_arrays)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)
    return b.graph


def normal(rng, shape):
    return rng.standard_normal(shape)


shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
nonscalar = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
seeds = st.integers(0, 2**16)


def test_every_differentiable_shape_op_has_a_rule():
    assert_rules_complete("shape")


# -- reshape, broadcast_in_dim, transpose, reverse -----------------------------------------

@settings(max_examples=15)
@given(shapes, seeds, st.integers(0, 2))
def test_reshape(shape, seed, kind):
    n = int(np.prod(shape))
    target = [(n,), tuple(reversed(shape)), (1,) + shape + (1,)][kind]
    check_vjp_rule("reshape", [normal(np.random.default_rng(seed), shape)], {"shape": target})


@st.composite
def broadcasts(draw):
    out = draw(shapes)
    dims = tuple(d for d in range(len(out)) if draw(st.booleans()))
    operand = tuple(1 if draw(st.booleans()) else out[d] for d in dims)
    return operand, out, dims


@settings(max_examples=25)
@given(broadcasts(), seeds)
def test_broadcast_in_dim(problem, seed):
    operand, out, dims = problem
    check_vjp_rule("broadcast_in_dim", [normal(np.random.default_rng(seed), operand)],
                   {"shape": out, "broadcast_dimensions": dims})


@settings(max_examples=15)
@given(shapes, st.data())
def test_transpose(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    check_vjp_rule("transpose", [normal(np.random.default_rng(0), shape)],
                   {"permutation": tuple(perm)})


@settings(max_examples=15)
@given(nonscalar, st.data())
def test_reverse(shape, data):
    rank = len(shape)
    dims = data.draw(st.lists(st.integers(-rank, rank - 1), unique_by=lambda a: a % rank))
    check_vjp_rule("reverse", [normal(np.random.default_rng(1), shape)], {"dims": tuple(dims)})


# -- slice, pad, concatenate -------------------------------------------------------------

@st.composite
def slices(draw):
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple))
    start, limit, stride = [], [], []
    for d in shape:
        s = draw(st.integers(0, d))
        start.append(s)
        limit.append(draw(st.integers(s, d)))
        stride.append(draw(st.integers(1, 3)))
    return shape, dict(start=tuple(start), limit=tuple(limit),
                       stride=tuple(stride) if draw(st.booleans()) else None)


@settings(max_examples=30)
@given(slices(), seeds)
def test_slice(problem, seed):
    shape, attrs = problem
    check_vjp_rule("slice", [normal(np.random.default_rng(seed), shape)], attrs)


@st.composite
def pads(draw):
    shape = draw(shapes)
    pick = lambda hi: tuple(draw(st.integers(0, hi)) for _ in shape)  # noqa: E731
    return shape, dict(low=pick(2), high=pick(2), interior=pick(2) if draw(st.booleans()) else None)


@settings(max_examples=25)
@given(pads(), seeds)
def test_pad(problem, seed):
    shape, attrs = problem
    rng = np.random.default_rng(seed)
    check_vjp_rule("pad", [normal(rng, shape), normal(rng, ())], attrs)


@settings(max_examples=20)
@given(nonscalar, st.lists(st.integers(0, 3), min_size=1, max_size=3), st.data())
def test_concatenate(shape, sizes, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    a = axis % len(shape)
    rng = np.random.default_rng(len(sizes))
    xs = [normal(rng, shape[:a] + (n,) + shape[a + 1:]) for n in sizes]
    check_vjp_rule("concatenate", xs, {"dimension": axis})


# -- dynamic slices ------------------------------------------------------------------------

@st.composite
def windows(draw):
    shape = draw(nonscalar)
    sizes = tuple(draw(st.integers(0, d)) for d in shape)
    # starts out of range too: they clamp, in the op and in its rule alike
    starts = [np.array(draw(st.integers(-2, d + 2)), dtype=np.int32) for d in shape]
    return shape, sizes, starts


@settings(max_examples=20)
@given(windows(), seeds)
def test_dynamic_slice(problem, seed):
    shape, sizes, starts = problem
    grads = check_vjp_rule("dynamic_slice", [normal(np.random.default_rng(seed), shape), *starts],
                           {"sizes": sizes})
    assert grads[1:] == [None] * len(starts)


@settings(max_examples=20)
@given(windows(), seeds)
def test_dynamic_update_slice(problem, seed):
    shape, sizes, starts = problem
    rng = np.random.default_rng(seed)
    x, update = normal(rng, shape), normal(rng, sizes)
    grads = check_vjp_rule("dynamic_update_slice", [x, update, *starts])
    assert grads[2:] == [None] * len(starts)


# -- take, take_along, scatter_along -----------------------------------------------------

@st.composite
def takes(draw):
    shape = draw(nonscalar)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    n = shape[axis]
    idx_shape = draw(st.lists(st.integers(1, 3), max_size=2).map(tuple))
    indices = np.array(draw(st.lists(st.integers(-n, n - 1), min_size=int(np.prod(idx_shape)),
                                     max_size=int(np.prod(idx_shape))))).reshape(idx_shape)
    return shape, axis, indices.astype(draw(st.sampled_from([np.int32, np.int64])))


@settings(max_examples=25)
@given(takes(), seeds)
def test_take(problem, seed):
    shape, axis, indices = problem
    grads = check_vjp_rule("take", [normal(np.random.default_rng(seed), shape), indices],
                           {"axis": axis})
    assert grads[1] is None


@st.composite
def alongs(draw):
    shape = draw(nonscalar)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    a = axis % len(shape)
    idx_shape = tuple(draw(st.integers(1, 4)) if i == a else draw(st.integers(1, d))
                      for i, d in enumerate(shape))
    n = shape[a]
    indices = draw(st.lists(st.integers(-n, n - 1), min_size=int(np.prod(idx_shape)),
                            max_size=int(np.prod(idx_shape))))
    return shape, axis, np.array(indices, dtype=np.int64).reshape(idx_shape)


@settings(max_examples=25)
@given(alongs(), seeds)
def test_take_along(problem, seed):
    shape, axis, indices = problem
    grads = check_vjp_rule("take_along", [normal(np.random.default_rng(seed), shape), indices],
                           {"axis": axis})
    assert grads[1] is None


@settings(max_examples=30)
@given(alongs(), seeds, st.sampled_from(["add", "set"]), st.integers(0, 1))
def test_scatter_along(problem, seed, mode, extra):
    shape, axis, indices = problem
    rng = np.random.default_rng(seed)
    # updates may be larger than indices: the rest of it is unused (zero cotangent)
    updates = normal(rng, tuple(n + extra for n in indices.shape))
    grads = check_vjp_rule("scatter_along", [normal(rng, shape), indices, updates],
                           {"axis": axis, "mode": mode})
    assert grads[1] is None


def test_take_accumulates_duplicate_indices():
    x = np.arange(12.0).reshape(4, 3)
    indices = np.array([[2, 2], [0, -2]])  # row 2 three times (-2 is 2)
    ct = np.ones((2, 2, 3))
    y = EAGER.take(x, indices, axis=0)
    (g, none) = registry.get("take").vjp(EAGER, [ct], [x, indices], [y], axis=0)
    np.testing.assert_array_equal(g, [[1.0] * 3, [0.0] * 3, [3.0] * 3, [0.0] * 3])
    assert none is None


def test_take_along_accumulates_duplicate_indices():
    x = np.arange(6.0).reshape(2, 3)
    indices = np.array([[1, 1, 1, 0], [2, 2, -1, 0]])
    ct = np.array([[1.0, 2.0, 4.0, 8.0], [1.0, 2.0, 4.0, 8.0]])
    (g, _) = registry.get("take_along").vjp(EAGER, [ct], [x, indices],
                                            [EAGER.take_along(x, indices, axis=1)], axis=1)
    np.testing.assert_array_equal(g, [[8.0, 7.0, 0.0], [8.0, 0.0, 7.0]])


def test_scatter_set_duplicates_credit_the_update_that_landed():
    x, indices, updates = np.zeros(3), np.array([1, 1, 2]), np.array([5.0, 6.0, 7.0])
    y = EAGER.scatter_along(x, indices, updates, axis=0, mode="set")
    landed = [i for i in range(2) if y[1] == updates[i]]
    g_x, _, g_u = registry.get("scatter_along").vjp(EAGER, [np.ones(3)], [x, indices, updates], [y],
                                                    axis=0, mode="set")
    np.testing.assert_array_equal(g_x, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(g_u, [float(i in landed) for i in range(2)] + [1.0])


# -- the same rules in graphs, on symbolic dims --------------------------------------------

B = symbol("B")


@pytest.mark.parametrize("op, inputs, attrs, symbols", [
    ("reshape", [np.ones((3, 4))], {"shape": (B * 2, 2)}, {(0, 0): "B"}),
    ("broadcast_in_dim", [np.ones((5, 1))], {"shape": (3, B, 4), "broadcast_dimensions": (1, 2)},
     {(0, 0): "B"}),
    ("broadcast_in_dim", [np.ones((3, 1))], {"shape": (B, 2), "broadcast_dimensions": (0, 1)},
     {(0, 0): "B"}),
    ("slice", [np.ones((7, 3))], {"start": (1, 0), "limit": (B, 3), "stride": (2, 1)},
     {(0, 0): "B"}),
    ("slice", [np.ones((7, 3))], {"start": (1, 1), "limit": (B - 1, 3)}, {(0, 0): "B"}),
    ("pad", [np.ones((5, 2)), np.ones(())], {"low": (1, 0), "high": (2, 1), "interior": (1, 0)},
     {(0, 0): "B"}),
    ("concatenate", [np.ones((5, 2)), np.ones((3, 2))], {"dimension": 0}, {(0, 0): "B"}),
    ("transpose", [np.ones((5, 2))], {"permutation": (1, 0)}, {(0, 0): "B"}),
    ("dynamic_slice", [np.ones((5, 2)), np.array(1), np.array(0)], {"sizes": (2, 2)},
     {(0, 0): "B"}),
    ("dynamic_update_slice", [np.ones((5, 2)), np.ones((2, 2)), np.array(4), np.array(0)], {},
     {(0, 0): "B"}),
    ("take", [np.ones((5, 2)), np.array([[0, 4], [4, 1], [2, 2]])], {"axis": 0},
     {(0, 0): "B", (1, 0): "T"}),
    ("take_along", [np.ones((5, 2)), np.array([[0, 4], [4, 1], [2, 2]])], {"axis": 0},
     {(0, 0): "B", (1, 0): "T"}),
    ("scatter_along", [np.ones((5, 2)), np.array([[0, 4], [4, 1], [2, 2]]), np.ones((4, 2))],
     {"axis": 0, "mode": "set"}, {(0, 0): "B", (1, 0): "T", (2, 0): "U"}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_rules_trace_on_symbolic_dims(op, inputs, attrs, symbols):
    rng = np.random.default_rng(0)
    inputs = [normal(rng, x.shape) if x.dtype.kind == "f" else x for x in inputs]
    traced_vjp(op, inputs, attrs, symbols)


def test_low_precision_cotangents_keep_their_dtype():
    x = np.linspace(-1, 1, 12).reshape(3, 4).astype(BF16)
    ct = np.ones((4, 3), BF16)
    (g,) = registry.get("transpose").vjp(EAGER, [ct], [x], [x.T.copy()], permutation=(1, 0))
    assert g.dtype == BF16 and g.shape == (3, 4)
    (g, _) = registry.get("take").vjp(EAGER, [np.ones((2, 4), BF16)], [x, np.array([1, 1])],
                                      [x[[1, 1]]], axis=0)
    assert g.dtype == BF16 and float(g[1, 0]) == 2.0
