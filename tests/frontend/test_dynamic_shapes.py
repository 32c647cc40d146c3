"""Dynamic shapes end to end: one compile serves every size a spec allows (0 and 1
included, without specializing on them), the same spec works for trace, export and
compile, relations between dims stay exact, out-of-spec inputs fail naming the dim,
the value and the constraint, and guards are cheap."""

import timeit

import numpy as np
import pytest

import kiln as kn
from kiln import STATIC, ShapeVar, TensorSpec
from kiln.errors import KilnArgumentError, KilnShapeSpecError, KilnTraceError
from kiln.ir.interpret import run_graph

B = ShapeVar("B", min=0, max=4096)
T = ShapeVar("T", min=4, max=64, multiple_of=4)


def close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got, want)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5, atol=2e-5, equal_nan=True)


def many_ops(x, w):
    """Ops whose type rules and lowering meet the symbolic dims B and T."""
    h = x @ w  # [B, T] @ [T, 8]
    return (kn.softmax(h, dim=-1), x.mean(dim=0), x.var(dim=1), kn.layer_norm(x, (x.shape[1],)),
            x.reshape(-1), kn.cat([x, x * 2], dim=0), kn.pad(x, (1, 2, 3, 0)), x[1:, :2],
            x[::2], x[:-1].flip(0).cumsum(dim=0), x.unsqueeze(1).expand(x.shape[0], 3, x.shape[1]),
            kn.arange(x.shape[0]) * 2, kn.zeros(x.shape[0] + 1), x.argmax(dim=1), x.T @ x)


SIZES = [(1, 4), (0, 8), (2, 4), (3, 12), (5, 64), (17, 20), (64, 8), (257, 4)]


@pytest.mark.filterwarnings("ignore:Mean of empty slice")  # eager numpy, at B == 0
def test_one_compile_serves_every_allowed_size():
    f = kn.compile(many_ops, dynamic_shapes={"x": TensorSpec([B, T]), "w": TensorSpec([T, STATIC])})
    rng = np.random.default_rng(0)
    for n, t in SIZES:  # the first call has B == 1: no 0/1 specialization happens
        x = rng.standard_normal((n, t)).astype(np.float32)
        w = rng.standard_normal((t, 8)).astype(np.float32)
        for got, want in zip(f(x, w), many_ops(kn.tensor(x), kn.tensor(w))):
            close(got, want)
    stats = f.stats()
    assert stats["compiles"] == 1 and stats["hits"] == len(SIZES) - 1 and stats["recompiles"] == []
    (graph,) = [c.graph for c in f.compiled_graphs()]
    assert [str(v.type) for v in graph.inputs] == ["f32[B, T]", "f32[T, 8]"]
    (guards,) = stats["guards"]
    assert guards == ["%x: f32, dim 0 dynamic (B in [0, 4096]), dim 1 dynamic (T in [4, 64] "
                      "multiple_of 4)", "%w: f32, dim 0 dynamic (T in [4, 64] multiple_of 4), "
                      "dim 1 == 8 (not declared dynamic)"]


def test_relations_between_dims_stay_exact():
    g = kn.trace(many_ops, np.ones((3, 8), np.float32), np.ones((8, 8), np.float32),
                 dynamic_shapes=[TensorSpec([B, T]), TensorSpec([T, STATIC])])
    types = [str(v.type) for v in g.outputs]
    assert types[4:7] == ["f32[B*T]", "f32[2*B, T]", "f32[B + 3, T + 3]"]
    assert types[8] == "f32[floor(B/2 + 1/2), T]" and types[12] == "f32[B + 1]"
    assert types[14] == "f32[T, T]"


def test_size_zero_as_the_first_example():
    N = ShapeVar("N", min=0)
    f = kn.compile(lambda x: (x * 2).sum() + kn.ones(x.shape[0]).sum(), dynamic_shapes=[TensorSpec([N])])
    for n in [0, 1, 2, 100, 0]:
        assert f(np.ones(n, np.float32)).item() == 3 * n
    assert f.stats()["compiles"] == 1
    assert str(f.compiled_graphs()[0].graph.inputs[0].type) == "f32[N]"


