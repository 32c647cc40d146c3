"""Linear algebra: dot_general and convolution against einsum / shift-and-add oracles and
torch, the LAPACK externs through reconstruction identities (q @ r == a, q orthonormal,
...) and torch.linalg, type rules on symbolic dims, and every type-rule error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER
from kiln.ir.shapes import evaluate, symbol
from kiln.ir.types import TensorType

BF16 = np.dtype(ml_dtypes.bfloat16)
LOW = [BF16, np.dtype(np.float16)]
LAPACK = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64)]
TOL = {np.dtype(np.float32): 2e-4, np.dtype(np.float64): 1e-10, np.dtype(np.complex64): 2e-4}


def infer(op, *types, **attrs):
    opdef = registry.get(op)
    return opdef.infer(list(types), opdef.normalize_attrs(attrs))


def T(shape, dtype=dt.float32):
    return TensorType(dtype, shape)


# -- dot_general ---------------------------------------------------------------------------

@st.composite
def dot_problems(draw):
    """Random batch / contracting / free sizes, laid out in a random dim order per operand."""
    sizes = st.lists(st.integers(1, 4), max_size=2)
    batch, contract, lfree, rfree = draw(sizes), draw(sizes), draw(sizes), draw(sizes)
    lroles = [("b", i) for i in range(len(batch))] + [("c", i) for i in range(len(contract))] + \
             [("l", i) for i in range(len(lfree))]
    rroles = [("b", i) for i in range(len(batch))] + [("c", i) for i in range(len(contract))] + \
             [("r", i) for i in range(len(rfree))]
    lroles, rroles = draw(st.permutations(lroles)), draw(st.permutations(rroles))
    size = {"b": batch, "c": contract, "l": lfree, "r": rfree}
    letter = {"b": "abcd", "c": "efgh", "l": "ijkl", "r": "mnop"}
    pos = lambda roles, kind: tuple(roles.index((kind, i)) for i in range(len(size[kind])))
    attrs = dict(lhs_contracting=pos(lroles, "c"), rhs_contracting=pos(rroles, "c"),
                 lhs_batch=pos(lroles, "b"), rhs_batch=pos(rroles, "b"))
    spec = "".join(letter[k][i] for k, i in lroles) + "," + "".join(letter[k][i] for k, i in rroles)
    # free dims keep their order within each operand
    out = letter["b"][:len(batch)] + "".join(letter[k][i] for k, i in lroles if k == "l") + \
        "".join(letter[k][i] for k, i in rroles if k == "r")
    shapes = [tuple(size[k][i] for k, i in roles) for roles in (lroles, rroles)]
    return shapes, attrs, spec + "->" + out


@settings(max_examples=60, deadline=None)
@given(dot_problems(), st.sampled_from(["f32", "f64", "bf16", "f16", "i32", "c64"]))
def test_dot_general_against_einsum(problem, short):
    (ls, rs), attrs, spec = problem
    dtype = dt.from_short(short).np_dtype
    rng = np.random.default_rng(len(spec))
    if short in ("bf16", "f16", "i32"):
        # small integers: sums are exact in the float32 accumulator, so the result is the
        # exact value rounded once
        lhs, rhs = rng.integers(-3, 4, ls).astype(dtype), rng.integers(-3, 4, rs).astype(dtype)
    else:
        lhs, rhs = rng.standard_normal(ls).astype(dtype), rng.standard_normal(rs).astype(dtype)
        if short == "c64":
            lhs = lhs + 1j * rng.standard_normal(ls).astype(np.float32)
    out = EAGER.dot_general(lhs, rhs, **attrs)
    exact = np.einsum(spec, lhs.astype(np.complex128), rhs.astype(np.complex128))
    assert out.dtype == dtype and out.shape == exact.shape
    assert infer("dot_general", T(ls, short), T(rs, short), **attrs) == [T(exact.shape, short)]
    if short in ("bf16", "f16", "i32"):
        np.testing.assert_array_equal(out, exact.real.astype(dtype))
    else:
        tol = 1e-12 if short == "f64" else 1e-5
        np.testing.assert_allclose(out, exact if short == "c64" else exact.real, rtol=tol, atol=tol)


def test_dot_general_against_torch_matmul():
    torch = pytest.importorskip("torch")
    a = np.random.default_rng(0).standard_normal((2, 5, 3)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((2, 4, 3)).astype(np.float32)
    ours = EAGER.dot_general(a, b, lhs_contracting=(2,), rhs_contracting=(2,), lhs_batch=(0,),
                             rhs_batch=(0,))
    theirs = torch.bmm(torch.from_numpy(a), torch.from_numpy(b).transpose(1, 2)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_dot_general_symbolic_types():
    B, K = symbol("B"), symbol("K")
    (t,) = infer("dot_general", T((B, 3, K)), T((K, B, 5)), lhs_contracting=(2,),
                 rhs_contracting=(0,), lhs_batch=(0,), rhs_batch=(1,))
    assert t == T((B, 3, 5))
    with pytest.raises(KilnShapeError, match=r"dot_general: contracting dims differ: f32\[3, K\]"):
        infer("dot_general", T((3, K)), T((B, 5)), lhs_contracting=(1,), rhs_contracting=(0,))


# -- convolution ---------------------------------------------------------------------------

def conv_shift_and_add(x, w, strides, padding, dilation, groups):
    """The oracle: one strided slice of the padded input per kernel offset, weighted and
    summed, group by group (no windows, no single contraction)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n = x.ndim - 2
    xp = np.pad(x, [(0, 0), (0, 0)] + list(padding))
    out = [(xp.shape[2 + i] - dilation[i] * (w.shape[2 + i] - 1) - 1) // strides[i] + 1
           for i in range(n)]
    cg, og = x.shape[1] // groups, w.shape[0] // groups
    y = np.zeros((x.shape[0], w.shape[0]) + tuple(out))
    for g in range(groups):
        for k in np.ndindex(*w.shape[2:]):
            window = tuple(slice(k[i] * dilation[i], k[i] * dilation[i] + strides[i] * (out[i] - 1) + 1,
                                 strides[i]) for i in range(n))
            part = xp[(slice(None), slice(g * cg, (g + 1) * cg)) + window]  # [N, cg, *out]
            wk = w[(slice(g * og, (g + 1) * og), slice(None)) + k]  # [og, cg]
            y[:, g * og:(g + 1) * og] += np.tensordot(wk, part, axes=([1], [1])).swapaxes(0, 1)
    return y


