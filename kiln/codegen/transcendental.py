"""Transcendental functions as Kernel IR arithmetic, for a backend without a math library.

The legalize pass (kiln/codegen/legalize.py) uses these when a backend's scalar table
lacks `exp`, `log`, `sin`, ... (tinygrad's `decomp/transcendental.py` is the model):
Cody-Waite range reduction, a polynomial on the reduced argument, and the exponent
put back or taken apart through the float's bits. Everything is built from add, sub,
mul, div, floor, compare, select, convert, bitcast_convert, and, or, abs, sqrt and
the unchecked integer division, all of which every backend has (natively or legalized).

Accuracy (float32, checked against numpy by tests/codegen/test_legalize.py): exp,
expm1, log, log1p, sin, cos, tanh, atan within a few ulp; sin/cos/tan reduce exactly
only while |x| < 1e5 (three-part pi/2); erf within ~1e-7 absolute. float64 uses longer
polynomials (exp, log, sin, cos, atan near float64 precision); its erf and `pow` (exp of
y log x) are float32-grade. A backend with a real math library declares the functions
native and never gets these. Low-precision floats compute in float32 and round once.
"""

from __future__ import annotations

import math

from kiln.codegen.kernel_ir import Const, Op
from kiln.ir import dtypes as dt
from kiln.ir.dtypes import DType

FUNCTIONS = ("exp", "expm1", "log", "log1p", "sin", "cos", "tan", "tanh", "sinh", "cosh",
             "atan", "asin", "acos", "atan2", "erf", "pow")


def _op(name, *args, dtype=None):
    from kiln.codegen.legalize import mk

    return mk(name, *args, dtype=dtype)


def _c(v, d):
    return Const(v, d)


def _horner(x, coeffs, d):
    """coeffs[0] + x * (coeffs[1] + x * (...))."""
    p = _c(coeffs[-1], d)
    for c in reversed(coeffs[:-1]):
        p = _op("add", _op("mul", p, x), _c(c, d))
    return p


def _is_nan(x):
    return _op("ne", x, x)


def _int_of(d: DType) -> DType:
    return dt.int64 if d == dt.float64 else dt.int32


def _pow2(k, d):
    """2**k for an integer-valued float k inside the normal exponent range."""
    it = _int_of(d)
    bias, mant = (1023, 52) if d == dt.float64 else (127, 23)
    biased = _op("add", _op("convert", k, dtype=it), bias)
    return _op("bitcast_convert", _op("mul", biased, 1 << mant), dtype=d)


# -- exp family ---------------------------------------------------------------------------

def _exp(x, d):
    f64 = d == dt.float64
    lo, hi = (-746.0, 710.0) if f64 else (-104.0, 89.0)
    ln2_hi, ln2_lo = (6.93147180369123816490e-01, 1.90821492927058770002e-10) if f64 else \
        (0.693145751953125, 1.42860682030941723212e-06)
    xc = _op("min", _op("max", x, lo), hi)
    n = _op("floor", _op("add", _op("mul", xc, 1.4426950408889634), 0.5))
    r = _op("sub", _op("sub", xc, _op("mul", n, ln2_hi)), _op("mul", n, ln2_lo))
    p = _horner(r, [1.0 / math.factorial(k) for k in range(14 if f64 else 8)], d)
    n1 = _op("floor", _op("mul", n, 0.5))
    n2 = _op("sub", n, n1)
    value = _op("mul", _op("mul", p, _pow2(n1, d)), _pow2(n2, d))
    return _op("select", _is_nan(x), x, value)


def _expm1(x, d):
    terms = 18 if d == dt.float64 else 10
    small = _op("mul", x, _horner(x, [1.0 / math.factorial(k + 1) for k in range(terms)], d))
    return _op("select", _op("lt", _op("abs", x), 0.5), small, _op("sub", _exp(x, d), 1.0))


# -- log family ---------------------------------------------------------------------------

