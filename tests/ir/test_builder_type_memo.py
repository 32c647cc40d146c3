"""GraphBuilder remembers, within one builder, the result types of each (op, operand
dtypes and shapes, exactly-typed attributes) signature of a region-free node
(kiln/ir/emitter.py `_infer`): the rule runs once per signature, the graph is the same
as without the memo, and a signature the rule refuses is refused every time."""

import numpy as np
import pytest

import kiln as kn
from kiln.errors import KilnError
from kiln.ir import registry
from kiln.ir.emitter import GraphBuilder
from kiln.ir.printer import print_graph
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify


def _count_infer(monkeypatch) -> list:
    calls = []
    real = registry.OpDef.infer
    monkeypatch.setattr(registry.OpDef, "infer", lambda self, *a: calls.append(self.name) or real(self, *a))
    return calls


def _build(builder: GraphBuilder):
    x = builder.add_input(TensorType(kn.float32, (2, 3)), "x")
    y = builder.add_input(TensorType(kn.float32, (3, 2)), "y")
    a = builder.apply("reshape", [x], {"shape": (3, 2)})[0]
    b = builder.apply("reshape", [x], {"shape": (3, 2)})[0]  # same signature
    c = builder.apply("add", [a, b], {})[0]
    d = builder.apply("add", [c, y], {})[0]  # same signature as c
    e = builder.apply("reshape", [d], {"shape": (6,)})[0]  # another reshape signature
    builder.graph.body.results = [e]
    return builder.graph


def test_a_repeated_signature_is_inferred_once_and_the_graph_is_unchanged(monkeypatch):
    plain = GraphBuilder()
    plain._infer = lambda opdef, operands, attrs: opdef.infer([x.type for x in operands], attrs)
    want = print_graph(_build(plain))
    calls = _count_infer(monkeypatch)
    g = _build(GraphBuilder())
    assert calls.count("reshape") == 2 and calls.count("add") == 1
    assert print_graph(g) == want
    verify(g)


def test_a_refused_signature_is_refused_again():
    builder = GraphBuilder()
    x = builder.add_input(TensorType(kn.float32, (2, 3)), "x")
    for _ in range(2):
        with pytest.raises(KilnError, match="reshape"):
            builder.apply("reshape", [x], {"shape": (4, 2)})


@pytest.mark.parametrize("shape", [(3.0, 2.0), (3, 2.0), (True, 6)], ids=["floats", "one float", "bool"])
def test_attributes_equal_in_python_but_of_another_type_are_inferred_again(shape):
    """(3, 2) == (3.0, 2.0) in Python: the memo key tells the types apart, so the rule
    sees the odd attribute (and refuses it) after the good one was remembered."""
    builder = GraphBuilder()
    x = builder.add_input(TensorType(kn.float32, (2, 3)), "x")
    builder.apply("reshape", [x], {"shape": (3, 2) if shape[0] is not True else (1, 6)})
    with pytest.raises(KilnError, match="must be an int"):
        builder.apply("reshape", [x], {"shape": shape})


def test_same_shape_other_dtype_is_its_own_signature():
    builder = GraphBuilder()
    x = builder.add_input(TensorType(kn.float32, (4,)), "x")
    i = builder.add_input(TensorType(kn.int32, (4,)), "i")
    (a,) = builder.apply("neg", [x], {})
    (b,) = builder.apply("neg", [i], {})
    assert a.type.dtype == kn.float32 and b.type.dtype == kn.int32


def test_traced_function_matches_eager_with_repeated_signatures():
    def f(x, w):
        h = x
        for _ in range(4):  # the same matmul/add/tanh signatures four times
            h = kn.tanh(h @ w + 1.0)
        return h.sum()

    x, w = kn.randn(5, 8, seed=0), kn.randn(8, 8, seed=1)
    compiled = kn.compile(f)
    np.testing.assert_allclose(compiled(x, w).numpy(), f(x, w).numpy(), rtol=1e-4, atol=1e-5)
