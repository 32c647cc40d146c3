"""The nn composites: each reference against an independent oracle (explicit float64
formulas, Python's own arithmetic, torch when installed), each decomposition run
eagerly and as a graph (static and symbolic shapes) against the reference, and each
type-rule error with its message."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import sympy
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER, GraphBuilder
from kiln.ir.ops.creation import threefry2x32
from kiln.ir.shapes import evaluate, symbol
from kiln.ir.types import TensorType

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float32), np.dtype(np.float64), BF16, np.dtype(np.float16)]
# one or two units in the last place of each dtype (results are rounded once from f32)
RTOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3,
        BF16: 1.6e-2}


def close(actual, expected, dtype=None, scale=1.0):
    dtype = np.dtype(dtype or actual.dtype)
    tol = RTOL.get(dtype, 0) * scale
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=tol, atol=tol, equal_nan=True)


def f64(x):
    return np.asarray(x, np.float64)


# -- the decomposition checks: eager, graph, symbolic graph ---------------------------------

B = "B"  # a symbolic dim in the specs below; 3 when concrete


def _sub(spec, b):
    if isinstance(spec, (tuple, list)):
        return tuple(_sub(s, b) for s in spec)
    return b if spec == B else spec


def _inputs(specs, dtype, rng):
    arrays = []
    for kind, shape in specs:
        shape = _sub(shape, 3)
        if kind == "key":
            arrays.append(np.array([7, 2024], np.uint32))
        elif kind == "bool":  # attention masks, with one fully masked row
            mask = rng.random(shape) < 0.7
            mask[..., 0, :] = False
            arrays.append(mask)
        elif kind == "den":  # divisors: away from zero, both signs
            arrays.append((rng.uniform(0.5, 3, shape) * rng.choice([-1, 1], shape)).astype(dtype))
        else:
            arrays.append((rng.standard_normal(shape) * 2).astype(dtype))
    return arrays


F = "f"
CASES = [
    ("sigmoid", [(F, (B, 16))], {}),
    ("relu", [(F, (B, 16))], {}),
    ("gelu", [(F, (B, 16))], {}),
    ("gelu", [(F, (B, 16))], {"approximate": "tanh"}),
    ("silu", [(F, (B, 16))], {}),
    ("softplus", [(F, (B, 16))], {"beta": 2.0, "threshold": 3.0}),
    ("mean", [(F, (B, 4, 5))], {"axes": (0, 2)}),
    ("mean", [(F, (B, 4))], {"axes": None}),
    ("var", [(F, (B, 4, 5))], {"axes": (0,)}),
    ("var", [(F, (4, B))], {"axes": (-1,), "correction": 0}),
    ("logsumexp", [(F, (B, 6))], {"axes": (0,)}),
    ("softmax", [(F, (B, 6))], {"dim": 0}),
    ("softmax", [(F, (B, 6))], {"dim": -1}),
    ("log_softmax", [(F, (B, 2, 6))], {"dim": 1}),
    ("layer_norm", [(F, (B, 4, 8)), (F, (4, 8)), (F, (4, 8))],
     {"normalized_ndim": 2, "has_weight": True, "has_bias": True}),
    ("layer_norm", [(F, (B, 8))], {"normalized_ndim": 1, "eps": 1e-3}),
    ("rms_norm", [(F, (B, 16)), (F, (16,))], {"normalized_ndim": 1, "has_weight": True}),
    ("rms_norm", [(F, (2, B, 5))], {"normalized_ndim": 2, "eps": 1e-6}),
    ("scaled_dot_product_attention", [(F, (B, 2, 5, 8)), (F, (B, 2, 7, 8)), (F, (B, 2, 7, 4))],
     {"is_causal": True}),
    ("scaled_dot_product_attention",
     [(F, (B, 1, 5, 8)), (F, (2, 7, 8)), (F, (1, 2, 7, 4)), ("bool", (5, 7))],
     {"has_mask": True, "scale": 0.3}),
    ("scaled_dot_product_attention", [(F, (B, 5, 8)), (F, (B, 7, 8)), (F, (B, 7, 8)),
                                      (F, (B, 1, 7))], {"has_mask": True}),
    ("matmul", [(F, (B, 3, 4)), (F, (4, 5))], {}),
    ("matmul", [(F, (4,)), (F, (B, 4, 5))], {}),
    ("matmul", [(F, (B, 3, 4)), (F, (4,))], {}),
    ("matmul", [(F, (1, 3, 4)), (F, (B, 1, 4, 2))], {}),
    ("conv2d", [(F, (B, 4, 9, 9)), (F, (6, 2, 3, 3)), (F, (6,))],
     {"groups": 2, "stride": 2, "padding": 1, "has_bias": True}),
    ("conv2d", [(F, (B, 3, 10, 8)), (F, (2, 3, 3, 2))], {"dilation": (2, 1), "padding": (0, 2)}),
    ("floor_divide", [(F, (B, 16)), ("den", (B, 16))], {}),
    ("remainder", [(F, (B, 16)), ("den", (B, 16))], {}),
    ("uniform", [("key", (2,))], {"shape": (B, 16), "low": -2.0, "high": 3.0}),
    ("normal", [("key", (2,))], {"shape": (B, 5)}),
]
IDS = [f"{op}-{i}" for i, (op, _, _) in enumerate(CASES)]


def _attrs(op, attrs, dtype, b):
    attrs = {k: _sub(v, b) for k, v in attrs.items()}
    if op in ("uniform", "normal"):
        attrs["dtype"] = dt.from_numpy(dtype)
    return attrs


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op, specs, attrs", CASES, ids=IDS)
def test_eager_decomposition_matches_reference(op, specs, attrs, dtype):
    args = _inputs(specs, dtype, np.random.default_rng(0))
    attrs = _attrs(op, attrs, dtype, 3)
    expected = EAGER.call(op, *args, **attrs)
    assert expected.dtype == dtype
    (actual,) = EAGER.decompose(op, args, attrs)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    exact = op in ("uniform", "normal", "relu") or dtype == np.float64 and op == "remainder"
    if exact:
        np.testing.assert_array_equal(actual, expected)
    else:
        close(actual, expected, dtype, scale=4 if op == "conv2d" else 1)


def _bind(value, bindings):
    if isinstance(value, (tuple, list)):
        return type(value)(_bind(v, bindings) for v in value)
    if isinstance(value, sympy.Basic):
        return evaluate(value, bindings)
    return value


def run_graph(graph, args, bindings):
    """A tiny interpreter: each node's reference (eager) with its symbols bound."""
    env = dict(zip(graph.inputs, args))
    for node in graph.nodes:
        attrs = {k: _bind(v, bindings) for k, v in node.attrs.items()}
        if node.op == "constant":
            results = [graph.constants[attrs["name"]]]
        else:
            results = EAGER.apply(node.op, [env[v] for v in node.operands], attrs)
        env.update(zip(node.results, results))
    return [env[v] for v in graph.outputs]


