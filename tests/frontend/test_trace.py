"""kn.trace: graphs are explicit (every broadcast and promotion is a node), dynamic
specs become symbolic dims, and reading a traced value from Python fails clearly."""

import numpy as np
import pytest

import kiln as kn
from kiln.errors import KilnConcretizationError, KilnShapeSpecError, KilnTraceError
from kiln.ir.interpret import run_graph
from kiln.ir.verifier import verify


def ops(graph):
    return [n.op for n in graph.walk()]


def test_broadcast_and_promotion_are_explicit_nodes():
    g = kn.trace(lambda x, y: x + y, kn.ones(3, 4, dtype=kn.float16), kn.ones(4, dtype=kn.int32))
    assert ops(g) == ["convert", "broadcast_in_dim", "add"]
    convert, broadcast, add = g.nodes
    assert convert.operands == [g.inputs[1]] and str(convert.results[0].type) == "f16[4]"
    assert broadcast.attrs["broadcast_dimensions"] == (1,)
    assert str(add.results[0].type) == "f16[3, 4]"


def test_python_scalars_are_weak():
    g = kn.trace(lambda x: x * 1.5 + 2, kn.ones(2, dtype=kn.bfloat16))
    assert all(v.type.dtype == kn.bfloat16 for n in g.walk() for v in n.results)
    g = kn.trace(lambda x: x * 1.5, kn.ones(2, dtype=kn.int32))
    assert str(g.outputs[0].type) == "f32[2]"


def test_every_node_type_is_checked_by_the_verifier():
    g = kn.trace(lambda x: kn.softmax(x, dim=-1).sum(dim=0), kn.randn(3, 5, seed=0))
    verify(g)
    assert ops(g) == ["softmax", "reduce_sum"]


def test_trace_runs_same_as_eager():
    def f(x, y):
        return (x @ y).relu().mean(dim=0), x[::-1, 1:] * 2

    args = (kn.randn(4, 3, seed=0), kn.randn(3, 5, seed=1))
    g = kn.trace(f, *args)
    got = run_graph(g, *[a.numpy() for a in args])
    for e, r in zip(f(*args), got):
        np.testing.assert_array_equal(e.numpy(), r)


def test_pytree_arguments_and_results():
    def f(params, x):
        return {"y": x @ params["w"] + params["b"], "n": [x.sum()]}

    params = {"w": kn.randn(3, 2, seed=0), "b": kn.zeros(2)}
    g = kn.trace(f, params, kn.ones(4, 3))
    assert [v.name for v in g.inputs] == ["params_0", "params_1", "x"]
    assert len(g.outputs) == 2


def test_dynamic_spec_gives_symbolic_dims_and_checks_examples():
    B = kn.ShapeVar("B", min=1, max=64)

    @kn.dynamic_spec({"x": kn.TensorSpec([B, kn.STATIC])})
    def f(x):
        return x.reshape(-1) * 2

    g = kn.trace(f, kn.ones(5, 3))
    assert str(g.outputs[0].type) == "f32[3*B]"
    (out,) = run_graph(g, np.ones((7, 3), np.float32))
    assert out.shape == (21,)
    with pytest.raises(KilnShapeSpecError, match=r"dim 0 \(B\) is 100, which breaks B in \[1, 64\]"):
        run_graph(g, np.ones((100, 3), np.float32))
    with pytest.raises(KilnShapeSpecError, match="B <= 64"):
        kn.trace(f, kn.ones(65, 3))


def test_factories_inside_a_trace_follow_symbolic_sizes():
    B = kn.ShapeVar("B")
    g = kn.trace(lambda x: x + kn.zeros(x.shape[0], 2), kn.ones(3, 2),
                 dynamic_shapes={"x": kn.TensorSpec([B, 2])})
    assert "full() {dtype=f32, shape=(B, 2), value=0}" in str(g)


@pytest.mark.parametrize("read", [
    lambda t: bool(t.sum() > 0),
    lambda t: float(t.sum()),
    lambda t: t.sum().item(),
    lambda t: t.numpy(),
    lambda t: np.asarray(t),
    lambda t: int(t.sum()),
])
def test_reading_a_traced_value_names_the_line_and_the_fix(read):
    def f(x):
        read(x)  # the user's line
        return x

    with pytest.raises(KilnConcretizationError) as info:
        kn.trace(f, kn.ones(3))
    message = str(info.value)
    assert "[K141]" in message and "kn.cond" in message and "kn.while_loop" in message
    assert "test_trace.py" in message


def test_python_if_on_a_tensor_points_at_the_if():
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(KilnConcretizationError, match=r"if x.sum\(\) > 0"):
        kn.trace(f, kn.ones(3))


def test_a_leaked_tracer_is_refused():
    leaked = []
    kn.trace(lambda x: leaked.append(x) or x, kn.ones(2))
    with pytest.raises(KilnTraceError, match="after its trace ended"):
        leaked[0] + 1


def test_boolean_mask_indexing_is_eager_only():
    x = kn.arange(6)
    np.testing.assert_array_equal(x[x > 2].numpy(), [3, 4, 5])
    with pytest.raises(KilnTraceError, match="data-dependent"):
        kn.trace(lambda x: x[x > 2], x)


def test_random_numbers_are_the_same_eager_and_traced():
    g = kn.trace(lambda x: x + kn.randn(4, seed=7), kn.zeros(4))
    (out,) = run_graph(g, np.zeros(4, np.float32))
    np.testing.assert_array_equal(out, kn.randn(4, seed=7).numpy())
