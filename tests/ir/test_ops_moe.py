"""grouped_matmul and grouped_matmul_dw: references against a per-expert numpy loop
(empty groups, no tokens, low precision), every type-rule error, vjp rules against finite
differences and torch.autograd, and `kn.grouped_matmul` eager, traced, compiled on the
CPU (static and dynamic token counts) and differentiated."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kiln as kn
from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.frontend.moe import grouped_matmul
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER
from kiln.ir.parser import parse_graph
from kiln.ir.shapes import symbol
from kiln.ir.types import TensorType
from kiln.testing import check_vjp_rule
from tests.autodiff.test_rules_shape import assert_rules_complete, traced_vjp

BF16 = np.dtype(ml_dtypes.bfloat16)


def loop_reference(x, w, sizes, transpose_rhs=False):
    """The obvious per-expert loop, in float64."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n = w.shape[1] if transpose_rhs else w.shape[2]
    out = np.zeros((x.shape[0], n))
    for e in range(len(sizes)):
        we = w[e].T if transpose_rhs else w[e]
        out[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]].astype(np.float64) @ we.astype(np.float64)
    return out


def problem(sizes, k=5, n=3, dtype=np.float64, seed=0, transpose_rhs=False):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int64)
    x = rng.standard_normal((int(sizes.sum()), k)).astype(dtype)
    shape = (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n)
    return x, rng.standard_normal(shape).astype(dtype), sizes


def T(shape, dtype=dt.float32):
    return TensorType(dtype, shape)


def infer(op, *types, **attrs):
    opdef = registry.get(op)
    return opdef.infer(list(types), opdef.normalize_attrs(attrs))


# -- references ------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[3, 0, 2, 1], [0, 0, 4], [0, 0, 0], [7], [1, 1, 1, 1, 1]])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_reference_matches_a_per_expert_loop(sizes, transpose_rhs):
    x, w, gs = problem(sizes, transpose_rhs=transpose_rhs)
    (y,) = EAGER.apply("grouped_matmul", [x, w, gs], {"transpose_rhs": transpose_rhs})
    assert y.shape == (sum(sizes), 3) and y.dtype == np.float64
    np.testing.assert_allclose(y, loop_reference(x, w, gs, transpose_rhs), rtol=1e-12)


def test_dw_reference_is_zero_for_empty_groups():
    x, _, gs = problem([2, 0, 3])
    y = np.random.default_rng(1).standard_normal((5, 4))
    (z,) = EAGER.apply("grouped_matmul_dw", [x, y, gs.astype(np.int32)], {})
    assert z.shape == (3, 5, 4)
    np.testing.assert_allclose(z[0], x[:2].T @ y[:2], rtol=1e-12)
    assert not z[1].any()
    np.testing.assert_allclose(z[2], x[2:].T @ y[2:], rtol=1e-12)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_low_precision_accumulates_in_float32_and_rounds_once(dtype):
    x, w, gs = problem([40, 0, 24], k=256, n=8, dtype=dtype)
    (y,) = EAGER.apply("grouped_matmul", [x, w, gs], {})
    assert y.dtype == dtype
    offsets = np.concatenate([[0], np.cumsum(gs)])
    f32 = [x[a:b].astype(np.float32) @ w[e].astype(np.float32)
           for e, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]
    np.testing.assert_array_equal(y, np.concatenate(f32).astype(dtype))  # rounded once
    close = loop_reference(x, w, gs)
    np.testing.assert_allclose(y.astype(np.float64), close, rtol=2e-2, atol=0.1)


def test_reference_checks_the_group_sizes_against_the_data():
    x, w, _ = problem([2, 2])
    with pytest.raises(KilnShapeError, match=r"group_sizes sum to 3 but x has 4 rows"):
        EAGER.apply("grouped_matmul", [x, w, np.array([1, 2])], {})
    with pytest.raises(KilnArgumentError, match=r"group_sizes must be >= 0, got \[5, -1\]"):
        EAGER.apply("grouped_matmul", [x, w, np.array([5, -1])], {})


# -- type rules ---------------------------------------------------------------------------------

def test_type_rule_on_symbolic_token_counts():
    tokens = symbol("T")
    (out,) = infer("grouped_matmul", T((tokens, 16)), T((8, 16, 32)), T((8,), dt.int32))
    assert out == T((tokens, 32))
    (out,) = infer("grouped_matmul", T((tokens, 16)), T((8, 32, 16)), T((8,), dt.int64),
                   transpose_rhs=True)
    assert out == T((tokens, 32))
    (dw,) = infer("grouped_matmul_dw", T((tokens, 16)), T((tokens, 32)), T((8,), dt.int64))
    assert dw == T((8, 16, 32))


