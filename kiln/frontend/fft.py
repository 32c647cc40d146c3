"""`kn.fft`: torch.fft's discrete Fourier transforms (fft, ifft, rfft, irfft, fft2, ifft2,
fftn, ifftn, fftfreq, rfftfreq, fftshift, ifftshift).

Each one-dimensional transform is one op of kiln/ir/ops/fft.py, run by numpy's
pocketfft (O(n log n) for every length, primes included), eagerly and as an extern step
of compiled programs, with the adjoint transforms as vjp rules, so `kn.grad`,
`.backward()` and `kn.compile` all work. Results are complex64 (kiln's complex dtype;
torch gives complex128 for float64 inputs) and irfft's are float32. `n` zero-pads or
trims the input along the dim first, `norm` is "backward" (default), "ortho" or
"forward"; fftn/fft2 transform one dim after another.

    >>> spec = kn.fft.rfft(signal)             # [..., n // 2 + 1] complex64
    >>> back = kn.fft.irfft(spec, n=signal.shape[-1])
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnArgumentError, KilnShapeError
from kiln.ir import dtypes as dt

_NORMS = (None, "backward", "ortho", "forward")


def _norm(norm, op: str) -> str:
    if norm not in _NORMS:
        raise KilnArgumentError(f"{op}: norm must be 'backward', 'ortho' or 'forward', got {norm!r}")
    return norm or "backward"


def _real(x):
    """x as a real float tensor (integers and bools compute in float32, as torch)."""
    from kiln.frontend.functional import to

    return x if x.dtype.is_floating else to(x, dt.float32)


def _complex(x):
    """x as complex64 (a real x gets a zero imaginary part)."""
    from kiln.frontend.dispatch import apply
    from kiln.frontend.factories import zeros_like
    from kiln.frontend.functional import to

    if x.dtype.is_complex:
        return x
    re = to(_real(x), dt.float32)
    return apply("complex", re, zeros_like(re))


def _axis(x, dim, op: str) -> int:
    from kiln.ir.shapes import normalize_axis

    if x.ndim == 0:
        raise KilnShapeError(f"{op}: needs a tensor with at least one dim, got a scalar")
    return normalize_axis(op, dim, x.ndim, "dim")


def _resize(t, n: int, dim: int, op: str):
    """t zero-padded or trimmed to length n along dim (torch's `n=`)."""
    from kiln.frontend.shape_ops import narrow, pad

    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise KilnArgumentError(f"{op}: the transform length n must be a positive int, got {n!r}")
    n = int(n)
    size = t.shape[dim]
    if not isinstance(size, int):
        raise KilnShapeError(f"{op}: n= pads or trims dim {dim}, which needs a static size; got "
                             f"{list(t.shape)}")
    if size > n:
        return narrow(t, dim, 0, n)
    if size < n:
        if t.dtype.is_complex:
            from kiln.frontend.dispatch import apply

            return apply("complex", _resize(apply("real", t), n, dim, op),
                         _resize(apply("imag", t), n, dim, op))
        return pad(t, [0, 0] * (t.ndim - 1 - dim) + [0, n - size])
    return t


def _c2c(input, n, dim: int, norm, inverse: bool, op: str):
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import _tensor

    x = _tensor(input)
    axis = _axis(x, dim, op)
    norm = _norm(norm, op)
    x = _complex(x)
    if n is not None:
        x = _resize(x, n, axis, op)
    return apply("fft", x, axis=axis, inverse=inverse, norm=norm)


def fft(input, n: int | None = None, dim: int = -1, norm: str | None = None):
    """The one-dimensional discrete Fourier transform along `dim` (torch.fft.fft).

    >>> kn.fft.fft(kn.tensor([1.0, 0.0, 0.0, 0.0])).numpy()   # [1, 1, 1, 1] complex64
    """
    return _c2c(input, n, dim, norm, False, "fft")


def ifft(input, n: int | None = None, dim: int = -1, norm: str | None = None):
    """The inverse of `fft` (torch.fft.ifft)."""
    return _c2c(input, n, dim, norm, True, "ifft")


def rfft(input, n: int | None = None, dim: int = -1, norm: str | None = None):
    """The DFT of a real signal: the n // 2 + 1 non-negative frequencies (torch.fft.rfft)."""
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import _tensor

    x = _tensor(input)
    if x.dtype.is_complex:
        raise KilnArgumentError("rfft: expects a real input; use kn.fft.fft for complex ones")
    axis = _axis(x, dim, "rfft")
    norm = _norm(norm, "rfft")
    x = _real(x)
    if n is not None:
        x = _resize(x, n, axis, "rfft")
    return apply("rfft", x, axis=axis, norm=norm)


def irfft(input, n: int | None = None, dim: int = -1, norm: str | None = None):
    """The real signal of length n (default 2 * (bins - 1)) whose rfft is `input` (the
    imaginary parts of the zero and Nyquist bins are ignored, as torch)."""
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import _tensor

    z = _tensor(input)
    axis = _axis(z, dim, "irfft")
    norm = _norm(norm, "irfft")
    bins = z.shape[axis]
    if n is None:
        if not isinstance(bins, int):
            raise KilnShapeError(f"irfft: the output length depends on the symbolic size {bins}; "
                                 "pass n= explicitly")
        n = 2 * (bins - 1)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise KilnArgumentError(f"irfft: the output length must be a positive int, got {n!r}")
    n = int(n)
    z = _resize(_complex(z), n // 2 + 1, axis, "irfft")
    return apply("irfft", z, axis=axis, n=n, norm=norm)


def _dims(x, s, dim, op):
    if dim is None:
        dim = tuple(range(-len(s), 0)) if s is not None else tuple(range(x.ndim))
    dim = tuple(dim)
    s = (None,) * len(dim) if s is None else tuple(s)
    if len(s) != len(dim):
        raise KilnArgumentError(f"{op}: s and dim must have the same length")
    return s, dim


def fftn(input, s=None, dim=None, norm: str | None = None):
    from kiln.frontend.functional import _tensor

    x = _tensor(input)
    s, dim = _dims(x, s, dim, "fftn")
    for size, d in zip(s, dim):
        x = fft(x, size, d, norm)
    return x


def ifftn(input, s=None, dim=None, norm: str | None = None):
    from kiln.frontend.functional import _tensor

    x = _tensor(input)
    s, dim = _dims(x, s, dim, "ifftn")
    for size, d in zip(s, dim):
        x = ifft(x, size, d, norm)
    return x


def fft2(input, s=None, dim=(-2, -1), norm: str | None = None):
    """The DFT over the last two dims."""
    return fftn(input, s, dim, norm)


def ifft2(input, s=None, dim=(-2, -1), norm: str | None = None):
    return ifftn(input, s, dim, norm)


def fftfreq(n: int, d: float = 1.0, *, dtype=None, device=None):
    """The sample frequencies of an n-point fft: [0, 1, ..., -1] / (d * n)."""
    from kiln.frontend.factories import tensor

    return tensor(np.fft.fftfreq(n, d), dtype=dtype or dt.float32, device=device)


def rfftfreq(n: int, d: float = 1.0, *, dtype=None, device=None):
    from kiln.frontend.factories import tensor

    return tensor(np.fft.rfftfreq(n, d), dtype=dtype or dt.float32, device=device)


def _roll_half(x, dim, up: bool):
    from kiln.frontend.functional import _tensor
    from kiln.frontend.shape_ops import cat, narrow

    x = _tensor(x)
    dims = range(x.ndim) if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
    for d in dims:
        size = x.shape[d]
        shift = size // 2 if up else size - size // 2
        if shift % size:
            x = cat([narrow(x, d, size - shift, shift), narrow(x, d, 0, size - shift)], dim=d)
    return x


def fftshift(input, dim=None):
    """Move the zero frequency to the middle (torch.fft.fftshift)."""
    return _roll_half(input, dim, up=True)


def ifftshift(input, dim=None):
    return _roll_half(input, dim, up=False)
