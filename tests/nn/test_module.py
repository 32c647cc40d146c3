"""nn.Module: what is a parameter, a buffer, a submodule; state dicts; functional_call."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn


class Block(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.fc = nn.Linear(4, 4, seed=seed)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("steps", kn.zeros((), dtype=kn.int64))
        self.register_buffer("scratch", kn.ones(4), persistent=False)
        self.table = kn.arange(3)  # an integer tensor attribute: neither parameter nor state
        self.scale = 2.0

    def forward(self, x):
        return self.norm(self.fc(x)) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = kn.randn(4, seed=9)
        self.blocks = nn.ModuleList([Block(1), Block(2)])
        self.head = nn.Sequential(nn.GELU(), nn.Linear(4, 2, seed=3))

    def forward(self, x):
        x = x + self.embed
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_parameters_buffers_and_modules_are_discovered_in_definition_order():
    net = Net()
    assert [n for n, _ in net.named_parameters()] == [
        "embed", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.norm.weight",
        "blocks.0.norm.bias", "blocks.1.fc.weight", "blocks.1.fc.bias", "blocks.1.norm.weight",
        "blocks.1.norm.bias", "head.1.weight", "head.1.bias"]
    assert [n for n, _ in net.named_buffers()] == [
        "blocks.0.steps", "blocks.0.scratch", "blocks.1.steps", "blocks.1.scratch"]
    assert [n for n, _ in net.named_modules()] == [
        "", "blocks", "blocks.0", "blocks.0.fc", "blocks.0.norm", "blocks.1", "blocks.1.fc",
        "blocks.1.norm", "head", "head.0", "head.1"]
    # torch's order (a module's own tensors, then its children's); the non-persistent
    # buffer stays out of the state dict, the integer attribute out of everything
    assert list(net.state_dict()) == [
        "embed", "blocks.0.steps", "blocks.0.fc.weight", "blocks.0.fc.bias",
        "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.1.steps", "blocks.1.fc.weight",
        "blocks.1.fc.bias", "blocks.1.norm.weight", "blocks.1.norm.bias", "head.1.weight",
        "head.1.bias"]
    assert len(list(net.parameters())) == 11
    assert net.get_submodule("blocks.1.fc") is net.blocks[1].fc


def test_state_dict_round_trip_into_a_fresh_model():
    a, b = Net(), Net()
    b.load_state_dict({k: v * 0 + 1 for k, v in a.state_dict().items()})
    for v in b.state_dict().values():
        assert (v.numpy() == 1).all()
    b.load_state_dict(a.state_dict())
    x = kn.randn(3, 4, seed=5)
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())
    # loading copies: changing the source array afterwards does not reach the model
    src = {k: np.array(v.numpy()) for k, v in a.state_dict().items()}
    b.load_state_dict(src)
    src["head.1.bias"][:] = 100.0
    assert not (b.head[1].bias.numpy() == 100.0).any()


def test_load_state_dict_errors_name_the_key_and_both_types():
    net = Net()
    sd = net.state_dict()
    with pytest.raises(kn.KilnArgumentError, match=r"missing keys \['head.1.bias'\]"):
        net.load_state_dict({k: v for k, v in sd.items() if k != "head.1.bias"})
    with pytest.raises(kn.KilnArgumentError, match=r"unexpected keys \['extra'\]"):
        net.load_state_dict({**sd, "extra": kn.ones(1)})
    with pytest.raises(kn.KilnShapeError, match=r"'head.1.weight' is f32\[2, 4\] in the module "
                                                r"but f32\[4, 2\] in the state dict"):
        net.load_state_dict({**sd, "head.1.weight": kn.ones(4, 2)})
    with pytest.raises(kn.KilnDTypeError, match=r"'embed' is f32\[4\] in the module but f64\[4\]"):
        net.load_state_dict({**sd, "embed": kn.ones(4, dtype=kn.float64)})
    # nothing was loaded by the failed calls
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), sd[k].numpy())
    missing, unexpected = net.load_state_dict({"embed": kn.zeros(4), "junk": kn.ones(1)},
                                              strict=False)
    assert "head.1.bias" in missing and unexpected == ["junk"]
    assert (net.embed.numpy() == 0).all()


def test_train_eval_and_repr():
    net = Net()
    assert net.training and net.blocks[0].fc.training
    assert net.eval() is net
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())
    text = repr(net)
    assert "(blocks): ModuleList(" in text
    assert "(fc): Linear(in_features=4, out_features=4, bias=True)" in text
    assert "(norm): LayerNorm((4,), eps=1e-05, elementwise_affine=True)" in text
    assert repr(nn.GELU("tanh")) == "GELU(approximate='tanh')"
    assert repr(nn.Dropout(0.25)) == "Dropout(p=0.25)"


def test_a_plain_list_of_modules_is_refused_with_the_fix():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(2, 2, seed=0)]

    with pytest.raises(kn.KilnArgumentError, match="nn.ModuleList"):
        Bad()


def test_containers():
    seq = nn.Sequential(nn.Linear(3, 5, seed=0), nn.ReLU(), nn.Linear(5, 2, seed=1))
    x = kn.randn(4, 3, seed=0)
    manual = seq[2](kn.relu(seq[0](x)))
    np.testing.assert_allclose(seq(x).numpy(), manual.numpy(), rtol=1e-6)
    assert len(seq) == 3 and isinstance(seq[1:], nn.Sequential) and len(seq[1:]) == 2
    ml = nn.ModuleList([nn.Identity()])
    ml.append(nn.Tanh())
    ml.insert(0, nn.Sigmoid())
    assert [type(m).__name__ for m in ml] == ["Sigmoid", "Identity", "Tanh"]
    del ml[0]
    assert [n for n, _ in ml.named_children()] == ["0", "1"]
    md = nn.ModuleDict({"a": nn.Linear(2, 2, seed=0)})
    md["b"] = nn.Linear(2, 3, seed=1)
    assert list(md) == ["a", "b"] and "b" in md
    assert [n for n, _ in md.named_parameters()] == ["a.weight", "a.bias", "b.weight", "b.bias"]
    with pytest.raises(kn.KilnArgumentError, match="not an attribute"):
        md["keys"] = nn.Identity()
    named = nn.Sequential({"first": nn.Linear(2, 2, seed=0), "act": nn.ReLU()})
    assert [n for n, _ in named.named_parameters()] == ["first.weight", "first.bias"]


def test_functional_call_swaps_and_restores_also_on_error():
    net = Net()
    x = kn.randn(2, 4, seed=1)
    before = {k: v for k, v in net.state_dict().items()}
    params = {k: v * 0 for k, v in net.named_parameters()}
    out = nn.functional_call(net, params, x)
    # all weights zero: layer norms of zeros are zero, the head's linear gives its bias 0
    np.testing.assert_array_equal(out.numpy(), np.zeros((2, 2), np.float32))
    for k, v in net.state_dict().items():
        assert v is before[k]

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = kn.ones(2)

        def forward(self, x):
            raise RuntimeError("boom")

    boom = Boom()
    w = boom.w
    with pytest.raises(RuntimeError, match="boom"):
        nn.functional_call(boom, {"w": kn.zeros(2)}, x)
    assert boom.w is w
    with pytest.raises(kn.KilnArgumentError, match="no parameter or buffer named 'wq'"):
        nn.functional_call(boom, {"wq": kn.zeros(2)}, x)
    # a subset of the names: the rest keep the module's own tensors; a tuple of dicts works
    out = nn.functional_call(net, ({"head.1.bias": kn.ones(2)}, {"embed": kn.zeros(4)}), x)
    manual = Net()
    manual.load_state_dict({**net.state_dict(), "head.1.bias": kn.ones(2), "embed": kn.zeros(4)})
    np.testing.assert_allclose(out.numpy(), manual(x).numpy(), rtol=1e-6)


def test_tied_weights_are_listed_once_and_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3, bias=False, seed=0)
            self.b = nn.Linear(3, 3, bias=False, seed=1)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    m = Tied()
    assert [n for n, _ in m.named_parameters()] == ["a.weight"]
    assert list(m.state_dict()) == ["a.weight", "b.weight"]
    x = kn.randn(2, 3, seed=0)
    w = kn.randn(3, 3, seed=7)
    out = nn.functional_call(m, {"a.weight": w}, x)  # b.weight follows its tie
    np.testing.assert_allclose(out.numpy(), (x.numpy() @ w.numpy().T) @ w.numpy().T, rtol=1e-5)
    m._set_tensors({"a.weight": w})
    assert m.b.weight is m.a.weight is w


def test_module_to_converts_floating_tensors_only():
    blk = Block().to(kn.float64)
    assert blk.fc.weight.dtype == kn.float64 and blk.norm.bias.dtype == kn.float64
    assert blk.steps.dtype == kn.int64
    assert blk(kn.randn(2, 4, dtype=kn.float64, seed=0)).dtype == kn.float64


def test_linear_init_is_torchs_scheme_and_deterministic_under_a_seed():
    a, b, c = nn.Linear(64, 32, seed=5), nn.Linear(64, 32, seed=5), nn.Linear(64, 32, seed=6)
    np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())
    assert not np.array_equal(a.weight.numpy(), c.weight.numpy())
    bound = 1 / np.sqrt(64)
    for t in (a.weight, a.bias):
        v = t.numpy()
        assert v.min() >= -bound and v.max() <= bound
    w = a.weight.numpy()
    assert w.max() > 0.99 * bound and w.min() < -0.99 * bound and abs(w.mean()) < 0.05 * bound
    assert a.weight.shape == (32, 64) and a.bias.shape == (32,)
    kn.manual_seed(3)
    d = nn.Linear(4, 4)
    kn.manual_seed(3)
    e = nn.Linear(4, 4)
    np.testing.assert_array_equal(d.weight.numpy(), e.weight.numpy())


def test_nested_functional_call_under_grad():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = nn.Linear(3, 3, seed=0)

        def forward(self, x):  # a forward that itself swaps a submodule's tensors
            return nn.functional_call(self.sub, {"bias": self.sub.bias * 2}, x)

    m = Outer()
    grads = kn.grad(lambda p: nn.functional_call(m, p, kn.ones(1, 3)).sum())(
        dict(m.named_parameters()))
    np.testing.assert_allclose(grads["sub.bias"].numpy(), [2.0, 2.0, 2.0])
    np.testing.assert_allclose(grads["sub.weight"].numpy(), np.ones((3, 3)))


def test_a_module_without_forward_says_so():
    from kiln.errors import KilnArgumentError

    class Empty(nn.Module):
        pass

    with pytest.raises(KilnArgumentError, match="Empty was called, but it does not define"):
        Empty()(1)
