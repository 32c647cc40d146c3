"""vjp rules of the linalg family against central finite differences: dot_general over
random dim layouts, convolution over strides / padding / dilation / groups, and the
LAPACK externs on well-conditioned inputs (SPD matrices, distinct eigenvalues and
singular values), real and complex; the rules also trace on symbolic dims."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER, GraphBuilder
from kiln.ir.shapes import ShapeVar, symbol
from kiln.ir.types import TensorType
from kiln.testing import check_vjp_rule
from tests.autodiff.test_rules_shape import BF16, assert_rules_complete, traced_vjp
from tests.ir.test_ops_linalg import dot_problems

seeds = st.integers(0, 2**16)
batches = st.lists(st.integers(1, 2), max_size=2).map(tuple)


def mT(x):
    return np.conj(np.swapaxes(x, -1, -2))


def re_dot(a, b):
    return np.vdot(a, b).real


def check_rule(op, inputs, attrs=None, loss=None, eps=1e-3, rtol=2e-2, seed=0):
    """check_vjp_rule's test for complex inputs, with complex directions (check_vjp_rule's
    are real, leaving the imaginary part unchecked), and for a chosen `loss`: a pair
    (cotangents(*results), value(*results)), for eigenvectors and singular vectors one
    that does not depend on their signs or phases, which LAPACK may flip between nearby
    inputs."""
    rng = np.random.default_rng(seed)
    cplx = lambda shape: rng.standard_normal(shape) + 1j * rng.standard_normal(shape)  # noqa: E731
    opdef = registry.get(op)
    attrs = opdef.normalize_attrs(dict(attrs or {}))
    ys = EAGER.apply(op, list(inputs), attrs)
    if loss is None:
        cts = [cplx(y.shape).astype(y.dtype) if y.dtype.kind == "c" else
               rng.standard_normal(y.shape).astype(y.dtype) for y in ys]

        def value(*outs):
            return sum(re_dot(c.astype(np.complex128), y.astype(np.complex128))
                       for c, y in zip(cts, outs))
    else:
        cts, value = loss[0](*ys), loss[1]
    grads = opdef.vjp(EAGER, cts, list(inputs), ys, **attrs)

    for i, x in enumerate(inputs):
        assert grads[i].dtype == x.dtype and grads[i].shape == x.shape
        for _ in range(3):
            v = cplx(x.shape) if x.dtype.kind == "c" else rng.standard_normal(x.shape)
            plus, minus = list(inputs), list(inputs)
            plus[i], minus[i] = (x + eps * v).astype(x.dtype), (x - eps * v).astype(x.dtype)
            numeric = (value(*EAGER.apply(op, plus, attrs)) -
                       value(*EAGER.apply(op, minus, attrs))) / (2 * eps)
            analytic = re_dot(v, grads[i])
            assert np.isclose(analytic, numeric, rtol=rtol, atol=rtol), \
                f"{op} operand {i}: gradient {analytic}, finite differences {numeric}"


def c64(rng, shape):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


def spd(rng, batch, n, complex_=False):
    a = c64(rng, batch + (n, n)) if complex_ else rng.standard_normal(batch + (n, n))
    return a @ np.conj(np.swapaxes(a, -1, -2)) + n * np.eye(n, dtype=a.dtype)


def with_spectrum(rng, batch, values, m, n):
    """(a, u): matrices a [*batch, m, n] with the given singular values, u their left
    singular vectors (random orthonormal columns)."""
    u = np.linalg.qr(rng.standard_normal(batch + (m, m)))[0][..., :len(values)]
    v = np.linalg.qr(rng.standard_normal(batch + (n, n)))[0][..., :len(values)]
    return u @ (np.asarray(values)[:, None] * np.swapaxes(v, -1, -2)), u


def test_every_differentiable_linalg_op_has_a_rule():
    assert_rules_complete("linalg")


# -- dot_general ------------------------------------------------------------------------

@settings(max_examples=30)
@given(dot_problems(), seeds)
def test_dot_general(problem, seed):
    (ls, rs), attrs, _ = problem
    rng = np.random.default_rng(seed)
    check_vjp_rule("dot_general", [rng.standard_normal(ls), rng.standard_normal(rs)], attrs)


def test_dot_general_negative_dims_and_complex():
    rng = np.random.default_rng(0)
    attrs = dict(lhs_contracting=(-1,), rhs_contracting=(-3,), lhs_batch=(0,), rhs_batch=(-2,))
    check_vjp_rule("dot_general", [rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 2, 5))],
                   attrs)
    check_rule("dot_general", [c64(rng, (2, 3, 4)), c64(rng, (4, 2, 5))], attrs, eps=1e-2)


# -- convolution ------------------------------------------------------------------------

@st.composite
def convs(draw):
    n = draw(st.integers(1, 2))
    groups = draw(st.integers(1, 2))
    cg, og, batch = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(n))
    strides = tuple(draw(st.integers(1, 3)) for _ in range(n))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(n))
    padding = tuple((draw(st.integers(0, 3)), draw(st.integers(0, 3))) for _ in range(n))
    spatial = tuple(max(1, d * (k - 1) + 1 - lo - hi) + draw(st.integers(0, 4))
                    for k, d, (lo, hi) in zip(kernel, dilation, padding))
    attrs = dict(window_strides=strides if draw(st.booleans()) or any(s > 1 for s in strides)
                 else None, padding=padding, rhs_dilation=dilation, feature_group_count=groups)
    return (batch, groups * cg) + spatial, (groups * og, cg) + kernel, attrs


@settings(max_examples=30)
@given(convs(), seeds)
def test_convolution(problem, seed):
    xs, ws, attrs = problem
    rng = np.random.default_rng(seed)
    check_vjp_rule("convolution", [rng.standard_normal(xs), rng.standard_normal(ws)], attrs)


def test_convolution_3d_and_complex():
    rng = np.random.default_rng(0)
    attrs = dict(window_strides=(1, 2, 1), padding=((1, 0), (0, 0), (2, 2)),
                 rhs_dilation=(1, 1, 3), feature_group_count=1)
    check_vjp_rule("convolution", [rng.standard_normal((1, 2, 4, 5, 3)),
                                   rng.standard_normal((3, 2, 2, 3, 1))], attrs)
    check_rule("convolution", [c64(rng, (2, 4, 7)), c64(rng, (4, 2, 3))],
               dict(window_strides=(2,), padding=((1, 2),), feature_group_count=2), eps=1e-2)


def test_conv_and_dot_cotangents_keep_low_precision():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 2, 6)).astype(BF16), rng.standard_normal((3, 2, 3)).astype(BF16)
    attrs = registry.get("convolution").normalize_attrs({"window_strides": (2,)})
    y = EAGER.convolution(x, w, **attrs)
    gx, gw = registry.get("convolution").vjp(EAGER, [np.ones(y.shape, BF16)], [x, w], [y], **attrs)
    assert (gx.dtype, gx.shape, gw.dtype, gw.shape) == (BF16, x.shape, BF16, w.shape)
    attrs = dict(lhs_contracting=(2,), rhs_contracting=(1,), lhs_batch=(0,), rhs_batch=(0,))
    r = rng.standard_normal((1, 6, 2)).astype(BF16)
    y = EAGER.dot_general(x, r, **attrs)
    gx, gr = registry.get("dot_general").vjp(EAGER, [np.ones(y.shape, BF16)], [x, r], [y], **attrs)
    assert (gx.dtype, gx.shape, gr.dtype, gr.shape) == (BF16, x.shape, BF16, r.shape)


# -- LAPACK externs ------------------------------------------------------------------------

@settings(max_examples=10)
@given(batches, st.integers(1, 4), seeds)
def test_cholesky(batch, n, seed):
    (g,) = check_vjp_rule("cholesky", [spd(np.random.default_rng(seed), batch, n)], rtol=1e-4,
                          atol=1e-6)
    assert np.all(np.triu(g, 1) == 0), "cholesky reads the lower triangle only"


@settings(max_examples=12)
@given(batches, st.integers(1, 4), st.integers(1, 4), seeds)
def test_qr(batch, m, n, seed):
    k = min(m, n)
    a, _ = with_spectrum(np.random.default_rng(seed), batch, np.linspace(2.0, 1.0, k), m, n)
    check_vjp_rule("qr", [a], rtol=1e-4, atol=1e-6)


def eigh_loss(rng, c, d):
    """<gw, w> + Re<c, V d V^H>, which no eigenvector's sign (phase) changes."""
    gw = rng.standard_normal(c.shape[:-1])
    return (lambda w, v: [gw.astype(w.dtype), ((c + mT(c)) @ v @ d).astype(v.dtype)],
            lambda w, v: re_dot(gw, w) + re_dot(c, v @ d @ mT(v)))


