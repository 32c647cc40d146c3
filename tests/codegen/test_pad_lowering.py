"""`pad` lowered inside fused kernels (kiln/codegen/pad_lower.py) against numpy's
np.pad and the op's own reference: low/high/interior widths including zeros, every
rank up to 3, float/int/bool dtypes, a fill that is a traced input, a symbolic dim,
the padded result feeding elementwise ops and a reduction in the same kernel, and the
vjp of a split (the gradient pads of attention's q/k/v split) with no extern left."""

import numpy as np
import pytest

import kiln as kn
import kiln.nn.functional as F
from kiln.errors import KilnArgumentError
from kiln.frontend.dispatch import apply
from kiln.ir import registry


def steps_of(f, *args):
    """The launches of one call of compiled `f` (name, stage)."""
    f(*args)
    with kn.profile() as p:
        out = f(*args)
    return out, [(e.name, e.stage) for e in p.events]


def reference(x, fill, low, high, interior):
    return registry.get("pad").reference(x, np.asarray(fill, x.dtype), low=low, high=high,
                                         interior=interior)


CASES = [
    ((5,), (0,), (0,), (0,)),
    ((5,), (2,), (3,), (0,)),
    ((5,), (0,), (0,), (2,)),
    ((1,), (1,), (1,), (3,)),
    ((4, 7), (1, 0), (0, 2), (0, 0)),
    ((4, 7), (2, 1), (1, 3), (1, 2)),
    ((3, 5, 9), (0, 2, 1), (1, 0, 8), (0, 1, 0)),
    ((2, 3, 17), (1, 1, 1), (1, 1, 1), (2, 0, 1)),
]


@pytest.mark.parametrize("shape,low,high,interior", CASES)
def test_pad_matches_the_reference(shape, low, high, interior):
    rng = np.random.default_rng(len(shape) + sum(low))
    x = rng.standard_normal(shape).astype(np.float32)
    fill = np.float32(-2.5)
    f = kn.compile(lambda t, v: apply("pad", t, v, low=low, high=high, interior=interior) * 3 + 1)
    got, steps = steps_of(f, kn.tensor(x), kn.tensor(fill))
    want = reference(x, fill, low, high, interior) * np.float32(3) + np.float32(1)
    np.testing.assert_array_equal(got.numpy(), want)
    assert [s for _, s in steps] == ["kernel"], steps  # one fused kernel, no extern


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.uint8, np.bool_])
def test_pad_dtypes(dtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 5)) * 50).astype(dtype)
    fill = np.asarray(1, dtype)
    f = kn.compile(lambda t, v: apply("pad", t, v, low=(1, 2), high=(2, 0), interior=(0, 1)))
    got = f(kn.tensor(x), kn.tensor(fill)).numpy()
    np.testing.assert_array_equal(got, reference(x, fill, (1, 2), (2, 0), (0, 1)))


def test_functional_pad_with_negative_widths():
    """F.pad's negative widths crop (a slice before the op, which only takes >= 0)."""
    x = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    f = kn.compile(lambda t: F.pad(t, (-1, 2, 3, -2, 0, 1), value=9.0))
    got, steps = steps_of(f, kn.tensor(x))
    want = np.pad(x[:, :2, 1:], ((0, 1), (3, 0), (0, 2)), constant_values=9.0)
    np.testing.assert_array_equal(got.numpy(), want)
    assert all(stage == "kernel" for _, stage in steps), steps


def test_negative_width_is_rejected_by_the_op():
    f = kn.compile(lambda t, v: apply("pad", t, v, low=(-1,), high=(0,), interior=(0,)))
    with pytest.raises(KilnArgumentError, match="pad: low"):
        f(kn.tensor(np.ones(3, np.float32)), kn.tensor(np.float32(0)))


def test_pad_then_reduction_fuses():
    """A padded row feeding a row sum: the pad is generated inside the reduction."""
    x = np.random.default_rng(3).standard_normal((8, 30)).astype(np.float32)
    f = kn.compile(lambda t: F.pad(t, (3, 5), value=0.5).exp().sum(-1))
    got, steps = steps_of(f, kn.tensor(x))
    want = np.exp(np.pad(x, ((0, 0), (3, 5)), constant_values=0.5).astype(np.float64)).sum(-1)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
    assert [s for _, s in steps] == ["kernel"], steps


def test_symbolic_dim():
    f = kn.compile(lambda t: F.pad(t, (2, 1, 1, 0), value=-1.0), dynamic=True)
    for rows in (3, 0, 11):  # 0: x is empty, the output all padding
        x = np.random.default_rng(rows).standard_normal((rows, 6)).astype(np.float32)
        np.testing.assert_array_equal(f(kn.tensor(x)).numpy(),
                                      np.pad(x, ((1, 0), (2, 1)), constant_values=-1.0))


def test_split_gradient_has_no_pad_extern():
    """The vjp of a q/k/v split pads each cotangent back to the full width."""
    w = np.random.default_rng(5).standard_normal((4, 12)).astype(np.float32)

    def loss(t):
        q, k, v = t.split(4, dim=-1)
        return (q * 1.0 + k * 2.0 + v * v).sum()

    g = kn.compile(kn.grad(loss))
    got, steps = steps_of(g, kn.tensor(w))
    want = np.concatenate([np.ones((4, 4)), np.full((4, 4), 2.0), 2 * w[:, 8:]], axis=1)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    assert all(stage == "kernel" for _, stage in steps), steps
