"""The Tensor object and its factories: construction and dtype inference, sharing
memory with numpy, filled and random tensors, numpy and DLPack interop, Python
conversions, repr, `kn.linalg` through reconstruction identities, and the errors a
user gets for each kind of mistake."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import kiln as kn
from kiln.errors import KilnArgumentError, KilnDTypeError, KilnError, KilnShapeError

FLOAT_DTYPES = [kn.float32, kn.float64, kn.float16, kn.bfloat16]
ALL_DTYPES = FLOAT_DTYPES + [kn.int32, kn.int64, kn.uint8, kn.int8, kn.bool]


# -- construction -----------------------------------------------------------------------------


@pytest.mark.parametrize("data, dtype", [
    ([1.0, 2.0], kn.float32),             # Python floats default to float32, as torch
    ([1, 2], kn.int64),
    ([True, False], kn.bool),
    ([1, 2.5], kn.float32),
    (3, kn.int64),
    (2.5, kn.float32),
    (True, kn.bool),
    (np.arange(3, dtype=np.int8), kn.int8),
    (np.ones(2, np.float64), kn.float64),  # numpy data keeps its dtype
    (np.float64(1.0), kn.float64),
    (np.ones(2, ml_dtypes.bfloat16), kn.bfloat16),
    (np.ones(2, np.uint16), kn.int32),     # kiln has no uint16: widened on the way in
    ([[1, 2], [3, 4]], kn.int64),
])
def test_tensor_infers_dtype(data, dtype):
    t = kn.tensor(data)
    assert t.dtype == dtype
    np.testing.assert_array_equal(t.numpy().astype(np.float64), np.asarray(data, np.float64))
    assert t.shape == np.shape(data) and isinstance(t.shape, tuple)
    assert t.ndim == len(t.shape) == t.dim()


def test_tensor_copies_and_asarray_shares():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    copied, shared = kn.tensor(a), kn.asarray(a)
    a[0, 0] = 100.0
    assert copied.numpy()[0, 0] == 0.0
    assert shared.numpy()[0, 0] == 100.0
    shared.numpy()[1, 2] = -1.0  # .numpy() is a view, not a copy
    assert a[1, 2] == -1.0
    assert kn.asarray(shared) is shared
    converted = kn.asarray(a, dtype=kn.float64)
    assert converted.dtype == kn.float64 and not np.shares_memory(converted.numpy(), a)
    assert kn.from_numpy(a).numpy() is a or np.shares_memory(kn.from_numpy(a).numpy(), a)


def test_tensor_with_dtype_converts():
    t = kn.tensor([1.7, -1.7, 0.0], dtype=kn.int32)
    assert t.dtype == kn.int32
    np.testing.assert_array_equal(t.numpy(), [1, -1, 0])
    assert kn.tensor([0, 2], dtype=kn.bool).tolist() == [False, True]
    assert kn.tensor([1, 2], dtype="float16").dtype == kn.float16


def test_metadata():
    t = kn.zeros(2, 3, 4)
    assert t.shape == (2, 3, 4) and t.size() == (2, 3, 4) and t.size(1) == 3 and t.size(-1) == 4
    assert t.numel() == 24 and t.ndim == 3
    assert t.device == "cpu" and t.device.type == "cpu"
    assert not t.is_traced
    assert kn.zeros(()).shape == () and kn.zeros(()).numel() == 1


# -- filled factories -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_zeros_ones_full_empty(dtype):
    np_dtype = dtype.np_dtype
    for args in ((2, 3), ((2, 3),), ([0, 4],), ()):
        shape = args[0] if len(args) == 1 else args
        z = kn.zeros(*args, dtype=dtype)
        assert z.dtype == dtype and z.shape == tuple(shape)
        np.testing.assert_array_equal(z.numpy(), np.zeros(shape, np_dtype))
        np.testing.assert_array_equal(kn.ones(*args, dtype=dtype).numpy(), np.ones(shape, np_dtype))
        # kiln's documented choice: empty is zero-filled (numpy and compiled code alike)
        np.testing.assert_array_equal(kn.empty(*args, dtype=dtype).numpy(), np.zeros(shape, np_dtype))
    f = kn.full((2, 2), 1, dtype=dtype)
    assert f.dtype == dtype
    np.testing.assert_array_equal(f.numpy(), np.ones((2, 2), np_dtype))


def test_full_infers_dtype_from_the_value():
    assert kn.full((2,), 1.5).dtype == kn.float32
    assert kn.full((2,), 3).dtype == kn.int64
    assert kn.full((2,), True).dtype == kn.bool
    np.testing.assert_array_equal(kn.full([3], -2.5).numpy(), np.full(3, -2.5, np.float32))
    with pytest.raises(KilnArgumentError, match="negative"):
        kn.zeros(2, -1)


@pytest.mark.parametrize("dtype", [None, kn.int8, kn.float16])
def test_like_factories(dtype):
    base = kn.tensor(np.arange(6, dtype=np.int32).reshape(3, 2))
    want_dtype = dtype or kn.int32
    for fn, value in ((kn.zeros_like, 0), (kn.ones_like, 1), (kn.empty_like, 0)):
        t = fn(base, dtype=dtype)
        assert t.dtype == want_dtype and t.shape == (3, 2)
        np.testing.assert_array_equal(t.numpy(), np.full((3, 2), value, want_dtype.np_dtype))
    t = kn.full_like(base, 7, dtype=dtype)
    assert t.dtype == want_dtype
    np.testing.assert_array_equal(t.numpy(), np.full((3, 2), 7, want_dtype.np_dtype))


@pytest.mark.parametrize("args, kwargs", [
    ((5,), {}), ((2, 9), {}), ((0, 10, 3), {}), ((5, 0, -1), {}), ((1.0, 2.0, 0.25), {}),
    ((0, 1, 0.1), {}), ((-3, 3), {"dtype": kn.float64}), ((0,), {}), ((3, 3), {}),
    ((10, 0, -3), {}), ((0.5, 3), {}), ((0, 5), {"dtype": kn.int8}),
])
def test_arange(args, kwargs):
    got = kn.arange(*args, **kwargs)
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args + (1,))[:3]
    floating = any(isinstance(v, float) for v in (start, end, step))
    want_dtype = kwargs.get("dtype") or (kn.float32 if floating else kn.int64)
    assert got.dtype == want_dtype
    n = max(0, math.ceil((end - start) / step))
    want = np.array([start + i * step for i in range(n)], np.float64)
    np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=1e-6, atol=1e-6)


def test_arange_matches_torch():
    torch = pytest.importorskip("torch")
    for args in ((5,), (2, 9), (0, 10, 3), (5, 0, -1), (1.0, 2.0, 0.25), (0, 1, 0.1), (10, 0, -3)):
        want = torch.arange(*args)
        got = kn.arange(*args)
        assert got.shape == tuple(want.shape), args
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    with pytest.raises(KilnArgumentError, match="arange"):
        kn.arange(0, 5, 0)


def test_linspace_and_eye():
    np.testing.assert_allclose(kn.linspace(0, 1, 5).numpy(), np.linspace(0, 1, 5, dtype=np.float32))
    np.testing.assert_allclose(kn.linspace(-2, 3, 11, dtype=kn.float64).numpy(), np.linspace(-2, 3, 11))
    assert kn.linspace(0, 1, 0).shape == (0,)
    np.testing.assert_array_equal(kn.linspace(4, 9, 1).numpy(), [4.0])
    with pytest.raises(KilnArgumentError, match="linspace"):
        kn.linspace(0, 1, -1)
    np.testing.assert_array_equal(kn.eye(3).numpy(), np.eye(3, dtype=np.float32))
    np.testing.assert_array_equal(kn.eye(2, 4).numpy(), np.eye(2, 4, dtype=np.float32))
    e = kn.eye(3, dtype=kn.int32)
    assert e.dtype == kn.int32
    np.testing.assert_array_equal(e.numpy(), np.eye(3, dtype=np.int32))


# -- random -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rand_is_seeded_and_in_unit_interval(dtype):
    a = kn.rand(1000, seed=5, dtype=dtype)
    b = kn.rand(1000, seed=5, dtype=dtype)
    c = kn.rand(1000, seed=6, dtype=dtype)
    assert a.dtype == dtype and a.shape == (1000,)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert not np.array_equal(a.numpy(), c.numpy())
    values = a.numpy().astype(np.float64)
    assert values.min() >= 0.0 and values.max() < 1.0
    assert len(np.unique(values)) > 50


def test_rand_and_randn_statistics():
    u = kn.rand(100_000, seed=11).numpy().astype(np.float64)
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert u.min() >= 0.0 and u.max() < 1.0
    n = kn.randn(100, 1000, seed=12).numpy().astype(np.float64)
    assert n.shape == (100, 1000)
    assert abs(n.mean()) < 0.02 and abs(n.std() - 1.0) < 0.02
    # roughly normal tails: about 4.55% outside two sigma
    assert abs((np.abs(n) > 2).mean() - 0.0455) < 0.005
    assert np.isfinite(n).all()
    h = kn.randn(1000, seed=3, dtype=kn.float16)
    assert h.dtype == kn.float16 and np.isfinite(h.numpy()).all()


def test_random_shapes_and_dtype_errors():
    assert kn.rand(2, 3, seed=0).shape == (2, 3)
    assert kn.randn((4, 1), seed=0).shape == (4, 1)
    assert kn.rand(0, seed=0).shape == (0,)
    assert kn.randn(seed=0).shape == ()
    with pytest.raises(KilnDTypeError, match="dtype must be floating"):
        kn.rand(3, dtype=kn.int32)


def test_randint():
    r = kn.randint(-3, 4, (20_000,), seed=2)
    assert r.dtype == kn.int64 and r.shape == (20_000,)
    values = r.numpy()
    assert values.min() == -3 and values.max() == 3
    counts = np.bincount(values + 3)
    assert counts.min() > 20_000 / 7 * 0.9
    np.testing.assert_array_equal(r.numpy(), kn.randint(-3, 4, (20_000,), seed=2).numpy())
    assert not np.array_equal(r.numpy(), kn.randint(-3, 4, (20_000,), seed=3).numpy())
    small = kn.randint(5, size=(3, 2), seed=0, dtype=kn.int32)
    assert small.dtype == kn.int32 and small.shape == (3, 2)
    assert ((small.numpy() >= 0) & (small.numpy() < 5)).all()
    with pytest.raises(KilnArgumentError, match="randint"):
        kn.randint(3, 3)


def test_manual_seed_reproduces_the_global_stream():
    kn.manual_seed(1234)
    a, b = kn.rand(8), kn.randn(8)
    assert not np.array_equal(a.numpy(), kn.rand(8).numpy())  # the stream advances
    kn.manual_seed(1234)
    np.testing.assert_array_equal(kn.rand(8).numpy(), a.numpy())
    np.testing.assert_array_equal(kn.randn(8).numpy(), b.numpy())
    kn.manual_seed(4321)
    assert not np.array_equal(kn.rand(8).numpy(), a.numpy())
    # dropout without a seed draws from the same stream
    kn.manual_seed(99)
    mask = kn.dropout(kn.ones(64), 0.5).numpy()
    kn.manual_seed(99)
    np.testing.assert_array_equal(kn.dropout(kn.ones(64), 0.5).numpy(), mask)


# -- numpy, DLPack and Python interop -----------------------------------------------------------


@settings(deadline=None, max_examples=30)
@given(st.sampled_from(ALL_DTYPES), array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
def test_numpy_roundtrip(dtype, shape):
    x = (np.arange(int(np.prod(shape))) % 5).reshape(shape).astype(dtype.np_dtype)
    t = kn.tensor(x)
    for out in (np.asarray(t), t.numpy(), np.array(t), t.__array__()):
        assert out.dtype == x.dtype and out.shape == x.shape
        np.testing.assert_array_equal(out, x)
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    copy = np.array(t, copy=True)
    copy[...] = 1
    np.testing.assert_array_equal(t.numpy(), x)
    if x.size:  # tolist() of an empty array loses its shape
        np.testing.assert_array_equal(np.asarray(kn.tensor(x.tolist(), dtype=dtype)), x)


def test_dlpack_both_ways_shares_memory():
    t = kn.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    out = np.from_dlpack(t)
    assert out.shape == (2, 3) and out.dtype == np.float32
    assert np.shares_memory(out, t.numpy())
    a = np.arange(4, dtype=np.int32)
    k = kn.from_dlpack(a)
    assert k.dtype == kn.int32
    a[2] = 40
    assert k.numpy()[2] == 40
    assert t.__dlpack_device__() == a.__dlpack_device__()
    with pytest.raises(KilnDTypeError, match="from_dlpack"):
        kn.from_dlpack([1, 2, 3])


def test_dlpack_with_torch():
    torch = pytest.importorskip("torch")
    src = torch.arange(5, dtype=torch.float32)
    k = kn.from_dlpack(src)
    src[0] = 7.0
    assert k.numpy()[0] == 7.0
    back = torch.from_dlpack(kn.tensor(np.arange(3, dtype=np.int64)))
    assert back.tolist() == [0, 1, 2]
    assert kn.tensor(torch.ones(2, 2)).shape == (2, 2)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_item_tolist_float_int_bool(dtype):
    t = kn.tensor(np.array([[1, 0], [2, 3]]).astype(dtype.np_dtype))
    want = np.array([[1, 0], [2, 3]]).astype(dtype.np_dtype)
    as_list = t.tolist()
    assert as_list == want.astype(np.float64 if dtype.is_floating else want.dtype).tolist()
    kind = float if dtype.is_floating else (bool if dtype == kn.bool else int)
    assert all(type(v) is kind for row in as_list for v in row)
    one = t[1, 0]
    assert type(one.item()) is kind and one.item() == want[1, 0]
    assert float(one) == float(want[1, 0]) and int(one) == int(want[1, 0])
    assert bool(one) is True and bool(t[0, 1]) is False
    assert kn.tensor(np.array([[5]]).astype(dtype.np_dtype)).item() == (True if dtype == kn.bool else 5)
    for convert in (float, int, bool):
        with pytest.raises(KilnShapeError, match="ambiguous"):
            convert(t)
    with pytest.raises(KilnShapeError, match="item"):
        t.item()
    with pytest.raises(KilnShapeError):
        kn.zeros(0).item()


def test_item_values_and_index_protocol():
    assert kn.tensor(2.5, dtype=kn.bfloat16).item() == 2.5
    assert kn.tensor(np.float16(0.1)).item() == float(np.float16(0.1))
    assert int(kn.tensor(-3.7)) == -3
    assert [10, 20, 30][kn.tensor(1)] == 20
    with pytest.raises(TypeError):
        [10, 20][kn.tensor(1.0)]
    if kn.tensor([0.0]):
        pytest.fail("bool(tensor([0.0])) must be False")


@pytest.mark.parametrize("value, dtype, text", [
    ([1, 2], None, "tensor([1, 2], dtype=kiln.int64)"),
    (1.5, None, "tensor(1.5, dtype=kiln.float32)"),
    ([True, False], None, "tensor([ True, False], dtype=kiln.bool)"),
    ([0.5, 2.0], kn.bfloat16, "tensor([0.5, 2. ], dtype=kiln.bfloat16)"),
    ([[1.0, 0.0], [0.0, 1.0]], kn.float16, "tensor([[1., 0.],\n        [0., 1.]], dtype=kiln.float16)"),
])
def test_repr(value, dtype, text):
    assert repr(kn.tensor(value, dtype=dtype)) == text


def test_tensor_is_hashable_by_identity_and_eq_is_elementwise():
    a, b = kn.tensor([1, 2]), kn.tensor([1, 2])
    assert len({a, b}) == 2
    eq = a == b
    assert isinstance(eq, kn.Tensor) and eq.dtype == kn.bool and eq.tolist() == [True, True]
    assert (a != b).tolist() == [False, False]


# -- linear algebra ---------------------------------------------------------------------------


def _spd(rng, batch, n, dtype):
    a = rng.standard_normal(batch + (n, n))
    return (a @ np.swapaxes(a, -1, -2) + n * np.eye(n)).astype(dtype)


@settings(deadline=None, max_examples=25)
@given(st.sampled_from([np.float32, np.float64]), st.lists(st.integers(1, 3), max_size=2),
       st.integers(1, 5), st.integers(0, 1000))
def test_cholesky_eigh_solve(dtype, batch, n, seed):
    rng = np.random.default_rng(seed)
    batch = tuple(batch)
    a = _spd(rng, batch, n, dtype)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    scale = np.abs(a).max()
    L = kn.linalg.cholesky(kn.tensor(a)).numpy()
    assert L.dtype == dtype and L.shape == a.shape
    np.testing.assert_allclose(L @ np.swapaxes(L, -1, -2), a, atol=tol * scale, rtol=tol)
    np.testing.assert_array_equal(np.triu(L, 1), 0)
    w, v = (r.numpy() for r in kn.linalg.eigh(kn.tensor(a)))
    assert w.shape == batch + (n,) and v.shape == a.shape
    assert (np.diff(w, axis=-1) >= -tol * scale).all()  # ascending
    np.testing.assert_allclose(v @ (w[..., None] * np.swapaxes(v, -1, -2)), a, atol=tol * scale * n)
    np.testing.assert_allclose(np.swapaxes(v, -1, -2) @ v, np.broadcast_to(np.eye(n), a.shape),
                               atol=tol * 10)
    b = rng.standard_normal(batch + (n, 2)).astype(dtype)
    x = kn.linalg.solve(kn.tensor(a), kn.tensor(b)).numpy()
    np.testing.assert_allclose(a @ x, b, atol=tol * 10 * scale, rtol=tol * 10)
    vec = rng.standard_normal(batch + (n,)).astype(dtype)
    xv = kn.linalg.solve(a, vec).numpy()
    assert xv.shape == vec.shape
    np.testing.assert_allclose((a @ xv[..., None])[..., 0], vec, atol=tol * 10 * scale, rtol=tol * 10)


@settings(deadline=None, max_examples=25)
@given(st.sampled_from([np.float32, np.float64]), st.lists(st.integers(1, 2), max_size=2),
       st.integers(1, 5), st.integers(1, 5), st.integers(0, 1000))
def test_qr_svd(dtype, batch, m, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(tuple(batch) + (m, n)).astype(dtype)
    k = min(m, n)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    q, r = (t.numpy() for t in kn.linalg.qr(kn.tensor(a)))
    assert q.shape == a.shape[:-2] + (m, k) and r.shape == a.shape[:-2] + (k, n)
    np.testing.assert_allclose(q @ r, a, atol=tol * 10)
    np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(k), q.shape[:-2] + (k, k)),
                               atol=tol * 10)
    np.testing.assert_array_equal(np.tril(r, -1), 0)
    u, s, vh = (t.numpy() for t in kn.linalg.svd(kn.tensor(a)))
    assert u.shape == a.shape[:-2] + (m, k) and s.shape == a.shape[:-2] + (k,)
    assert vh.shape == a.shape[:-2] + (k, n)
    np.testing.assert_allclose((u * s[..., None, :]) @ vh, a, atol=tol * 10)
    assert (s >= 0).all() and (np.diff(s, axis=-1) <= tol).all()  # descending
    np.testing.assert_allclose(s, np.linalg.svd(a.astype(np.float64), compute_uv=False), atol=tol * 10)


def test_linalg_integer_inputs_and_errors():
    L = kn.linalg.cholesky(kn.tensor([[4, 2], [2, 3]]))
    assert L.dtype == kn.float32
    np.testing.assert_allclose(L.numpy(), [[2, 0], [1, math.sqrt(2)]], rtol=1e-6)
    with pytest.raises(KilnShapeError, match="cholesky"):
        kn.linalg.cholesky(kn.ones(2, 3))
    with pytest.raises(KilnShapeError, match="qr"):
        kn.linalg.qr(kn.ones(3))
    with pytest.raises(KilnShapeError, match="solve"):
        kn.linalg.solve(kn.eye(3), kn.ones(2, 1))
    with pytest.raises(KilnDTypeError, match="eigh"):
        kn.linalg.eigh(kn.eye(2, dtype=kn.float16))
    with pytest.raises(KilnArgumentError, match="svd"):
        kn.linalg.svd(kn.eye(2), full_matrices=True)
    # a matrix LAPACK rejects gives NaNs in its slot, as JAX
    bad = kn.linalg.cholesky(kn.tensor(np.stack([np.eye(2), -np.eye(2)]).astype(np.float32)))
    np.testing.assert_allclose(bad.numpy()[0], np.eye(2))
    assert np.isnan(bad.numpy()[1]).all()


def test_linalg_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    a = _spd(rng, (2,), 4, np.float64)
    np.testing.assert_allclose(kn.linalg.cholesky(a).numpy(), torch.linalg.cholesky(torch.tensor(a)).numpy(),
                               rtol=1e-10)
    np.testing.assert_allclose(kn.linalg.eigh(a)[0].numpy(), torch.linalg.eigh(torch.tensor(a))[0].numpy(),
                               rtol=1e-10)
    b = rng.standard_normal((2, 4, 3))
    np.testing.assert_allclose(kn.linalg.solve(a, b).numpy(),
                               torch.linalg.solve(torch.tensor(a), torch.tensor(b)).numpy(), rtol=1e-8)


# -- errors: each class of mistake, never a raw numpy exception ----------------------------------


@pytest.mark.parametrize("bad, error", [
    (lambda: kn.tensor(["a", "b"]), KilnDTypeError),
    (lambda: kn.tensor(np.array([1, 2], np.uint64)) + "x", KilnDTypeError),
    (lambda: kn.tensor(kn.zeros(2)).gather(0, kn.tensor([[0]])), KilnShapeError),
    (lambda: kn.tensor(2.0).gather(0, kn.tensor(0)), KilnShapeError),
    (lambda: kn.tensor(np.array(["2020-01-01"], "datetime64[D]")), KilnDTypeError),
    (lambda: kn.zeros(2, dtype="int4"), KilnDTypeError),
    (lambda: kn.ones(2, 3).to("floaty"), KilnDTypeError),
    (lambda: kn.zeros(-1), KilnArgumentError),
    (lambda: kn.ones(3).reshape(2, 2), KilnShapeError),
    (lambda: kn.ones(3).view(-1, -1), KilnArgumentError),
    (lambda: kn.ones(2, 3).permute(1, 0, 2), KilnArgumentError),
    (lambda: kn.ones(2, 3).squeeze(4), KilnArgumentError),
    (lambda: kn.ones(2, 3).unsqueeze(4), KilnArgumentError),
    (lambda: kn.ones(2, 3).flatten(1, 0), KilnArgumentError),
    (lambda: kn.ones(2, 3).mean(dim=3), KilnArgumentError),
    (lambda: kn.ones(2, 3).narrow(1, 2, 2), KilnError),
    (lambda: kn.stack([]), KilnArgumentError),
    (lambda: kn.layer_norm(kn.ones(2, 3), []), KilnArgumentError),
    (lambda: kn.rms_norm(kn.ones(2, 3), (2,)), KilnShapeError),
    (lambda: kn.scaled_dot_product_attention(kn.ones(3), kn.ones(3), kn.ones(3)), KilnShapeError),
    (lambda: kn.scaled_dot_product_attention(kn.ones(2, 3), kn.ones(2, 3), kn.ones(2, 3),
                                             dropout_p=1.5), KilnArgumentError),
    (lambda: kn.conv2d(kn.ones(1, 1, 3, 3), kn.ones(1, 1, 2, 2), stride=(1, 1, 1)), KilnArgumentError),
    (lambda: kn.ones(2) ** kn.ones(3), KilnShapeError),
    (lambda: kn.max(kn.zeros(0)), KilnShapeError),
    (lambda: kn.zeros(2, 0).argmax(dim=1), KilnShapeError),
    (lambda: kn.zeros(3)[kn.tensor([True, False])], kn.KilnIndexError),
])
def test_mistakes_raise_kiln_errors(bad, error):
    with pytest.raises(error) as info:
        bad()
    assert isinstance(info.value, KilnError)
    assert str(info.value).startswith("[K1")