def svd_loss(rng, c, d):
    """<gs, s> + Re<c, U d Vh>, which no sign (phase) of a singular pair changes."""
    gs = rng.standard_normal(c.shape[:-2] + d.shape[-1:])
    return (lambda u, s, vh: [(c @ mT(vh) @ d).astype(u.dtype), gs.astype(s.dtype),
                              (d @ mT(u) @ c).astype(vh.dtype)],
            lambda u, s, vh: re_dot(gs, s) + re_dot(c, u @ d @ vh))


@settings(max_examples=10)
@given(batches, st.integers(1, 4), seeds)
def test_eigh(batch, n, seed):
    rng = np.random.default_rng(seed)
    _, u = with_spectrum(rng, batch, np.ones(n), n, n)
    a = u @ (np.linspace(-1.0, 2.0, n)[:, None] * np.swapaxes(u, -1, -2))
    a = a + np.triu(rng.standard_normal(a.shape), 1)  # the upper triangle is unread
    loss = eigh_loss(rng, rng.standard_normal(a.shape), np.diag(rng.standard_normal(n)))
    check_rule("eigh", [a], loss=loss, eps=1e-6, rtol=1e-5)
    w, v = EAGER.eigh(a)
    (g,) = registry.get("eigh").vjp(EAGER, loss[0](w, v), [a], [w, v])
    assert np.all(np.triu(g, 1) == 0), "eigh reads the lower triangle only"


