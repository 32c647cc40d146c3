"""The names PyTorch code reaches for, against torch: tril/triu, masked_fill, topk,
one_hot, multinomial, einsum, clone/contiguous, device= and the dtype aliases."""

import numpy as np
import pytest

import kiln as kn

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("diagonal", [-1, 0, 2])
@pytest.mark.parametrize("shape", [(4, 4), (2, 3, 5)])
def test_tril_triu_match_torch(shape, diagonal):
    x = _x(*shape)
    np.testing.assert_array_equal(kn.tril(kn.tensor(x), diagonal).numpy(),
                                  torch.tril(torch.tensor(x), diagonal).numpy())
    np.testing.assert_array_equal(kn.tensor(x).triu(diagonal).numpy(),
                                  torch.tensor(x).triu(diagonal).numpy())


def test_tril_gradient_and_compiled():
    x = kn.tensor(_x(3, 3))
    g = kn.grad(lambda x: (kn.tril(x) * 2).sum())(x)
    np.testing.assert_array_equal(g.numpy(), np.tril(np.full((3, 3), 2, np.float32)))
    traced = kn.trace(lambda x: kn.triu(x, 1), x)
    assert "iota" in str(traced)


def test_masked_fill_matches_torch_and_checks_its_mask():
    x, m = _x(2, 1, 4, 4), np.tril(np.ones((4, 4))) == 0
    got = kn.tensor(x).masked_fill(kn.tensor(m), float("-inf")).numpy()
    want = torch.tensor(x).masked_fill(torch.tensor(m), float("-inf")).numpy()
    np.testing.assert_array_equal(got, want)
    with pytest.raises(kn.KilnDTypeError, match="bool"):
        kn.masked_fill(kn.tensor(x), kn.ones(4, 4), 0.0)
    with pytest.raises(kn.KilnShapeError, match="enlarge"):
        kn.masked_fill(kn.ones(4), kn.tensor(np.ones((2, 4), bool)), 0.0)


@pytest.mark.parametrize("largest", [True, False])
def test_topk_matches_torch(largest):
    x = _x(3, 7)
    v, i = kn.topk(kn.tensor(x), 3, dim=-1, largest=largest)
    tv, ti = torch.topk(torch.tensor(x), 3, dim=-1, largest=largest)
    np.testing.assert_array_equal(v.numpy(), tv.numpy())
    np.testing.assert_array_equal(i.numpy(), ti.numpy())
    with pytest.raises(kn.KilnArgumentError, match="larger than dim"):
        kn.topk(kn.tensor(x), 8)


def test_one_hot_matches_torch():
    idx = np.array([[0, 2], [3, 1]])
    got = kn.one_hot(kn.tensor(idx), 5).numpy()
    want = torch.nn.functional.one_hot(torch.tensor(idx), 5).numpy()
    np.testing.assert_array_equal(got, want)
    assert kn.one_hot(kn.tensor(idx)).shape == (2, 2, 4)
    with pytest.raises(kn.KilnIndexError, match="out of range"):
        kn.one_hot(kn.tensor(idx), 3)


def test_multinomial_frequencies_and_errors():
    probs = kn.tensor(np.array([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 0.0, 2.0]], np.float32))
    draws = kn.multinomial(probs, 4000, replacement=True, seed=1).numpy()
    assert draws.shape == (2, 4000) and draws.dtype == np.int64
    freq = np.stack([np.bincount(r, minlength=4) / 4000 for r in draws])
    np.testing.assert_allclose(freq, [[0.1, 0, 0.6, 0.3], [0.25, 0.25, 0, 0.5]], atol=0.03)
    assert (draws[0] != 1).all() and (draws[1] != 2).all()
    distinct = kn.multinomial(probs, 3, seed=2).numpy()
    assert all(len(set(r)) == 3 for r in distinct)
    assert 1 not in distinct[0] and 2 not in distinct[1]
    kn.manual_seed(5)
    a = kn.multinomial(probs, 2).numpy()
    kn.manual_seed(5)
    np.testing.assert_array_equal(a, kn.multinomial(probs, 2).numpy())
    with pytest.raises(kn.KilnArgumentError, match="without replacement"):
        kn.multinomial(probs, 5)
    with pytest.raises(kn.KilnArgumentError, match=">= 0"):
        kn.multinomial(kn.tensor([0.5, -0.1]), 1)


@pytest.mark.parametrize("eq,shapes", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("ij,jk", [(3, 4), (4, 2)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]), ("...ij->...ji", [(2, 3, 4)]),
    ("i,i->", [(5,), (5,)]), ("ij,jk,k->i", [(3, 4), (4, 2), (2,)]), ("ij->", [(3, 4)])])