@pytest.mark.parametrize("op, specs, attrs", CASES, ids=IDS)
def test_graph_decomposition_with_symbolic_dims(op, specs, attrs):
    """Built once with B symbolic: result types equal the composite's type rule and every
    node is a registered op; evaluated with B = 3 it equals the reference."""
    dtype = np.dtype(np.float32)
    sym_attrs = _attrs(op, attrs, dtype, symbol("B"))
    builder = GraphBuilder()
    params = []
    for (kind, shape), arr in zip(specs, _inputs(specs, dtype, np.random.default_rng(1))):
        params.append(builder.add_input(TensorType(dt.from_numpy(arr.dtype), _sub(shape, symbol("B")))))
    outs = builder.decompose(op, params, sym_attrs)
    opdef = registry.get(op)
    assert [o.type for o in outs] == opdef.infer([p.type for p in params],
                                                 opdef.normalize_attrs(sym_attrs))
    assert any(p.type.symbols() for p in params) or "B" in str(sym_attrs)
    used = {node.op for node in builder.graph.nodes}
    assert op not in used and all(registry.get(name) for name in used)
    builder.graph.body.results = outs
    args = _inputs(specs, dtype, np.random.default_rng(1))
    (actual,) = run_graph(builder.graph, args, {"B": 3})
    expected = EAGER.call(op, *args, **_attrs(op, attrs, dtype, 3))
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    close(actual, expected, dtype, scale=4)


