"""The `complex` pass: complex64 arithmetic becomes float32 pairs (before/expected in text
IR), complex programs compile into real kernels only and match numpy, the accessors
and constructors match torch, and grad follows PyTorch's convention (issue 21)."""

import numpy as np
import pytest

import kiln as kn
from kiln.ir.parser import parse_graph
from kiln.passes.complex_decompose import BLAS_MACS, decompose_complex, decompose_complex_blas
from kiln.passes.dce import dce
from kiln.passes.fusion import fuse
from kiln.passes.pipeline import optimize
from tests.passes.examples import assert_rewrites

CASES = {
    "a complex product is four real products of parts read in place (stride 2)": ("""
graph @g(%z: c64[4], %w: c64[4]) -> c64[4]
  %0 = mul(%z, %w) : c64[4]
  return %0
""", """
graph @g(%z: c64[4], %w: c64[4]) -> c64[4]
  %0 = view_as_real(%z) : f32[4, 2]
  %1 = slice(%0) {limit=(4, 1), start=(0, 0)} : f32[4, 1]
  %2 = reshape(%1) {shape=(4,)} : f32[4]
  %3 = slice(%0) {limit=(4, 2), start=(0, 1)} : f32[4, 1]
  %4 = reshape(%3) {shape=(4,)} : f32[4]
  %5 = view_as_real(%w) : f32[4, 2]
  %6 = slice(%5) {limit=(4, 1), start=(0, 0)} : f32[4, 1]
  %7 = reshape(%6) {shape=(4,)} : f32[4]
  %8 = slice(%5) {limit=(4, 2), start=(0, 1)} : f32[4, 1]
  %9 = reshape(%8) {shape=(4,)} : f32[4]
  %10 = mul(%2, %7) : f32[4]
  %11 = mul(%4, %9) : f32[4]
  %12 = sub(%10, %11) : f32[4]
  %13 = mul(%2, %9) : f32[4]
  %14 = mul(%4, %7) : f32[4]
  %15 = add(%13, %14) : f32[4]
  %16 = complex(%12, %15) : c64[4]
  return %16
"""),
    "a complex matrix product is one real GEMM on the interleaved memory: A as (m, 2k) @ pair block of B": ("""
graph @g(%a: c64[2, 3], %b: c64[3, 5]) -> c64[2, 5]
  %0 = matmul(%a, %b) : c64[2, 5]
  return %0
""", """
graph @g(%a: c64[2, 3], %b: c64[3, 5]) -> c64[2, 5]
  %0 = view_as_real(%a) : f32[2, 3, 2]
  %1 = view_as_real(%b) : f32[3, 5, 2]
  %2 = slice(%1) {limit=(3, 5, 1), start=(0, 0, 0)} : f32[3, 5, 1]
  %3 = reshape(%2) {shape=(3, 5)} : f32[3, 5]
  %4 = slice(%1) {limit=(3, 5, 2), start=(0, 0, 1)} : f32[3, 5, 1]
  %5 = reshape(%4) {shape=(3, 5)} : f32[3, 5]
  %6 = reshape(%0) {shape=(2, 6)} : f32[2, 6]
  %7 = iota() {dimension=1, dtype=i32, shape=(3, 2, 5, 2)} : i32[3, 2, 5, 2]
  %8 = iota() {dimension=3, dtype=i32, shape=(3, 2, 5, 2)} : i32[3, 2, 5, 2]
  %9 = full() {dtype=i32, shape=(3, 2, 5, 2), value=0} : i32[3, 2, 5, 2]
  %10 = eq(%7, %9) : i1[3, 2, 5, 2]
  %11 = broadcast_in_dim(%5) {broadcast_dimensions=(0, 2), shape=(3, 2, 5, 2)} : f32[3, 2, 5, 2]
  %12 = neg(%5) : f32[3, 5]
  %13 = broadcast_in_dim(%12) {broadcast_dimensions=(0, 2), shape=(3, 2, 5, 2)} : f32[3, 2, 5, 2]
  %14 = select(%10, %11, %13) : f32[3, 2, 5, 2]
  %15 = eq(%7, %8) : i1[3, 2, 5, 2]
  %16 = broadcast_in_dim(%3) {broadcast_dimensions=(0, 2), shape=(3, 2, 5, 2)} : f32[3, 2, 5, 2]
  %17 = select(%15, %16, %14) : f32[3, 2, 5, 2]
  %18 = reshape(%17) {shape=(6, 10)} : f32[6, 10]
  %19 = matmul(%6, %18) : f32[2, 10]
  %20 = reshape(%19) {shape=(2, 5, 2)} : f32[2, 5, 2]
  %21 = view_as_complex(%20) : c64[2, 5]
  return %21
"""),
    "a complex GEMM of a symbolic size is four real GEMMs (4M)": ("""
graph @g(%a: c64[B, 3], %b: c64[3, 5]) -> c64[B, 5]
  where B in [1, 8]
  %0 = matmul(%a, %b) : c64[B, 5]
  return %0
""", """
graph @g(%a: c64[B, 3], %b: c64[3, 5]) -> c64[B, 5]
  where B in [1, 8]
  %0 = view_as_real(%a) : f32[B, 3, 2]
  %1 = slice(%0) {limit=(B, 3, 1), start=(0, 0, 0)} : f32[B, 3, 1]
  %2 = reshape(%1) {shape=(B, 3)} : f32[B, 3]
  %3 = slice(%0) {limit=(B, 3, 2), start=(0, 0, 1)} : f32[B, 3, 1]
  %4 = reshape(%3) {shape=(B, 3)} : f32[B, 3]
  %5 = view_as_real(%b) : f32[3, 5, 2]
  %6 = slice(%5) {limit=(3, 5, 1), start=(0, 0, 0)} : f32[3, 5, 1]
  %7 = reshape(%6) {shape=(3, 5)} : f32[3, 5]
  %8 = slice(%5) {limit=(3, 5, 2), start=(0, 0, 1)} : f32[3, 5, 1]
  %9 = reshape(%8) {shape=(3, 5)} : f32[3, 5]
  %10 = matmul(%2, %7) : f32[B, 5]
  %11 = matmul(%4, %9) : f32[B, 5]
  %12 = sub(%10, %11) : f32[B, 5]
  %13 = matmul(%2, %9) : f32[B, 5]
  %14 = matmul(%4, %7) : f32[B, 5]
  %15 = add(%13, %14) : f32[B, 5]
  %16 = complex(%12, %15) : c64[B, 5]
  return %16
"""),
    "parts flow between ops without packing: |z + w| and a sum": ("""
graph @g(%z: c64[4], %w: c64[4]) -> (f32[4], c64[])
  %0 = add(%z, %w) : c64[4]
  %1 = abs(%0) : f32[4]
  %2 = reduce_sum(%0) {axes=(0,)} : c64[]
  return %1, %2
""", """
graph @g(%z: c64[4], %w: c64[4]) -> (f32[4], c64[])
  %0 = view_as_real(%z) : f32[4, 2]
  %1 = slice(%0) {limit=(4, 1), start=(0, 0)} : f32[4, 1]
  %2 = reshape(%1) {shape=(4,)} : f32[4]
  %3 = slice(%0) {limit=(4, 2), start=(0, 1)} : f32[4, 1]
  %4 = reshape(%3) {shape=(4,)} : f32[4]
  %5 = view_as_real(%w) : f32[4, 2]
  %6 = slice(%5) {limit=(4, 1), start=(0, 0)} : f32[4, 1]
  %7 = reshape(%6) {shape=(4,)} : f32[4]
  %8 = slice(%5) {limit=(4, 2), start=(0, 1)} : f32[4, 1]
  %9 = reshape(%8) {shape=(4,)} : f32[4]
  %10 = add(%2, %7) : f32[4]
  %11 = add(%4, %9) : f32[4]
  %12 = mul(%10, %10) : f32[4]
  %13 = mul(%11, %11) : f32[4]
  %14 = add(%12, %13) : f32[4]
  %15 = sqrt(%14) : f32[4]
  %16 = reduce_sum(%10) {axes=(0,)} : f32[]
  %17 = reduce_sum(%11) {axes=(0,)} : f32[]
  %18 = complex(%16, %17) : c64[]
  return %15, %18
"""),
}


