"""kn.linalg's LU family (lu, lu_factor, det, slogdet, inv, solve_triangular, lstsq) and
kn.fft against torch: values, gradients through the tape, and compiled."""

import numpy as np
import pytest

import kiln as kn
from kiln.frontend.dispatch import apply
from tests.torch_oracle import check_against_torch as _grads

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(11)


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_lu_and_lu_factor_match_torch():
    a = _x(3, 5, 5)
    P, L, U = kn.linalg.lu(kn.tensor(a))
    tP, tL, tU = torch.linalg.lu(torch.tensor(a))
    for k, t in ((P, tP), (L, tL), (U, tU)):
        np.testing.assert_allclose(k.numpy(), t.numpy(), rtol=1e-5, atol=1e-5)
    LU, piv = kn.linalg.lu_factor(kn.tensor(a))
    tLU, tpiv = torch.linalg.lu_factor(torch.tensor(a))
    np.testing.assert_allclose(LU.numpy(), tLU.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(piv.numpy(), tpiv.numpy())


def test_det_slogdet_inv_values_and_gradients():
    a = _x(2, 4, 4) + 3 * np.eye(4, dtype=np.float32)
    _grads(kn.linalg.det, torch.linalg.det, a)
    _grads(lambda m: kn.linalg.slogdet(m)[1], lambda m: torch.linalg.slogdet(m)[1], a)
    _grads(kn.linalg.inv, torch.linalg.inv, a)
    sign, _ = kn.linalg.slogdet(kn.tensor(a) * -1)
    np.testing.assert_array_equal(sign.numpy(), torch.linalg.slogdet(torch.tensor(-a))[0].numpy())
    det = kn.compile(lambda m: kn.linalg.det(m))
    np.testing.assert_allclose(det(kn.tensor(a)).numpy(), np.linalg.det(a), rtol=1e-4)
    with pytest.raises(kn.KilnShapeError, match="square"):
        kn.linalg.det(kn.ones(2, 3))


@pytest.mark.parametrize("upper,left,unit", [(True, True, False), (False, False, True),
                                             (False, True, False)])
def test_solve_triangular(upper, left, unit):
    a = np.triu(_x(4, 4)) if upper else np.tril(_x(4, 4))
    a = a + 4 * np.eye(4, dtype=np.float32)
    b = _x(4, 3) if left else _x(3, 4)
    _grads(lambda a, b: kn.linalg.solve_triangular(a, b, upper=upper, left=left, unitriangular=unit),
           lambda a, b: torch.linalg.solve_triangular(a, b, upper=upper, left=left,
                                                      unitriangular=unit), a, b)


@pytest.mark.parametrize("m,n", [(6, 4), (3, 5)])
def test_lstsq_tall_and_wide(m, n):
    a, b = _x(m, n), _x(m, 2)
    got = kn.linalg.lstsq(kn.tensor(a), kn.tensor(b)).solution.numpy()
    np.testing.assert_allclose(got, np.linalg.lstsq(a, b, rcond=None)[0], rtol=1e-4, atol=1e-5)
    if m >= n:
        _grads(lambda a, b: kn.linalg.lstsq(a, b).solution,
               lambda a, b: torch.linalg.lstsq(a, b).solution, a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name,kw", [("fft", {}), ("fft", dict(n=6)), ("ifft", dict(norm="ortho")),
                                     ("rfft", {}), ("rfft", dict(n=10, norm="forward")),
                                     ("fft2", {}), ("ifft2", {}), ("fftn", dict(dim=(0,)))])
def test_fft_family_matches_torch(name, kw):
    x = _x(3, 8)
    z = (x + 1j * _x(3, 8)).astype(np.complex64)
    for data in ((x, z) if name not in ("rfft",) else (x,)):
        got = getattr(kn.fft, name)(kn.tensor(data), **kw).numpy()
        want = getattr(torch.fft, name)(torch.tensor(data), **kw).resolve_conj().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    _grads(lambda x: apply("real", getattr(kn.fft, name)(x, **kw)) + 2 * apply("imag", getattr(kn.fft, name)(x, **kw)),
           lambda x: getattr(torch.fft, name)(x, **kw).real + 2 * getattr(torch.fft, name)(x, **kw).imag,
           x, atol=1e-4)


def test_irfft_shift_freq_and_compiled():
    x = _x(2, 9)
    spec = torch.fft.rfft(torch.tensor(x))
    for n in (None, 9, 7):
        np.testing.assert_allclose(kn.fft.irfft(kn.tensor(spec.numpy()), n=n).numpy(),
                                   torch.fft.irfft(spec, n=n).numpy(), rtol=1e-4, atol=1e-5)
    _grads(lambda x: kn.fft.irfft(kn.fft.rfft(x) * 2.0, n=9), lambda x: torch.fft.irfft(
        torch.fft.rfft(x) * 2.0, n=9), x)
    for fn in ("fftshift", "ifftshift"):
        np.testing.assert_array_equal(getattr(kn.fft, fn)(kn.tensor(x)).numpy(),
                                      getattr(torch.fft, fn)(torch.tensor(x)).numpy())
    np.testing.assert_allclose(kn.fft.fftfreq(7, 0.5).numpy(), torch.fft.fftfreq(7, 0.5).numpy())
    np.testing.assert_allclose(kn.fft.rfftfreq(8).numpy(), torch.fft.rfftfreq(8).numpy())
    power = kn.compile(lambda x: apply("real", kn.fft.rfft(x)) ** 2 + apply("imag", kn.fft.rfft(x)) ** 2)
    np.testing.assert_allclose(power(kn.tensor(x)).numpy(), np.abs(np.fft.rfft(x)) ** 2, rtol=1e-4,
                               atol=1e-4)
