"""Layers against torch.nn with the same weights: forward values, parameter names and
shapes (state dicts load across), eager and compiled."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn

torch = pytest.importorskip("torch", reason="torch (CPU) is a test extra: pip install -e .[test]")


def load_into_torch(kmodule, tmodule):
    """Copy kiln's state dict into the torch module; the names and shapes must match."""
    sd = {k: torch.tensor(np.array(v.numpy())) for k, v in kmodule.state_dict().items()}
    tmodule.load_state_dict(sd, strict=True)
    return tmodule


def close(kiln_out, torch_out, tol=1e-5):
    np.testing.assert_allclose(kiln_out.numpy(), torch_out.detach().numpy(), rtol=tol, atol=tol)


def both(kmodule, *args, **kwargs):
    """Eager and compiled outputs of a module (the compiled one through kn.compile)."""
    eager = kmodule(*args, **kwargs)
    compiled = kn.compile(kmodule)(*args, **kwargs)
    return eager, compiled


@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(bias):
    k = nn.Linear(12, 7, bias=bias, seed=0)
    t = load_into_torch(k, torch.nn.Linear(12, 7, bias=bias))
    x = np.random.default_rng(0).standard_normal((3, 5, 12)).astype(np.float32)
    for out in both(k, kn.tensor(x)):
        close(out, t(torch.tensor(x)))


@pytest.mark.parametrize("shape,affine,bias", [(16, True, True), ((4, 8), True, False),
                                               (16, False, True)])
def test_layer_norm_matches_torch(shape, affine, bias):
    k = nn.LayerNorm(shape, eps=1e-4, elementwise_affine=affine, bias=bias)
    if affine:  # non-trivial affine parameters
        k.load_state_dict({name: kn.randn(*v.shape, seed=i) for i, (name, v) in
                           enumerate(k.state_dict().items())})
    t = load_into_torch(k, torch.nn.LayerNorm(shape, eps=1e-4, elementwise_affine=affine, bias=bias))
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 8) if shape != 16 else (2, 5, 16))
    x = x.astype(np.float32) * 3 + 1
    for out in both(k, kn.tensor(x)):
        close(out, t(torch.tensor(x)))


@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rms_norm_matches_torch(eps):
    k = nn.RMSNorm(16, eps=eps)
    k.load_state_dict({"weight": kn.randn(16, seed=3)})
    t = load_into_torch(k, torch.nn.RMSNorm(16, eps=eps))
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    for out in both(k, kn.tensor(x)):
        close(out, t(torch.tensor(x)))


@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding_matches_torch(padding_idx):
    k = nn.Embedding(10, 6, padding_idx=padding_idx, seed=0)
    if padding_idx is not None:
        assert (k.weight.numpy()[padding_idx] == 0).all()
    t = load_into_torch(k, torch.nn.Embedding(10, 6, padding_idx=padding_idx))
    idx = np.array([[1, 2, 9], [0, 2, 2]])
    for out in both(k, kn.tensor(idx)):
        close(out, t(torch.tensor(idx)), tol=0)
    assert k(kn.tensor(idx)).shape == (2, 3, 6)


def test_activation_modules_match_torch():
    x = np.linspace(-4, 4, 33).astype(np.float32).reshape(3, 11)
    pairs = [(nn.ReLU(), torch.nn.ReLU()), (nn.GELU(), torch.nn.GELU()),
             (nn.GELU("tanh"), torch.nn.GELU("tanh")), (nn.SiLU(), torch.nn.SiLU()),
             (nn.Tanh(), torch.nn.Tanh()), (nn.Sigmoid(), torch.nn.Sigmoid()),
             (nn.Softmax(dim=0), torch.nn.Softmax(dim=0)), (nn.Identity(), torch.nn.Identity())]
    for k, t in pairs:
        close(k(kn.tensor(x)), t(torch.tensor(x)))


def _mha_pair(E=16, H=4, bias=True, batch_first=True, seed=0):
    k = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, seed=seed)
    if bias:  # torch initializes the biases to zero: give them values to check them
        k.in_proj_bias = kn.randn(3 * E, seed=seed + 10) * 0.1
        k.out_proj.bias = kn.randn(E, seed=seed + 11) * 0.1
    t = load_into_torch(k, torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first))
    return k, t