@pytest.mark.parametrize("name", list(CASES))
def test_complex_case(name):
    before, expected = CASES[name]
    assert_rewrites(lambda g: dce(decompose_complex(g)), before, expected)


def test_the_3m_gemm_is_three_real_gemms(monkeypatch):
    monkeypatch.setenv("KILN_COMPLEX_GEMM", "3m")
    a, b = _c(6, 7, seed=1), _c(7, 5, seed=2)
    graph = dce(decompose_complex(kn.trace(lambda a, b: a @ b, a, b)))
    assert [n.op for n in graph.nodes].count("matmul") == 3
    got = kn.compile(lambda a, b: a @ b)(a, b).numpy()
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)


def test_cpu_keeps_a_large_complex_matmul_whole():
    """The CPU's variant of the pass leaves a complex matmul of >= BLAS_MACS multiply-adds
    whole (one cgemm call); a smaller one, and every other backend's, become real GEMMs."""
    big = kn.trace(lambda a, b: a @ b * 2, _c(64, 32), _c(32, 64))
    assert 64 * 32 * 64 >= BLAS_MACS
    kept = decompose_complex_blas(big)
    ops = [n.op for n in kept.nodes]
    assert ops.count("matmul") == 1 and next(n for n in kept.nodes if n.op == "matmul").results[0].type.dtype.is_complex
    assert "mul" in ops  # the product's consumer is still decomposed into real parts
    small = decompose_complex_blas(kn.trace(lambda a, b: a @ b, _c(8, 16), _c(16, 4)))
    with pytest.MonkeyPatch.context() as mp:  # the 3M form asked for: real GEMMs, as asked
        mp.setenv("KILN_COMPLEX_GEMM", "3m")
        three = decompose_complex_blas(big)
    assert [n.op for n in three.nodes].count("matmul") == 3
    assert all(not n.results[0].type.dtype.is_complex for n in small.nodes if n.op == "matmul")
    assert all(not n.results[0].type.dtype.is_complex for n in decompose_complex(big).nodes if n.op == "matmul")


