"""A small pre-norm transformer block (attention + MLP + layer_norm) in kiln's eager API.

Used by the demo, the docs and the tests: run it eagerly, trace it, export it.
"""

import kiln as kn


def transformer_block(x, wq, wk, wv, wo, w1, b1, w2, b2, ln1_w, ln1_b, ln2_w, ln2_b):
    """x: [batch, seq, dim]; single-head causal attention, then a GELU MLP."""
    dim = x.shape[-1]
    h = kn.layer_norm(x, (dim,), ln1_w, ln1_b)
    attn = kn.scaled_dot_product_attention(h @ wq, h @ wk, h @ wv, is_causal=True)
    x = x + attn @ wo
    h = kn.layer_norm(x, (dim,), ln2_w, ln2_b)
    return x + kn.gelu(h @ w1 + b1, approximate="tanh") @ w2 + b2


def example_inputs(batch=2, seq=16, dim=32, hidden=128, seed=0):
    scale = dim ** -0.5
    weights = [kn.randn(dim, dim, seed=seed + i) * scale for i in range(1, 5)]
    return (
        kn.randn(batch, seq, dim, seed=seed),
        *weights,
        kn.randn(dim, hidden, seed=seed + 5) * scale, kn.zeros(hidden),
        kn.randn(hidden, dim, seed=seed + 6) * hidden ** -0.5, kn.zeros(dim),
        kn.ones(dim), kn.zeros(dim), kn.ones(dim), kn.zeros(dim),
    )