# -- references against independent oracles ---------------------------------------------------

def _x(shape=(4, 33), dtype=np.float32, seed=0, scale=4.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_activations_against_formulas(dtype):
    x = _x(dtype=dtype)
    x[0, :4] = [0.0, -30.0, 30.0, np.nan]
    v = f64(x)
    sig = 0.5 * (1 + np.tanh(v / 2))  # a different closed form of the logistic function
    close(EAGER.sigmoid(x), sig, dtype)
    close(EAGER.silu(x), v * sig, dtype)
    relu = EAGER.relu(x)
    np.testing.assert_array_equal(f64(relu), np.where(v > 0, v, np.where(np.isnan(v), v, 0)))
    phi = np.array([0.5 * math.erfc(-t / math.sqrt(2)) if t == t else t for t in v.ravel()])
    close(EAGER.gelu(x), v * phi.reshape(v.shape), dtype, scale=2)
    tanh_form = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    close(EAGER.gelu(x, approximate="tanh"), tanh_form, dtype, scale=2)
    with np.errstate(invalid="ignore"):  # the NaN input
        soft = np.where(2 * v > 5, v, np.logaddexp(0, 2 * v) / 2)
    close(EAGER.softplus(x, beta=2.0, threshold=5.0), soft, dtype, scale=2)


def test_relu_on_integers():
    x = np.array([-5, 0, 3, -128, 127], np.int8)
    np.testing.assert_array_equal(EAGER.relu(x), [0, 0, 3, 0, 127])
    np.testing.assert_array_equal(EAGER.decompose("relu", [x], {})[0], [0, 0, 3, 0, 127])


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_statistics_against_formulas(dtype):
    x = _x((3, 4, 5), dtype)
    v = f64(x)
    close(EAGER.mean(x, axes=(0, 2)), v.sum(axis=(0, 2)) / 15, dtype)
    for corr in (0, 1, 2):
        manual = ((v - v.mean(axis=1, keepdims=True)) ** 2).sum(axis=1) / (4 - corr)
        close(EAGER.var(x, axes=(1,), correction=corr), manual, dtype, scale=2)
    close(EAGER.logsumexp(x, axes=(1, 2)), np.logaddexp.reduce(v.reshape(3, 20), axis=1), dtype)
    e = np.exp(v - v.max(axis=1, keepdims=True))
    close(EAGER.softmax(x, dim=1), e / e.sum(axis=1, keepdims=True), dtype)
    close(EAGER.log_softmax(x, dim=-1), v - np.log(np.exp(v).sum(-1, keepdims=True)), dtype,
          scale=4)


def test_statistics_edge_cases():
    rows = np.array([[-np.inf, -np.inf], [1000.0, 1000.0], [np.inf, 0.0]], np.float32)
    lse_dec = EAGER.decompose("logsumexp", [rows], {"axes": (1,)})[0]
    for lse in (EAGER.logsumexp(rows, axes=(1,)), lse_dec):
        np.testing.assert_array_equal(lse, np.float32([-np.inf, 1000 + math.log(2), np.inf]))
    one = np.ones((1, 3), np.float32)
    assert np.isnan(EAGER.var(one, axes=(0,))).all()  # N - correction = 0: 0/0, as torch
    assert np.isnan(EAGER.softmax(rows[:1], dim=1)).all()  # all -inf row, as torch
    s = np.float32(2.5).reshape(())
    assert EAGER.softmax(s, dim=0) == 1 and EAGER.decompose("softmax", [s], {"dim": 0})[0] == 1


def test_normalization_against_formulas():
    x, w, b = _x((2, 3, 6), np.float64), _x((3, 6), np.float64, 1), _x((3, 6), np.float64, 2)
    flat = x.reshape(2, 18)
    z = (flat - flat.mean(1, keepdims=True)) / np.sqrt(flat.var(1, keepdims=True) + 1e-5)
    ln = EAGER.layer_norm(x, w, b, normalized_ndim=2, has_weight=True, has_bias=True)
    close(ln, z.reshape(x.shape) * w + b)
    only_bias = EAGER.layer_norm(x, b, normalized_ndim=2, has_bias=True)
    close(only_bias, z.reshape(x.shape) + b)
    rms = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + np.finfo(np.float64).eps)
    close(EAGER.rms_norm(x, w[0], normalized_ndim=1, has_weight=True), rms * w[0])