CONVS = [
    ((1, 3, 32, 32), (8, 3, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    ((2, 4, 9, 11), (6, 2, 3, 2), (2, 3), ((0, 2), (1, 0)), (2, 1), 2),
    ((2, 2, 17), (4, 1, 5), (3,), ((2, 1),), (2,), 2),
    ((1, 2, 5, 6, 4), (3, 2, 2, 3, 1), (1, 2, 1), ((1, 0), (0, 0), (2, 2)), (1, 1, 3), 1),
]


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)] + LOW, ids=str)
@pytest.mark.parametrize("xs, ws, strides, padding, dilation, groups", CONVS)
def test_convolution_against_shift_and_add(xs, ws, strides, padding, dilation, groups, dtype):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype)
    attrs = dict(window_strides=strides, padding=padding, rhs_dilation=dilation,
                 feature_group_count=groups)
    y = EAGER.convolution(x, w, **attrs)
    expected = conv_shift_and_add(x, w, strides, padding, dilation, groups)
    assert y.dtype == dtype and y.shape == expected.shape
    if dtype in LOW:  # float32 accumulation, rounded once: within one ulp of the dtype
        eps = float(ml_dtypes.finfo(dtype).eps)
        assert (np.abs(y.astype(np.float64) - expected) <= eps * np.abs(expected) + 1e-6).all()
    else:
        tol = 1e-4 if dtype == np.float32 else 1e-10
        np.testing.assert_allclose(y, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("xs, ws, strides, padding, dilation, groups", CONVS)
def test_convolution_against_torch(xs, ws, strides, padding, dilation, groups):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    y = EAGER.convolution(x, w, window_strides=strides, padding=padding, rhs_dilation=dilation,
                          feature_group_count=groups)
    flat = [p for pair in reversed(padding) for p in pair]  # F.pad wants the last dim first
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(ws) - 2]
    theirs = conv(F.pad(torch.from_numpy(x), flat), torch.from_numpy(w), stride=strides,
                  dilation=dilation, groups=groups).numpy()
    np.testing.assert_allclose(y, theirs, rtol=1e-10, atol=1e-10)


