"""In-place ops and item assignment rebind the tensor handle, with torch's results."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(2)


def _pair(*shape):
    x = RNG.standard_normal(shape).astype(np.float32)
    return kn.tensor(x), torch.tensor(x)


@pytest.mark.parametrize("index", [
    0, (slice(None), 1), (Ellipsis, slice(0, 4, 2)), (1, slice(1, None, 2)),
    ([0, 2],), (slice(None), [3, 0]), (None, 1)])
def test_setitem_matches_torch(index):
    k, t = _pair(3, 5)
    k[index] = 7.0
    t[index] = 7.0
    np.testing.assert_array_equal(k.numpy(), t.numpy())
    k2, t2 = _pair(3, 5)
    region = t2[index]
    v = RNG.standard_normal(region.shape).astype(np.float32)
    k2[index] = kn.tensor(v)
    t2[index] = torch.tensor(v)
    np.testing.assert_array_equal(k2.numpy(), t2.numpy())


def test_boolean_mask_assignment_eager_and_traced():
    k, t = _pair(4, 6)
    v, tv = kn.topk(k, 2)[0], torch.topk(t, 2)[0]
    k[k < v[:, [-1]]] = -float("inf")
    t[t < tv[:, [-1]]] = -float("inf")
    np.testing.assert_array_equal(k.numpy(), t.numpy())

    def clip(x):
        x[x > 0.5] = 0.5
        return x

    x = RNG.standard_normal((3, 3)).astype(np.float32)
    from kiln.ir.interpret import run_graph

    (out,) = run_graph(kn.trace(clip, kn.tensor(x)), x)
    np.testing.assert_array_equal(out, np.minimum(x, 0.5))


def test_inplace_ops_match_torch_and_alias_through_references():
    k, t = _pair(2, 3)
    alias = k
    for name, args in [("add_", (1.5,)), ("mul_", (2.0,)), ("sub_", (0.25,)),
                       ("clamp_", (-1.0, 1.0)), ("div_", (3.0,)), ("neg_", ()),
                       ("masked_fill_", None), ("fill_", (0.5,)), ("zero_", ())]:
        if args is None:
            m = np.array([[True, False, True], [False, False, True]])
            getattr(k, name)(kn.tensor(m), 9.0)
            getattr(t, name)(torch.tensor(m), 9.0)
        else:
            assert getattr(k, name)(*args) is k
            getattr(t, name)(*args)
        np.testing.assert_allclose(alias.numpy(), t.numpy(), rtol=1e-6, err_msg=name)
    k += 2
    assert alias is k and (alias.numpy() == 2).all()
    src = kn.tensor([1.0, 2.0, 3.0])
    k.copy_(src)
    np.testing.assert_array_equal(alias.numpy(), np.tile([1.0, 2.0, 3.0], (2, 1)))


def test_inplace_rules_are_numbered():
    x = kn.ones(3)
    with pytest.raises(kn.KilnError, match="K300.*shape"):
        x.add_(kn.ones(2, 3))
    i = kn.tensor([1, 2])
    with pytest.raises(kn.KilnError, match="K300.*cannot be written"):
        i.add_(0.5)
    i.add_(True)
    np.testing.assert_array_equal(i.numpy(), [2, 3])
    w = kn.ones(2, requires_grad=True)
    with pytest.raises(kn.KilnError, match="K300.*leaf"):
        w.mul_(w)
    with kn.no_grad():
        w.mul_(3.0)
    np.testing.assert_array_equal(w.numpy(), [3.0, 3.0])


def test_inplace_init_keeps_tied_weights_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.wte.weight = self.head.weight

        def forward(self, idx):
            return self.head(self.wte(idx))

    m = Tied()

    def init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    kn.manual_seed(0)
    m.apply(init)
    assert m.wte.weight is m.head.weight
    assert abs(float(m.head.weight.numpy().std()) - 0.02) < 0.01
    nn.init.zeros_(m.head.weight)
    assert (m.wte.weight.numpy() == 0).all()
    assert len(list(m.parameters())) == 1


def test_load_state_dict_writes_into_the_existing_tensors():
    lin = nn.Linear(3, 2)
    w = lin.weight
    new = {"weight": np.ones((2, 3), np.float32), "bias": np.zeros(2, np.float32)}
    lin.load_state_dict(new)
    assert lin.weight is w and (w.numpy() == 1).all() and w.requires_grad


def test_inplace_on_views_writes_through_to_the_base_like_torch():
    k, t = kn.zeros(3, 4), torch.zeros(3, 4)
    for kv, tv in [(k[:, 1], t[:, 1]), (k[0], t[0]), (k.view(12)[5:7], t.view(12)[5:7]),
                   (k.transpose(0, 1)[3], t.transpose(0, 1)[3]), (k.narrow(0, 2, 1), t.narrow(0, 2, 1)),
                   (k.permute(1, 0), t.permute(1, 0)), (k.unsqueeze(0)[0, 1:], t.unsqueeze(0)[0, 1:])]:
        kv.add_(1.5)
        tv.add_(1.5)
        np.testing.assert_array_equal(k.numpy(), t.numpy())
    k.permute(1, 0)[0, 1] = 5.0
    t.permute(1, 0)[0, 1] = 5.0
    k.view(12)[kn.tensor([0, 11])] = -1.0
    t.view(12)[torch.tensor([0, 11])] = -1.0
    np.testing.assert_array_equal(k.numpy(), t.numpy())


def test_data_is_an_untaped_view_of_a_parameter():
    w = nn.Parameter(kn.ones(3))
    w.data.mul_(3.0)
    np.testing.assert_array_equal(w.numpy(), [3.0, 3.0, 3.0])
    w.data = kn.zeros(3)
    assert w.requires_grad and w.is_leaf and (w.numpy() == 0).all()
    with pytest.raises(kn.KilnError, match="K300.*leaf"):
        w[0].mul_(w[1])  # a view of a leaf that requires grad, changed with grad mode on


def test_writes_through_a_view_inside_a_trace():
    def f(x):
        x[:, 0].mul_(10.0)
        x.view(-1)[-1] = 0.0
        return x

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    from kiln.ir.interpret import run_graph

    (out,) = run_graph(kn.trace(f, kn.tensor(x)), x)
    want = x.copy()
    want[:, 0] *= 10
    want[-1, -1] = 0
    np.testing.assert_array_equal(out, want)


def test_views_see_later_writes_to_their_base():
    x = kn.zeros(2, 3)
    row, col, flat = x[1], x[:, 2], x.view(6)
    x.fill_(7.0)
    x[1, 2] = -1.0
    assert row.tolist() == [7.0, 7.0, -1.0] and col.tolist() == [7.0, -1.0]
    assert flat.numpy()[-1] == -1.0 and (row * 2).tolist() == [14.0, 14.0, -2.0]
    flat[0] = 3.0  # and a write through one view is seen by another
    assert x[0, 0].item() == 3.0 and x.transpose(0, 1)[0, 0].item() == 3.0