@pytest.mark.parametrize("types, attrs, error, message", [
    ((T((4, 16), dt.int32), T((2, 16, 8), dt.int32), T((2,), dt.int64)), {}, KilnDTypeError,
     r"grouped_matmul: x i32\[4, 16\] is not supported; grouped_matmul takes float16"),
    ((T((4, 16)), T((2, 16, 8), dt.bfloat16), T((2,), dt.int64)), {}, KilnDTypeError,
     r"x f32\[4, 16\] and w bf16\[2, 16, 8\] must have one dtype"),
    ((T((4, 2, 8)), T((2, 16, 8)), T((2,), dt.int64)), {}, KilnShapeError,
     r"x f32\[4, 2, 8\] must be a matrix \[T, features\]"),
    ((T((4, 16)), T((16, 8)), T((2,), dt.int64)), {}, KilnShapeError,
     r"w f32\[16, 8\] must be \[E, K, N\], one matrix per expert"),
    ((T((4, 16)), T((2, 16, 8)), T((2,), dt.float32)), {}, KilnDTypeError,
     r"group_sizes f32\[2\] must be int32 or int64"),
    ((T((4, 16)), T((2, 16, 8)), T((2, 1), dt.int32)), {}, KilnShapeError,
     r"group_sizes i32\[2, 1\] must be a vector \[E\]"),
    ((T((4, 16)), T((2, 16, 8)), T((3,), dt.int64)), {}, KilnShapeError,
     r"group_sizes i64\[3\] has 3 entries but w f32\[2, 16, 8\] holds 2 experts"),
    ((T((4, 12)), T((2, 16, 8)), T((2,), dt.int64)), {}, KilnShapeError,
     r"contracting dims differ: x f32\[4, 12\] has 12 features, w f32\[2, 16, 8\] "
     r"\(\[E, K, N\]\) takes 16"),
    ((T((4, 16)), T((2, 16, 8)), T((2,), dt.int64)), {"transpose_rhs": True}, KilnShapeError,
     r"\(\[E, N, K\]\) takes 8"),
    ((T((4, 16)), T((2, 16, 8)), T((2,), dt.int64)), {"transpose_rhs": 1}, KilnArgumentError,
     r"transpose_rhs must be a bool"),
])
def test_grouped_matmul_type_errors(types, attrs, error, message):
    with pytest.raises(error, match=message):
        infer("grouped_matmul", *types, **attrs)


@pytest.mark.parametrize("types, error, message", [
    ((T((4, 16)), T((5, 8)), T((2,), dt.int64)), KilnShapeError,
     r"grouped_matmul_dw: x f32\[4, 16\] and y f32\[5, 8\] must have one row per token"),
    ((T((4, 16)), T((4, 8), dt.float16), T((2,), dt.int64)), KilnDTypeError, r"one dtype"),
    ((T((4, 16)), T((4, 8)), T((2,), dt.uint8)), KilnDTypeError, r"int32 or int64"),
])
def test_grouped_matmul_dw_type_errors(types, error, message):
    with pytest.raises(error, match=message):
        infer("grouped_matmul_dw", *types)


# -- vjp rules ------------------------------------------------------------------------------------

@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_grouped_matmul_vjp_rule(transpose_rhs):
    x, w, gs = problem([3, 0, 2, 1], transpose_rhs=transpose_rhs)
    dx, dw, dg = check_vjp_rule("grouped_matmul", [x, w, gs], {"transpose_rhs": transpose_rhs})
    assert dg is None


def test_every_moe_op_has_a_vjp_rule():
    assert_rules_complete("moe")


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_vjp_rules_trace_on_a_symbolic_token_count(transpose_rhs):
    x, w, gs = problem([2, 0, 3], transpose_rhs=transpose_rhs)
    graph = traced_vjp("grouped_matmul", [x, w, gs], {"transpose_rhs": transpose_rhs},
                       symbols={(0, 0): "T"})
    assert "grouped_matmul_dw" in str(graph)
    y = np.random.default_rng(5).standard_normal((5, 4))
    traced_vjp("grouped_matmul_dw", [x, y, gs], symbols={(0, 0): "T", (1, 0): "T"})


def test_grouped_matmul_dw_vjp_rule():
    x, _, gs = problem([2, 0, 3, 1])
    y = np.random.default_rng(2).standard_normal((6, 4))
    check_vjp_rule("grouped_matmul_dw", [x, y, gs])