def test_convolution_symbolic_types():
    N, H = symbol("N"), symbol("H")
    (t,) = infer("convolution", T((N, 3, H, 32)), T((4, 3, 3, 3)), window_strides=(2, 1),
                 padding=((1, 1), (0, 0)))
    assert t.shape[:2] == (N, 4) and t.shape[3] == 30
    for h in (31, 32):  # the symbolic size evaluates to the size numpy produces
        x = np.zeros((1, 3, h, 32), np.float32)
        y = EAGER.convolution(x, np.zeros((4, 3, 3, 3), np.float32), window_strides=(2, 1),
                              padding=((1, 1), (0, 0)))
        assert evaluate(t.shape[2], {"H": h}) == y.shape[2]


# -- LAPACK externs --------------------------------------------------------------------------

def _matrices(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal(shape)
    return a.astype(dtype)


def _spd(shape, dtype):
    a = _matrices(shape, dtype).astype(np.complex128)
    n = shape[-1]
    spd = a @ np.conj(np.swapaxes(a, -1, -2)) + n * np.eye(n)
    return (spd if np.dtype(dtype).kind == "c" else spd.real).astype(dtype)


def _h(x):
    return np.conj(np.swapaxes(x, -1, -2))


def _close(a, b, dtype):
    np.testing.assert_allclose(a, b, rtol=TOL[np.dtype(dtype)], atol=TOL[np.dtype(dtype)])


@pytest.mark.parametrize("dtype", LAPACK, ids=str)
def test_cholesky_reconstructs(dtype):
    a = _spd((2, 3, 4, 4), dtype)
    L = EAGER.cholesky(a)
    assert L.dtype == dtype and L.shape == a.shape
    np.testing.assert_array_equal(np.triu(L, 1), 0)
    _close(L @ _h(L), a, dtype)
    bad = a.copy()
    bad[1, 2] = -np.eye(4)  # one non positive-definite matrix: NaNs in its slot only
    L = EAGER.cholesky(bad)
    assert np.isnan(L[1, 2]).all() and np.isfinite(L[0]).all() and np.isfinite(L[1, :2]).all()


@pytest.mark.parametrize("dtype", LAPACK, ids=str)
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 4)])
def test_qr_reconstructs(shape, dtype):
    a = _matrices(shape, dtype)
    q, r = EAGER.qr(a)
    k = min(shape[-2:])
    assert q.shape == shape[:-1] + (k,) and r.shape == shape[:-2] + (k, shape[-1])
    assert q.dtype == r.dtype == dtype
    _close(q @ r, a, dtype)
    _close(_h(q) @ q, np.broadcast_to(np.eye(k), shape[:-2] + (k, k)), dtype)
    np.testing.assert_array_equal(np.tril(r, -1), 0)


@pytest.mark.parametrize("dtype", LAPACK, ids=str)
def test_eigh_reconstructs(dtype):
    a = _spd((3, 5, 5), dtype) - 5 * np.eye(5).astype(dtype)
    w, v = EAGER.eigh(a)
    assert w.dtype == (np.float32 if dtype == np.complex64 else dtype) and v.dtype == dtype
    assert (np.diff(w, axis=-1) >= 0).all()
    _close(a @ v, v * w[..., None, :], dtype)
    _close(_h(v) @ v, np.broadcast_to(np.eye(5), (3, 5, 5)), dtype)
    # only the lower triangle is read
    junk = a + np.triu(np.full_like(a, 7), 1)
    _close(EAGER.eigh(junk)[0], w, dtype)


@pytest.mark.parametrize("dtype", LAPACK, ids=str)
@pytest.mark.parametrize("shape", [(6, 4), (2, 3, 5)])
def test_svd_reconstructs(shape, dtype):
    a = _matrices(shape, dtype)
    u, s, vh = EAGER.svd(a)
    k = min(shape[-2:])
    assert u.shape == shape[:-1] + (k,) and s.shape == shape[:-2] + (k,)
    assert vh.shape == shape[:-2] + (k, shape[-1])
    assert s.dtype == (np.float32 if dtype == np.complex64 else dtype)
    assert (s >= 0).all() and (np.diff(s, axis=-1) <= 0).all()
    _close((u * s[..., None, :]) @ vh, a, dtype)
    _close(_h(u) @ u, np.broadcast_to(np.eye(k), shape[:-2] + (k, k)), dtype)
    if len(shape) == 3:  # a NaN matrix does not converge: NaNs in its slot only
        bad = a.copy()
        bad[1, 0, 0] = np.nan
        u2, s2, vh2 = EAGER.svd(bad)
        assert np.isnan(s2[1]).all() and np.isnan(u2[1]).all() and np.isnan(vh2[1]).all()
        _close(s2[0], s[0], dtype)


