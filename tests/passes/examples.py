"""Real graphs the pass tests run every pass over: traced models (MLP, softmax with
mixed dtypes, layer_norm, attention, indexing, reductions, a symbolic batch, random
numbers) and hand-built control flow (a while_loop and a cond whose regions hold
composites, repeats, dead code and constants), each with inputs to run it on.

`check_preserves(pass_fn, name)` runs a pass over one of them and checks that the
result verifies, leaves its input untouched and computes the same outputs.
"""

from __future__ import annotations

import numpy as np

import kiln as kn
from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Region, Value
from kiln.ir.interpret import run_graph
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify


def _transformer(x, wq, wk, wv, w1, w2):
    h = kn.layer_norm(x, (x.shape[-1],))
    a = kn.scaled_dot_product_attention(h @ wq, h @ wk, h @ wv, is_causal=True)
    x = x + a
    return x + kn.gelu(kn.rms_norm(x, (x.shape[-1],)) @ w1, approximate="tanh") @ w2


def _traced(fn, *args, **kwargs):
    def make():
        graph = kn.trace(fn, *args, **kwargs)
        return graph, [a.numpy() for a in args]

    return make


def _symbolic_batch():
    B = kn.ShapeVar("B", min=1, max=64)

    def f(x, w):
        y = (x @ w).reshape(-1, 2, 4).transpose(1, 2).transpose(1, 2)
        return kn.softmax(y * 1.0, dim=-1).sum(dim=1) + kn.zeros(x.shape[0], 4)

    graph = kn.trace(f, kn.ones(3, 8), kn.ones(8, 8),
                     dynamic_shapes={"x": kn.TensorSpec([B, 8])})
    return graph, [np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32),
                   np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)]


def _while_graph():
    """while n > 0: x = gelu(x * 1) + exp(w) + exp(w); n -= 1 (w from the outer scope),
    with a dead exp, a constant subexpression and a transpose pair in the body."""
    b = GraphBuilder()
    x = b.add_input(TensorType(dt.float32, (2, 3)), "x")
    n = b.add_input(TensorType(dt.int32, ()), "n")
    w = b.exp(b.neg(x))
    cond_region = Region([Value(x.type), Value(n.type)])
    body = Region([Value(x.type), Value(n.type)])
    inner = GraphBuilder(b.graph)
    inner.regions.append(cond_region)
    cond_region.results = [inner.binary("gt", cond_region.params[1], 0)]
    inner.regions[-1] = body
    p, k = body.params
    inner.exp(p)  # dead
    flipped = inner.transpose(inner.transpose(p, permutation=(1, 0)), permutation=(1, 0))
    g = inner.gelu(inner.binary("mul", flipped, 1.0))
    two = inner.binary("add", inner.full(1.0, dt.float32, (2, 3)), inner.full(1.0, dt.float32, (2, 3)))
    y = inner.add(inner.add(g, inner.exp(w)), inner.mul(inner.exp(w), two))
    body.results = [y, inner.binary("sub", k, 1)]
    loop = b.apply("while_loop", [x, n], {}, regions=[cond_region, body])
    b.graph.body.results = [b.add(loop[0], b.exp(w))]
    rng = np.random.default_rng(2)
    return b.graph, [rng.standard_normal((2, 3)).astype(np.float32) * 0.1, np.array(3, np.int32)]


def _cond_graph():
    """cond(sum(x) > 0, softmax(x) + 0 ..., neg(neg(x)) * 1 ...) with a value shared by
    both branches and the outer scope."""
    b = GraphBuilder()
    x = b.add_input(TensorType(dt.float32, (4, 5)), "x")
    s = b.exp(x)
    pred = b.binary("gt", b.reduce_sum(x, axes=(0, 1)), 0.0)
    branches = []
    for k in range(2):
        region = Region([Value(x.type)])
        inner = GraphBuilder(b.graph)
        inner.regions.append(region)
        (p,) = region.params
        if k == 0:
            out = inner.binary("sub", inner.softmax(p, dim=1), 0.0)
            out = inner.add(out, inner.exp(x))
        else:
            out = inner.binary("mul", inner.neg(inner.neg(p)), 1.0)
            out = inner.add(out, inner.layer_norm(p, normalized_ndim=1))
            out = inner.add(out, inner.exp(x))
        region.results = [out]
        branches.append(region)
    (result,) = b.apply("cond", [pred, x], {}, regions=branches)
    b.graph.body.results = [b.add(result, s)]
    rng = np.random.default_rng(3)
    return b.graph, [rng.standard_normal((4, 5)).astype(np.float32)]


