"""Tape autograd (`requires_grad`, `.backward()`, `.grad`, `no_grad`) against torch."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(1)


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_backward_matches_torch_through_a_small_network():
    x, w1, w2 = _x(5, 4), _x(4, 6), _x(6, 3)
    kw1, kw2 = kn.tensor(w1, requires_grad=True), kn.tensor(w2, requires_grad=True)
    tw1, tw2 = torch.tensor(w1, requires_grad=True), torch.tensor(w2, requires_grad=True)
    loss = kn.softmax(kn.gelu(kn.tensor(x) @ kw1) @ kw2, dim=-1).log().mean()
    tloss = torch.softmax(torch.nn.functional.gelu(torch.tensor(x) @ tw1) @ tw2, -1).log().mean()
    assert loss.requires_grad and not loss.is_leaf and loss.grad_fn is not None
    loss.backward()
    tloss.backward()
    np.testing.assert_allclose(kw1.grad.numpy(), tw1.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kw2.grad.numpy(), tw2.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_grads_accumulate_and_unreached_leaves_stay_none():
    a = kn.ones(3, requires_grad=True)
    b = kn.ones(3, requires_grad=True)
    (a * 2).sum().backward()
    (a * a).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [4, 4, 4])
    assert b.grad is None


def test_no_grad_detach_and_enable_grad():
    w = kn.ones(2, requires_grad=True)
    with kn.no_grad():
        y = w * 3
        with kn.enable_grad():
            z = w * 3
    assert not y.requires_grad and z.requires_grad
    assert not (w.detach() * 2).requires_grad
    assert kn.is_grad_enabled()

    @kn.no_grad()
    def evaluate(v):
        return (v * v).sum()

    assert not evaluate(w).requires_grad


def test_backward_errors_are_numbered():
    with pytest.raises(kn.KilnError, match="K301.*does not require grad"):
        kn.ones(2).sum().backward()
    w = kn.ones(2, requires_grad=True)
    with pytest.raises(kn.KilnError, match="K301.*one element"):
        (w * 2).backward()
    with pytest.raises(kn.KilnError, match="K301.*only float"):
        kn.tensor([1, 2], requires_grad=True)


def test_non_scalar_backward_with_gradient():
    w = kn.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (w * w).backward(gradient=kn.tensor([1.0, 0.0, 2.0]))
    np.testing.assert_array_equal(w.grad.numpy(), [2.0, 0.0, 12.0])


def test_module_parameters_get_grads_like_torch():
    torch.manual_seed(0)
    tmodel = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model.load_state_dict({k: v.detach().numpy() for k, v in tmodel.state_dict().items()})
    x, y = _x(6, 4), RNG.integers(0, 2, 6)
    loss = nn.functional.cross_entropy(model(kn.tensor(x)), kn.tensor(y))
    tloss = torch.nn.functional.cross_entropy(tmodel(torch.tensor(x)), torch.tensor(y))
    loss.backward()
    tloss.backward()
    for (name, p), (_, tp) in zip(model.named_parameters(), tmodel.named_parameters()):
        assert p.requires_grad
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_parameter_wraps_data_and_requires_grad():
    p = nn.Parameter(kn.ones(3))
    assert isinstance(p, kn.Tensor) and p.requires_grad and p.is_leaf
    assert not nn.Parameter(kn.ones(3), requires_grad=False).requires_grad
    assert "Parameter containing" in repr(p)


def test_backward_inside_a_trace_gives_the_same_gradient():
    w0 = _x(3)

    def step(w):
        w = w.detach().requires_grad_()
        (w.sin() * w).sum().backward()
        return w.grad

    eager = step(kn.tensor(w0))
    traced = kn.trace(step, kn.tensor(w0))
    from kiln.ir.interpret import run_graph

    (out,) = run_graph(traced, w0)
    np.testing.assert_allclose(out, eager.numpy(), rtol=1e-6)
    np.testing.assert_allclose(eager.numpy(), np.cos(w0) * w0 + np.sin(w0), rtol=1e-6)


def test_changing_outside_state_inside_a_trace_is_a_numbered_error():
    from kiln import optim

    w = nn.Parameter(kn.ones(3))
    opt = optim.SGD([w], lr=0.1)

    def step(x):
        loss = (x * w).sum()
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(kn.KilnError, match="K302.*did not receive"):
        kn.trace(step, kn.ones(3))
    assert w.grad is None and not w.is_traced  # nothing leaked out of the trace
    buf = kn.zeros(3)
    with pytest.raises(kn.KilnError, match="K302"):
        kn.trace(lambda x: buf.add_(x), kn.ones(3))
    assert not buf.is_traced
    step(kn.ones(3))  # eagerly the same step works
    np.testing.assert_allclose(w.numpy(), [0.9, 0.9, 0.9])
