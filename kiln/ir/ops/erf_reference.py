"""numpy references of erf and erfc (eager mode and the oracle of every test), vectorized.

numpy has no erf. float64 inputs take math.erf/math.erfc element by element (libm's,
within an ulp). float32 inputs (and float16/bfloat16, which `via_f32` widens to float32)
are computed in float64, vectorized (erf's Taylor series below 0.5, Chebyshev fits of
exp(x^2) erfc(x) on seven intervals of [0.5, 4), Laplace's continued fraction above; relative error < 2e-13,
measured), then every result within that error of a point where rounding to
float32, float16 or bfloat16 could go either way (a multiple of 2^-25 of its binade:
every midpoint of those grids is one) is recomputed with math.erf. So a float32 result
is exactly math.erf's rounded to float32, at ~1/10000 of the scalar calls (issue 22:
exact GELU ran `np.frompyfunc(math.erf)` over every element). Arrays of 4096 elements or
more of float32/float64 take `NATIVE` where a higher layer set it (the CPU's loop over
libm's erf, which math.erf is: the same values, ~10x faster).
"""

from __future__ import annotations

import math

import numpy as np

_ERF_TAYLOR = tuple(2 / math.sqrt(math.pi) * (-1) ** k / (math.factorial(k) * (2 * k + 1))
                    for k in range(12))
_ERF_REL_ERROR = 1e-12  # bound used for the exactness check; measured < 1e-13
_SERIES_BELOW = 0.5
_FIT_WIDTH, _FIT_TOP, _FIT_DEGREE = 0.5, 4.0, 11
_CONTINUED_TERMS = 16


def _scaled_erfc_fit(lo: float, hi: float) -> np.ndarray:
    """Power-basis coefficients in t = (x - mid) / half of a Chebyshev interpolant of
    exp(x^2) erfc(x) on [lo, hi] (smooth: degree 11 is within ~1e-15 on a width of 0.5),
    from math.erfc at the Chebyshev points: made once at import."""
    k = np.arange(_FIT_DEGREE + 1)
    t = np.cos(np.pi * (k + 0.5) / (_FIT_DEGREE + 1))
    xs = (lo + hi) / 2 + (hi - lo) / 2 * t
    ys = np.array([math.erfc(v) * math.exp(v * v) for v in xs])
    return np.polynomial.chebyshev.cheb2poly(np.polynomial.chebyshev.chebfit(t, ys, _FIT_DEGREE))


_FITS = tuple((lo, _scaled_erfc_fit(lo, lo + _FIT_WIDTH))
              for lo in np.arange(_SERIES_BELOW, _FIT_TOP, _FIT_WIDTH).tolist())
_FIT_TABLE = np.array([c for _, c in _FITS]).T.copy()  # [power, interval]


def _horner(t, coeffs):
    p = np.full_like(t, coeffs[-1])
    for c in coeffs[-2::-1]:
        p *= t
        p += c
    return p


def _erf_series(a):
    """erf(a) for |a| < 0.5: its Taylor series, 12 terms (Horner in a^2)."""
    return a * _horner(a * a, _ERF_TAYLOR)


def _erfc_fraction(a):
    """erfc(a) for a >= 4: Laplace's continued fraction, 16 terms from the tail."""
    f = a.copy()
    for n in range(_CONTINUED_TERMS, 0, -1):
        f = a + (n / 2) / f
    return np.exp(-a * a) / (math.sqrt(math.pi) * f)


def _erfc_positive(a):
    """erfc(a) for a >= 0.5 (or NaN): the fits on [0.5, 4), the continued fraction above.
    Each element's fit coefficients are gathered, so all fits run as one Horner pass."""
    out = np.empty_like(a)
    rest = ~(a < _FIT_TOP)  # NaN goes here and stays NaN
    if rest.any():
        out[rest] = _erfc_fraction(a[rest])
    mid = ~rest
    v = a[mid]
    slot = ((v - _SERIES_BELOW) * (1.0 / _FIT_WIDTH)).astype(np.intp)
    np.clip(slot, 0, len(_FITS) - 1, out=slot)
    t = (v - _SERIES_BELOW - slot * _FIT_WIDTH) * (2.0 / _FIT_WIDTH) - 1.0
    p = _FIT_TABLE[-1].take(slot)
    for row in _FIT_TABLE[-2::-1]:
        p *= t
        p += row.take(slot)
    out[mid] = p * np.exp(-v * v)
    return out