EXAMPLES = {
    "mlp": _traced(lambda x, w, b: kn.gelu(x @ w + b) * 2 + 0, kn.randn(4, 8, seed=0),
                   kn.randn(8, 16, seed=1), kn.randn(16, seed=2)),
    "softmax_mixed_dtypes": _traced(lambda x, y: kn.softmax(x * y + 1, dim=-1).to(kn.bfloat16),
                                    kn.randn(3, 5, seed=0, dtype=kn.float16), kn.arange(5)),
    "layer_norm": _traced(lambda x, w, b: kn.layer_norm(x, (6,), w, b) * 1.0,
                          kn.randn(3, 6, seed=4), kn.randn(6, seed=5), kn.randn(6, seed=6)),
    "attention": _traced(lambda q, k, v: kn.scaled_dot_product_attention(q, k, v, is_causal=True),
                         kn.randn(2, 4, 8, seed=7), kn.randn(2, 4, 8, seed=8),
                         kn.randn(2, 4, 8, seed=9)),
    "indexing": _traced(lambda x: x[1:, ::2][..., None] + x[[0, 2]].sum(dim=0, keepdim=True)[:, ::2, None],
                        kn.randn(3, 6, seed=3)),
    "reductions": _traced(lambda x: (x.max(dim=1)[0], x.argmin(), kn.logsumexp(x, dim=0),
                                     x.var(dim=1)), kn.randn(4, 7, seed=4)),
    "integers": _traced(lambda x: (x * 0 + x * 1 - 0, (x // 3) % 4, x.flip(0).flip(0)),
                        kn.arange(12, dtype=kn.int32).reshape(3, 4)),
    "constants": _traced(lambda x: x * kn.tensor([1.0, 2.0, 3.0]) + kn.arange(3, dtype=kn.float32) * 2,
                         kn.randn(2, 3, seed=10)),
    "random": _traced(lambda x: x + kn.randn(4, seed=7) + kn.rand(4, seed=7), kn.zeros(4)),
    "transformer": _traced(_transformer, kn.randn(2, 8, 16, seed=6), *(
        kn.randn(*s, seed=7 + i) * 0.1 for i, s in enumerate([(16, 16)] * 3 + [(16, 32), (32, 16)]))),
    "symbolic_batch": _symbolic_batch,
    "while_loop": _while_graph,
    "cond": _cond_graph,
}


def example(name):
    """(graph, input arrays) of one example, built fresh."""
    return EXAMPLES[name]()


def check_preserves(pass_fn, name, *, exact=True, **tolerance):
    """Run `pass_fn` on example `name`: it verifies, the input graph is unchanged, and
    the outputs agree (bit for bit when `exact`). Returns the new graph."""
    graph, inputs = example(name)
    before = str(graph)
    result = pass_fn(graph)
    assert str(graph) == before, "the pass changed its input graph"
    verify(result)
    want = run_graph(graph, *inputs)
    got = run_graph(result, *inputs)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), **tolerance)
    return result


def assert_rewrites(pass_fn, before, expected, constants=None, expected_constants=None):
    """STYLE §3: parse `before`, run the pass, and compare with `expected` as printed.

    The input graph must be left as it was and the result must verify; constants, when
    given, are compared by name, dtype, shape and bytes. Returns the result.
    """
    from kiln.ir.parser import parse_graph

    graph = parse_graph(before, constants=constants)
    text = str(graph)
    result = pass_fn(graph)
    assert str(graph) == text, "the pass changed its input graph"
    verify(result)
    want = parse_graph(expected, constants=expected_constants if expected_constants is not None
                       else result.constants)
    assert str(result) == str(want)
    if expected_constants is not None:
        assert result.structurally_equal(want)
    return result
