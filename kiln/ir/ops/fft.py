"""Fast Fourier transforms along one axis: extern calls into numpy's pocketfft.

Three ops cover torch.fft's family (the frontend, kiln/frontend/fft.py, composes them
over axes and handles `n=` by padding or trimming first):

- `fft`  complex64 -> complex64, the same shape: the DFT (`inverse=False`) or its inverse;
- `rfft` real -> complex64, the axis becomes n // 2 + 1 long: the non-negative frequencies;
- `irfft` complex64 [.., n // 2 + 1, ..] -> float32 [.., n, ..]: the real signal of length
  `n` with that half spectrum (the imaginary parts of the zero and Nyquist bins ignored).

`norm` is torch's (and numpy's): "backward" scales the inverse by 1/n, "forward" the
forward transform, "ortho" both by 1/sqrt(n). Eagerly and in compiled programs (an
extern step, as LAPACK's calls run) they are `numpy.fft` — O(n log n) for every n,
primes included (pocketfft's Bluestein) — computed in complex128 and rounded once to
complex64, the way kiln's other externs keep float32 results accurate.

vjp rules are the adjoint transforms, with torch's conventions for complex cotangents
(conjugate-linear): an `fft` pulls back through the inverse `fft` with the dual norm
(backward <-> forward, ortho itself); `rfft` through the inverse `fft` of the cotangent
zero-padded to n, real part; `irfft` through `rfft` of the cotangent with the bins that
stand for two conjugate entries doubled (torch's fft_c2r_backward).
"""

from __future__ import annotations

import numpy as np
import sympy

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.registry import EXTERN, REQUIRED, defop
from kiln.ir.sharding import shard_dims, sharding_rule
from kiln.ir.shapes import dim, normalize_axis

NORMS = ("backward", "ortho", "forward")
_DUAL = {"backward": "forward", "forward": "backward", "ortho": "ortho"}


def _check(op, x, axis, norm):
    if norm not in NORMS:
        raise KilnArgumentError(f"{op}: norm must be 'backward', 'ortho' or 'forward', got {norm!r}")
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise KilnArgumentError(f"{op}: axis must be an int, got {axis!r}")
    if x.rank == 0:
        raise KilnShapeError(f"{op}: needs at least one dim, got the scalar {x}")
    return normalize_axis(op, axis, x.rank, "axis")


def _length(op, size, what):
    if isinstance(size, int) and size < 1:
        raise KilnShapeError(f"{op}: the transform length along the axis must be >= 1, {what} is {size}")


def _with_axis(t, axis, size):
    shape = list(t.shape)
    shape[axis] = size
    return t.with_shape(tuple(shape))


def _fft_type(op, x, *, axis, inverse, norm):
    axis = _check(op, x, axis, norm)
    if x.dtype != dt.complex64:
        raise KilnDTypeError(f"{op}: takes a complex64 operand, got {x} (kn.fft.fft converts real "
                             "inputs first)")
    if not isinstance(inverse, bool):
        raise KilnArgumentError(f"{op}: inverse must be a bool, got {inverse!r}")
    _length(op, x.shape[axis], "the input's")
    return x


@defop("fft", family="fft", kind=EXTERN, num_operands=1,
       attrs={"axis": REQUIRED, "inverse": False, "norm": "backward"})
class fft:
    """The discrete Fourier transform of a complex64 tensor along `axis` (or its inverse)."""

    type = _fft_type

    def reference(x, *, axis, inverse, norm):
        transform = np.fft.ifft if inverse else np.fft.fft
        return transform(x.astype(np.complex128), axis=axis, norm=norm).astype(np.complex64)

    def vjp(b, cts, xs, ys, *, axis, inverse, norm):
        return [b.fft(cts[0], axis=axis, inverse=not inverse, norm=_DUAL[norm])]


@sharding_rule("fft")
def _fft_sharding(spec):
    axis = spec.attrs["axis"] % spec.ndim
    return shard_dims(spec, [d for d in range(spec.ndim) if d != axis])