def _inputs(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def test_mha_parameter_layout_is_torchs():
    k = nn.MultiheadAttention(16, 4, seed=0)
    assert {n: v.shape for n, v in k.state_dict().items()} == {
        "in_proj_weight": (48, 16), "in_proj_bias": (48,), "out_proj.weight": (16, 16),
        "out_proj.bias": (16,)}
    t = torch.nn.MultiheadAttention(16, 4)
    assert list(t.state_dict()) == list(k.state_dict())
    bound = np.sqrt(6 / (16 + 48))  # xavier-uniform over [3E, E], as torch
    w = k.in_proj_weight.numpy()
    assert w.max() <= bound and w.min() >= -bound and w.max() > 0.9 * bound


@pytest.mark.parametrize("bias", [True, False])
def test_mha_self_attention_matches_torch(bias):
    k, t = _mha_pair(bias=bias)
    (x,) = _inputs([(2, 5, 16)])
    ref, _ = t(torch.tensor(x), torch.tensor(x), torch.tensor(x), need_weights=False)
    X = kn.tensor(x)
    for out in both(k, X, X, X):
        assert out[1] is None
        close(out[0], ref)


def test_mha_cross_attention_and_weights_match_torch():
    k, t = _mha_pair()
    q, kv = _inputs([(2, 3, 16), (2, 7, 16)], seed=1)
    ref, ref_w = t(torch.tensor(q), torch.tensor(kv), torch.tensor(kv), need_weights=True)
    out, w = k(kn.tensor(q), kn.tensor(kv), kn.tensor(kv), need_weights=True)
    close(out, ref)
    close(w, ref_w)
    ref, ref_w = t(torch.tensor(q), torch.tensor(kv), torch.tensor(kv), need_weights=True,
                   average_attn_weights=False)
    out, w = k(kn.tensor(q), kn.tensor(kv), kn.tensor(kv), need_weights=True,
               average_attn_weights=False)
    close(w, ref_w)
    assert w.shape == (2, 4, 3, 7)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")  # torch's own
def test_mha_masks_match_torch():
    k, t = _mha_pair()
    (x,) = _inputs([(2, 5, 16)], seed=2)
    T, X = torch.tensor(x), kn.tensor(x)
    causal = np.triu(np.ones((5, 5), bool), 1)  # torch's module: True = may not attend
    padding = np.array([[False] * 5, [False, False, False, True, True]])
    additive = np.random.default_rng(3).standard_normal((2 * 4, 5, 5)).astype(np.float32)
    cases = [
        (dict(attn_mask=torch.tensor(causal)), dict(attn_mask=kn.tensor(causal))),
        (dict(attn_mask=torch.tensor(causal), is_causal=True), dict(is_causal=True)),
        (dict(key_padding_mask=torch.tensor(padding)), dict(key_padding_mask=kn.tensor(padding))),
        (dict(attn_mask=torch.tensor(causal), key_padding_mask=torch.tensor(padding)),
         dict(attn_mask=kn.tensor(causal), key_padding_mask=kn.tensor(padding))),
        (dict(attn_mask=torch.tensor(additive)), dict(attn_mask=kn.tensor(additive))),
        (dict(attn_mask=torch.tensor(additive), key_padding_mask=torch.tensor(padding)),
         dict(attn_mask=kn.tensor(additive), key_padding_mask=kn.tensor(padding))),
    ]
    for torch_kw, kiln_kw in cases:
        ref, _ = t(T, T, T, need_weights=False, **torch_kw)
        for out in both(k, X, X, X, **kiln_kw):
            close(out[0], ref)
        _, ref_w = t(T, T, T, need_weights=True, **torch_kw)
        close(k(X, X, X, need_weights=True, **kiln_kw)[1], ref_w)


def test_mha_sequence_first_and_unbatched_match_torch():
    k, t = _mha_pair(batch_first=False, seed=4)
    (x,) = _inputs([(6, 2, 16)], seed=5)  # [L, B, E]
    ref, _ = t(torch.tensor(x), torch.tensor(x), torch.tensor(x), need_weights=False)
    close(k(kn.tensor(x), kn.tensor(x), kn.tensor(x))[0], ref)
    u = x[:, 0]  # unbatched [L, E]
    ref, ref_w = t(torch.tensor(u), torch.tensor(u), torch.tensor(u))
    out, w = k(kn.tensor(u), kn.tensor(u), kn.tensor(u), need_weights=True)
    close(out, ref)
    close(w, ref_w)


def test_mha_rejects_bad_shapes():
    k = nn.MultiheadAttention(16, 4, seed=0)
    x = kn.randn(2, 5, 16, seed=0)
    with pytest.raises(kn.KilnShapeError, match=r"attn_mask must be \[L, S\] = \[5, 5\]"):
        k(x, x, x, attn_mask=kn.ones(4, 5, dtype=kn.bool))
    with pytest.raises(kn.KilnShapeError, match="embed_dim 16"):
        k(kn.randn(2, 5, 8, seed=0), x, x)
    with pytest.raises(kn.KilnArgumentError, match="divisible"):
        nn.MultiheadAttention(10, 4)
