"""Training end to end: kn.grad through modules against torch.autograd, a compiled
training step against the same step eager, and the example script."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn, optim
from kiln.nn import functional as F

torch = pytest.importorskip("torch", reason="torch (CPU) is a test extra: pip install -e .[test]")


def to_torch(kmodule, tmodule):
    tmodule.load_state_dict({k: torch.tensor(np.array(v.numpy()))
                             for k, v in kmodule.state_dict().items()})
    return tmodule


def grads_close(kgrads: dict, tmodule, tol):
    for name, p in tmodule.named_parameters():
        np.testing.assert_allclose(kgrads[name].numpy(), p.grad.numpy(), rtol=tol, atol=tol,
                                   err_msg=name)


class TinyLM(nn.Module):
    """Embedding -> LayerNorm -> causal self-attention -> Linear head."""

    def __init__(self, vocab=11, dim=16, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, seed=0)
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, seed=1)
        self.head = nn.Linear(dim, vocab, seed=2)

    def forward(self, tokens):
        h = self.norm(self.embed(tokens))
        a, _ = self.attn(h, h, h, is_causal=True)
        return self.head(h + a)


class TorchTinyLM(torch.nn.Module):
    def __init__(self, vocab=11, dim=16, heads=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.norm(self.embed(tokens))
        L = tokens.shape[1]
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        return self.head(h + a)


TOKENS = np.random.default_rng(0).integers(0, 11, (3, 7))
TARGETS = np.random.default_rng(1).integers(0, 11, (3, 7))


def test_cross_entropy_and_attention_gradients_match_torch_autograd():
    model = TinyLM()
    model.attn.in_proj_bias = kn.randn(48, seed=3) * 0.1  # torch's zero init hides bias bugs
    ref = to_torch(model, TorchTinyLM())

    def loss_fn(params, tokens, targets):
        logits = nn.functional_call(model, params, tokens)
        return F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), label_smoothing=0.1)

    params = dict(model.named_parameters())
    loss, grads = kn.value_and_grad(loss_fn)(params, kn.tensor(TOKENS), kn.tensor(TARGETS))
    tloss = torch.nn.functional.cross_entropy(
        ref(torch.tensor(TOKENS)).reshape(-1, 11), torch.tensor(TARGETS).reshape(-1),
        label_smoothing=0.1)
    tloss.backward()
    np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5)
    assert set(grads) == {n for n, _ in ref.named_parameters()}
    grads_close(grads, ref, tol=2e-5)


def test_attention_model_gradients_compiled_match_torch_autograd():
    model = TinyLM()
    ref = to_torch(model, TorchTinyLM())

    def loss_fn(params, tokens, targets):
        logits = nn.functional_call(model, params, tokens)
        return F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))

    step = kn.compile(kn.value_and_grad(loss_fn))
    loss, grads = step(dict(model.named_parameters()), kn.tensor(TOKENS), kn.tensor(TARGETS))
    tloss = torch.nn.functional.cross_entropy(
        ref(torch.tensor(TOKENS)).reshape(-1, 11), torch.tensor(TARGETS).reshape(-1))
    tloss.backward()
    np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5)
    grads_close(grads, ref, tol=2e-5)


def test_embedding_padding_row_gets_no_gradient():
    emb = nn.Embedding(5, 3, padding_idx=0, seed=0)
    tokens = kn.tensor([[0, 1, 0, 4]])
    g = kn.grad(lambda p: (nn.functional_call(emb, p, tokens) ** 2).sum())(
        dict(emb.named_parameters()))["weight"].numpy()
    ref = torch.nn.Embedding(5, 3, padding_idx=0)
    to_torch(emb, ref)
    (ref(torch.tensor([[0, 1, 0, 4]])) ** 2).sum().backward()
    np.testing.assert_allclose(g, ref.weight.grad.numpy(), rtol=1e-6)
    assert (g[0] == 0).all() and (g[1] != 0).all()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32, seed=0), nn.GELU(), nn.LayerNorm(32),
                                 nn.Dropout(0.2), nn.Linear(32, 5, seed=1))

    def forward(self, x):
        return self.net(x)


def test_compiled_training_step_matches_eager_over_several_steps():
    model = MLP()
    opt = optim.AdamW(lr=1e-2, weight_decay=0.05)

    def loss_fn(params, x, y, key):
        with nn.rng(key):
            return F.cross_entropy(nn.functional_call(model, params, x), y)

    def step(params, state, x, y, key):
        loss, grads = kn.value_and_grad(loss_fn)(params, x, y, key)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    compiled = kn.compile(step)
    p_eager = p_comp = dict(model.named_parameters())
    s_eager = s_comp = opt.init(p_eager)
    losses = []
    for i in range(6):
        x = kn.randn(16, 12, seed=i)
        y = kn.randint(0, 5, (16,), seed=100 + i)
        key = nn.random.fold_in(nn.random.key(7), i)
        p_eager, s_eager, l_eager = step(p_eager, s_eager, x, y, key)
        p_comp, s_comp, l_comp = compiled(p_comp, s_comp, x, y, key)
        np.testing.assert_allclose(l_comp.item(), l_eager.item(), rtol=1e-4)
        losses.append(l_comp.item())
    for name in p_eager:
        np.testing.assert_allclose(p_comp[name].numpy(), p_eager[name].numpy(), rtol=1e-4,
                                   atol=1e-5, err_msg=name)
    assert int(s_comp["step"].item()) == 6
    assert compiled.stats()["compiles"] == 1  # new keys, batches and states: one program
    assert not np.allclose(p_comp["net.0.weight"].numpy(), model.net[0].weight.numpy())


def test_eager_training_with_opt_step_learns():
    kn.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16, seed=0), nn.Tanh(), nn.Linear(16, 1, seed=1))
    x = kn.randn(64, 4, seed=1)
    y = (x * kn.tensor([1.0, -2.0, 0.5, 0.0])).sum(dim=-1, keepdim=True)
    opt = optim.SGD(lr=0.1, momentum=0.9)
    loss_fn = lambda p: F.mse_loss(nn.functional_call(model, p, x), y)  # noqa: E731
    first = None
    for _ in range(30):
        loss, grads = kn.value_and_grad(loss_fn)(dict(model.named_parameters()))
        first = first if first is not None else loss.item()
        opt.step(model, grads)
    assert F.mse_loss(model(x), y).item() < 0.1 * first


def test_the_example_script_trains():
    from examples.train_mlp import main

    result = main(["--steps", "40", "--eager-steps", "2", "--batch", "64"])
    losses = result["losses"]
    assert np.mean(losses[-5:]) < 0.25 * losses[0]
    assert result["test_loss"] < 0.5 * result["baseline"]
    assert result["compiles"] == 1