def test_einsum_matches_torch_values_and_gradients(eq, shapes):
    xs = [_x(*s) for s in shapes]
    got = kn.einsum(eq, *[kn.tensor(a) for a in xs])
    ts = [torch.tensor(a, requires_grad=True) for a in xs]
    want = torch.einsum(eq, *ts)
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-5)
    want.sum().backward()
    grads = kn.grad(lambda *a: kn.einsum(eq, *a).sum(), argnums=tuple(range(len(xs))))(
        *[kn.tensor(a) for a in xs])
    for g, t in zip(grads, ts):
        np.testing.assert_allclose(g.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_einsum_rejects_bad_equations():
    with pytest.raises(kn.KilnArgumentError, match="names 2 operands"):
        kn.einsum("ij,jk->ik", kn.ones(2, 2))
    with pytest.raises(kn.KilnShapeError, match="rank"):
        kn.einsum("ijk->i", kn.ones(2, 2))


def test_clone_contiguous_detach():
    x = kn.tensor(_x(2, 3))
    c = x.clone()
    c.add_(1.0)
    assert not np.allclose(c.numpy(), x.numpy())
    assert x.contiguous() is x
    assert x.transpose(0, 1).contiguous().shape == (3, 2)


def test_device_argument_and_dtype_aliases():
    x = kn.arange(4, device="cpu", dtype=kn.long)
    assert x.dtype == kn.int64 and x.device == "cpu" and x.device.type == "cpu"
    assert kn.zeros(2, device=x.device).device == "cpu"
    assert kn.ones(2, device=torch.device("cpu")).dtype == kn.float32
    assert (kn.float, kn.double, kn.half, kn.int, kn.long, kn.short) == (
        kn.float32, kn.float64, kn.float16, kn.int32, kn.int64, kn.int16)
    y = kn.randn(3).to("cpu", kn.double)
    assert y.dtype == kn.float64 and y.to(x).dtype == kn.int64
    with pytest.raises(kn.KilnError, match=r"K105.*unknown device 'tpu'"):
        kn.zeros(2, device="tpu")
    with pytest.raises(kn.KilnError, match="K381.*not available.*NVIDIA GPU"):  # no GPU here
        kn.ones(2, device="cuda:0")


def test_sdpa_dropout_drops_and_rescales_the_attention_weights():
    q, k = kn.tensor(_x(1, 2, 6, 4)), kn.tensor(_x(1, 2, 6, 4))
    eye = kn.eye(6).reshape(1, 1, 6, 6).expand(1, 2, 6, 6)  # v = I: the output is the weights
    with kn.nn.rng(kn.nn.random.key(0)):
        dropped = kn.scaled_dot_product_attention(q, k, eye, dropout_p=0.5, is_causal=True)
    with kn.nn.rng(kn.nn.random.key(0)):
        again = kn.nn.functional.scaled_dot_product_attention(q, k, eye, dropout_p=0.5,
                                                              is_causal=True)
    np.testing.assert_array_equal(dropped.numpy(), again.numpy())
    weights = torch.softmax((torch.tensor(q.numpy()) @ torch.tensor(k.numpy()).mT / 2.0)
                            .masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf")), -1)
    d, w = dropped.numpy(), weights.numpy()
    kept = d != 0
    np.testing.assert_allclose(d[kept], 2 * w[kept], rtol=1e-5)
    assert 0.2 < kept[w > 0].mean() < 0.8


def test_export_names_inputs_after_forward_and_takes_dynamic_shapes_by_name():
    class Head(kn.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = kn.nn.Linear(4, 2)

        def forward(self, idx, targets=None):
            return self.proj(idx)

    B = kn.ShapeVar("B", min=1, max=64)
    prog = kn.export(Head(), (kn.ones(3, 4),),
                     dynamic_shapes={"idx": kn.TensorSpec([B, kn.STATIC])})
    assert str(prog.graph).splitlines()[0].startswith("graph @Head(%idx: f32[B, 4])")
    assert prog(kn.ones(5, 4)).shape == (5, 2)


def test_the_new_ops_compile_and_match_eager():
    x = kn.tensor(_x(2, 5, 5))
    idx = kn.tensor(np.array([[0, 3], [4, 1]]))

    def f(x, idx):
        masked = kn.tril(x).masked_fill(kn.triu(kn.ones(5, 5), 1) > 0, -1.0)
        values, indices = kn.topk(masked, 2, dim=-1)
        mixed = kn.einsum("bij,bkj->bik", masked, x.clone().contiguous())
        return values, indices, mixed.sum(-1), kn.one_hot(idx, 5)

    fast = kn.compile(f)
    for got, want in zip(fast(x, idx), f(x, idx)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
