"""`kn.fft`: torch.fft's discrete Fourier transforms (fft, ifft, rfft, irfft, fft2, ifft2,
fftn, ifftn, fftfreq, rfftfreq, fftshift, ifftshift).

A transform along one dim is a matrix product with the DFT's cosine and sine matrices
(built in float64, applied in the input's real dtype), on the real and imaginary parts,
then `complex(re, im)`: O(n^2) per dim rather than O(n log n), but every piece is a
registered op, so the transforms run eagerly, trace, compile and differentiate with the
registry's matmul and complex vjp rules. Results are complex64 (kiln's complex dtype).
`n` zero-pads or trims the input, `norm` is "backward" (default), "ortho" or "forward".

    >>> spec = kn.fft.rfft(signal)             # [..., n // 2 + 1] complex64
    >>> back = kn.fft.irfft(spec, n=signal.shape[-1])
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnArgumentError, KilnShapeError
from kiln.ir import dtypes as dt

_NORMS = (None, "backward", "ortho", "forward")


def _parts(x):
    """(real, imaginary or None) float parts of x."""
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import _tensor, to

    x = _tensor(x)
    if x.dtype.is_complex:
        return apply("real", x), apply("imag", x)
    return (x if x.dtype.is_floating else to(x, dt.float32)), None


def _scale(norm, n: int, inverse: bool) -> float:
    if norm not in _NORMS:
        raise KilnArgumentError(f"fft: norm must be 'backward', 'ortho' or 'forward', got {norm!r}")
    norm = norm or "backward"
    if norm == "ortho":
        return 1.0 / math.sqrt(n)
    return 1.0 / n if (norm == "backward") == inverse else 1.0


def _resize(t, n: int, dim: int):
    """t zero-padded or trimmed to length n along dim (torch's `n=`)."""
    from kiln.frontend.shape_ops import narrow, pad

    size = t.shape[dim]
    if not isinstance(size, int):
        raise KilnShapeError(f"fft: needs a static size along dim {dim}, got {list(t.shape)}")
    if size > n:
        return narrow(t, dim, 0, n)
    if size < n:
        widths = [0, 0] * (t.ndim - 1 - dim % t.ndim) + [0, n - size]
        return pad(t, widths)
    return t


def _matrix(values: np.ndarray, like):
    from kiln.frontend.factories import tensor

    return tensor(values.astype(like.dtype.np_dtype))


def _transform(x, n, dim: int, norm, inverse: bool, bins: int | None = None):
    """The (inverse) DFT of x along dim to length n, keeping the first `bins` outputs."""
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import _tensor

    x = _tensor(x)
    dim = dim % max(x.ndim, 1)
    n = x.shape[dim] if n is None else int(n)
    if not isinstance(n, int) or n <= 0:
        raise KilnArgumentError(f"fft: the transform length must be a positive static int, got {n}")
    re, im = _parts(x)
    re = _resize(re, n, dim).movedim(dim, -1)
    im = None if im is None else _resize(im, n, dim).movedim(dim, -1)
    k = n if bins is None else bins
    angle = 2.0 * np.pi * np.outer(np.arange(n), np.arange(k)) / n
    sign = 1.0 if inverse else -1.0
    scale = _scale(norm, n, inverse)
    cos, sin = _matrix(np.cos(angle) * scale, re), _matrix(sign * np.sin(angle) * scale, re)
    out_re, out_im = re @ cos, re @ sin  # x e^{sign i a} = (re + i im)(cos + i sin_signed)
    if im is not None:
        out_re, out_im = out_re - im @ sin, out_im + im @ cos
    from kiln.frontend.functional import to

    z = apply("complex", to(out_re, dt.float32), to(out_im, dt.float32))
    return z.movedim(-1, dim)


def fft(input, n: int | None = None, dim: int = -1, norm: str | None = None):
    """The one-dimensional discrete Fourier transform along `dim`."""
    return _transform(input, n, dim, norm, inverse=False)


def ifft(input, n: int | None = None, dim: int = -1, norm: str | None = None):
    """The inverse of `fft`."""
    return _transform(input, n, dim, norm, inverse=True)


def rfft(input, n: int | None = None, dim: int = -1, norm: str | None = None):
    """The DFT of a real signal: the n // 2 + 1 non-negative frequencies."""
    from kiln.frontend.functional import _tensor

    x = _tensor(input)
    if x.dtype.is_complex:
        raise KilnArgumentError("rfft: expects a real input; use kn.fft.fft for complex ones")
    length = x.shape[dim] if n is None else int(n)
    return _transform(x, length, dim, norm, inverse=False, bins=length // 2 + 1)


def irfft(input, n: int | None = None, dim: int = -1, norm: str | None = None):
    """The real signal of length n (default 2 * (bins - 1)) whose rfft is `input` (the
    imaginary parts of the zero and Nyquist bins are ignored, as torch)."""
    from kiln.frontend.functional import _tensor

    z = _tensor(input)
    dim = dim % max(z.ndim, 1)
    bins = z.shape[dim]
    n = 2 * (bins - 1) if n is None else int(n)
    if n <= 0:
        raise KilnArgumentError(f"irfft: the output length must be positive, got {n}")
    re, im = _parts(z)
    keep = n // 2 + 1
    re = _resize(re, keep, dim).movedim(dim, -1)
    im = None if im is None else _resize(im, keep, dim).movedim(dim, -1)
    weight = np.full(keep, 2.0)
    weight[0] = 1.0
    if n % 2 == 0:
        weight[-1] = 1.0
    angle = 2.0 * np.pi * np.outer(np.arange(keep), np.arange(n)) / n
    scale = _scale(norm, n, inverse=True)
    out = re @ _matrix(weight[:, None] * np.cos(angle) * scale, re)
    if im is not None:
        out = out - im @ _matrix(weight[:, None] * np.sin(angle) * scale, re)
    return out.movedim(-1, dim)


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
