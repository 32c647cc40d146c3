"""Eager kn.grad / kn.value_and_grad reuse the traced vjp program per argument signature
(issue 22 item 5), and re-trace whenever a re-trace could give another answer."""

import numpy as np
import pytest

import kiln as kn

rng = np.random.default_rng(0)


def _np_loss_and_grad(w, x, scale=1.0):
    """Oracle for loss = scale * mean((x @ w)^2): d/dw = 2 scale x^T (x w) / numel."""
    y = x.astype(np.float64) @ w.astype(np.float64)
    return scale * (y ** 2).mean(), scale * 2 * x.T.astype(np.float64) @ y / y.size


def _counted(body):
    calls = []

    def f(*args):
        calls.append(1)
        return body(*args)
    return f, calls


def test_same_signature_traces_once_and_stays_right():
    f, calls = _counted(lambda w, x: ((x @ w) ** 2).mean())
    vg = kn.value_and_grad(f)
    for seed in range(4):
        r = np.random.default_rng(seed)
        w, x = r.standard_normal((4, 3)).astype(np.float32), r.standard_normal((5, 4)).astype(np.float32)
        loss, g = vg(kn.tensor(w), kn.tensor(x))
        want_loss, want_g = _np_loss_and_grad(w, x)
        np.testing.assert_allclose(loss.numpy(), want_loss, rtol=1e-5)
        np.testing.assert_allclose(g.numpy(), want_g, rtol=1e-4, atol=1e-5)
    assert len(calls) == 1
    assert vg.cache_size() == 1


def test_new_shape_dtype_or_static_value_retraces():
    f, calls = _counted(lambda w, x, s: ((x @ w) ** 2).mean() * s)
    gr = kn.grad(f)
    w, x = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    gr(kn.tensor(w), kn.tensor(x), 1.0)
    gr(kn.tensor(w), kn.tensor(x), 1.0)
    assert len(calls) == 1
    x7 = rng.standard_normal((7, 4)).astype(np.float32)
    np.testing.assert_allclose(gr(kn.tensor(w), kn.tensor(x7), 1.0).numpy(),
                               _np_loss_and_grad(w, x7)[1], rtol=1e-4, atol=1e-5)
    assert len(calls) == 2
    g64 = gr(kn.tensor(w.astype(np.float64)), kn.tensor(x.astype(np.float64)), 1.0)
    assert g64.dtype == kn.float64 and len(calls) == 3
    np.testing.assert_allclose(gr(kn.tensor(w), kn.tensor(x), 3.0).numpy(),
                               _np_loss_and_grad(w, x, 3.0)[1], rtol=1e-4, atol=1e-5)
    assert len(calls) == 4


def test_closed_over_tensor_changed_in_place_or_rebound_is_seen():
    w = rng.standard_normal((4, 3)).astype(np.float32)
    x = kn.tensor(rng.standard_normal((5, 4)).astype(np.float32))
    state = {"x": x}
    f, calls = _counted(lambda w: ((state["x"] @ w) ** 2).mean())
    gr = kn.grad(f)
    gr(kn.tensor(w))
    gr(kn.tensor(w))
    assert len(calls) == 1
    with kn.no_grad():
        x.mul_(2.0)  # rebinds x's data: the cached constant is stale
    np.testing.assert_allclose(gr(kn.tensor(w)).numpy(), _np_loss_and_grad(w, x.numpy())[1],
                               rtol=1e-4, atol=1e-5)
    assert len(calls) == 2
    state["x"] = kn.tensor(rng.standard_normal((5, 4)).astype(np.float32))  # a new binding
    np.testing.assert_allclose(gr(kn.tensor(w)).numpy(), _np_loss_and_grad(w, state["x"].numpy())[1],
                               rtol=1e-4, atol=1e-5)
    assert len(calls) == 3


class _Scaled:
    def __init__(self, x):
        self.x, self.scale = x, 1.0

    def __call__(self, w):
        return ((self.x @ w) ** 2).mean() * self.scale