@pytest.mark.parametrize("case", ["square", "batched", "a transposed", "b conj transposed", "rows of a batch"])
def test_compiled_complex_matmul_is_one_cgemm_matching_numpy(case):
    """Compiled on the CPU, a large complex matmul is numpy's own cgemm: bit-identical to
    np.matmul where the operands are plain arrays, within float32 rounding otherwise."""
    a, b = _c(96, 80, seed=5), _c(80, 112, seed=6)
    fn, oracle, args, exact = {
        "square": (lambda x, y: x @ y, lambda x, y: x @ y, (a, b), True),
        "batched": (lambda x, y: x @ y, lambda x, y: x @ y, (_c(3, 40, 48, seed=7), _c(3, 48, 56, seed=8)), True),
        "a transposed": (lambda x, y: x.mT @ y, lambda x, y: x.T @ y, (_c(80, 96, seed=9), b), False),
        "b conj transposed": (lambda x, y: x @ y.conj().mT, lambda x, y: x @ y.conj().T,
                              (a, _c(112, 80, seed=10)), False),
        "rows of a batch": (lambda x, y: (x @ y) + 1j, lambda x, y: (x @ y) + 1j,
                            (_c(4, 24, 80, seed=11), b), False),
    }[case]
    got = kn.compile(fn)(*args).numpy()
    want = oracle(*args)
    assert got.dtype == np.complex64 and got.shape == want.shape
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # the same against a float64 oracle: no digits lost to a 3M-style cancellation
    want64 = oracle(*[x.astype(np.complex128) for x in args])
    np.testing.assert_allclose(got, want64, rtol=1e-5, atol=1e-4)