def _rfft_type(op, x, *, axis, norm):
    axis = _check(op, x, axis, norm)
    if not x.dtype.is_floating:
        raise KilnDTypeError(f"{op}: takes a real float operand, got {x} (use fft for complex "
                             "inputs)")
    n = x.shape[axis]
    _length(op, n, "the input's")
    bins = n // 2 + 1 if isinstance(n, int) else dim(sympy.floor(n / 2) + 1)
    return _with_axis(x, axis, bins).with_dtype(dt.complex64)


@defop("rfft", family="fft", kind=EXTERN, num_operands=1, attrs={"axis": REQUIRED, "norm": "backward"})
class rfft:
    """The DFT of a real tensor along `axis`: its n // 2 + 1 non-negative frequencies."""

    type = _rfft_type

    def reference(x, *, axis, norm):
        return np.fft.rfft(x.astype(np.float64), axis=axis, norm=norm).astype(np.complex64)

    def vjp(b, cts, xs, ys, *, axis, norm):
        """Re(F^H g~) with g~ the cotangent zero-padded from n // 2 + 1 bins to n."""
        x = b.type_of(xs[0])
        axis = axis % x.rank
        n, g = x.shape[axis], cts[0]
        bins = b.type_of(g).shape[axis]
        if not isinstance(n, int):
            raise KilnShapeError("rfft: its gradient needs a static length along the axis, got "
                                 f"{n}; make that dim static")
        low, high = [0] * x.rank, [0] * x.rank
        high[axis] = n - bins
        zero = b.complex(b.full(0.0, dt.float32), b.full(0.0, dt.float32))
        padded = b.pad(g, zero, low=tuple(low), high=tuple(high), interior=None)
        full = b.fft(padded, axis=axis, inverse=True, norm=_DUAL[norm])
        return [b.convert(b.real(full), x.dtype)]


sharding_rule("rfft")(_fft_sharding)


def _irfft_type(op, x, *, axis, n, norm):
    axis = _check(op, x, axis, norm)
    if x.dtype != dt.complex64:
        raise KilnDTypeError(f"{op}: takes a complex64 half spectrum, got {x}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise KilnArgumentError(f"{op}: the output length n must be an int >= 1, got {n!r}")
    bins = x.shape[axis]
    if isinstance(bins, int) and bins != n // 2 + 1:
        raise KilnShapeError(f"{op}: a length-{n} signal has {n // 2 + 1} bins, the operand {x} "
                             f"has {bins} along axis {axis} (kn.fft.irfft pads or trims first)")
    return _with_axis(x, axis, n).with_dtype(dt.float32)


@defop("irfft", family="fft", kind=EXTERN, num_operands=1,
       attrs={"axis": REQUIRED, "n": REQUIRED, "norm": "backward"})
class irfft:
    """The real signal of length n along `axis` whose rfft is the half spectrum operand."""

    type = _irfft_type

    def reference(x, *, axis, n, norm):
        return np.fft.irfft(x.astype(np.complex128), n=n, axis=axis, norm=norm).astype(np.float32)

    def vjp(b, cts, xs, ys, *, axis, n, norm):
        """rfft of the cotangent (dual norm), bins 1 .. n - (n // 2 + 1) doubled: each
        stands for itself and its conjugate mirror in the full spectrum."""
        t = b.type_of(xs[0])
        axis = axis % t.rank
        g = b.rfft(b.convert(cts[0], dt.float32), axis=axis, norm=_DUAL[norm])
        bins = n // 2 + 1
        weight = np.ones(bins, np.float32)
        weight[1:n - bins + 1] = 2.0
        shape = b.type_of(g).shape
        w = b.broadcast_in_dim(b.constant(weight), shape=shape, broadcast_dimensions=(axis,))
        w = b.complex(w, b.full(0.0, dt.float32, shape))
        return [b.mul(g, w)]


sharding_rule("irfft")(_fft_sharding)