@settings(max_examples=12)
@given(batches, st.integers(1, 4), st.integers(1, 4), seeds)
def test_svd(batch, m, n, seed):
    rng = np.random.default_rng(seed)
    k = min(m, n)
    a, _ = with_spectrum(rng, batch, np.linspace(3.0, 1.0, k), m, n)
    loss = svd_loss(rng, rng.standard_normal(a.shape), np.diag(rng.standard_normal(k)))
    check_rule("svd", [a], loss=loss, eps=1e-6, rtol=1e-5)


@settings(max_examples=12)
@given(batches, batches, st.integers(1, 3), st.integers(1, 2), seeds)
def test_solve(a_batch, b_batch, n, k, seed):
    rng = np.random.default_rng(seed)
    check_vjp_rule("solve", [spd(rng, a_batch, n), rng.standard_normal(b_batch + (n, k))],
                   rtol=1e-4, atol=1e-6)


@settings(max_examples=15)
@given(batches, batches, st.integers(1, 3), st.booleans(), st.booleans(), seeds)
def test_triangular_solve(a_batch, b_batch, n, lower, unit, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(a_batch + (n, n)) + 3 * np.eye(n)  # the other triangle is unread
    (g, _) = check_vjp_rule("triangular_solve", [a, rng.standard_normal(b_batch + (n, 2))],
                            {"lower": lower, "unit_diagonal": unit}, rtol=1e-4, atol=1e-6)
    read = np.tril(np.ones((n, n)), -unit) if lower else np.triu(np.ones((n, n)), unit)
    assert np.all(g[..., read == 0] == 0)


def test_degenerate_eigenvalues_give_finite_basis_free_cotangents():
    # a repeated eigenvalue: eigenvalue cotangents alone are exact, and an eigenvector
    # cotangent gives finite values (the part that ignores the basis of the eigenspace)
    a = np.diag([1.0, 1.0, 3.0])
    w, v = EAGER.eigh(a)
    (g,) = registry.get("eigh").vjp(EAGER, [np.array([1.0, 2.0, 4.0]), None], [a], [w, v])
    np.testing.assert_allclose(g, np.diag([1.0, 2.0, 4.0]), atol=1e-12)
    (g,) = registry.get("eigh").vjp(EAGER, [None, np.ones((3, 3))], [a], [w, v])
    assert np.all(np.isfinite(g))


def test_zero_singular_values_give_finite_cotangents():
    a = np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    u, s, vh = EAGER.svd(a)
    (g,) = registry.get("svd").vjp(EAGER, [np.ones(u.shape), np.ones(2), np.ones(vh.shape)], [a],
                                   [u, s, vh])
    assert np.all(np.isfinite(g))


def test_lapack_complex():
    rng = np.random.default_rng(0)
    h = spd(rng, (), 3, complex_=True)
    check_rule("cholesky", [h])
    check_rule("solve", [h, c64(rng, (2, 3, 2))])
    check_rule("triangular_solve", [h, c64(rng, (3, 2))], {"lower": False})
    for shape in ((4, 3), (3, 4), (3, 3)):
        check_rule("qr", [c64(rng, shape)])
    d = np.diag([0.5, -1.0, 2.0])
    check_rule("eigh", [h], loss=eigh_loss(rng, c64(rng, (3, 3)), d))
    for m, n in ((4, 3), (3, 4)):
        # a genuinely complex a: at real inputs LAPACK's phases jump, and a fixed
        # cotangent's finite differences would see the jump
        u, v = np.linalg.qr(c64(rng, (m, m)))[0][:, :3], np.linalg.qr(c64(rng, (n, n)))[0][:, :3]
        a = (u @ np.diag([3.0, 2.0, 1.0]) @ mT(v)).astype(np.complex64)
        check_rule("svd", [a], loss=svd_loss(rng, c64(rng, (m, n)), d))


def test_multi_result_rules_take_partial_cotangents():
    a, _ = with_spectrum(np.random.default_rng(0), (), [3.0, 2.0, 1.0], 4, 3)
    for op in ("qr", "svd", "eigh"):
        x = a[:3] @ a[:3].T if op == "eigh" else a
        ys = EAGER.apply(op, [x], {})
        rule = registry.get(op).vjp
        assert rule(EAGER, [None] * len(ys), [x], ys) == [None]
        for i in range(len(ys)):
            cts = [np.ones(y.shape) if j == i else None for j, y in enumerate(ys)]
            (g,) = rule(EAGER, cts, [x], ys)
            assert g.shape == x.shape and np.all(np.isfinite(g))


# -- symbolic dims --------------------------------------------------------------------------

@pytest.mark.parametrize("op, inputs, attrs, symbols", [
    ("dot_general", [(5, 3, 4), (5, 4, 2)], dict(lhs_contracting=(2,), rhs_contracting=(1,),
                                                  lhs_batch=(0,), rhs_batch=(0,)),
     {(0, 0): "B", (1, 0): "B"}),
    ("dot_general", [(3, 6), (6, 2)], dict(lhs_contracting=(1,), rhs_contracting=(0,)),
     {(0, 1): "K", (1, 0): "K"}),
    # a symbolic spatial dim: the input cotangent pads for the largest remainder, then crops
    ("convolution", [(2, 2, 9), (4, 1, 3)], dict(window_strides=(2,), padding=((1, 3),),
                                                  rhs_dilation=(2,), feature_group_count=2),
     {(0, 0): "N", (0, 2): "D"}),
    ("convolution", [(1, 2, 8, 7), (2, 2, 2, 2)], dict(window_strides=(3, 1)),
     {(0, 2): "H", (0, 3): "W"}),
    ("cholesky", [(3, 2, 2)], {}, {(0, 0): "B"}),
    ("solve", [(3, 2, 2), (3, 2, 1)], {}, {(0, 0): "B", (1, 0): "B"}),
    ("triangular_solve", [(1, 2, 2), (3, 2, 1)], {}, {(1, 0): "B"}),
    ("qr", [(3, 4, 2)], {}, {(0, 0): "B"}),
    ("svd", [(3, 2, 4)], {}, {(0, 0): "B"}),
    ("eigh", [(3, 2, 2)], {}, {(0, 0): "B"}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_rules_trace_on_symbolic_dims(op, inputs, attrs, symbols):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in inputs]
    if op in ("cholesky", "solve", "eigh", "triangular_solve"):
        arrays[0] = spd(rng, inputs[0][:-2], inputs[0][-1])
    traced_vjp(op, arrays, attrs, symbols)


def test_qr_and_svd_rules_need_a_known_shape_class():
    b = GraphBuilder()
    for name in ("M", "N"):
        b.graph.shape_vars[name] = ShapeVar(name)
    a = b.add_input(TensorType(dt.float64, (symbol("M"), symbol("N"))))
    for op in ("qr", "svd"):
        ys = b.apply(op, [a], {})
        cts = [b.add_input(y.type) for y in ys]
        with pytest.raises(KilnShapeError, match=f"{op}: its vjp needs to know whether"):
            registry.get(op).vjp(b, cts, [a], ys)