def test_vjp_agrees_with_torch_autograd():
    torch = pytest.importorskip("torch", reason="torch (a test extra) is the autograd oracle")
    x, w, gs = problem([3, 0, 4, 1], k=6, n=5)
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    offsets = np.concatenate([[0], np.cumsum(gs)])
    parts = [xt[offsets[e]:offsets[e + 1]] @ wt[e] for e in range(len(gs))]
    (torch.cat(parts).tanh().sum()).backward()
    grads = kn.grad(lambda x, w: kn.tanh(grouped_matmul(x, w, gs)).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(grads[0].numpy(), xt.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(grads[1].numpy(), wt.grad.numpy(), rtol=1e-10)


# -- the frontend function -------------------------------------------------------------------------

def test_frontend_promotes_and_accepts_python_group_sizes():
    x = kn.arange(12).reshape(4, 3)
    y = grouped_matmul(x, kn.ones(2, 3, 2, dtype=kn.int32), [1, 3])  # integers: float32
    assert y.dtype == kn.float32 and y.shape == (4, 2)
    np.testing.assert_allclose(y.numpy()[:, 0], x.numpy().sum(1))
    assert grouped_matmul(x, kn.ones(2, 3, 2, dtype=kn.float16), [1, 3]).dtype == kn.float16
    y16 = grouped_matmul(kn.ones(4, 3, dtype=kn.bfloat16), kn.ones(2, 3, 2, dtype=kn.bfloat16),
                         np.array([4, 0], np.uint8))
    assert y16.dtype == kn.bfloat16


def test_frontend_rejects_float_group_sizes():
    with pytest.raises(KilnDTypeError, match=r"group_sizes must hold integers .* got f32\[2\]"):
        grouped_matmul(kn.ones(4, 3), kn.ones(2, 3, 2), kn.tensor([1.0, 3.0]))


def moe_ffn(x, w1, w2, sizes):
    return grouped_matmul(kn.silu(grouped_matmul(x, w1, sizes)), w2, sizes)


def test_compiles_on_the_cpu_as_an_extern_call():
    x, w1, sizes = problem([5, 0, 3, 8], k=16, n=32, dtype=np.float32)
    w2 = np.random.default_rng(3).standard_normal((4, 32, 16)).astype(np.float32)
    f = kn.compile(moe_ffn)
    got = f(x, w1, w2, sizes).numpy()
    h = loop_reference(x, w1, sizes)
    np.testing.assert_allclose(got, loop_reference(h / (1 + np.exp(-h)), w2, sizes), rtol=2e-4,
                               atol=2e-4)
    steps = [type(s).__name__ + ":" + getattr(s, "op", "") for s in
             f.compiled_graphs()[0].program.steps]
    assert steps.count("Extern:grouped_matmul") == 2  # the silu between them is a kernel launch
    assert any(s.startswith("Launch") for s in steps)


def test_compiles_for_every_token_count_under_a_dynamic_spec():
    tokens = kn.ShapeVar("T", min=0, max=1024)
    f = kn.compile(moe_ffn, dynamic_shapes=[kn.TensorSpec([tokens, 16]), None, None, None])
    rng = np.random.default_rng(4)
    w1 = rng.standard_normal((3, 16, 8)).astype(np.float32)
    w2 = rng.standard_normal((3, 8, 16)).astype(np.float32)
    for sizes in ([4, 0, 2], [0, 0, 0], [10, 20, 3]):
        sizes = np.array(sizes, np.int32)
        x = rng.standard_normal((int(sizes.sum()), 16)).astype(np.float32)
        np.testing.assert_allclose(f(x, w1, w2, sizes).numpy(),
                                   moe_ffn(x, w1, w2, sizes).numpy(), rtol=1e-5, atol=1e-5)
    assert f.stats()["compiles"] == 1


def test_compiled_gradient_matches_eager():
    x, w, sizes = problem([2, 3, 0], k=4, n=6, dtype=np.float32)
    loss = lambda x, w: (grouped_matmul(x, w, sizes) ** 2).sum()  # noqa: E731
    eager = kn.grad(loss, argnums=(0, 1))(x, w)
    compiled = kn.compile(kn.grad(loss, argnums=(0, 1)))(x, w)
    for a, b in zip(eager, compiled):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5)


def test_text_form_round_trips():
    x, w, sizes = problem([2, 3], dtype=np.float32)
    graph = kn.trace(lambda x, w, s: grouped_matmul(x, w, s, transpose_rhs=False), x, w, sizes)
    text = str(graph)
    assert "grouped_matmul(%x, %w, %s) {transpose_rhs=false} : f32[5, 3]" in text
    assert str(parse_graph(text, constants=graph.constants)) == text