def test_a_symbolic_size_used_as_a_value_is_counted_in_the_graph():
    spec = [TensorSpec([ShapeVar("N")])]
    mean = kn.compile(lambda x: x.sum() / x.shape[0], dynamic_shapes=spec)
    for n in (3, 8):
        data = np.arange(n, dtype=np.float32)
        np.testing.assert_allclose(mean(data).numpy(), data.mean(), rtol=1e-6)
    assert mean.stats()["compiles"] == 1
    # an expression the graph does not evaluate still says how to count
    with pytest.raises(KilnTraceError, match="the symbolic size .* was used as a tensor value") as info:
        kn.trace(lambda x: x.sum() / abs(x.shape[0] - 2), np.ones(3, np.float32), dynamic_shapes=spec)
    assert "kn.ones(x.shape[0]).sum()" in str(info.value)


@kn.dynamic_spec({"x": TensorSpec([B, STATIC])})
def scaled(x, scale):
    return x * scale + x.sum(dim=0)


def test_the_decorator_is_honoured_by_trace_export_and_compile(tmp_path):
    scale = np.float32(0.5) * np.ones(3, np.float32)
    g = kn.trace(scaled, np.ones((2, 3), np.float32), scale)
    assert str(g.inputs[0].type) == "f32[B, 3]" and "where B in [0, 4096]" in str(g)
    kn.export(scaled, (np.ones((2, 3), np.float32), scale)).save(tmp_path / "s.kir")
    loaded = kn.load(tmp_path / "s.kir")
    f = kn.compile(scaled)
    for n in [0, 1, 2, 9, 300]:
        x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
        want = scaled(kn.tensor(x), kn.tensor(scale))
        close(f(x, scale), want)
        close(loaded(x, scale), want)
        np.testing.assert_allclose(run_graph(g, x, scale)[0], want.numpy())
    assert f.stats()["compiles"] == 1


def test_control_flow_over_dynamic_shapes():
    N = ShapeVar("N", min=0, max=1 << 20)

    def newton(a):
        def body(i, y):
            return i + 1, 0.5 * (y + a / y)

        return kn.while_loop(lambda i, y: i < 12, body, (kn.tensor(0), kn.ones_like(a)))[1]

    f = kn.compile(newton, dynamic_shapes=[TensorSpec([N])])
    for n in [1, 0, 7, 1000, 4099]:
        a = np.linspace(1, 50, n).astype(np.float32)
        np.testing.assert_allclose(f(a).numpy(), np.sqrt(a), rtol=1e-6)
    assert f.stats()["compiles"] == 1


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,what", [
    ((5000, 3), "dim 0 \\(B\\) is 5000, which breaks B in \\[0, 4096\\]"),
    ((2, 3, 1), "rank"),
])
def test_sizes_outside_the_spec_name_dim_value_and_constraint(shape, what, tmp_path):
    scale = np.ones(3, np.float32)
    f = kn.compile(scaled)
    f(np.ones((2, 3), np.float32), scale)
    kn.export(scaled, (np.ones((2, 3), np.float32), scale)).save(tmp_path / "s.kir")
    loaded = kn.load(tmp_path / "s.kir")
    bad = np.ones(shape, np.float32)
    with pytest.raises(KilnShapeSpecError if what != "rank" else kn.KilnShapeError, match=what):
        loaded(bad, scale)
    if what != "rank":
        with pytest.raises(KilnShapeSpecError, match=what) as info:
            f(bad, scale)
        assert "B <= 4096" in str(info.value)
        with pytest.raises(KilnShapeSpecError, match=what):
            kn.trace(scaled, bad, scale)


