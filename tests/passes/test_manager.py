"""The pass manager (stages, until, dumps, verification) and the rewrite tools
(copy_graph, rebuild) every pass is built from."""

import numpy as np
import pytest

from kiln.errors import KilnArgumentError, KilnError, KilnVerifierError
from kiln.ir.graph import Node
from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.ir.verifier import verify
from kiln.passes.canonicalize import canonicalize
from kiln.passes.dce import dce
from kiln.passes.manager import VERIFY_ENV, Pipeline, run_pass, verify_enabled
from kiln.passes.rewrite import copy_graph, rebuild, uses
from tests.passes.examples import assert_rewrites, example

TEXT = """
graph @g(%x: f32[4]) -> f32[4]
  %0 = neg(%x) : f32[4]
  %1 = neg(%0) : f32[4]
  %2 = exp(%1) : f32[4]
  return %2
"""


def _broken(graph):
    """A pass that returns a graph the verifier rejects (a wrong result type)."""
    new = copy_graph(graph)
    new.nodes[-1].results[0].type = new.nodes[-1].results[0].type.with_shape((5,))
    return new


def _mutating(graph):
    graph.nodes.pop()
    return graph


# -- the pipeline -------------------------------------------------------------------------

def test_stages_run_in_order_and_record_their_outputs():
    g = parse_graph(TEXT)
    seen = []
    p = Pipeline([("canonicalize", canonicalize), ("dce", dce)], debug=True)
    out = p.run(g, dump=lambda name, graph: seen.append((name, str(graph))))
    assert [name for name, _ in seen] == ["canonicalize", "dce"]
    assert out.op_counts() == {"exp": 1}
    assert [r.changed for r in p.records] == [True, True]
    stages = p.run_stages(g)
    assert list(stages) == ["canonicalize", "dce"] and str(stages["dce"]) == str(out)
    assert stages["canonicalize"].op_counts() == {"neg": 1, "exp": 1}  # dce not yet run


def test_until_stops_after_the_named_stage():
    g = parse_graph(TEXT)
    p = Pipeline([("canonicalize", canonicalize), ("dce", dce)])
    assert p.run(g, until="canonicalize").op_counts() == {"neg": 1, "exp": 1}
    with pytest.raises(KilnArgumentError, match="canonicalize, dce"):
        p.run(g, until="fuse")


def test_extension_points_and_unique_names():
    p = Pipeline([("canonicalize", canonicalize)])
    p.append("dce", dce).insert_after("canonicalize", "again", canonicalize)
    assert p.names() == ["canonicalize", "again", "dce"]
    with pytest.raises(KilnArgumentError, match="twice"):
        p.append("dce", dce)
    with pytest.raises(KilnArgumentError, match="name, function"):
        Pipeline([("x", 3)])


def test_debug_verifies_after_each_stage_and_names_the_pass():
    g = parse_graph(TEXT)
    Pipeline([("broken", _broken)]).run(g)  # unchecked by default
    with pytest.raises(KilnVerifierError, match="after pass 'broken'"):
        Pipeline([("broken", _broken)], debug=True).run(g)


def test_env_var_turns_verification_on(monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, "1")
    assert verify_enabled()
    with pytest.raises(KilnVerifierError, match="broken"):
        Pipeline([("broken", _broken)]).run(parse_graph(TEXT))
    monkeypatch.setenv(VERIFY_ENV, "0")
    assert not verify_enabled() and verify_enabled(debug=True)


def test_a_pass_that_mutates_its_input_is_caught():
    with pytest.raises(KilnError, match="modified the graph it was given"):
        run_pass(_mutating, parse_graph(TEXT))


# -- rewrite tools --------------------------------------------------------------------

def test_copy_graph_is_deep_and_maps_every_value():
    g, inputs = example("while_loop")
    vmap = {}
    c = copy_graph(g, vmap)
    assert str(c) == str(g) and c is not g
    old_nodes, new_nodes = list(g.walk()), list(c.walk())
    assert not {id(n) for n in old_nodes} & {id(n) for n in new_nodes}
    assert all(vmap[r] is n.results[i] for o, n in zip(old_nodes, new_nodes)
               for i, r in enumerate(o.results))
    loop = next(n for n in c.nodes if n.regions)
    loop.regions[1].nodes.clear()  # the copy owns its own nodes and regions
    assert str(g) != str(c) and verify(g)
    np.testing.assert_array_equal(run_graph(copy_graph(g), *inputs)[0], run_graph(g, *inputs)[0])


def test_rebuild_replaces_a_node_by_a_subgraph():
    # exp(x) -> 1 + expm1(x), emitted through the builder, inside the region too
    def rule(b, node: Node):
        if node.op != "exp":
            return None
        return b.binary("add", b.expm1(node.operands[0]), 1.0)

    before = """
graph @g(%p: i1[], %x: f32[3]) -> f32[3]
  %0 = exp(%x) : f32[3]
  %1 = cond(%p, %0) : f32[3]
    region(%2: f32[3]):
      %3 = exp(%2) : f32[3]
      yield %3
    region(%4: f32[3]):
      yield %4
    end
  return %1
"""
    expected = """
graph @g(%p: i1[], %x: f32[3]) -> f32[3]
  %0 = expm1(%x) : f32[3]
  %1 = full() {dtype=f32, shape=(3,), value=1.0} : f32[3]
  %2 = add(%0, %1) : f32[3]
  %3 = cond(%p, %2) : f32[3]
    region(%4: f32[3]):
      %5 = expm1(%4) : f32[3]
      %6 = full() {dtype=f32, shape=(3,), value=1.0} : f32[3]
      %7 = add(%5, %6) : f32[3]
      yield %7
    region(%8: f32[3]):
      yield %8
    end
  return %3
"""
    assert_rewrites(lambda g: rebuild(g, rule), before, expected)


def test_rebuild_without_a_match_returns_the_input_and_refuses_type_changes():
    g = parse_graph(TEXT)
    assert rebuild(g, lambda b, node: None) is g
    with pytest.raises(KilnError, match="internal: a rewrite of exp"):
        rebuild(g, lambda b, node: [b.reshape(node.operands[0], shape=(2, 2))]
                if node.op == "exp" else None)


@pytest.mark.parametrize("fanout", [1, 3])
def test_a_rule_that_never_settles_is_reported(fanout):
    # neg(x) -> neg(neg(neg(x))) matches its own output forever (and grows: fanout 3)
    def rule(b, node):
        if node.op != "neg":
            return None
        x = node.operands[0]
        return b.neg(b.neg(b.neg(x))) if fanout == 3 else b.neg(x)

    g = parse_graph("graph @g(%x: f32[2]) -> f32[2]\n  %0 = neg(%x) : f32[2]\n  return %0\n")
    with pytest.raises(KilnError, match="did not settle"):
        rebuild(g, rule)


def test_uses_counts_operands_and_yields():
    g = parse_graph(TEXT)
    counts = uses(g)
    assert counts[g.inputs[0]] == 1 and counts[g.outputs[0]] == 1
