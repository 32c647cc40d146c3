"""kn.grad / kn.vjp / kn.value_and_grad: the graph transformation end to end, against
finite differences (kiln.testing.check_grads, float64) and closed forms; gradients
through cond/switch/while_loop; composition with compile and export."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kiln as kn
from kiln.passes.autodiff import vjp_graph
from kiln.testing import check_grads

f64 = kn.float64


def rand(*shape, seed=0):
    return kn.randn(*shape, dtype=f64, seed=seed)


def close(a, b, tol=1e-9):
    np.testing.assert_allclose(np.asarray(a.numpy() if isinstance(a, kn.Tensor) else a),
                               np.asarray(b.numpy() if isinstance(b, kn.Tensor) else b),
                               rtol=tol, atol=tol)


# -- the API ------------------------------------------------------------------------------


def test_grad_matches_the_closed_form():
    x = rand(5)
    g = kn.grad(lambda x: (x.sin() * x).sum())(x)
    xn = x.numpy()
    close(g, np.sin(xn) + xn * np.cos(xn))
    assert g.dtype == f64 and g.shape == (5,)


def test_argnums_pytrees_and_value():
    params = {"w": rand(3, 2, seed=1), "b": [rand(2, seed=2)]}
    x = rand(4, 3, seed=3)

    def loss(p, x):
        return ((x @ p["w"] + p["b"][0]).tanh() ** 2).mean()

    value, (gp, gx) = kn.value_and_grad(loss, argnums=(0, 1))(params, x)
    close(value, loss(params, x))
    assert set(gp) == {"w", "b"} and isinstance(gp["b"], list) and gp["w"].shape == (3, 2)
    assert gx.shape == (4, 3)
    check_grads(loss, params, x, argnums=(0, 1))


def test_has_aux_and_integer_outputs():
    x = rand(4)

    def f(x):
        return (x * x).sum(), {"max": x.max(), "idx": x.argmax()}

    (g, aux) = kn.grad(f, has_aux=True)(x)
    close(g, 2 * x.numpy())
    assert int(aux["idx"].item()) == int(np.argmax(x.numpy()))
    out, pullback, aux2 = kn.vjp(f, x, has_aux=True)
    (gx,) = pullback(kn.tensor(np.float64(1.0)))
    close(gx, 2 * x.numpy())


def test_vjp_pytree_outputs_and_zero_cotangents():
    x, y = rand(3, seed=1), rand(3, seed=2)
    out, pullback = kn.vjp(lambda x, y: {"s": x * y, "c": (x + y).cos()}, x, y)
    ct = {"s": kn.ones(3, dtype=f64), "c": None}  # None: a zero cotangent
    gx, gy = pullback(ct)
    close(gx, y.numpy())
    close(gy, x.numpy())


def test_stop_gradient():
    x = rand(3)
    g = kn.grad(lambda x: (x * kn.stop_gradient(x)).sum())(x)
    close(g, x.numpy())  # d/dx (x * c) with c = x held constant


def test_broadcasting_and_casts_get_correct_gradients():
    a, b = rand(3, 1, seed=1), rand(4, seed=2)
    check_grads(lambda a, b: (a * b + a).exp().sum(), a, b, argnums=(0, 1))
    g = kn.grad(lambda a: (a.to(kn.float32) * 2).sum())(a)
    assert g.dtype == f64 and g.shape == (3, 1)
    close(g, np.full((3, 1), 2.0))


def test_indexing_gather_and_reductions():
    x = rand(5, 4, seed=4)
    idx = kn.tensor(np.array([0, 2, 2, 4]))
    check_grads(lambda x: (x[idx] ** 2).sum() + x[1:, ::2].mean() + x.max(dim=1)[0].sum(), x)


@settings(max_examples=15)
@given(st.sampled_from([(), (1,), (3,), (2, 3), (2, 1, 3)]),
       st.sampled_from([(), (1,), (3,), (1, 3)]))
def test_binary_broadcasting_property(sa, sb):
    a, b = rand(*sa, seed=5), rand(*sb, seed=6)
    check_grads(lambda a, b: (a * b.sin() - a / (b * b + 1)).sum(), a, b, argnums=(0, 1))


def test_errors_are_numbered():
    x = rand(3)
    with pytest.raises(kn.KilnGradientError, match="one float scalar"):
        kn.grad(lambda x: x * 2)(x)
    with pytest.raises(kn.KilnGradientError, match="int64"):
        kn.grad(lambda i: (i * 2).sum())(kn.tensor(np.arange(3)))
    with pytest.raises(kn.KilnArgumentError, match="argnums"):
        kn.grad(lambda x: x.sum(), argnums=3)(x)


# -- control flow -------------------------------------------------------------------------


def test_cond_gradient_only_runs_the_taken_branch():
    x = rand(4).abs() + 0.5

    def f(p, x):
        # the false branch's backward would give NaN for x > 0 (sqrt of a negative)
        return kn.cond(p, lambda x: x.log().sum(), lambda x: (-x).sqrt().sum(), x)

    g = kn.grad(f, argnums=1)(kn.tensor(True), x)
    close(g, 1 / x.numpy())
    check_grads(f, kn.tensor(True), x, argnums=1)


def test_switch_gradients_with_a_captured_tensor():
    x, y = rand(4, seed=1), rand(4, seed=2)

    def f(i, x):
        return kn.switch(i, [lambda x: (x * y).sum(), lambda x: x.sin().sum(),
                             lambda x: (x * x * x).sum()], x)

    compiled = kn.compile(kn.grad(f, argnums=1))
    for i, want in enumerate([y.numpy(), np.cos(x.numpy()), 3 * x.numpy() ** 2]):
        close(kn.grad(f, argnums=1)(kn.tensor(i), x), want)
        close(compiled(kn.tensor(i), x), want)
    assert compiled.stats()["compiles"] == 1


def test_bounded_while_loop_gradient():
    x, w = rand(4, seed=1), rand(4, seed=2)

    def f(x, w):
        def body(i, x):
            return i + 1, (x * w).sin() + x  # w is captured: a loop-invariant operand
        _, x = kn.while_loop(lambda i, x: i < 3, body, (kn.tensor(0), x), max_iterations=8)
        return (x * x).sum()

    check_grads(f, x, w, argnums=(0, 1))
    eager = kn.grad(f, argnums=(0, 1))(x, w)
    compiled = kn.compile(kn.grad(f, argnums=(0, 1)))(x, w)
    for a, b in zip(eager, compiled):
        close(a, b, 1e-9)


def test_max_iterations_bounds_the_loop():
    def f(x):
        i, x = kn.while_loop(lambda i, x: i < 100, lambda i, x: (i + 1, x * 2),
                             (kn.tensor(0), x), max_iterations=4)
        return x.sum(), i

    x = rand(3)
    for run in (f, kn.compile(f)):
        total, trips = run(x)
        assert int(trips.item()) == 4
        close(total, 16 * x.numpy().sum())
    close(kn.grad(lambda x: f(x)[0])(x), np.full(3, 16.0))


def test_unbounded_while_loop_gradient_raises():
    x = rand(3)

    def f(x):
        (y,) = kn.while_loop(lambda y: y.sum() < 100, lambda y: (y * 2,), (x.abs() + 1,))
        return y.sum()

    with pytest.raises(kn.KilnGradientError, match="max_iterations"):
        kn.grad(f)(x)


def test_nested_control_flow():
    x = rand(4, seed=7)

    def f(p, x):
        def loop(x):
            def body(i, x):
                return i + 1, kn.switch(i, [lambda x: x.sin(), lambda x: x * x,
                                            lambda x: x.tanh()], x)
            return kn.while_loop(lambda i, x: i < 3, body, (kn.tensor(0), x),
                                 max_iterations=3)[1].sum()
        return kn.cond(p, loop, lambda x: x.cos().sum(), x)

    for p in (True, False):
        check_grads(f, kn.tensor(p), x, argnums=1)
        close(kn.grad(f, argnums=1)(kn.tensor(p), x),
              kn.compile(kn.grad(f, argnums=1))(kn.tensor(p), x))


# -- composition ---------------------------------------------------------------------------


def test_compiled_gradient_equals_eager_and_is_one_program():
    w, x = kn.randn(8, 4, seed=1), kn.randn(16, 8, seed=2)

    def loss(w, x):
        return kn.gelu(x @ w).pow(2).mean()

    step = kn.compile(kn.value_and_grad(loss))
    (v1, g1), (v2, g2) = step(w, x), kn.value_and_grad(loss)(w, x)
    close(v1, v2, 1e-5)
    close(g1, g2, 1e-5)
    step(w, x)
    assert step.stats()["compiles"] == 1 and step.stats()["hits"] == 1


def test_gradient_inside_a_compiled_function_closing_over_traced_tensors():
    @kn.compile
    def newton_step(w, x):
        g = kn.grad(lambda w: ((w * x).sin()).sum())(w)  # x: a tensor of the outer trace
        return w - 0.1 * g

    w, x = rand(3, seed=1), rand(3, seed=2)
    close(newton_step(w, x), w.numpy() - 0.1 * x.numpy() * np.cos(w.numpy() * x.numpy()))


def test_export_of_a_gradient_function_round_trips(tmp_path):
    x = rand(5)
    fn = kn.grad(lambda x: (x.sin() * x).sum())
    prog = kn.export(fn, (x,))
    path = tmp_path / "grad.kir"
    prog.save(path)
    close(kn.load(path)(x), fn(x))


def test_dynamic_shapes_never_recompile():
    B = kn.ShapeVar("B", min=1, max=64)
    fn = kn.grad(lambda x: (x.sin() * x).sum())
    compiled = kn.compile(fn, dynamic_shapes={"x": kn.TensorSpec([B])})
    for n in (1, 3, 17):
        x = kn.randn(n, seed=n)
        close(compiled(x), fn(x), 1e-6)
    assert compiled.stats()["compiles"] == 1


def test_the_graph_transformation_splits_forward_and_backward():
    graph = kn.trace(lambda x: (x.sin() * x).sum(), kn.ones(4))
    v = vjp_graph(graph)
    text = str(v.joint())
    assert "cos" in text and "sin" in text
    # the backward reads only what it needs from the forward: the input (sin and cos of it)
    assert v.num_residuals >= 1 and len(v.backward.inputs) == v.num_residuals + 1
    assert [str(t) for t in (o.type for o in v.backward.outputs)] == ["f32[4]"]
