"""Dropout: where its key comes from, what it computes, and eager == compiled."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn
from kiln.nn import functional as F


def mask_of(out, x, p):
    """The kept positions, checking that kept values are x / (1 - p) and the rest 0."""
    out, x = out.numpy(), x.numpy()
    kept = out != 0
    np.testing.assert_allclose(out[kept], x[kept] / (1 - p), rtol=1e-6)
    return kept


def test_eval_mode_and_p_zero_are_the_identity():
    x = kn.randn(8, 8, seed=0)
    d = nn.Dropout(0.5).eval()
    assert d(x) is x
    assert nn.Dropout(0.0)(x) is x
    assert (nn.Dropout(1.0)(x).numpy() == 0).all()
    with pytest.raises(kn.KilnArgumentError, match=r"p must be in \[0, 1\]"):
        nn.Dropout(1.5)


def test_rate_and_mean_are_preserved():
    x = kn.ones(256, 256)
    for p in (0.1, 0.5, 0.9):
        out = nn.Dropout(p, seed=1)(x)
        kept = mask_of(out, x, p)
        assert abs(kept.mean() - (1 - p)) < 0.01  # 65536 Bernoulli draws: sd 0.002
        assert abs(out.numpy().mean() - 1.0) < 0.03


def test_a_seed_makes_the_sequence_of_masks_deterministic():
    x = kn.ones(64, 64)
    a, b = nn.Dropout(0.5, seed=3), nn.Dropout(0.5, seed=3)
    first = [mask_of(a(x), x, 0.5) for _ in range(3)]
    second = [mask_of(b(x), x, 0.5) for _ in range(3)]
    for m1, m2 in zip(first, second):
        np.testing.assert_array_equal(m1, m2)
    assert not np.array_equal(first[0], first[1])  # each call draws a new mask
    # without a seed: kiln's global stream, reset by manual_seed
    kn.manual_seed(7)
    c = mask_of(nn.Dropout(0.5)(x), x, 0.5)
    kn.manual_seed(7)
    np.testing.assert_array_equal(c, mask_of(nn.Dropout(0.5)(x), x, 0.5))


def test_an_rng_block_numbers_its_draws_and_overrides_the_seed():
    x = kn.ones(32, 32)
    model = nn.Sequential(nn.Dropout(0.5, seed=1), nn.Dropout(0.5, seed=1))
    key = nn.random.key(11)
    with nn.rng(key):
        out = model(x)
    # draw n uses fold_in(key, n)
    expected = F.dropout(F.dropout(x, 0.5, key=nn.random.fold_in(key, 0)), 0.5,
                         key=nn.random.fold_in(key, 1))
    np.testing.assert_array_equal(out.numpy(), expected.numpy())
    with nn.rng(key):
        again = model(x)
    np.testing.assert_array_equal(out.numpy(), again.numpy())


def test_fold_in_and_split_give_independent_keys():
    key = nn.random.key(0)
    keys = {tuple(nn.random.fold_in(key, i).tolist()) for i in range(100)}
    assert len(keys) == 100
    # a tensor counter folds in exactly like the Python int (a compiled step's step count)
    np.testing.assert_array_equal(nn.random.fold_in(key, 5).numpy(),
                                  nn.random.fold_in(key, kn.tensor(5)).numpy())
    pair = nn.random.split(key, 3)
    assert pair.shape == (3, 2) and pair.dtype == kn.uint32
    assert len({tuple(r) for r in pair.tolist()}) == 3
    with pytest.raises(kn.KilnDTypeError, match="u32"):
        nn.random.fold_in(kn.ones(2), 0)


def test_eager_and_compiled_draw_the_same_mask_from_the_same_key():
    x = kn.randn(16, 32, seed=0)

    def f(x, key):
        with nn.rng(key):
            return nn.Dropout(0.3)(x)

    compiled = kn.compile(f)
    for step in range(3):
        key = nn.random.fold_in(nn.random.key(1), step)
        np.testing.assert_array_equal(compiled(x, key).numpy(), f(x, key).numpy())
    masks = [compiled(x, nn.random.fold_in(nn.random.key(1), s)).numpy() != 0 for s in range(2)]
    assert not np.array_equal(*masks)
    assert compiled.stats()["compiles"] == 1  # a new key is a new input, never a recompile


def test_a_step_counter_tensor_folds_in_inside_the_compiled_function():
    x = kn.ones(8, 8)

    @kn.compile
    def f(x, key, step):
        with nn.rng(nn.random.fold_in(key, step)):
            return F.dropout(x, 0.5)

    key = nn.random.key(2)
    outs = [f(x, key, kn.tensor(s)).numpy() for s in range(3)]
    for s, out in enumerate(outs):
        with nn.rng(nn.random.fold_in(key, s)):
            np.testing.assert_array_equal(out, F.dropout(x, 0.5).numpy())
    assert f.stats()["compiles"] == 1


def test_tracing_without_a_key_raises_with_the_fix():
    d = nn.Dropout(0.5, seed=0)
    with pytest.raises(kn.KilnTraceError, match="without a key") as info:
        kn.compile(lambda x: d(x))(kn.ones(4))
    assert "kn.nn.rng(key)" in str(info.value)
    kn.compile(lambda x: d.eval()(x))(kn.ones(4))  # eval mode needs no key


def test_compiled_module_gets_fresh_masks_and_matches_eager_inside_an_rng_block():
    model = nn.Sequential(nn.Linear(8, 8, seed=0), nn.Dropout(0.5), nn.Linear(8, 8, seed=1),
                          nn.Dropout(0.5))
    fast = kn.compile(model)
    x = kn.randn(4, 8, seed=1)
    a, b = fast(x).numpy(), fast(x).numpy()
    assert not np.array_equal(a, b)
    key = nn.random.key(4)
    with nn.rng(key):
        eager = [model(x).numpy(), model(x).numpy()]
    with nn.rng(key):  # the compiled calls continue the block's numbering as eager does
        compiled = [fast(x).numpy(), fast(x).numpy()]
    for e, c in zip(eager, compiled):
        np.testing.assert_allclose(c, e, rtol=1e-5, atol=1e-6)
    # one program for fresh keys, one for continuing a block (its position is an input)
    assert fast.stats()["compiles"] == 2
    with nn.rng(nn.random.key(5)):
        fast(x)
        fast(x)
    assert fast.stats()["compiles"] == 2
    model.eval()
    np.testing.assert_allclose(fast(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert fast.stats()["compiles"] == 3


def test_mha_attention_dropout_uses_the_key():
    mha = nn.MultiheadAttention(8, 2, dropout=0.5, seed=0)
    x = kn.randn(2, 6, 8, seed=0)
    with nn.rng(nn.random.key(0)):
        a = mha(x, x, x, need_weights=True)
    with nn.rng(nn.random.key(0)):
        b = kn.compile(mha)(x, x, x, need_weights=True)
    np.testing.assert_allclose(a[0].numpy(), b[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a[1].numpy(), b[1].numpy(), rtol=1e-5, atol=1e-6)
    mha.eval()
    w = mha(x, x, x, need_weights=True)[1].numpy()
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
