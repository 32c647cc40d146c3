"""Complex <-> real views (issue 21 follow-up): `view_as_real`, `view_as_complex`, `.real`
and `.imag` share memory with `z` as in torch, writes through them change `z` (eager and
compiled, the same sequence run on torch as the oracle), gradients through them match
finite differences and torch, and compiled complex programs read and write the
interleaved memory directly (no split or pack step, one real GEMM for a product)."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.kernel_ir import GemmKernel
from kiln.runtime.program import Extern, Launch, View


def _c(*shape, seed=0):
    rng = np.random.default_rng(seed)
    return np.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape), np.complex64)


Z = _c(3, 4)


def test_views_share_memory_and_values_with_z():
    z = kn.tensor(Z)
    pairs, re, im = kn.view_as_real(z), z.real, z.imag
    back = kn.view_as_complex(pairs)
    np.testing.assert_array_equal(pairs.numpy(), Z.view(np.float32).reshape(3, 4, 2))
    np.testing.assert_array_equal(re.numpy(), Z.real)
    np.testing.assert_array_equal(im.numpy(), Z.imag)
    np.testing.assert_array_equal(back.numpy(), Z)
    for view in (pairs, re, im, back):
        assert np.shares_memory(view.numpy(), z.numpy())
    assert re.numpy().strides[-1] == 8 and im.numpy().strides[-1] == 8  # stride 2 floats
    pairs.numpy()[0, 0, 1] = 42.0  # a write into the shared memory is a write into z
    assert z.numpy()[0, 0].imag == 42.0 and im.numpy()[0, 0] == 42.0


def _torch_ops(torch):
    """The same in-place sequence for kiln (m=kn) and torch (m=torch)."""
    def run(m, z):
        pairs = m.view_as_real(z)
        pairs.mul_(2)                  # through view_as_real
        z.real.add_(1)                 # through .real
        z.imag[1, 2] = 7.0             # item assignment through .imag
        m.view_as_complex(pairs).mul_(1j)   # a view of a view
        seen = pairs[0].clone()        # the view reads z's latest value
        z.add_(0.5)                    # a write to z is seen by its views
        z.imag = z.real * 3            # the setters
        return seen, pairs.clone(), z.real.clone()
    return run


def test_writes_through_views_change_z_like_torch():
    torch = pytest.importorskip("torch")
    run = _torch_ops(torch)
    zk, zt = kn.tensor(Z), torch.tensor(Z)
    for got, want in zip(run(kn, zk), run(torch, zt)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    np.testing.assert_allclose(zk.numpy(), zt.numpy(), rtol=1e-6)
    assert np.shares_memory(kn.view_as_real(zk).numpy(), zk.numpy())


def test_writes_through_views_inside_a_compiled_function_reach_the_argument():
    def f(z):
        kn.view_as_real(z).mul_(2)
        z.real.add_(1)
        z.imag[0, 1] = -3.0
        return kn.view_as_real(z).sum()

    eager, compiled = kn.tensor(Z), kn.tensor(Z)
    want = Z * 2 + 1
    want.imag[0, 1] = -3.0
    got_eager, got = f(eager).numpy(), kn.compile(f)(compiled).numpy()
    for value, z in ((got_eager, eager), (got, compiled)):
        np.testing.assert_allclose(z.numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(value, want.real.sum() + want.imag.sum(), rtol=1e-5)


def test_a_view_passed_to_a_compiled_function():
    z = kn.tensor(Z)
    f = kn.compile(lambda x: x * 2 + 1)
    np.testing.assert_allclose(f(z.imag).numpy(), Z.imag * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(f(z.real).numpy(), Z.real * 2 + 1, rtol=1e-6)
    g = kn.compile(lambda p: kn.view_as_complex(p) * 1j)
    np.testing.assert_allclose(g(kn.view_as_real(z)).numpy(), Z * 1j, rtol=1e-6)


W = np.random.default_rng(5).standard_normal((3, 4, 2)).astype(np.float32)
LOSSES = {
    "view_as_real": (lambda m, z: (m.view_as_real(z) ** 2 * m.tensor(W)).sum()),
    "real and imag": (lambda m, z: (z.real * z.imag + m.exp(z.imag)).sum()),
    "view_as_complex of view_as_real": (
        lambda m, z: m.abs(m.view_as_complex(m.view_as_real(z) * m.tensor(W)) * (1 - 2j)).sum()),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_grad_through_the_views_matches_finite_differences_and_torch(name):
    loss = LOSSES[name]
    g = kn.grad(lambda z: loss(kn, z))(kn.tensor(Z)).numpy()
    compiled = kn.compile(kn.grad(lambda z: loss(kn, z)))(Z).numpy()
    np.testing.assert_allclose(compiled, g, rtol=1e-4, atol=1e-4)
    value = lambda v: float(loss(kn, kn.tensor(v.astype(np.complex64))).numpy())  # noqa: E731
    h = 1e-2
    for k in ((0, 0), (1, 2), (2, 3)):
        e = np.zeros(Z.shape, np.complex128)
        e[k] = h
        d_re = (value(Z + e) - value(Z - e)) / (2 * h)
        d_im = (value(Z + 1j * e) - value(Z - 1j * e)) / (2 * h)
        np.testing.assert_allclose(g[k], d_re + 1j * d_im, rtol=2e-2, atol=2e-2)
    torch = pytest.importorskip("torch")
    t = torch.tensor(Z, requires_grad=True)
    loss(torch, t).backward()
    np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-4, atol=1e-4)


def _steps(f):
    return f.compiled_graphs()[-1].program


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 5)])
def test_a_compiled_complex_program_reads_and_writes_the_interleaved_memory(shape):
    """No step splits or packs: views of the arguments, one kernel indexing the pairs
    (loads at 2k and 2k + 1), and the result a view of the pairs it stored."""
    z, w = _c(*shape, seed=1), _c(*shape, seed=2)
    f = kn.compile(lambda z, w: kn.exp(z) * w + z * 0.5 - kn.abs(z))
    np.testing.assert_allclose(f(z, w).numpy(), np.exp(z) * w + z * 0.5 - np.abs(z),
                               rtol=2e-5, atol=2e-5)
    program = _steps(f)
    assert not any(isinstance(s, Extern) for s in program.steps), program.steps
    assert sum(isinstance(s, Launch) for s in program.steps) == 1
    assert isinstance(program.steps[-1], View)
    (kernel,) = program.kernels.values()
    assert [b.shape for b in kernel.outputs] == [tuple(shape) + (2,)]
    first = min(kernel.stages, key=lambda s: str(s.index)).index
    assert sorted(str(s.index - first) for s in kernel.stages) == ["0", "1"]  # re at 2k, im at 2k + 1
    assert {s.buffer for s in kernel.stages} == {kernel.outputs[0].name}


def test_view_results_of_a_compiled_function():
    f = kn.compile(lambda z: (kn.view_as_real(z * 2), (z * 2).real, kn.view_as_complex(kn.view_as_real(z))))
    pairs, re, same = f(Z)
    np.testing.assert_allclose(pairs.numpy(), (2 * Z).view(np.float32).reshape(3, 4, 2), rtol=1e-6)
    np.testing.assert_allclose(re.numpy(), 2 * Z.real, rtol=1e-6)
    np.testing.assert_array_equal(same.numpy(), Z)


@pytest.mark.parametrize("sa, sb", [((6, 7), (7, 5)), ((2, 6, 7), (7, 5)), ((2, 1, 3, 4), (5, 4, 6))])
def test_a_complex_product_is_one_gemm_on_the_interleaved_memory(sa, sb):
    """A's memory is the GEMM's left operand and the GEMM's output is the result's memory:
    the only other step builds B's pair block (one loop kernel)."""
    a, b = _c(*sa, seed=3), _c(*sb, seed=4)
    f = kn.compile(lambda a, b: a @ b)
    np.testing.assert_allclose(f(a, b).numpy(), a @ b, rtol=1e-5, atol=1e-5)
    program = _steps(f)
    kinds = [type(k).__name__ for k in program.kernels.values()]
    externs = [s.op for s in program.steps if isinstance(s, Extern)]
    assert externs in ([], ["matmul"]) and kinds.count("Kernel") == 1, (kinds, externs)
    assert kinds.count("GemmKernel") + len(externs) == 1
    assert any(isinstance(k, GemmKernel) for k in program.kernels.values()) or externs
    assert isinstance(program.steps[-1], View)


