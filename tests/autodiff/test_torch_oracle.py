"""Gradients of composite ops against torch.autograd (torch CPU is a test extra)."""

import numpy as np
import pytest

import kiln as kn

torch = pytest.importorskip("torch", reason="torch (CPU) is a test extra: pip install -e .[test]")


def grads_close(kiln_grads, torch_tensors, tol):
    for g, t in zip(kiln_grads, torch_tensors):
        np.testing.assert_allclose(g.numpy(), t.grad.numpy(), rtol=tol, atol=tol)


def leaf(array):
    return torch.tensor(array, requires_grad=True)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 2e-5)])
def test_layer_norm_gradients(dtype, tol):
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(dtype) for s in ((4, 6, 8), (8,), (8,)))
    up = rng.standard_normal((4, 6, 8)).astype(dtype)

    def f(x, w, b):
        return (kn.layer_norm(x, (8,), w, b, eps=1e-5) * kn.tensor(up)).sum()

    got = kn.grad(f, argnums=(0, 1, 2))(kn.tensor(x), kn.tensor(w), kn.tensor(b))
    tx, tw, tb = leaf(x), leaf(w), leaf(b)
    (torch.nn.functional.layer_norm(tx, (8,), tw, tb, eps=1e-5) * torch.tensor(up)).sum().backward()
    grads_close(got, (tx, tw, tb), tol)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradients(causal):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    up = rng.standard_normal((2, 3, 5, 4))

    def f(q, k, v):
        return (kn.scaled_dot_product_attention(q, k, v, is_causal=causal) * kn.tensor(up)).sum()

    got = kn.grad(f, argnums=(0, 1, 2))(kn.tensor(q), kn.tensor(k), kn.tensor(v))
    tq, tk, tv = leaf(q), leaf(k), leaf(v)
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    (out * torch.tensor(up)).sum().backward()
    grads_close(got, (tq, tk, tv), 1e-9)


def test_softmax_cross_entropy_gradients():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 10))
    target = rng.integers(0, 10, 6)

    def f(logits):
        logp = kn.log_softmax(logits, dim=-1)
        picked = logp.gather(1, kn.tensor(target).reshape(6, 1))
        return -picked.mean()

    got = kn.grad(f)(kn.tensor(logits))
    tl = leaf(logits)
    torch.nn.functional.cross_entropy(tl, torch.tensor(target)).backward()
    grads_close([got], [tl], 1e-10)


def test_compiled_mlp_gradients_match_torch():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w1, w2 = (rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((8, 32), (32, 1)))

    def loss(w1, w2, x):
        return (kn.gelu(x @ w1) @ w2).pow(2).mean()

    got = kn.compile(kn.grad(loss, argnums=(0, 1)))(kn.tensor(w1), kn.tensor(w2), kn.tensor(x))
    t1, t2 = leaf(w1), leaf(w2)
    ((torch.nn.functional.gelu(torch.tensor(x) @ t1) @ t2) ** 2).mean().backward()
    grads_close(got, (t1, t2), 2e-5)