def test_object_attribute_change_retraces():
    x = rng.standard_normal((5, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    model = _Scaled(kn.tensor(x))
    gr = kn.grad(model)
    gr(kn.tensor(w))
    model.scale = 5.0
    np.testing.assert_allclose(gr(kn.tensor(w)).numpy(), _np_loss_and_grad(w, x, 5.0)[1],
                               rtol=1e-4, atol=1e-5)


def test_unseeded_randomness_is_never_frozen():
    f, calls = _counted(lambda w: (w * kn.rand(4)).sum())
    gr = kn.grad(f)
    a, b = gr(kn.ones(4)).numpy(), gr(kn.ones(4)).numpy()
    assert len(calls) == 2 and not np.array_equal(a, b)  # d/dw = the random draw itself


def test_has_aux_and_tuple_argnums_through_the_cache():
    f, calls = _counted(lambda w, x: (((x @ w) ** 2).mean(), {"y": x @ w}))
    vg = kn.value_and_grad(f, argnums=(0, 1), has_aux=True)
    for _ in range(2):
        w, x = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
        (loss, aux), (gw, gx) = vg(kn.tensor(w), kn.tensor(x))
        np.testing.assert_allclose(aux["y"].numpy(), x @ w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gw.numpy(), _np_loss_and_grad(w, x)[1], rtol=1e-4, atol=1e-5)
        y = (x @ w).astype(np.float64)
        np.testing.assert_allclose(gx.numpy(), 2 * y @ w.T / y.size, rtol=1e-4, atol=1e-5)
    assert len(calls) == 1


def test_cached_eager_grad_still_traces_under_compile():
    gr = kn.grad(lambda w: (w.sin() * w).sum())
    w = rng.standard_normal(6).astype(np.float32)
    eager = gr(kn.tensor(w)).numpy()
    compiled = kn.compile(lambda w: gr(w) * 2.0)(kn.tensor(w)).numpy()
    want = np.cos(w) * w + np.sin(w)
    np.testing.assert_allclose(eager, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compiled, 2 * want, rtol=1e-5, atol=1e-6)


def test_the_cache_is_bounded():
    gr = kn.grad(lambda w: (w * w).sum())
    for n in range(1, 12):
        w = np.arange(n, dtype=np.float32)
        np.testing.assert_array_equal(gr(kn.tensor(w)).numpy(), 2 * w)
    assert gr.cache_size() == 8


def test_a_cached_trace_raises_the_same_error_again():
    from kiln.errors import KilnGradientError

    gr = kn.grad(lambda w: w * 2.0)  # not a scalar
    for _ in range(2):
        with pytest.raises(KilnGradientError, match="one float scalar"):
            gr(kn.ones(3))


def test_reused_traces_with_control_flow_and_decompositions_stay_right():
    # kn.cond has regions (the interpreter runs it); gelu and softmax are decompositions
    def f(w, x):
        h = kn.gelu(x * w)  # exact: erf
        y = kn.cond((h.sum() > 0), lambda: (h * h).sum(), lambda: (h * 3.0).sum())
        return y + kn.softmax(h, dim=-1).max()
    gr = kn.value_and_grad(f)
    for seed in range(3):
        r = np.random.default_rng(seed)
        w, x = r.standard_normal(6).astype(np.float32), r.standard_normal(6).astype(np.float32)
        value, g = gr(kn.tensor(w), kn.tensor(x))
        eps = 1e-3  # central differences in float64 through the eager ops
        w64, x64 = kn.tensor(w.astype(np.float64)), kn.tensor(x.astype(np.float64))
        for i in range(6):
            d = np.zeros(6)
            d[i] = eps
            up = f(w64 + kn.tensor(d), x64).numpy()
            down = f(w64 - kn.tensor(d), x64).numpy()
            np.testing.assert_allclose(g.numpy()[i], (up - down) / (2 * eps), rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(value.numpy(), f(w64, x64).numpy(), rtol=1e-5)
    assert gr.cache_size() == 1


def test_a_reused_trace_skips_the_interpreter(monkeypatch):
    from kiln.frontend import autodiff

    interpreted = []
    original = autodiff.run_graph
    monkeypatch.setattr(autodiff, "run_graph", lambda g, *a: interpreted.append(g) or original(g, *a))
    vg = kn.value_and_grad(lambda w: (w.tanh() * w).sum())
    w = rng.standard_normal(5).astype(np.float32)
    for _ in range(3):
        value, g = vg(kn.tensor(w))
        t = np.tanh(w.astype(np.float64))
        np.testing.assert_allclose(g.numpy(), t + w * (1 - t * t), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(value.numpy(), (t * w).sum(), rtol=1e-5)
    assert len(interpreted) == 2  # forward and backward of the first call only