def test_multiple_of_and_min_constraints():
    f = kn.compile(lambda x: x + 1, dynamic_shapes=[TensorSpec([T])])
    f(np.ones(8, np.float32))
    with pytest.raises(KilnShapeSpecError, match="dim 0 \\(T\\) is 10, which breaks T in \\[4, 64\\] "
                                                 "multiple_of 4") as info:
        f(np.ones(10, np.float32))
    assert "T % 4 == 0" in str(info.value)
    with pytest.raises(KilnShapeSpecError, match="requires T >= 4"):
        f(np.ones(0, np.float32))
    assert f.stats()["compiles"] == 1


def test_one_shape_var_in_two_inputs_must_agree():
    f = kn.compile(lambda x, y: x + y, dynamic_shapes=[TensorSpec([B]), TensorSpec([B])])
    f(np.ones(3, np.float32), np.ones(3, np.float32))
    with pytest.raises(KilnShapeSpecError, match="dim 0 is 4 but B is 3 elsewhere"):
        f(np.ones(3, np.float32), np.ones(4, np.float32))


def test_undeclared_dims_recompile_with_the_reason():
    f = kn.compile(lambda x: x * 2, dynamic=False)
    f(np.ones(3, np.float32))
    f(np.ones(4, np.float32))
    stats = f.stats()
    assert stats["compiles"] == 2
    assert "dim 0 changed from 3 to 4 (not declared dynamic)" in stats["recompiles"][0]["reason"]
    assert stats["guards"] == [["%x: f32, dim 0 == 3 (not declared dynamic)"],
                               ["%x: f32, dim 0 == 4 (not declared dynamic)"]]


def test_by_default_a_dim_that_changed_becomes_dynamic_at_the_first_recompile():
    """dynamic=None, PyTorch's automatic dynamic: static first, then symbolic."""
    f = kn.compile(lambda x: x * 2)
    for n in (3, 4, 9, 30):
        np.testing.assert_array_equal(f(np.ones(n, np.float32)).numpy(), np.full(n, 2, np.float32))
    stats = f.stats()
    assert stats["compiles"] == 2 and stats["hits"] == 2
    assert "automatic dynamic: `x` dim 0 symbolic from now on" in stats["recompiles"][0]["reason"]
    assert stats["guards"] == [["%x: f32, dim 0 == 3 (not declared dynamic)"],
                               ["%x: f32, dim 0 dynamic (s0 in [2, inf))"]]


def test_a_spec_for_an_argument_holding_several_tensors_is_an_error():
    with pytest.raises(KilnArgumentError, match="holds 2 tensors, but a TensorSpec describes exactly one"):
        kn.trace(lambda p: p[0] + p[1], (np.ones(2, np.float32), np.ones(2, np.float32)),
                 dynamic_shapes=[TensorSpec([B])])


# -- guard cost -----------------------------------------------------------------------------------


def test_guards_are_cheap():
    f = kn.compile(lambda x, w: x * w + 1.0, dynamic_shapes=[TensorSpec([B, STATIC]), None])
    x, w = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    f(x, w)
    (compiled,) = f.compiled_graphs()

    def per_call(fn):
        return min(timeit.repeat(fn, number=2000, repeat=5)) / 2000

    guard = per_call(lambda: f._key((x, w), None)) + per_call(lambda: compiled.binder([x, w]))
    total = per_call(lambda: f(x, w))
    # measured ~2 us of guards in ~13 us per call; the bounds leave room for slow CI
    assert guard < 20e-6 and total < 500e-6


def test_dim_functions_match_sympy():
    import sympy

    from kiln.ir.shapes import dim_function, evaluate, symbol

    b, t = symbol("B"), symbol("T")
    exprs = [2 * b + 1, b * t, sympy.floor(b / 2 + sympy.Rational(1, 2)), sympy.Max(0, b - 1),
             b - sympy.Min(1, b), sympy.Mod(b, 4), sympy.ceiling(b / 3), b ** 2, 7,
             sympy.floor(b / 3 - sympy.Min(1, b) / 3 + sympy.Rational(2, 3))]
    for e in exprs:
        fn = dim_function(e)
        for sizes in ({"B": n, "T": m} for n in range(9) for m in (1, 4, 7)):
            assert fn(sizes) == evaluate(e, sizes), (e, sizes)