# -- torch as a second oracle ----------------------------------------------------------------------

TORCH_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), BF16]


def _torch(x):
    torch = pytest.importorskip("torch")
    if x.dtype == BF16:
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def _np(t, dtype):
    return t.float().numpy().astype(dtype) if dtype == BF16 else t.numpy()


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_against_torch_elementwise_and_statistics(dtype):
    torch = pytest.importorskip("torch")
    F_ = torch.nn.functional
    x = _x((3, 4, 7), dtype)
    t = _torch(x)
    pairs = [
        (EAGER.sigmoid(x), torch.sigmoid(t)), (EAGER.relu(x), F_.relu(t)),
        (EAGER.gelu(x), F_.gelu(t)), (EAGER.gelu(x, approximate="tanh"), F_.gelu(t, approximate="tanh")),
        (EAGER.silu(x), F_.silu(t)),
        (EAGER.softplus(x, beta=1.5, threshold=4.0), F_.softplus(t, beta=1.5, threshold=4.0)),
        (EAGER.mean(x, axes=(0, 2)), t.mean((0, 2))),
        (EAGER.var(x, axes=(1, 2), correction=1), t.var((1, 2), correction=1)),
        (EAGER.logsumexp(x, axes=(1,)), t.logsumexp(1)),
        (EAGER.softmax(x, dim=1), t.softmax(1)), (EAGER.log_softmax(x, dim=-1), t.log_softmax(-1)),
    ]
    for ours, theirs in pairs:
        close(ours, _np(theirs, dtype).astype(np.float64), dtype, scale=2)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_against_torch_norms(dtype):
    torch = pytest.importorskip("torch")
    F_ = torch.nn.functional
    x, w, b = _x((2, 3, 8), dtype, 0, 1e-2), _x((3, 8), dtype, 1, 1), _x((3, 8), dtype, 2, 1)
    tx, tw, tb = _torch(x), _torch(w), _torch(b)
    ours = EAGER.layer_norm(x, w, b, normalized_ndim=2, has_weight=True, has_bias=True, eps=1e-4)
    close(ours, _np(F_.layer_norm(tx, (3, 8), tw, tb, eps=1e-4), dtype), dtype, scale=2)
    # tiny inputs make the default eps visible: it must be torch's
    close(EAGER.rms_norm(x, w[0], normalized_ndim=1, has_weight=True),
          _np(F_.rms_norm(tx, (8,), tw[0]), dtype), dtype, scale=2)
    close(EAGER.rms_norm(x, normalized_ndim=2, eps=0.5), _np(F_.rms_norm(tx, (3, 8), eps=0.5), dtype),
          dtype, scale=2)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_against_torch_attention(dtype):
    torch = pytest.importorskip("torch")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = _x((2, 1, 5, 8), dtype, 0, 1), _x((1, 3, 7, 8), dtype, 1, 1), _x((1, 3, 7, 4), dtype, 2, 1)
    bool_mask = np.random.default_rng(3).random((5, 7)) < 0.6
    bool_mask[2] = False  # a fully masked row: torch gives zeros
    float_mask = _x((3, 5, 7), dtype, 4, 1)
    tq, tk, tv = _torch(q), _torch(k), _torch(v)
    cases = [
        (EAGER.scaled_dot_product_attention(q, k, v), sdpa(tq, tk, tv)),
        (EAGER.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5),
         sdpa(tq, tk, tv, is_causal=True, scale=0.5)),
        (EAGER.scaled_dot_product_attention(q, k, v, bool_mask, has_mask=True),
         sdpa(tq, tk, tv, attn_mask=torch.from_numpy(bool_mask))),
        (EAGER.scaled_dot_product_attention(q, k, v, float_mask, has_mask=True),
         sdpa(tq, tk, tv, attn_mask=_torch(float_mask))),
    ]
    for ours, theirs in cases:
        assert ours.shape == (2, 3, 5, 4)
        close(ours, _np(theirs, dtype), dtype, scale=4)
    assert not EAGER.scaled_dot_product_attention(q, k, v, bool_mask, has_mask=True)[:, :, 2].any()


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_against_torch_conv2d(dtype):
    torch = pytest.importorskip("torch")
    x, w, b = _x((2, 4, 11, 9), dtype, 0, 1), _x((6, 2, 3, 2), dtype, 1, 1), _x((6,), dtype, 2, 1)
    ours = EAGER.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2,
                        has_bias=True)
    theirs = torch.nn.functional.conv2d(_torch(x), _torch(w), _torch(b), stride=(2, 1),
                                        padding=(1, 2), dilation=(1, 2), groups=2)
    close(ours, _np(theirs, dtype), dtype, scale=4)


shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2)


@settings(max_examples=40, deadline=None)
@given(batch_a=shapes, batch_b=shapes, m=st.integers(1, 4), k=st.integers(1, 4),
       n=st.integers(1, 4), vec=st.sampled_from(["", "a", "b", "ab"]), drop=st.data())
def test_matmul_against_torch(batch_a, batch_b, m, k, n, vec, drop):
    torch = pytest.importorskip("torch")
    # make the batch dims broadcast: some of b's trailing batch dims become 1 or a's
    batch_b = [drop.draw(st.sampled_from([1, a])) if i < len(batch_a) else d
               for i, (a, d) in enumerate(zip(batch_a[::-1] + [0] * 3, batch_b[::-1]))][::-1]
    a_shape = (k,) if "a" in vec else tuple(batch_a) + (m, k)
    b_shape = (k,) if "b" in vec else tuple(batch_b) + (k, n)
    a, b = _x(a_shape, np.float64, 0, 1), _x(b_shape, np.float64, 1, 1)
    expected = torch.matmul(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    ours = EAGER.matmul(a, b)
    assert ours.shape == expected.shape
    close(ours, expected)
    close(EAGER.decompose("matmul", [a, b], {})[0], expected)
    ai, bi = (a * 4).astype(np.int32), (b * 4).astype(np.int32)
    np.testing.assert_array_equal(EAGER.matmul(ai, bi), np.matmul(ai.astype(np.int64), bi))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data(),
       st.sampled_from(FLOATS))
def test_reductions_over_random_shapes_and_axes(shape, data, dtype):
    axes = tuple(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1)))
    x = _x(tuple(shape), dtype, len(shape), 2)
    v, keep = f64(x), [d for i, d in enumerate(shape) if i not in axes]
    flat = np.moveaxis(v, axes, tuple(range(len(axes)))).reshape(-1, *keep)
    n = flat.shape[0]
    expected = {"mean": flat.sum(0) / n, "logsumexp": np.log(np.exp(flat).sum(0)),
                "var": ((flat - flat.sum(0) / n) ** 2).sum(0) / max(n - 1, 0) if n > 1 else None}
    for op, want in expected.items():
        if want is None:
            continue
        for got in (EAGER.call(op, x, axes=axes), EAGER.decompose(op, [x], {"axes": axes})[0]):
            assert got.dtype == dtype and got.shape == tuple(keep)
            close(got, want, dtype, scale=4)