def _log(x, d):
    f64 = d == dt.float64
    it = _int_of(d)
    tiny, scale, shift = (2.0 ** -1022, 2.0 ** 54, 54) if f64 else (2.0 ** -126, 2.0 ** 24, 24)
    exp_mask, mant_mask, one_bits, mant, bias = (
        (0x7FF0000000000000, 0x000FFFFFFFFFFFFF, 0x3FF0000000000000, 52, 1023) if f64 else
        (0x7F800000, 0x007FFFFF, 0x3F800000, 23, 127))
    sub = _op("lt", x, tiny)
    xs = _op("select", sub, _op("mul", x, scale), x)
    bits = _op("bitcast_convert", xs, dtype=it)
    e = _op("sub", _op("div_unchecked", _op("and", bits, exp_mask), 1 << mant), bias)
    e = _op("select", sub, _op("sub", e, shift), e)
    m = _op("bitcast_convert", _op("or", _op("and", bits, mant_mask), one_bits), dtype=d)
    big = _op("gt", m, math.sqrt(2.0))
    m = _op("select", big, _op("mul", m, 0.5), m)
    ef = _op("convert", _op("select", big, _op("add", e, 1), e), dtype=d)
    s = _op("div", _op("sub", m, 1.0), _op("add", m, 1.0))
    z = _op("mul", s, s)
    series = _horner(z, [2.0 / (2 * k + 1) for k in range(11 if f64 else 5)], d)
    ln2_hi, ln2_lo = (6.93147180369123816490e-01, 1.90821492927058770002e-10) if f64 else \
        (0.693145751953125, 1.42860682030941723212e-06)
    value = _op("add", _op("mul", ef, ln2_hi), _op("add", _op("mul", s, series), _op("mul", ef, ln2_lo)))
    value = _op("select", _op("eq", x, float("inf")), x, value)
    value = _op("select", _op("eq", x, 0.0), _c(-math.inf, d), value)
    return _op("select", _op("or", _op("lt", x, 0.0), _is_nan(x)), _c(math.nan, d), value)


def _log1p(x, d):
    u = _op("add", x, 1.0)
    ratio = _op("div", _op("mul", _log(u, d), x), _op("sub", u, 1.0))
    value = _op("select", _op("eq", u, 1.0), x, ratio)
    return _op("select", _op("eq", x, float("inf")), x, value)


# -- trigonometry ---------------------------------------------------------------------------

def _sin_cos(x, d):
    """(sin x, cos x, quadrant) pieces: polynomials on r = x - q pi/2 and q mod 4."""
    f64 = d == dt.float64
    parts = (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21) if f64 \
        else (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)
    q = _op("floor", _op("add", _op("mul", x, 2.0 / math.pi), 0.5))
    r = x
    for p in parts:
        r = _op("sub", r, _op("mul", q, p))
    z = _op("mul", r, r)
    n = 11 if f64 else 5
    sin_r = _op("mul", r, _horner(z, [(-1) ** k / math.factorial(2 * k + 1) for k in range(n)], d))
    cos_r = _horner(z, [(-1) ** k / math.factorial(2 * k) for k in range(n + 1)], d)
    it = _int_of(d)
    j = _op("and", _op("convert", _op("select", _is_nan(q), _c(0.0, d), q), dtype=it), 3)
    return sin_r, cos_r, j


def _quadrant(j, a, b, c, e):
    """a, b, c, e for j = 0, 1, 2, 3."""
    return _op("select", _op("eq", j, 0), a, _op("select", _op("eq", j, 1), b, _op("select", _op("eq", j, 2), c, e)))


def _sin(x, d):
    s, c, j = _sin_cos(x, d)
    return _quadrant(j, s, c, _op("neg", s), _op("neg", c))


def _cos(x, d):
    s, c, j = _sin_cos(x, d)
    return _quadrant(j, c, _op("neg", s), _op("neg", c), s)


def _tan(x, d):
    s, c, j = _sin_cos(x, d)
    odd = _op("ne", _op("and", j, 1), 0)
    return _op("select", odd, _op("neg", _op("div", c, s)), _op("div", s, c))


def _atan_unit(t, d):
    """atan(t) for t in [0, 1] (NaN passes through)."""
    f64 = d == dt.float64
    reduce = _op("gt", t, 0.41421356237309503)
    u = _op("select", reduce, _op("div", _op("sub", t, 1.0), _op("add", t, 1.0)), t)
    z = _op("mul", u, u)
    p = _op("mul", u, _horner(z, [(-1) ** k / (2 * k + 1) for k in range(21 if f64 else 9)], d))
    return _op("select", reduce, _op("add", p, math.pi / 4), p)


def _atan(x, d):
    a = _op("abs", x)
    inv = _op("gt", a, 1.0)
    v = _atan_unit(_op("select", inv, _op("div", 1.0, a), a), d)
    v = _op("select", inv, _op("sub", _c(math.pi / 2, d), v), v)
    v = _op("select", _op("lt", x, 0.0), _op("neg", v), v)
    return _op("select", _is_nan(x), x, v)


def _signbit(x, d):
    """x < 0, -0 and negative NaN included (the sign bit)."""
    return _op("lt", _op("bitcast_convert", x, dtype=_int_of(d)), 0)


