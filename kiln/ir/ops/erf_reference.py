"""numpy references of erf and erfc (eager mode and the oracle of every test), vectorized.

numpy has no erf. float64 inputs take math.erf/math.erfc element by element (libm's,
within an ulp). float32 inputs (and float16/bfloat16, which `via_f32` widens to float32)
are computed in float64 by a vectorized series / continued fraction (relative error
< 2e-13, measured), then every result within that error of a point where rounding to
float32, float16 or bfloat16 could go either way (a multiple of 2^-25 of its binade:
every midpoint of those grids is one) is recomputed with math.erf. So a float32 result
is exactly math.erf's rounded to float32, at ~1/10000 of the scalar calls (issue 22:
exact GELU ran `np.frompyfunc(math.erf)` over every element).
"""

from __future__ import annotations

import math

import numpy as np

_ERF_TAYLOR = tuple(2 / math.sqrt(math.pi) * (-1) ** k / (math.factorial(k) * (2 * k + 1))
                    for k in range(40))
_ERF_REL_ERROR = 1e-12  # bound used for the exactness check; measured < 1.3e-13


def _erf_series(a):
    """erf(a) for |a| < 2: its Taylor series, 40 terms (Horner in a^2)."""
    z = a * a
    p = np.full_like(a, _ERF_TAYLOR[-1])
    for c in _ERF_TAYLOR[-2::-1]:
        p = p * z + c
    return a * p


def _erfc_fraction(a):
    """erfc(a) for a >= 2: Laplace's continued fraction, 40 terms from the tail."""
    f = a.copy()
    for n in range(40, 0, -1):
        f = a + (n / 2) / f
    return np.exp(-a * a) / (math.sqrt(math.pi) * f)


def _erf_pair(x):
    """(erf, erfc) of float64 `x`, vectorized, relative error < 2e-13."""
    a = np.abs(x)
    small = a < 2
    series = np.copysign(_erf_series(np.where(small, x, 0.0)), x)
    tail = _erfc_fraction(np.where(small, 2.0, a))
    erf = np.where(small, series, np.copysign(1.0 - tail, x))
    erfc = np.where(small, 1.0 - series, np.where(x < 0, 2.0 - tail, tail))
    return erf, erfc


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


def erf_reference(x: np.ndarray) -> np.ndarray:
    """erf of a float array, as math.erf rounded to the dtype (float64: math.erf)."""
    if x.dtype == np.float64:
        return np.asarray(np.frompyfunc(math.erf, 1, 1)(x)).astype(np.float64)
    x = x.astype(np.float64)
    with np.errstate(all="ignore"):
        return _round_as_scalar(_erf_pair(x)[0], x, math.erf)


def erfc_reference(x: np.ndarray) -> np.ndarray:
    """erfc of a float array, as math.erfc rounded to the dtype (float64: math.erfc)."""
    # not 1 - erf(x): that would lose every digit for large x
    if x.dtype == np.float64:
        return np.asarray(np.frompyfunc(math.erfc, 1, 1)(x)).astype(np.float64)
    x = x.astype(np.float64)
    with np.errstate(all="ignore"):
        return _round_as_scalar(_erf_pair(x)[1], x, math.erfc)