# -- floor division: Python's own // and % are the oracle ----------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.sampled_from([np.int8, np.int32, np.int64, np.uint8]), st.data())
def test_integer_floor_division_is_python(dtype, data):
    info = np.iinfo(dtype)
    lo = max(info.min, -1000) + (1 if info.min < 0 else 0)  # -MIN // -1 overflows
    ints = st.integers(lo, min(info.max, 1000))
    xs = data.draw(st.lists(st.tuples(ints, ints), min_size=1, max_size=12))
    a = np.array([p[0] for p in xs], dtype)
    b = np.array([p[1] for p in xs], dtype)
    want_q = [int(x) // int(y) if y else 0 for x, y in zip(a, b)]
    want_r = [int(x) % int(y) if y else 0 for x, y in zip(a, b)]
    for q in (EAGER.floor_divide(a, b), EAGER.decompose("floor_divide", [a, b], {})[0]):
        assert q.dtype == a.dtype and q.tolist() == want_q
    for r in (EAGER.remainder(a, b), EAGER.decompose("remainder", [a, b], {})[0]):
        assert r.tolist() == want_r


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e6, 1e6, width=32), st.floats(-1e3, 1e3, width=32)),
                min_size=1, max_size=12))
@example([(-262145.0, float(np.float32(0.05)))])  # quotient past 2**22: torch's answer, one off
def test_float_floor_division_is_python(pairs):
    a = np.array([p[0] for p in pairs], np.float32)
    b = np.array([p[1] for p in pairs], np.float32)
    q_ref, q_dec = EAGER.floor_divide(a, b), EAGER.decompose("floor_divide", [a, b], {})[0]
    r_ref, r_dec = EAGER.remainder(a, b), EAGER.decompose("remainder", [a, b], {})[0]
    np.testing.assert_array_equal(q_ref, q_dec)
    np.testing.assert_array_equal(r_ref, r_dec)
    for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        if y == 0:
            assert math.isnan(r_ref[i]) and (math.isnan(q_ref[i]) if x == 0 else math.isinf(q_ref[i]))
            continue
        # exact rational arithmetic: floor(x / y) (rounded once to float32 when huge),
        # and x - y * floor(x / y) within rounding of |y|
        floor = math.floor(Fraction(x) / Fraction(y))
        if abs(floor) > float(np.finfo(np.float32).max):  # the quotient overflows float32
            assert np.isinf(q_ref[i]) and (q_ref[i] > 0) == (floor > 0)
            continue
        # CPython's algorithm (as torch) is exact while float32 resolves the quotient to
        # better than a half; from 2**22 on its rounded division may land one off
        ulp = Fraction(float(np.spacing(np.float32(abs(floor)))))
        assert abs(Fraction(float(q_ref[i])) - floor) <= (0 if abs(floor) < 2 ** 22 else max(1, ulp))
        rest = Fraction(x) - Fraction(y) * floor
        assert abs(Fraction(float(r_ref[i])) - rest) <= Fraction(float(np.spacing(np.float32(abs(y)))))
        assert r_ref[i] == 0 or (r_ref[i] < 0) == (y < 0)


def test_floor_division_against_torch():
    torch = pytest.importorskip("torch")
    a, b = _x((64,), np.float32, 0, 10), _x((64,), np.float32, 1, 3)
    b[:3] = [0.0, -0.0, 0.0]
    a[:3] = [1.0, 2.0, 0.0]
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    np.testing.assert_array_equal(EAGER.floor_divide(a, b), torch.floor_divide(ta, tb).numpy())
    np.testing.assert_array_equal(EAGER.remainder(a, b), torch.remainder(ta, tb).numpy())


# -- random sampling --------------------------------------------------------------------------------

