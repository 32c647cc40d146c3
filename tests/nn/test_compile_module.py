"""kn.compile(module): weights are inputs, so changing them never recompiles."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn


def mlp():
    return nn.Sequential(nn.Linear(8, 16, seed=0), nn.GELU(), nn.LayerNorm(16),
                         nn.Linear(16, 4, seed=1))


def test_compiled_module_matches_eager_and_sees_new_weights_without_recompiling():
    model = mlp()
    fast = kn.compile(model)
    assert isinstance(fast, nn.CompiledModule)
    x = kn.randn(5, 8, seed=0)
    np.testing.assert_allclose(fast(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    # load_state_dict, plain assignment and an optimizer step all take effect
    other = mlp()
    other.load_state_dict({k: v * 1.5 for k, v in model.state_dict().items()})
    model.load_state_dict(other.state_dict())
    np.testing.assert_allclose(fast(x).numpy(), other(x).numpy(), rtol=1e-5, atol=1e-6)
    model[3].bias = kn.full((4,), 10.0)
    assert np.allclose(fast(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)
    assert fast(x).numpy().mean() > 5
    stats = fast.stats()
    assert stats["compiles"] == 1 and stats["hits"] == 3
    # a new input shape is a new specialization, as for any compiled function
    fast(kn.randn(7, 8, seed=1))
    assert fast.stats()["compiles"] == 2


def test_weights_are_graph_inputs_not_constants():
    model = mlp()
    fast = kn.compile(model)
    fast(kn.randn(2, 8, seed=0))
    (graph,) = [c.graph for c in fast.compiled_graphs()]
    assert len(graph.inputs) == 1 + len(list(model.parameters()))
    assert not graph.constants


def test_forward_keyword_arguments_and_tuple_results():
    mha = nn.MultiheadAttention(8, 2, seed=0)
    fast = kn.compile(mha)
    x = kn.randn(2, 5, 8, seed=0)
    mask = kn.tensor(np.triu(np.ones((5, 5), bool), 1))
    out, w = fast(x, x, x, attn_mask=mask)
    assert w is None
    np.testing.assert_allclose(out.numpy(), mha(x, x, x, attn_mask=mask)[0].numpy(), rtol=1e-5,
                               atol=1e-6)
    out, w = fast(x, x, x, is_causal=True, need_weights=True)  # Python flags are guards
    ref = mha(x, x, x, is_causal=True, need_weights=True)
    np.testing.assert_allclose(w.numpy(), ref[1].numpy(), rtol=1e-5, atol=1e-6)
    assert fast.stats()["compiles"] == 2


def test_dynamic_shapes_by_forward_argument_name():
    model = mlp()
    B = kn.ShapeVar("B", min=1)
    fast = kn.compile(model, dynamic_shapes={"x": kn.TensorSpec([B, 8])})
    for n in (1, 3, 9):
        x = kn.randn(n, 8, seed=n)
        np.testing.assert_allclose(fast(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert fast.stats()["compiles"] == 1


def test_buffers_are_inputs_too_and_attributes_read_through():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3, seed=0)
            self.register_buffer("scale", kn.ones(()))

        def forward(self, x):
            return self.fc(x) * self.scale

    m = Scaled()
    fast = kn.compile(m)
    x = kn.randn(2, 3, seed=0)
    base = fast(x).numpy()
    m.scale = kn.full((), 3.0)
    np.testing.assert_allclose(fast(x).numpy(), 3 * base, rtol=1e-6)
    assert fast.stats()["compiles"] == 1
    assert fast.fc is m.fc and "CompiledModule(Scaled(" in repr(fast)


def test_a_bound_forward_still_compiles_as_a_plain_function():
    model = mlp()
    fast = kn.compile(model.forward)
    assert isinstance(fast, kn.CompiledFunction)
    x = kn.randn(2, 8, seed=0)
    np.testing.assert_allclose(fast(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_a_traced_tensor_left_on_a_module_is_reported():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = kn.ones(2)

        def forward(self, x):
            self.cache = x * self.w
            return self.cache

    m = Leaky()
    with pytest.raises(kn.KilnTraceError, match="attribute 'cache'"):
        kn.compile(m)(kn.ones(2))
    with pytest.raises(kn.KilnTraceError, match="attribute 'cache'"):
        kn.grad(lambda p: nn.functional_call(m, p, kn.ones(2)).sum())({"w": kn.ones(2)})
