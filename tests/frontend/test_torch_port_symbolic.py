"""Sizes in user code under a dynamic spec: `x.size()` comparisons decided by the declared
ranges (or a numbered error naming the dim), slicing/view/arange by a symbolic size, and
one compile serving every length of the range."""

import numpy as np
import pytest

import kiln as kn
from kiln.ir.interpret import run_graph

T = kn.ShapeVar("T", min=1, max=16)
SPEC = {"x": kn.TensorSpec([2, T])}


def test_comparisons_the_range_decides():
    seen = []

    def f(x):
        b, t = x.size()
        assert t <= 16 and t >= 1 and not (t > 16) and t < 17 and t != 0 and 2 * t + 1 <= 33
        seen.append((t <= 16, t > 20, 16 - t >= 0))
        return x * 2

    kn.trace(f, kn.ones(2, 5), dynamic_shapes=SPEC)
    assert seen == [(True, False, True)]


def test_an_undecided_comparison_is_a_numbered_error_naming_the_dim():
    def f(x):
        if x.size(1) <= 8:
            return x
        return x * 2

    with pytest.raises(kn.KilnConcretizationError, match=r"K141.*T <= 8.*T in \[1, 16\]"):
        kn.trace(f, kn.ones(2, 5), dynamic_shapes=SPEC)
    with pytest.raises(kn.KilnConcretizationError, match="Python int"):
        kn.trace(lambda x: x[:, :1] * len(range(x.size(1))), kn.ones(2, 5), dynamic_shapes=SPEC)


def test_slice_view_and_arange_by_a_symbolic_size():
    buf = np.tril(np.ones((16, 16), np.float32))

    def f(x):
        b, t = x.size()
        mask = kn.tensor(buf).view(1, 16, 16)[:, :t, :t]
        pos = kn.arange(0, t, dtype=kn.long)
        y = x.view(b, t, 1) * mask[0, -1:, :].view(1, t, 1) + pos.view(1, t, 1)
        return y.narrow(1, 0, t).sum(dim=-1)

    g = kn.trace(f, kn.ones(2, 5), dynamic_shapes=SPEC)
    for t in (1, 5, 16):
        x = np.random.default_rng(t).standard_normal((2, t)).astype(np.float32)
        (got,) = run_graph(g, x)
        np.testing.assert_allclose(got, f(kn.tensor(x)).numpy(), rtol=1e-6)
        np.testing.assert_allclose(got, x + np.arange(t), rtol=1e-6)


def test_a_generation_loop_over_growing_lengths_compiles_once():
    w = kn.randn(4, 4, seed=0)

    def step(x):
        b, t, c = x.size()
        assert t <= 16
        return (x @ w)[:, -1:, :].tanh()

    fast = kn.compile(step, dynamic_shapes={"x": kn.TensorSpec([1, T, 4])})
    x = kn.randn(1, 1, 4, seed=1)
    for _ in range(6):
        x = kn.cat([x, fast(x)], dim=1)
    assert x.shape == (1, 7, 4) and fast.stats()["compiles"] == 1
    np.testing.assert_allclose(fast(x).numpy(), step(x).numpy(), rtol=1e-5, atol=1e-6)