def _bits(key, n):
    counter = np.arange((n + 1) // 2, dtype=np.uint32)
    with np.errstate(over="ignore"):
        y0, y1 = threefry2x32(key[0], key[1], counter, np.zeros_like(counter))
    return np.stack([y0, y1], axis=1).ravel()[:n]


def test_uniform_and_normal_bits_match_explicit_numpy():
    key = np.array([3, 99], np.uint32)
    u = EAGER.uniform(key, shape=(40, 50), low=-1.0, high=2.0)
    unit = ((_bits(key, 2000) >> np.uint32(9)) | np.uint32(0x3F800000)).view(np.float32) - np.float32(1)
    np.testing.assert_array_equal(u.ravel(), unit * np.float32(3.0) + np.float32(-1.0))
    assert u.min() >= -1 and u.max() < 2 and abs(u.mean() - 0.5) < 0.05
    z = EAGER.normal(key, shape=(4000,))
    pair = ((_bits(key, 8000) >> np.uint32(9)) | np.uint32(0x3F800000)).view(np.float32) - np.float32(1)
    u1, u2 = np.float32(1) - pair[:4000], pair[4000:]
    expected = np.sqrt(np.log(u1) * np.float32(-2)) * np.cos(u2 * np.float32(2 * math.pi))
    np.testing.assert_array_equal(z, expected)
    assert abs(z.mean()) < 0.06 and abs(z.std() - 1) < 0.05 and np.isfinite(z).all()
    # a Kolmogorov-Smirnov distance against the normal CDF
    cdf = np.array([0.5 * math.erfc(-t / math.sqrt(2)) for t in np.sort(z.astype(np.float64))])
    assert np.max(np.abs(cdf - np.arange(1, 4001) / 4000)) < 0.03
    assert not np.array_equal(z, EAGER.normal(np.array([3, 100], np.uint32), shape=(4000,)))


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(ml_dtypes.float8_e4m3fn)],
                         ids=str)
def test_low_precision_uniform_stays_below_one(dtype):
    u = EAGER.uniform(np.array([1, 2], np.uint32), shape=(4096,), dtype=dt.from_numpy(dtype))
    assert u.dtype == dtype and f64(u).min() >= 0 and f64(u).max() < 1


# -- type-rule errors name the op and its operands ---------------------------------------------------

def T(shape, dtype=dt.float32):
    return TensorType(dtype, shape)


