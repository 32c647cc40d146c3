"""Generated MSL run under the CPU simulation of threadgroups, against numpy.

Every kernel kind -- pointwise, the five reductions (each chosen by the shapes that call
for it, asserted), the simdgroup_matrix GEMM with its epilogue -- over dtypes and tail
shapes; every source also passes clang++-15 -fsyntax-only against the compatibility
header (tests/codegen/metal/metal_compat.h)."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.backend import get_backend
from kiln.codegen.metal.emit import emit_kernel
from kiln.frontend.compile import compile_graph
from tests.codegen.metal.conftest import needs_clang
from tests.codegen.metal.simulator import check_msl

pytestmark = needs_clang
RNG = np.random.default_rng(15)


def _data(shape, dtype):
    if np.dtype(dtype) == np.bool_:
        return RNG.random(shape) < 0.5
    if np.dtype(dtype).kind in "iu":
        return RNG.integers(-4 if np.dtype(dtype).kind == "i" else 0, 5, shape).astype(dtype)
    return RNG.standard_normal(shape).astype(dtype)


def _run(sim, fn, *args):
    """fn compiled for the simulator on args: (result, kinds that ran, vec4 flags); every
    kernel's source also passes the syntax check."""
    sim.calls.clear()
    got = kn.compile(fn, backend="metal-sim")(*args).numpy()
    for call in sim.calls:
        check_msl(call.emitted.source)
    return got, [c.emitted.kind for c in sim.calls], [c.emitted.vec4 for c in sim.calls]


def _expect(fn, *args):
    return fn(*(kn.tensor(a) for a in args)).numpy()


def _tol(dtype):
    return dict(rtol=2e-3, atol=2e-3) if np.dtype(dtype) == np.float16 else dict(rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_pointwise_over_dtypes_and_a_tail_shape(sim, dtype):
    shape = (3, 91)  # 273 points: one full threadgroup of 256 and a tail
    x, y = _data(shape, dtype), _data(shape, dtype)
    if np.dtype(dtype).kind == "f":
        fn = lambda x, y: kn.where(x > y, kn.exp(x) * y, kn.tanh(y) - x)  # noqa: E731
    else:
        fn = lambda x, y: (x * y + 7) // kn.where(y == 0, kn.ones_like(y), y) - x  # noqa: E731
    got, kinds, _ = _run(sim, fn, x, y)
    assert kinds == ["pointwise"]
    np.testing.assert_allclose(got, _expect(fn, x, y), **_tol(dtype))


CASES = {
    # kind: (function, input shape) -- the shapes decide the kind
    "inner": (lambda x: x.sum(dim=-1), (5, 300)),
    "narrow": (lambda x: x.sum(dim=-1), (70, 7)),
    "outer": (lambda x: x.sum(dim=0), (50, 40)),
    "strided": (lambda x: x.permute(2, 0, 1).sum(dim=-1), (4, 9, 5)),
    "full": (lambda x: x.sum(), (33, 21)),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_reduction_kind_is_chosen_by_its_shape_and_matches_numpy(sim, kind):
    fn, shape = CASES[kind]
    x = _data(shape, np.float32)
    got, kinds, _ = _run(sim, fn, x)
    assert kinds == [kind]
    np.testing.assert_allclose(got, _expect(fn, x), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype,op", [(np.float16, "max"), (np.float32, "min"), (np.int32, "sum"),
                                      (np.float32, "prod")])
def test_reductions_over_dtypes_and_ops(sim, dtype, op):
    x = _data((6, 45), dtype)  # 45: a tail past every vector width
    if op == "prod":
        x = (1 + 0.1 * x).astype(dtype)
    x[2, 7] = np.nan if np.dtype(dtype).kind == "f" and op in ("max", "min") else x[2, 7]
    fn = {"max": lambda t: t.amax(dim=-1), "min": lambda t: t.amin(dim=0), "sum": lambda t: t.sum(dim=-1),
          "prod": lambda t: t.prod(dim=-1)}[op]
    got, kinds, _ = _run(sim, fn, x)
    want = _expect(fn, x)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **_tol(dtype))


def test_vec4_loads_only_where_the_layout_is_aligned(sim):
    fn = lambda x: kn.softmax(x, -1)  # noqa: E731
    for n, vec in ((256, True), (301, False)):
        x = _data((3, n), np.float32)
        got, kinds, vec4 = _run(sim, fn, x)
        assert kinds == ["inner"] and vec4 == [vec], (n, kinds, vec4)
        np.testing.assert_allclose(got, _expect(fn, x), rtol=1e-5, atol=1e-7)


def test_half_max_stays_in_half_registers():
    x = kn.trace(lambda t: t.amax(dim=-1), np.zeros((4, 64), np.float16))
    backend = get_backend("metal")
    (kernel,) = compile_graph(x, "metal", build=False).program.kernels.values()
    source = emit_kernel(backend.legalize(kernel)).source
    assert "half acc_" in source and "float acc_" not in source


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gemm_on_simdgroup_matrix_with_a_fused_epilogue(sim, dtype):
    a, w, b = _data((2, 37, 45), dtype), _data((45, 33), dtype), _data((33,), dtype)  # tails in M, N, K
    fn = lambda a, w, b: kn.relu(a @ w + b)  # noqa: E731
    got, kinds, _ = _run(sim, fn, a, w, b)
    assert kinds == ["gemm"]
    assert "simdgroup_multiply_accumulate" in sim.calls[0].emitted.source
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == np.float16 else dict(rtol=1e-4, atol=1e-4)
    want = np.maximum(a.astype(np.float32) @ w.astype(np.float32) + b.astype(np.float32), 0)
    np.testing.assert_allclose(got.astype(np.float32), want, **tol)


def test_gemm_with_a_transposed_operand(sim):
    a, w = _data((20, 12), np.float32), _data((9, 12), np.float32)
    got, kinds, _ = _run(sim, lambda a, w: a @ w.T, a, w)
    assert kinds[-1] == "gemm"
    np.testing.assert_allclose(got, a @ w.T, rtol=1e-5, atol=1e-5)