def _c(*shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


Z, W = _c(64, seed=0), _c(64, seed=1)
X = np.random.default_rng(2).standard_normal(64).astype(np.float32)
PROGRAMS = {
    "chain": (lambda z, w: kn.exp(z) * w / (z + 1.5) - kn.log(w) * 0.5 + 2j,
              lambda z, w: np.exp(z) * w / (z + 1.5) - np.log(w) * 0.5 + 2j, (Z, W)),
    "abs sqrt pow": (lambda z: kn.abs(kn.sqrt(z)) + kn.abs(z ** 2) * kn.abs(z ** 2.5),
                     lambda z: np.abs(np.sqrt(z)) + np.abs(z ** 2) * np.abs(z ** 2.5), (Z,)),
    "negative real axis sqrt": (lambda z: kn.sqrt(z), np.sqrt,
                                (np.array([-4 + 0j, -4 + 1e-7j, -4 - 1e-7j, 0j, 9 + 0j], np.complex64),)),
    "sum conj": (lambda z: (z * z.conj()).sum() + z.sum(), lambda z: (z * z.conj()).sum() + z.sum(), (Z,)),
    "matmul": (lambda a, b: a @ b, lambda a, b: a @ b, (_c(8, 16, seed=3), _c(16, 4, seed=4))),
    "accessors": (lambda z: kn.angle(z) + z.real * z.imag, lambda z: np.angle(z) + z.real * z.imag, (Z,)),
    "real times complex": (lambda x, z: (x * z).sum() * 0.1, lambda x, z: (x * z).sum() * 0.1, (X, Z)),
    "polar": (lambda r, t: kn.polar(r, t) * 3, lambda r, t: r * np.exp(1j * t) * 3,
              (np.abs(X), X)),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_compiled_complex_programs_match_numpy_with_real_kernels_only(name):
    fn, oracle, args = PROGRAMS[name]
    want = oracle(*args)
    eager = fn(*[kn.tensor(a) for a in args]).numpy()
    got = kn.compile(fn)(*args).numpy()
    for value in (eager, got):
        np.testing.assert_allclose(value, want, rtol=2e-5, atol=2e-5)
    fused = fuse(optimize(kn.trace(fn, *args)))
    for node in fused.walk():
        if node.op == "fused":  # no kernel computes on complex values
            assert not any(v.type.dtype.is_complex for r in node.regions for n in r.nodes
                           for v in n.results + n.operands), name


def test_accessors_and_constructors():
    z = kn.tensor(Z)
    np.testing.assert_array_equal(z.real.numpy(), Z.real)
    np.testing.assert_array_equal(z.imag.numpy(), Z.imag)
    np.testing.assert_array_equal(z.conj().numpy(), Z.conj())
    np.testing.assert_array_equal(kn.view_as_real(z).numpy(), np.stack([Z.real, Z.imag], -1))
    np.testing.assert_array_equal(kn.view_as_complex(kn.view_as_real(z)).numpy(), Z)
    np.testing.assert_allclose(kn.angle(z).numpy(), np.angle(Z), rtol=1e-6)
    np.testing.assert_array_equal(kn.angle(kn.tensor([-2.0, 0.0, 3.0])).numpy(), np.float32([np.pi, 0, 0]))
    np.testing.assert_array_equal(kn.complex(kn.tensor(X), kn.tensor(X)).numpy(), X + 1j * X)
    assert z.is_complex() and not kn.tensor(X).is_complex()
    np.testing.assert_array_equal(kn.tensor(X).real.numpy(), X)
    with pytest.raises(kn.KilnDTypeError, match="imag: expects a complex tensor"):
        kn.tensor(X).imag
    with pytest.raises(kn.KilnShapeError, match="last dim is 2"):
        kn.view_as_complex(kn.ones(3, 3))
    np.testing.assert_allclose((z * 0.1).numpy(), Z * np.float32(0.1), rtol=1e-6)  # was K102


def _torch_grad(torch, fn, z):
    t = torch.tensor(z, requires_grad=True)
    fn(torch, t).backward()
    return t.grad.numpy()


GRADS = {
    "|z|": (lambda m, z: m.abs(z).sum() if m is kn else z.abs().sum()),
    "|exp(z) z|": (lambda m, z: m.abs(m.exp(z) * z).sum() if m is kn else (z.exp() * z).abs().sum()),
    "re(z w) + angle": (lambda m, z: ((z * (1 + 2j)).real + m.angle(z)).sum() if m is kn
                        else ((z * (1 + 2j)).real + z.angle()).sum()),
    "|z @ z^T|": (lambda m, z: m.abs(z.reshape(8, 8) @ z.reshape(8, 8).transpose(0, 1)).sum()
                  if m is kn else (z.reshape(8, 8) @ z.reshape(8, 8).T).abs().sum()),
}


@pytest.mark.parametrize("name", list(GRADS))
def test_grad_of_real_functions_of_complex_inputs_is_pytorchs(name):
    """dL/dRe + i dL/dIm (the conjugate Wirtinger convention), checked against central
    finite differences on both parts, and against torch when installed."""
    f = GRADS[name]
    z = Z.astype(np.complex128).astype(np.complex64)
    g = kn.grad(lambda z: f(kn, z))(kn.tensor(z)).numpy()
    compiled = kn.compile(kn.grad(lambda z: f(kn, z)))(z).numpy()
    np.testing.assert_allclose(compiled, g, rtol=1e-4, atol=1e-4)
    loss = lambda v: float(f(kn, kn.tensor(v.astype(np.complex64))).numpy())  # noqa: E731
    h = 1e-2
    for k in (0, 7, 33):
        e = np.zeros(64, np.complex64)
        e[k] = h
        d_re = (loss(z + e) - loss(z - e)) / (2 * h)
        d_im = (loss(z + 1j * e) - loss(z - 1j * e)) / (2 * h)
        np.testing.assert_allclose(g[k], d_re + 1j * d_im, rtol=2e-2, atol=2e-2)
    try:
        import torch
    except ImportError:
        return
    np.testing.assert_allclose(g, _torch_grad(torch, lambda m, t: f(m, t), z), rtol=1e-4, atol=1e-4)


def test_grad_refuses_a_complex_output():
    with pytest.raises(kn.KilnGradientError, match="one float scalar"):
        kn.grad(lambda z: z.sum())(kn.tensor(Z))


@pytest.mark.parametrize("sa, sb", [((6, 7), (7, 5)), ((2, 6, 7), (7, 5)), ((6, 7), (3, 7, 5)),
                                    ((1, 3), (3, 1))])
def test_a_complex_matrix_product_is_one_real_gemm_and_matches_numpy(sa, sb):
    from kiln.codegen.kernel_ir import GemmKernel

    a, b = _c(*sa, seed=3), _c(*sb, seed=4)
    f = kn.compile(lambda a, b: a @ b)
    np.testing.assert_allclose(f(a, b).numpy(), a @ b, rtol=1e-5, atol=1e-5)
    program = f.compiled_graphs()[0].program
    gemms = sum(isinstance(k, GemmKernel) for k in program.kernels.values())
    gemms += sum(getattr(s, "op", None) in ("matmul", "dot_general") for s in program.steps)
    assert gemms == 1  # a GEMM template, or a library call where the layout needs one