ERRORS = [
    ("matmul", [T((2, 3)), T((4, 5))], {}, KilnShapeError,
     "matmul: contracting dims differ: f32[2, 3] has 3, f32[4, 5] has 4"),
    ("matmul", [T((2, 3)), T((3,), dt.float16)], {}, KilnDTypeError, "f16[3]"),
    ("matmul", [T((2, 2, 3)), T((3, 3, 1))], {}, KilnShapeError, "f32[3, 3, 1]"),
    ("sigmoid", [T((2,), dt.int32)], {}, KilnDTypeError, "i32[2]"),
    ("relu", [T((2,), dt.bool_)], {}, KilnDTypeError, "i1[2]"),
    ("gelu", [T((2,))], {"approximate": "erf"}, KilnArgumentError, "'erf'"),
    ("mean", [T((2, 3))], {"axes": (2,)}, KilnArgumentError, "rank 2"),
    ("softmax", [T((2, 3))], {"dim": 5}, KilnArgumentError, "dim 5"),
    ("layer_norm", [T((2, 3)), T((2,))], {"normalized_ndim": 1, "has_weight": True},
     KilnShapeError, "weight f32[2] must be f32[3]"),
    ("layer_norm", [T((2, 3)), T((3,))], {"normalized_ndim": 1}, KilnArgumentError, "got 2"),
    ("rms_norm", [T((2, 3))], {"normalized_ndim": 3}, KilnArgumentError, "f32[2, 3]"),
    ("scaled_dot_product_attention", [T((2, 4, 8)), T((2, 5, 6)), T((2, 5, 6))], {},
     KilnShapeError, "query f32[2, 4, 8] and key f32[2, 5, 6]"),
    ("scaled_dot_product_attention", [T((4, 8)), T((5, 8)), T((6, 8))], {},
     KilnShapeError, "value f32[6, 8]"),
    ("scaled_dot_product_attention", [T((4, 8)), T((5, 8)), T((5, 8)), T((3, 5), dt.bool_)],
     {"has_mask": True}, KilnShapeError, "mask i1[3, 5]"),
    ("conv2d", [T((1, 3, 8, 8)), T((4, 2, 3, 3))], {}, KilnShapeError, "f32[4, 2, 3, 3]"),
    ("conv2d", [T((1, 3, 2, 2)), T((4, 3, 3, 3))], {}, KilnShapeError, "f32[1, 3, 2, 2]"),
    ("conv2d", [T((3, 8, 8)), T((4, 3, 3, 3))], {}, KilnShapeError, "f32[3, 8, 8]"),
    ("softplus", [T((2,))], {"beta": 0.0}, KilnArgumentError, "softplus: beta (non-zero)"),
    ("var", [T((2,), dt.int64)], {}, KilnDTypeError, "var: operand of type i64[2]"),
    ("var", [T((2,))], {"correction": "1"}, KilnArgumentError, "var: correction"),
    ("logsumexp", [T((2,), dt.bfloat16)], {"axes": (0, 0)}, KilnArgumentError, "repeats a dim"),
    ("log_softmax", [T((2,), dt.int8)], {}, KilnDTypeError, "log_softmax: operand of type i8[2]"),
    ("rms_norm", [T((2, 3))], {"normalized_ndim": 1, "eps": "small"}, KilnArgumentError,
     "rms_norm: eps"),
    ("layer_norm", [T((2, 3)), T((3,), dt.float16)], {"normalized_ndim": 1, "has_bias": True},
     KilnShapeError, "layer_norm: bias f16[3] must be f32[3], the last 1 dims of x f32[2, 3]"),
    ("scaled_dot_product_attention", [T((4, 8)), T((5, 8), dt.float16), T((5, 8))], {},
     KilnDTypeError, "query f32[4, 8], key f16[5, 8] and value f32[5, 8]"),
    ("scaled_dot_product_attention", [T((8,)), T((5, 8)), T((5, 8))], {},
     KilnShapeError, "query f32[8] must have rank >= 2"),
    ("scaled_dot_product_attention", [T((4, 8)), T((5, 8)), T((5, 8)), T((4, 5), dt.int32)],
     {"has_mask": True}, KilnDTypeError, "mask i32[4, 5] must be bool or f32"),
    ("scaled_dot_product_attention", [T((4, 8)), T((5, 8)), T((5, 8)), T((4, 5), dt.bool_)],
     {"has_mask": True, "is_causal": True}, KilnArgumentError, "not together with is_causal"),
    ("scaled_dot_product_attention", [T((4, 8)), T((5, 8)), T((5, 8))], {"has_mask": True},
     KilnArgumentError, "has_mask=True with 0 mask operand(s)"),
    ("conv2d", [T((1, 4, 8, 8)), T((4, 4, 3, 3)), T((3,))], {"has_bias": True}, KilnShapeError,
     "conv2d: bias f32[3] must be f32[4]"),
    ("conv2d", [T((1, 4, 8, 8)), T((4, 4, 3, 3))], {"stride": (1, 2, 3)}, KilnArgumentError,
     "conv2d: attribute stride must have 2 entries"),
    ("floor_divide", [T((2,)), T((3,))], {}, KilnShapeError, "f32[2], f32[3]"),
    ("floor_divide", [T((2,)), T((2,), dt.float64)], {}, KilnDTypeError, "f32[2], f64[2]"),
    ("remainder", [T((2,), dt.complex64), T((2,), dt.complex64)], {}, KilnDTypeError, "c64[2]"),
    ("uniform", [T((2,), dt.uint32)], {"shape": (3,), "low": 1.0, "high": 1.0},
     KilnArgumentError, "uniform: needs numbers low < high, got 1.0, 1.0"),
    ("uniform", [T((3,), dt.uint32)], {"shape": (3,)}, KilnDTypeError, "u32[3]"),
    ("remainder", [T((2,), dt.bool_), T((2,), dt.bool_)], {}, KilnDTypeError, "i1[2]"),
    ("uniform", [T((2,), dt.int32)], {"shape": (3,)}, KilnDTypeError, "i32[2]"),
    ("normal", [T((2,), dt.uint32)], {"shape": (3,), "dtype": dt.int32}, KilnDTypeError, "int32"),
]


@pytest.mark.parametrize("op, types, attrs, error, text", ERRORS,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_type_rule_errors(op, types, attrs, error, text):
    opdef = registry.get(op)
    with pytest.raises(error) as info:
        opdef.infer(types, opdef.normalize_attrs(attrs))
    assert info.value.message.startswith(op + ":")
    assert text in info.value.message
