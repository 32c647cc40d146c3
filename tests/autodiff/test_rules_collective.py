"""vjp rules of the collectives. On one process (world_size=1) every collective is the
identity, so the rules are checked against finite differences there. For a group of 4
they are traced into graphs: the cotangents have their operands' types, the emitted
collectives keep the group, and the interpreter (whose collective references are rank
0 of a world where every rank holds the same operand) gives rank 0's gradient of the
sum of every rank's loss when every rank also holds the same cotangent."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER, GraphBuilder
from kiln.ir.interpret import run_graph
from kiln.ir.ops.collective import REDUCE_OPS, START_OPS
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.testing import check_vjp_rule
from tests.autodiff.test_rules_shape import BF16, assert_rules_complete

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
nonscalar = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)


def test_every_differentiable_collective_op_has_a_rule():
    assert_rules_complete("collective")
    ops = registry.all_ops()
    assert all(ops[name].vjp for name in COLLECTIVES)
    # the split forms come from the scheduling pass, after autodiff
    assert not any(ops[name].differentiable for name in [*START_OPS.values(), "collective_wait"])


@st.composite
def single_rank(draw):
    op = draw(st.sampled_from(COLLECTIVES))
    shape = draw(nonscalar if op != "all_reduce" and op != "broadcast" else
                 st.lists(st.integers(1, 3), max_size=3).map(tuple))
    rank = len(shape)
    axis = lambda: draw(st.integers(-rank, rank - 1))  # noqa: E731
    attrs = {"group": draw(st.sampled_from(["world", "world.s0"])), "world_size": 1}
    if op in ("all_reduce", "reduce_scatter"):
        attrs["reduce_op"] = draw(st.sampled_from(REDUCE_OPS))
    if op in ("all_gather", "reduce_scatter"):
        attrs["axis"] = axis()
    if op == "all_to_all":
        attrs.update(split_axis=axis(), concat_axis=axis())
    return op, shape, attrs


@settings(max_examples=40)
@given(single_rank(), st.integers(0, 2**16))
def test_single_rank_rules_against_finite_differences(problem, seed):
    op, shape, attrs = problem
    rng = np.random.default_rng(seed)
    x = rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1.5, shape)  # away from 0 for prod
    (g,) = check_vjp_rule(op, [x], attrs)
    assert g.shape == x.shape


def test_single_rank_prod_is_exact_at_zero():
    (g,) = check_vjp_rule("all_reduce", [np.array([0.0, 2.0])], {"reduce_op": "prod"})
    assert np.all(np.isfinite(g))


def traced(op, shape, attrs, dtype=dt.float64):
    """op and its vjp in one graph over a group of 4: (graph, emitted collective nodes)."""
    b = GraphBuilder()
    x = b.add_input(TensorType(dtype, shape))
    attrs = registry.get(op).normalize_attrs({"group": "tp", "world_size": 4, **attrs})
    (y,) = b.apply(op, [x], attrs)
    ct = b.add_input(y.type)
    start = len(b.graph.nodes)
    (g,) = registry.get(op).vjp(b, [ct], [x], [y], **attrs)
    assert g.type == x.type, f"{op}: cotangent {g.type} for operand {x.type}"
    b.graph.body.results = [g]
    verify(b.graph)
    emitted = [n for n in b.graph.nodes[start:] if registry.get(n.op).kind == "collective"]
    assert emitted and all(n.attrs["group"] == "tp" and n.attrs["world_size"] == 4
                           for n in emitted), f"{op}: the rule must keep the group"
    return b.graph, emitted


# rank 0's gradient of sum over ranks of <ct, y_rank> when every rank holds x and ct
REPLICATED = [
    ("all_reduce", {"reduce_op": "sum"}, lambda x, ct: 4 * ct),
    ("all_reduce", {"reduce_op": "avg"}, lambda x, ct: ct),
    ("all_reduce", {"reduce_op": "max"}, lambda x, ct: ct),  # a 4-way tie: a quarter of 4 ct
    ("all_reduce", {"reduce_op": "min"}, lambda x, ct: ct),
    ("all_reduce", {"reduce_op": "prod"}, lambda x, ct: 4 * ct * x ** 3),
    ("all_gather", {"axis": -1}, lambda x, ct: 4 * ct[:, :2]),
    ("reduce_scatter", {"reduce_op": "sum", "axis": 1}, lambda x, ct: np.tile(ct, (1, 4))),
    # (reduce_scatter max gathers the result chunks, which differ per rank: not replicated)
    ("reduce_scatter", {"reduce_op": "avg", "axis": 1}, lambda x, ct: np.tile(ct, (1, 4)) / 4),
    ("broadcast", {"src": 0}, lambda x, ct: 4 * ct),
    ("broadcast", {"src": 3}, lambda x, ct: 0 * ct),
    ("all_to_all", {"split_axis": 1, "concat_axis": 0}, lambda x, ct: np.tile(ct[:3], (1, 4))),
    ("all_to_all", {"split_axis": 1, "concat_axis": 1}, lambda x, ct: np.tile(ct[:, :2], (1, 4))),
]


@pytest.mark.parametrize("op, attrs, expected", REPLICATED,
                         ids=[f"{op}-{'-'.join(map(str, a.values()))}" for op, a, _ in REPLICATED])
def test_group_of_4_rules_in_the_replicated_world(op, attrs, expected):
    shape = (3, 2) if op in ("all_gather", "all_reduce", "broadcast") else (3, 8)
    graph, _ = traced(op, shape, attrs)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.5, shape)
    ct = rng.standard_normal(graph.inputs[1].type.shape)
    (g,) = run_graph(graph, x, ct)
    np.testing.assert_allclose(g, expected(x, ct), rtol=1e-12)


def test_rules_emit_the_inverse_collectives():
    _, emitted = traced("all_gather", (3, 2), {"axis": 1})
    assert [(n.op, n.attrs["reduce_op"], n.attrs["axis"]) for n in emitted] == \
        [("reduce_scatter", "sum", 1)]
    _, emitted = traced("reduce_scatter", (8, 2), {"axis": 0, "reduce_op": "avg"})
    assert [(n.op, n.attrs["axis"]) for n in emitted] == [("all_gather", 0)]
    _, emitted = traced("all_to_all", (4, 8), {"split_axis": 1, "concat_axis": 0})
    assert [(n.op, n.attrs["split_axis"], n.attrs["concat_axis"]) for n in emitted] == \
        [("all_to_all", 0, 1)]
    _, emitted = traced("all_reduce", (3,), {"reduce_op": "sum"})
    assert [(n.op, n.attrs["reduce_op"]) for n in emitted] == [("all_reduce", "sum")]


def test_low_precision_cotangents_keep_their_dtype():
    x = np.linspace(0.5, 1.5, 6).reshape(2, 3).astype(BF16)
    for op, attrs in [("all_reduce", {"reduce_op": "max"}), ("all_reduce", {"reduce_op": "prod"}),
                      ("reduce_scatter", {"reduce_op": "avg"}), ("broadcast", {})]:
        attrs = registry.get(op).normalize_attrs(attrs)
        (y,) = EAGER.apply(op, [x], attrs)
        (g,) = registry.get(op).vjp(EAGER, [np.ones(y.shape, BF16)], [x], [y], **attrs)
        assert g.dtype == BF16 and g.shape == x.shape
        traced(op, (4, 4), {k: v for k, v in attrs.items() if k not in ("group", "world_size")},
               dtype=dt.bfloat16)