@pytest.mark.parametrize("dtype", LAPACK, ids=str)
def test_solve_satisfies_the_system(dtype):
    a = _matrices((2, 1, 4, 4), dtype) + 4 * np.eye(4).astype(dtype)
    b = _matrices((3, 4, 2), dtype, 1)
    x = EAGER.solve(a, b)  # batch dims broadcast: [2, 1] with [3]
    assert x.shape == (2, 3, 4, 2) and x.dtype == dtype
    _close(a @ x, np.broadcast_to(b, x.shape), dtype)
    singular = np.zeros((2, 4, 4), dtype)
    singular[1] = np.eye(4)
    x = EAGER.solve(singular, b[:2])
    assert np.isnan(x[0]).all() and np.allclose(x[1], b[1])


@pytest.mark.parametrize("dtype", LAPACK, ids=str)
@pytest.mark.parametrize("lower, unit", [(True, False), (False, False), (True, True), (False, True)])
def test_triangular_solve_reads_one_triangle(lower, unit, dtype):
    a = _matrices((2, 5, 5), dtype) + 3 * np.eye(5).astype(dtype)
    b = _matrices((2, 5, 3), dtype, 1)
    tri = np.tril(a) if lower else np.triu(a)
    if unit:  # the stored diagonal is ignored
        idx = np.arange(5)
        tri[..., idx, idx] = 1
    x = EAGER.triangular_solve(a, b, lower=lower, unit_diagonal=unit)
    assert x.dtype == dtype and x.shape == b.shape
    wide = np.complex128 if np.dtype(dtype).kind == "c" else np.float64
    _close(x, np.linalg.solve(tri.astype(wide), b.astype(wide)), dtype)


def test_linalg_against_torch():
    torch = pytest.importorskip("torch")
    a = _spd((2, 4, 4), np.float64)
    b = _matrices((2, 4, 3), np.float64, 1)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    np.testing.assert_allclose(EAGER.cholesky(a), torch.linalg.cholesky(ta).numpy(), rtol=1e-10)
    np.testing.assert_allclose(EAGER.eigh(a)[0], torch.linalg.eigvalsh(ta).numpy(), rtol=1e-10)
    np.testing.assert_allclose(EAGER.svd(b)[1], torch.linalg.svdvals(tb).numpy(), rtol=1e-10)
    np.testing.assert_allclose(EAGER.solve(a, b), torch.linalg.solve(ta, tb).numpy(), rtol=1e-10)
    for lower in (True, False):
        theirs = torch.linalg.solve_triangular(ta, tb, upper=not lower, unitriangular=True)
        ours = EAGER.triangular_solve(a, b, lower=lower, unit_diagonal=True)
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-10, atol=1e-12)
    q, r = EAGER.qr(b)
    tq, tr = torch.linalg.qr(tb)
    signs = np.sign(np.diagonal(r, axis1=-2, axis2=-1) * np.diagonal(tr.numpy(), axis1=-2, axis2=-1))
    np.testing.assert_allclose(q * signs[..., None, :], tq.numpy(), rtol=1e-10, atol=1e-12)


def test_extern_symbolic_types():
    B, M = symbol("B"), symbol("M")
    q, r = infer("qr", T((B, 5, 3)))
    assert q == T((B, 5, 3)) and r == T((B, 3, 3))
    u, s, vh = infer("svd", T((M, 4), dt.complex64))
    assert s.dtype == dt.float32 and s.shape == (sympy.Min(M, 4),) and vh.shape[1] == 4
    assert infer("solve", T((B, 4, 4)), T((4, M))) == [T((B, 4, M))]
    assert infer("cholesky", T((B, M, M))) == [T((B, M, M))]
    for op in ("cholesky", "qr", "eigh", "svd", "solve", "triangular_solve"):
        assert registry.get(op).kind == "extern" and registry.get(op).differentiable


# -- type-rule errors -------------------------------------------------------------------------

