"""The text form round-trips exactly: parse(print(g)) prints the same text and is
structurally equal, for example graphs and for randomly generated ones."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

import kiln as kn
from kiln.errors import KilnParseError, KilnVerifierError
from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Region, Value
from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.ir.shapes import ShapeVar
from kiln.ir.types import TensorType


def roundtrip(graph):
    text = str(graph)
    again = parse_graph(text, constants=graph.constants)
    assert str(again) == text
    assert again.structurally_equal(graph)
    return again


def transformer_block(x, wq, wk, wv, w1, w2):
    h = kn.layer_norm(x, (x.shape[-1],))
    a = kn.scaled_dot_product_attention(h @ wq, h @ wk, h @ wv, is_causal=True)
    x = x + a
    return x + kn.gelu(kn.rms_norm(x, (x.shape[-1],)) @ w1, approximate="tanh") @ w2


EXAMPLES = {
    "mlp": (lambda x, w, b: kn.gelu(x @ w + b), lambda: (kn.randn(4, 8, seed=0), kn.randn(8, 16, seed=1), kn.randn(16, seed=2))),
    "softmax_mixed_dtypes": (lambda x, y: kn.softmax(x * y + 1, dim=-1).to(kn.bfloat16),
                             lambda: (kn.randn(3, 5, seed=0, dtype=kn.float16), kn.arange(5))),
    "indexing": (lambda x: x[1:, ::2][..., None] + x[[0, 2]].sum(dim=0, keepdim=True)[:, ::2, None],
                 lambda: (kn.randn(3, 6, seed=3),)),
    "reductions": (lambda x: (x.max(dim=1)[0], x.argmin(), kn.logsumexp(x, dim=0), x.var(dim=1)),
                   lambda: (kn.randn(4, 7, seed=4),)),
    "closure_constant": (lambda x: x * np.linspace(0, 1, 6, dtype=np.float32) + kn.tensor([1.5] * 6),
                         lambda: (kn.randn(2, 6, seed=5),)),
    "transformer": (transformer_block, lambda: (kn.randn(2, 8, 16, seed=6),) + tuple(
        kn.randn(*s, seed=7 + i) * 0.1 for i, s in enumerate([(16, 16)] * 3 + [(16, 32), (32, 16)]))),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_graphs_roundtrip_and_run(name):
    fn, make_args = EXAMPLES[name]
    args = make_args()
    graph = kn.trace(fn, *args)
    again = roundtrip(graph)
    expected = fn(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = run_graph(again, *[a.numpy() for a in args])
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(np.asarray(e.numpy()), g)


def test_symbolic_shapes_and_constraints_roundtrip():
    B = ShapeVar("B", min=1, max=8192, multiple_of=8)
    T = ShapeVar("T", min=2)
    graph = kn.trace(lambda x: (x.reshape(-1, 4) * 2, x[:, 1:].sum(dim=1)), kn.ones(8, 12),
                     dynamic_shapes={"x": kn.TensorSpec([B, kn.STATIC])})
    text = roundtrip(graph)
    assert "where B in [1, 8192] multiple_of 8" in str(text)
    assert "f32[3*B, 4]" in str(graph)
    g2 = kn.trace(lambda x, y: kn.cat([x, y], dim=0), kn.ones(8, 2), kn.ones(5, 2),
                  dynamic_shapes=(kn.TensorSpec([B, 2]), kn.TensorSpec([T, 2])))
    assert "f32[B + T, 2]" in str(g2)
    roundtrip(g2)


def test_regions_roundtrip():
    b = GraphBuilder()
    x = b.add_input(TensorType(dt.float32, (4,)), "x")
    n = b.add_input(TensorType(dt.int32, ()), "n")
    cond_region = Region([Value(x.type), Value(n.type)])
    body = Region([Value(x.type), Value(n.type)])
    inner = GraphBuilder(b.graph)
    inner.regions.append(cond_region)
    cond_region.results = [inner.binary("gt", cond_region.params[1], 0)]
    inner.regions[-1] = body
    doubled = inner.binary("mul", body.params[0], 2.0)
    body.results = [doubled, inner.binary("sub", body.params[1], 1)]
    loop = b.apply("while_loop", [x, n], {}, regions=[cond_region, body])
    b.graph.body.results = [loop[0]]
    again = roundtrip(b.graph)
    assert "while_loop" in str(again) and str(again).count("region(") == 2
    (out,) = run_graph(again, np.ones(4, np.float32), np.array(3, np.int32))
    np.testing.assert_array_equal(out, np.full(4, 8.0, np.float32))


def test_attribute_values_roundtrip_exactly():
    values = [0.1, -0.0, 1e-45, 3.4028234663852886e38, float("inf"), float("-inf"), 1 / 3]
    for v in values:
        g = kn.trace(lambda x: x + kn.full((2,), v, dtype=kn.float64), kn.ones(2, dtype=kn.float64))
        again = roundtrip(g)
        full = next(n for n in again.walk() if n.op == "full")
        assert full.attrs["value"] == v and str(full.attrs["value"]) == str(v)
    g = kn.trace(lambda x: x + kn.full((2,), float("nan"), dtype=kn.float32), kn.ones(2))
    assert "value=nan" in str(roundtrip(g))


# -- random graphs -------------------------------------------------------------------

UNARY = ["neg", "exp", "tanh", "abs", "sin", "sqrt"]
BINARY = ["add", "sub", "mul", "max", "min"]


@st.composite
def random_graphs(draw):
    b = GraphBuilder()
    dims = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    dtype = draw(st.sampled_from([dt.float32, dt.float64, dt.bfloat16, dt.float16]))
    values = [b.add_input(TensorType(dtype, tuple(dims)), f"in{i}") for i in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["unary", "binary", "scalar", "reduce", "reshape", "convert"]))
        x = draw(st.sampled_from(values))
        if kind == "unary" and x.type.dtype.is_floating:
            values.append(b.call(draw(st.sampled_from(UNARY)), x))
        elif kind == "binary":
            y = draw(st.sampled_from(values))
            if x.type == y.type:
                values.append(b.binary(draw(st.sampled_from(BINARY)), x, y))
        elif kind == "scalar":
            values.append(b.binary("mul", x, draw(st.floats(-4, 4, allow_nan=False, width=32))))
        elif kind == "reduce" and x.type.rank:
            values.append(b.call("reduce_sum", x, axes=(draw(st.integers(0, x.type.rank - 1)),)))
        elif kind == "reshape":
            values.append(b.call("reshape", x, shape=(int(np.prod(x.type.shape, dtype=int)),)))
        elif kind == "convert":
            values.append(b.convert(x, draw(st.sampled_from([dt.float32, dt.float64, dt.int32]))))
    b.graph.body.results = draw(st.lists(st.sampled_from(values[len(b.graph.inputs):] or values),
                                         min_size=1, max_size=3))
    return b.graph


@given(random_graphs())
def test_random_graphs_roundtrip(graph):
    roundtrip(graph)


# -- malformed text -------------------------------------------------------------------

BAD_TEXTS = {
    "unknown op": "graph @g(%x: f32[2]) -> f32[2]\n  %0 = frobnicate(%x) : f32[2]\n  return %0\n",
    "use before def": "graph @g(%x: f32[2]) -> f32[2]\n  %0 = neg(%1) : f32[2]\n  return %0\n",
    "undeclared shape var": "graph @g(%x: f32[B]) -> f32[B]\n  return %x\n",
    "bad dtype": "graph @g(%x: q7[2]) -> q7[2]\n  return %x\n",
    "no return": "graph @g(%x: f32[2]) -> f32[2]\n  %0 = neg(%x) : f32[2]\n",
    "header mismatch": "graph @g(%x: f32[2]) -> f32[3]\n  return %x\n",
    "junk char": "graph @g(%x: f32[2]) -> f32[2]\n  return %x $\n",
}


@pytest.mark.parametrize("what", sorted(BAD_TEXTS))
def test_malformed_text_is_a_parse_error(what):
    with pytest.raises(KilnParseError):
        parse_graph(BAD_TEXTS[what])


def test_type_rule_violation_is_a_verifier_error():
    text = "graph @g(%x: f32[2]) -> f32[3]\n  %0 = neg(%x) : f32[3]\n  return %0\n"
    with pytest.raises(KilnVerifierError, match="type rule of neg gives f32\\[2\\]"):
        parse_graph(text)