def _erf_pair(x):
    """(erf, erfc) of float64 `x`, vectorized, relative error < 2e-13."""
    x = np.asarray(x, dtype=np.float64)
    flat = x.reshape(-1)
    erf, erfc = np.empty_like(flat), np.empty_like(flat)
    small = np.abs(flat) < _SERIES_BELOW
    series = _erf_series(flat[small])
    erf[small], erfc[small] = series, 1.0 - series
    big = ~small
    xb = flat[big]
    tail = _erfc_positive(np.abs(xb))
    erf[big] = np.copysign(1.0 - tail, xb)
    erfc[big] = np.where(xb < 0, 2.0 - tail, tail)
    return erf.reshape(x.shape), erfc.reshape(x.shape)


def _round_as_scalar(y, x, scalar):
    """`y` with the results whose low-precision rounding is in doubt taken from `scalar`.

    In units of 2^-25 of y's binade (s), float32's midpoints are the odd integers,
    float16's the odd multiples of 2^13, bfloat16's of 2^16; other integers are values
    of the formats (1 - 1e-17 rounds to 1 in each: no doubt). Below float16's
    smallest normal, subnormal grids put midpoints anywhere on the integers."""
    m, _ = np.frexp(y)
    s = m * float(1 << 25)
    n = np.rint(s)
    near = np.abs(s - n) < float(1 << 25) * _ERF_REL_ERROR
    k = np.abs(np.nan_to_num(n)).astype(np.int64)
    midpoint = ((k & 1) == 1) | ((k & 0x3FFF) == 0x2000) | ((k & 0x1FFFF) == 0x10000) \
        | (np.abs(y) < 2.0 ** -14)
    doubt = near & midpoint & (y != 0)
    if doubt.any():
        y[doubt] = [scalar(v) for v in x[doubt].tolist()]
    return y


# elements per block: a block's ~20 float64 temporaries stay in L2 (one pass over
# memory, not one per operation: on a loaded machine 8 MB temporaries made it slower
# than the scalar loop)
_BLOCK = 16384


def _blockwise(x, which: int, scalar):
    flat = np.ascontiguousarray(x, dtype=np.float64).reshape(-1)
    out = np.empty_like(flat)
    with np.errstate(all="ignore"):
        for lo in range(0, flat.size, _BLOCK):
            part = flat[lo:lo + _BLOCK]
            out[lo:lo + _BLOCK] = _round_as_scalar(_erf_pair(part)[which], part, scalar)
    return out.reshape(np.shape(x))


# fn(x, "erf" | "erfc") -> the same values natively, or None: set by a higher layer (the
# CPU's libm loop, kiln/codegen/cpu/special_native.py, which kiln/frontend installs;
# kiln/ir imports nothing above it). math.erf is libm's erf, so that loop is exact too.
NATIVE = None


def erf_reference(x: np.ndarray) -> np.ndarray:
    """erf of a float array, as math.erf rounded to the dtype (float64: math.erf)."""
    if NATIVE is not None:
        out = NATIVE(x, "erf")
        if out is not None:
            return out
    if x.dtype == np.float64:
        return np.asarray(np.frompyfunc(math.erf, 1, 1)(x)).astype(np.float64)
    return _blockwise(x, 0, math.erf)


def erfc_reference(x: np.ndarray) -> np.ndarray:
    """erfc of a float array, as math.erfc rounded to the dtype (float64: math.erfc)."""
    # not 1 - erf(x): that would lose every digit for large x
    if NATIVE is not None:
        out = NATIVE(x, "erfc")
        if out is not None:
            return out
    if x.dtype == np.float64:
        return np.asarray(np.frompyfunc(math.erfc, 1, 1)(x)).astype(np.float64)
    return _blockwise(x, 1, math.erfc)