def test_view_errors():
    with pytest.raises(kn.KilnShapeError, match="last dim is 2"):
        kn.view_as_complex(kn.ones(3, 3))
    with pytest.raises(kn.KilnDTypeError, match="view_as_real: expects a complex tensor"):
        kn.view_as_real(kn.ones(3, 2))


@pytest.mark.parametrize("name", ["part also returned", "parts of a reduction", "parts of two kernels"])
def test_complex_results_that_cannot_be_stored_as_pairs_are_packed(name):
    """A part someone else reads, or parts no single loop kernel computes, keep the
    packing step (and the values are right)."""
    z = _c(6, 5, seed=7)
    fn, want, packs = {
        "part also returned": (lambda z: (z * 2, (z * 2).real), (2 * z, 2 * z.real), 1),
        "parts of a reduction": (lambda z: (z * 2).sum(0), ((2 * z).sum(0),), 1),
        "parts of two kernels": (lambda z: kn.complex(kn.abs(z).sum(1), z.real.sum(1) * 2),
                                 (np.abs(z).sum(1) + 2j * z.real.sum(1),), 1),
    }[name]
    f = kn.compile(fn)
    got = f(z)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=2e-5, atol=2e-5)
    externs = [s.op for s in _steps(f).steps if isinstance(s, Extern)]
    assert externs.count("complex") == packs, externs