def _atan2(y, x, d):
    ay, ax = _op("abs", y), _op("abs", x)
    swap = _op("gt", ay, ax)
    num, den = _op("select", swap, ax, ay), _op("select", swap, ay, ax)
    both_zero = _op("and", _op("eq", ay, 0.0), _op("eq", ax, 0.0))
    both_inf = _op("and", _op("eq", ay, float("inf")), _op("eq", ax, float("inf")))
    t = _op("select", both_zero, _c(0.0, d), _op("select", both_inf, _c(1.0, d), _op("div", num, den)))
    a = _atan_unit(t, d)
    a = _op("select", swap, _op("sub", _c(math.pi / 2, d), a), a)
    a = _op("select", _signbit(x, d), _op("sub", _c(math.pi, d), a), a)  # atan2(0, -0) = pi
    a = _op("select", _signbit(y, d), _op("neg", a), a)
    return _op("select", _op("or", _is_nan(x), _is_nan(y)), _op("add", x, y), a)


def _asin(x, d):
    return _atan2(x, _op("sqrt", _op("mul", _op("sub", 1.0, x), _op("add", x, 1.0))), d)


def _acos(x, d):
    return _atan2(_op("sqrt", _op("mul", _op("sub", 1.0, x), _op("add", x, 1.0))), x, d)


# -- hyperbolic, erf, pow -----------------------------------------------------------------------

def _copysign_of(x, v):
    return _op("select", _op("lt", x, 0.0), _op("neg", v), v)


def _tanh(x, d):
    a = _op("abs", x)
    t = _expm1(_op("add", a, a), d)
    v = _op("select", _op("gt", a, 40.0 if d == dt.float64 else 20.0), _c(1.0, d),
            _op("div", t, _op("add", t, 2.0)))
    return _op("select", _is_nan(x), x, _copysign_of(x, v))


def _sinh(x, d):
    a = _op("abs", x)
    t = _expm1(a, d)
    v = _op("mul", _op("add", t, _op("div", t, _op("add", t, 1.0))), 0.5)
    v = _op("select", _op("eq", t, float("inf")), t, v)
    return _op("select", _is_nan(x), x, _copysign_of(x, v))


def _cosh(x, d):
    e = _exp(_op("abs", x), d)
    return _op("mul", _op("add", e, _op("div", 1.0, e)), 0.5)


# Numerical Recipes' erfc (Chebyshev fit; fractional error < 1.2e-7 everywhere)
ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
               -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _erf(x, d):
    a = _op("abs", x)
    t = _op("div", 1.0, _op("add", _op("mul", a, 0.5), 1.0))
    tail = _op("mul", t, _exp(_op("add", _op("neg", _op("mul", a, a)), _horner(t, list(ERFC_COEFFS), d)), d))
    big = _copysign_of(x, _op("sub", 1.0, tail))
    n = 12 if d == dt.float64 else 7
    coeffs = [2 / math.sqrt(math.pi) * (-1) ** k / (math.factorial(k) * (2 * k + 1)) for k in range(n)]
    small = _op("mul", x, _horner(_op("mul", x, x), coeffs, d))
    return _op("select", _op("lt", a, 0.5), small, _op("select", _is_nan(x), x, big))


def _pow(x, y, d):
    r = _exp(_op("mul", y, _log(_op("abs", x), d)), d)
    y_int = _op("eq", _op("floor", y), y)
    half = _op("mul", y, 0.5)
    y_odd = _op("and", y_int, _op("ne", _op("floor", half), half))
    neg = _op("lt", x, 0.0)
    r = _op("select", _op("and", neg, y_odd), _op("neg", r), r)
    r = _op("select", _op("and", neg, _op("not", y_int)), _c(math.nan, d), r)
    one = _op("or", _op("eq", y, 0.0), _op("eq", x, 1.0))
    return _op("select", one, _c(1.0, d), r)


_UNARY = {"exp": _exp, "expm1": _expm1, "log": _log, "log1p": _log1p, "sin": _sin, "cos": _cos,
          "tan": _tan, "tanh": _tanh, "sinh": _sinh, "cosh": _cosh, "atan": _atan, "asin": _asin,
          "acos": _acos, "erf": _erf}
_BINARY = {"atan2": _atan2, "pow": _pow}


def expand(op: str, args: tuple, out: DType):
    """`op(args)` as arithmetic, or None when `op` is not a float transcendental here."""
    if op not in _UNARY and op not in _BINARY:
        return None
    if not out.is_floating or any(not a.dtype.is_floating for a in args):
        return None
    work = dt.float64 if out == dt.float64 else dt.float32
    wide = tuple(a if a.dtype == work else Op("convert", (a,), work) for a in args)
    value = _UNARY[op](*wide, work) if op in _UNARY else _BINARY[op](*wide, work)
    return value if out == work else Op("convert", (value,), out)
