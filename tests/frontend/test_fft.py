"""kn.fft as real FFTs (pocketfft extern ops, kiln/ir/ops/fft.py): values against numpy's
float64 transforms over lengths including primes and 2^16 in every norm, eager and
compiled (an extern step, also under kn.capture), gradients by finite differences and
against torch (complex inputs), and the errors of bad arguments."""

import numpy as np
import pytest

import kiln as kn
from kiln.frontend.dispatch import apply

RNG = np.random.default_rng(20)
NORMS = (None, "backward", "ortho", "forward")
LENGTHS = (1, 2, 7, 97, 128, 1000, 4099, 1 << 16)


def _real(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _cplx(*shape):
    return (RNG.standard_normal(shape) + 1j * RNG.standard_normal(shape)).astype(np.complex64)


def _close(got, want, tol=2e-6):
    """float32 accuracy relative to the transform's magnitude (an O(n^2) DFT in float32
    misses this by orders of magnitude at 2^16)."""
    got = np.asarray(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(np.abs(want).max(), 1e-30)
    assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("norm", NORMS)
def test_values_match_numpy_float64(n, norm):
    x, z = _real(3, n) if n < 4096 else _real(n), _cplx(2, n) if n < 4096 else _cplx(n)
    x64, z64 = x.astype(np.float64), z.astype(np.complex128)
    got = kn.fft.fft(kn.tensor(z), norm=norm)
    assert got.dtype == kn.complex64
    _close(got.numpy(), np.fft.fft(z64, norm=norm))
    _close(kn.fft.ifft(kn.tensor(z), norm=norm).numpy(), np.fft.ifft(z64, norm=norm))
    _close(kn.fft.fft(kn.tensor(x), norm=norm).numpy(), np.fft.fft(x64, norm=norm))
    spec = kn.fft.rfft(kn.tensor(x), norm=norm)
    _close(spec.numpy(), np.fft.rfft(x64, norm=norm))
    half = np.fft.rfft(x64)
    back = kn.fft.irfft(kn.tensor(half.astype(np.complex64)), n=n, norm=norm)
    assert back.dtype == kn.float32
    _close(back.numpy(), np.fft.irfft(half, n=n, norm=norm))


@pytest.mark.parametrize("fn,kw", [("fft", dict(n=12)), ("fft", dict(n=5, dim=0)),
                                   ("ifft", dict(n=9, dim=1, norm="ortho")),
                                   ("rfft", dict(n=11)), ("rfft", dict(n=4, dim=0)),
                                   ("irfft", dict(n=15)), ("irfft", dict(n=6, dim=0)),
                                   ("fft2", {}), ("ifft2", dict(s=(4, 16))),
                                   ("fftn", dict(dim=(0, 2), norm="forward"))])
def test_n_dim_and_multi_dim_forms(fn, kw):
    data = _cplx(6, 10, 3) if fn != "rfft" else _real(6, 10, 3)
    if fn in ("fft2", "ifft2", "fftn"):
        npfn = getattr(np.fft, fn)
        kw_np = {("axes" if k == "dim" else k): v for k, v in kw.items()}
    else:
        npfn = getattr(np.fft, fn)
        kw_np = {("axis" if k == "dim" else k): v for k, v in kw.items()}
        kw_np.setdefault("axis", -1)
        kw.setdefault("dim", -1)
    want = npfn(data.astype(np.complex128 if data.dtype.kind == "c" else np.float64), **kw_np)
    _close(getattr(kn.fft, fn)(kn.tensor(data), **kw).numpy(), want)


def test_exported_fft_saves_and_loads(tmp_path):
    def f(x):
        return kn.fft.irfft(kn.fft.rfft(x, norm="ortho") * 2, n=9, norm="ortho")

    x = _real(3, 9)
    kn.export(f, (x,)).save(tmp_path / "f.kir")
    loaded = kn.load(tmp_path / "f.kir")
    assert "rfft(" in str(loaded.graph) and 'norm="ortho"' in str(loaded.graph)
    _close(loaded(x).numpy(), 2 * x.astype(np.float64))


def test_compiled_is_an_extern_fft_and_captures():
    def power(x):
        spec = kn.fft.rfft(x, norm="ortho")
        return apply("real", spec) ** 2 + apply("imag", spec) ** 2

    x = _real(4, 4099)
    f = kn.compile(power)
    want = np.abs(np.fft.rfft(x.astype(np.float64), norm="ortho")) ** 2
    _close(f(x).numpy(), want, tol=5e-6)
    graph = f.compiled_graphs()[0]
    ops = {n.op for n in graph.optimized.nodes}
    assert "rfft" in ops and "dot_general" not in ops
    steps = [getattr(s, "op", None) for s in graph.program.steps]
    assert "rfft" in steps
    replay = kn.capture(power, x)
    _close(replay(x).numpy(), want, tol=5e-6)
    roundtrip = kn.compile(lambda z: kn.fft.ifft(kn.fft.fft(z, norm="forward"), norm="forward"))
    z = _cplx(3, 64)
    _close(roundtrip(z).numpy(), z.astype(np.complex128))


def _fd_grad(loss, x, eps=1e-3):
    x = x.astype(np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        g[i] = (loss(up) - loss(down)) / (2 * eps)
    return g


@pytest.mark.parametrize("n", [5, 8])
@pytest.mark.parametrize("norm", NORMS)
def test_gradients_by_finite_differences(n, norm):
    x = _real(2, n)
    w = _real(2, n // 2 + 1)
    w2 = _real(2, n)

    def k_loss(t):  # quadratic: central differences are exact up to rounding
        spec = kn.fft.rfft(t, norm=norm)
        full = kn.fft.ifft(t * 1.5, norm=norm)
        back = kn.fft.irfft(spec * 0.5, n=n, norm=norm)
        return ((apply("real", spec) ** 2 + 3 * apply("imag", spec)) * kn.tensor(w)).sum() + \
            (apply("imag", full) * kn.tensor(w2)).sum() + (back ** 2 * kn.tensor(w2)).sum()

    def np_loss(t):
        spec = np.fft.rfft(t, norm=norm)
        full = np.fft.ifft(t * 1.5, norm=norm)
        back = np.fft.irfft(spec * 0.5, n=n, norm=norm)
        return ((spec.real ** 2 + 3 * spec.imag) * w).sum() + (full.imag * w2).sum() + \
            (back ** 2 * w2).sum()

    want = _fd_grad(np_loss, x)
    np.testing.assert_allclose(kn.grad(k_loss)(kn.tensor(x)).numpy(), want, rtol=1e-4, atol=1e-4)
    compiled = kn.compile(kn.grad(k_loss))
    np.testing.assert_allclose(compiled(x).numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fn,kw", [("fft", {}), ("ifft", dict(norm="ortho")), ("fft", dict(n=7)),
                                   ("irfft", dict(n=9)), ("irfft", dict(n=10, norm="forward")),
                                   ("fft2", {})])
def test_complex_input_gradients_match_torch(fn, kw):
    torch = pytest.importorskip("torch")
    z = _cplx(3, 6)
    r = _real(*getattr(torch.fft, fn)(torch.tensor(z), **kw).shape)
    kz = kn.tensor(z)

    def k_loss(t):
        out = getattr(kn.fft, fn)(t, **kw)
        if out.dtype == kn.complex64:
            out = apply("real", out) + 2 * apply("imag", out)
        return (out * kn.tensor(r)).sum()

    tz = torch.tensor(z, requires_grad=True)
    out = getattr(torch.fft, fn)(tz, **kw)
    if out.is_complex():
        out = out.real + 2 * out.imag
    (out * torch.tensor(r)).sum().backward()
    got = kn.grad(k_loss)(kz).numpy()
    np.testing.assert_allclose(got, tz.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_bad_arguments_are_numbered_errors():
    x = kn.tensor(_real(4))
    with pytest.raises(kn.KilnArgumentError, match="norm"):
        kn.fft.fft(x, norm="both")
    with pytest.raises(kn.KilnArgumentError, match="real input"):
        kn.fft.rfft(kn.tensor(_cplx(4)))
    with pytest.raises(kn.KilnArgumentError, match="positive int"):
        kn.fft.fft(x, n=0)
    with pytest.raises(kn.KilnError, match="dim"):
        kn.fft.fft(x, dim=3)
    with pytest.raises(kn.KilnShapeError, match="scalar"):
        kn.fft.fft(kn.tensor(1.0))