ERRORS = [
    ("dot_general", [T((2, 3)), T((4, 5))], dict(lhs_contracting=(1,), rhs_contracting=(0,)),
     KilnShapeError, "dot_general: contracting dims differ: f32[2, 3] has 3 in dim 1, f32[4, 5] has 4"),
    ("dot_general", [T((2, 3)), T((3, 5), dt.float16)], dict(lhs_contracting=(1,), rhs_contracting=(0,)),
     KilnDTypeError, "f32[2, 3], f16[3, 5]"),
    ("dot_general", [T((2,), dt.bool_), T((2,), dt.bool_)],
     dict(lhs_contracting=(0,), rhs_contracting=(0,)),
     KilnDTypeError, "i1[2]"),
    ("dot_general", [T((2, 3)), T((2, 3))], dict(lhs_contracting=(0,), rhs_contracting=(0,),
                                                 lhs_batch=(0,), rhs_batch=(1,)),
     KilnArgumentError, "both batch and contracting"),
    ("dot_general", [T((2, 3)), T((2, 3))], dict(lhs_contracting=(0, 1), rhs_contracting=(0,)),
     KilnArgumentError, "dot_general: lhs and rhs need as many contracting ((0, 1) vs (0,))"),
    ("dot_general", [T((2, 3)), T((4, 3))], dict(lhs_contracting=(1,), rhs_contracting=(1,),
                                                 lhs_batch=(0,), rhs_batch=(0,)),
     KilnShapeError, "batch dims differ: f32[2, 3] has 2"),
    ("convolution", [T((1, 3, 8, 8)), T((4, 2, 3, 3))], {}, KilnShapeError,
     "convolution: input f32[1, 3, 8, 8] has 3 channels but kernel f32[4, 2, 3, 3]"),
    ("convolution", [T((1, 3, 2, 8)), T((4, 3, 3, 3))], {}, KilnShapeError, "f32[1, 3, 2, 8]"),
    ("convolution", [T((1, 4, 8, 8)), T((3, 2, 3, 3))], {"feature_group_count": 2},
     KilnShapeError, "3 output channels"),
    ("convolution", [T((1, 3, 8)), T((4, 3, 3, 3))], {}, KilnShapeError, "f32[1, 3, 8]"),
    ("convolution", [T((1, 3, 8)), T((4, 3, 3))], {"padding": ((-1, 0),)}, KilnArgumentError,
     "convolution: padding"),
    ("convolution", [T((1, 3, 8)), T((4, 3, 3))], {"window_strides": (0,)}, KilnArgumentError,
     "convolution: strides"),
    ("cholesky", [T((3, 4))], {}, KilnShapeError, "cholesky: operand f32[3, 4] must be square"),
    ("cholesky", [T((3, 3), dt.bfloat16)], {}, KilnDTypeError, "cholesky: operand of type bf16[3, 3]"),
    ("eigh", [T((3,))], {}, KilnShapeError, "eigh: operand f32[3]"),
    ("qr", [T((3, 3), dt.int32)], {}, KilnDTypeError, "qr: operand of type i32[3, 3]"),
    ("svd", [T((5,), dt.float64)], {}, KilnShapeError, "svd: operand f64[5]"),
    ("solve", [T((3, 3)), T((4, 2))], {}, KilnShapeError, "solve: a f32[3, 3] is 3 x 3 but b f32[4, 2]"),
    ("solve", [T((3, 3)), T((3,))], {}, KilnShapeError, "solve: right-hand side b f32[3]"),
    ("solve", [T((3, 3)), T((3, 1), dt.float64)], {}, KilnDTypeError, "f32[3, 3] and b f64[3, 1]"),
    ("solve", [T((2, 3, 3)), T((4, 3, 1))], {}, KilnShapeError, "solve: cannot broadcast f32[2, 3, 3]"),
    ("convolution", [T((1, 3, 8)), T((4, 3, 3), dt.float64)], {}, KilnDTypeError,
     "convolution: operands must have one dtype, got f32[1, 3, 8], f64[4, 3, 3]"),
    ("convolution", [T((1, 3, 8)), T((4, 3, 3))], {"rhs_dilation": (1, 1)}, KilnArgumentError,
     "convolution: attribute rhs_dilation must have 1 entries"),
    ("triangular_solve", [T((3, 3), dt.complex64), T((3, 1))], {}, KilnDTypeError,
     "triangular_solve: a c64[3, 3] and b f32[3, 1] must have one dtype"),
    ("triangular_solve", [T((3, 3)), T((3, 1))], {"lower": "yes"}, KilnArgumentError,
     "triangular_solve: lower and unit_diagonal must be bools, got 'yes'"),
    ("triangular_solve", [T((2, 3)), T((3, 1))], {}, KilnShapeError,
     "triangular_solve: matrix a f32[2, 3]"),
]


@pytest.mark.parametrize("op, types, attrs, error, text", ERRORS,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_type_rule_errors(op, types, attrs, error, text):
    with pytest.raises(error) as info:
        infer(op, *types, **attrs)
    assert info.value.message.startswith(op + ":")
    assert text in info.value.message
