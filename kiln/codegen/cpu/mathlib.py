"""Vectorizable transcendentals as `alwaysinline` LLVM functions built from arithmetic.

There is no vector math library on this machine: a call to `expf` inside a loop keeps the
loop scalar. So float32 functions are straight-line arithmetic (selects, no branches)
that the loop vectorizer widens after inlining. Two implementations:

- float32-native (mathlib_f32.py) for the hot functions `exp expm1 log log1p tanh erf`:
  Cody-Waite reduction and float32 minimax polynomials, full-width float32 vectors,
  within ~2 ulp (measured by tests/codegen/test_cpu_mathlib.py).
- float64-internal (this file) for the others, and for all of them under
  `float32_math("double")`: range reduction plus Taylor/Chebyshev polynomials accurate
  to ~1e-11 in float64, then one rounding (correctly rounded on every tested input, at
  half the vector width). sin/cos/tan reduce exactly for every float32 argument
  (Payne-Hanek in float64 pieces, see `_reduce_quadrant`).

float64 transcendentals call glibc's libm (< 1 ulp); the cost is that a float64 loop
containing one does not vectorize (documented in docs/cpu-backend.md).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import mpmath
import numpy as np
from numpy.polynomial import chebyshev

from kiln.codegen.cpu import mathlib_f32
from kiln.codegen.cpu.ir_builder import Fn, Module, V, const

F32_FUNCS = ("exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos", "atan",
             "atan2", "sinh", "cosh", "tanh", "erf", "pow")
LIBM_F64 = {n: n for n in F32_FUNCS}

# the default of CpuOptions.f32_math for options made while `float32_math` is active:
# "native" (mathlib_f32 where it has the function) or "double" (float64-internal)
_F32_DEFAULT = ["native"]


def default_f32_math() -> str:
    """What `CpuOptions()` takes for `f32_math` when none is given."""
    return _F32_DEFAULT[0]


@contextmanager
def float32_math(mode: str):
    """Inside the block, new `CpuOptions()` default to f32_math=`mode`: "native" or
    "double" (float64-internal, correctly rounded, half the vector width) -- for accuracy
    comparisons and benchmarks. Code generation reads only the options (whose text is in
    the artifact-cache key), so make a fresh CpuBackend inside the block, or pass
    `CpuOptions(f32_math=...)` directly."""
    if mode not in ("native", "double"):
        raise ValueError(f"float32_math: mode must be 'native' or 'double', got {mode!r}")
    saved = _F32_DEFAULT[0]
    _F32_DEFAULT[0] = mode
    try:
        yield
    finally:
        _F32_DEFAULT[0] = saved

_LN2 = math.log(2.0)
with mpmath.workprec(600):
    _LN2_LO = float(mpmath.log(2) - mpmath.mpf(_LN2))
    # 2/pi to 500 bits (as an integer numerator over 2^500), for exact trig reduction
    _TWO_OVER_PI_NBITS = 500
    _TWO_OVER_PI_BITS = int(mpmath.floor(2 / mpmath.pi * mpmath.mpf(2) ** _TWO_OVER_PI_NBITS))


def _two_over_pi_chunks(n: int, bits: int = 24) -> list[float]:
    """2/pi split into `n` doubles of `bits` significant bits each, so x * chunk is
    exact in float64 for any float32 x (24 + 24 <= 53)."""
    total = _TWO_OVER_PI_BITS
    chunks = []
    for i in range(n):
        shift = _TWO_OVER_PI_NBITS - bits * (i + 1)
        piece = (total >> shift) & ((1 << bits) - 1)
        chunks.append(math.ldexp(piece, -bits * (i + 1)))
    return chunks


def _taylor(fn: Fn, x: V, coeffs: list[float]) -> V:
    """sum coeffs[i] * x^i by Horner with fma (coeffs[0] first)."""
    acc = const(x.ty, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = fn.fma(acc, x, const(x.ty, c))
    return acc


def _clenshaw(fn: Fn, t: V, coeffs) -> V:
    """Chebyshev series sum c_k T_k(t), t in [-1, 1] (stable, unlike monomials)."""
    b1, b2 = const("double", 0.0), const("double", 0.0)
    two_t = fn.fadd(t, t)
    for c in reversed(coeffs[1:]):
        b1, b2 = fn.fsub(fn.fma(two_t, b1, const("double", float(c))), b2), b1
    return fn.fsub(fn.fma(t, b1, const("double", float(coeffs[0]))), b2)


_ERF_CHEB = chebyshev.chebinterpolate(
    lambda t: np.array([math.erf(2.5 + 1.5 * v) for v in np.atleast_1d(t)]), 18)


def _fabs(fn, x):
    return fn.unary_intrinsic("fabs", x)


def _copysign(fn, mag, sign):
    return fn.binary_intrinsic("copysign", mag, sign)


def _is_nan(fn, x):
    return fn.fcmp("uno", x, x)


def _clamp(fn, x, lo, hi):
    return fn.binary_intrinsic("minnum", fn.binary_intrinsic("maxnum", x, const(x.ty, lo)),
                               const(x.ty, hi))


def _expm1_parts(fn: Fn, x: V):
    """x (double, |x| <= 300) -> (em1, scale) with exp(x) = scale * (1 + em1) and
    |em1| <= 0.42: k = round(x / ln2), r = x - k ln2 (two fma steps), em1 = e^r - 1."""
    k = fn.unary_intrinsic("roundeven", fn.fmul(x, const("double", 1 / _LN2)))
    r = fn.fma(fn.fneg(k), const("double", _LN2), x)
    r = fn.fma(fn.fneg(k), const("double", _LN2_LO), r)
    poly = _taylor(fn, r, [1 / math.factorial(i + 1) for i in range(11)])  # e^r - 1 = r*poly
    em1 = fn.fmul(r, poly)
    ki = fn.cast("fptosi", k, "i64")
    scale = fn.cast("bitcast", fn.bin("shl", fn.bin("add", ki, const("i64", 1023)), const("i64", 52)), "double")
    return em1, scale


def _exp_d(fn, x):
    em1, scale = _expm1_parts(fn, _clamp(fn, x, -300.0, 300.0))
    return fn.fma(scale, em1, scale)


def _expm1_d(fn, x):
    em1, scale = _expm1_parts(fn, _clamp(fn, x, -300.0, 300.0))
    # k == 0 gives scale == 1: fma(1, em1, 0) == em1 exactly, so no cancellation
    return fn.fma(scale, em1, fn.fsub(scale, const("double", 1.0)))


def _log_d(fn: Fn, u: V) -> V:
    """log of a positive normal double: u = m 2^e, m in [sqrt(1/2), sqrt(2)),
    log m = 2 atanh(s), s = (m-1)/(m+1), |s| <= 0.172 (series to s^17)."""
    bits = fn.cast("bitcast", u, "i64")
    # subtracting the bits of sqrt(1/2) puts m's exponent boundary at sqrt(2)
    off = fn.bin("sub", bits, const("i64", 0x3FE6A09E667F3BCD))
    e = fn.bin("ashr", off, const("i64", 52))
    mbits = fn.bin("sub", bits, fn.bin("shl", e, const("i64", 52)))
    m = fn.cast("bitcast", mbits, "double")
    s = fn.fdiv(fn.fsub(m, const("double", 1.0)), fn.fadd(m, const("double", 1.0)))
    z = fn.fmul(s, s)
    series = _taylor(fn, z, [1.0 / (2 * i + 3) for i in range(8)])
    two_s = fn.fadd(s, s)
    logm = fn.fma(fn.fmul(two_s, z), series, two_s)
    ed = fn.cast("sitofp", e, "double")
    return fn.fma(ed, const("double", _LN2), fn.fma(ed, const("double", _LN2_LO), logm))


def _log_special(fn, x, value):
    """IEEE specials of log for double x: NaN, <0 -> NaN; 0 -> -inf; inf -> inf."""
    zero = const("double", 0.0)
    value = fn.select(fn.fcmp("oeq", x, zero), const("double", -math.inf), value)
    value = fn.select(fn.fcmp("oeq", x, const("double", math.inf)), x, value)
    return fn.select(fn.fcmp("ult", x, zero), const("double", math.nan), value)


def _atan_01(fn: Fn, t: V) -> V:
    """atan on [0, 1]: above tan(pi/8) use pi/4 + atan((t-1)/(t+1)); |u| <= 0.4143."""
    big = fn.fcmp("ogt", t, const("double", 0.41421356237309503))
    u = fn.select(big, fn.fdiv(fn.fsub(t, const("double", 1.0)), fn.fadd(t, const("double", 1.0))), t)
    z = fn.fmul(u, u)
    series = _taylor(fn, z, [(-1) ** (i + 1) / (2 * i + 3) for i in range(16)])
    at = fn.fma(fn.fmul(u, z), series, u)
    return fn.select(big, fn.fadd(at, const("double", math.pi / 4)), at)


def _atan2_d(fn: Fn, y: V, x: V) -> V:
    ay, ax = _fabs(fn, y), _fabs(fn, x)
    hi = fn.binary_intrinsic("maxnum", ax, ay)
    lo = fn.binary_intrinsic("minnum", ax, ay)
    t = fn.fdiv(lo, hi)
    both_inf = fn.bin("and", fn.fcmp("oeq", ax, const("double", math.inf)),
                      fn.fcmp("oeq", ay, const("double", math.inf)))
    t = fn.select(both_inf, const("double", 1.0), t)
    t = fn.select(fn.fcmp("oeq", hi, const("double", 0.0)), const("double", 0.0), t)
    a = _atan_01(fn, t)
    a = fn.select(fn.fcmp("ogt", ay, ax), fn.fsub(const("double", math.pi / 2), a), a)
    x_neg = fn.icmp("slt", fn.cast("bitcast", x, "i64"), const("i64", 0))
    a = fn.select(x_neg, fn.fsub(const("double", math.pi), a), a)
    a = _copysign(fn, a, y)
    return fn.select(fn.bin("or", _is_nan(fn, x), _is_nan(fn, y)), fn.fadd(x, y), a)


def _reduce_quadrant(fn: Fn, x: V):
    """x (a float32 value in a double) -> (j, r): x = (4n + j) pi/2 + r, |r| <= pi/4.
    Payne-Hanek in float64: x * c_i is exact for 24-bit chunks c_i of 2/pi, each product
    is reduced mod 4 exactly, and the pieces are summed with TwoSum into a double-double,
    so r is accurate for every float32 x (even 3e38)."""
    hi, lo = const("double", 0.0), const("double", 0.0)
    for c in _two_over_pi_chunks(8):
        p = fn.fmul(x, const("double", c))
        q = fn.fma(const("double", -4.0), fn.unary_intrinsic("roundeven", fn.fmul(p, const("double", 0.25))), p)
        s = fn.fadd(hi, q)  # TwoSum(hi, q)
        bb = fn.fsub(s, hi)
        err = fn.fadd(fn.fsub(hi, fn.fsub(s, bb)), fn.fsub(q, bb))
        hi, lo = s, fn.fadd(lo, err)
        hi = fn.fma(const("double", -4.0), fn.unary_intrinsic("roundeven", fn.fmul(hi, const("double", 0.25))), hi)
    jd = fn.unary_intrinsic("roundeven", hi)
    f = fn.fadd(fn.fsub(hi, jd), lo)
    r = fn.fmul(f, const("double", math.pi / 2))
    j = fn.bin("and", fn.cast("fptosi", jd, "i64"), const("i64", 3))
    return j, r


def _sin_cos_poly(fn, r):
    z = fn.fmul(r, r)
    s = fn.fma(fn.fmul(r, z), _taylor(fn, z, [(-1) ** (i + 1) / math.factorial(2 * i + 3) for i in range(6)]), r)
    c = fn.fma(z, _taylor(fn, z, [(-1) ** (i + 1) / math.factorial(2 * i + 2) for i in range(7)]),
               const("double", 1.0))
    return s, c


def _trig(fn: Fn, x: V, which: str) -> V:
    j, r = _reduce_quadrant(fn, x)
    s, c = _sin_cos_poly(fn, r)
    bit0 = fn.icmp("ne", fn.bin("and", j, const("i64", 1)), const("i64", 0))
    if which == "tan":
        return fn.select(bit0, fn.fdiv(fn.fneg(c), s), fn.fdiv(s, c))
    if which == "cos":
        j = fn.bin("add", j, const("i64", 1))
        bit0 = fn.icmp("ne", fn.bin("and", j, const("i64", 1)), const("i64", 0))
    v = fn.select(bit0, c, s)
    neg = fn.icmp("ne", fn.bin("and", j, const("i64", 2)), const("i64", 0))
    return fn.select(neg, fn.fneg(v), v)


def _erf_d(fn: Fn, x: V) -> V:
    a = _fabs(fn, x)
    z = fn.fmul(a, a)
    small = _taylor(fn, z, [(-1) ** n / (math.factorial(n) * (2 * n + 1)) * 2 / math.sqrt(math.pi)
                            for n in range(15)])
    small = fn.fmul(a, small)
    t = fn.fmul(fn.fsub(_clamp(fn, a, 1.0, 4.0), const("double", 2.5)), const("double", 1 / 1.5))
    mid = _clenshaw(fn, t, _ERF_CHEB)
    v = fn.select(fn.fcmp("ole", a, const("double", 1.0)), small, mid)
    v = fn.select(fn.fcmp("oge", a, const("double", 4.0)), const("double", 1.0), v)
    return _copysign(fn, v, x)


def _pow_d(fn: Fn, x: V, y: V) -> V:
    """IEEE pow for double x, y carrying float32 values: exp(y log|x|) plus the sign and
    special-case rules (C99 Annex F, as numpy)."""
    one, zero, inf = const("double", 1.0), const("double", 0.0), const("double", math.inf)
    ax = _fabs(fn, x)
    lg = _log_special(fn, ax, _log_d(fn, ax))
    t = fn.fmul(y, lg)
    mag = _exp_d(fn, t)
    mag = fn.select(fn.fcmp("oeq", t, inf), inf, mag)
    mag = fn.select(fn.fcmp("oeq", t, fn.fneg(inf)), zero, mag)
    mag = fn.select(_is_nan(fn, t), const("double", math.nan), mag)
    y_int = fn.fcmp("oeq", fn.unary_intrinsic("trunc", y), y)
    half = fn.fmul(y, const("double", 0.5))
    y_odd = fn.bin("and", y_int, fn.fcmp("one", fn.unary_intrinsic("trunc", half), half))
    x_neg = fn.icmp("slt", fn.cast("bitcast", x, "i64"), const("i64", 0))
    out = fn.select(fn.bin("and", x_neg, y_odd), fn.fneg(mag), mag)
    finite_neg = fn.bin("and", fn.fcmp("olt", x, zero), fn.fcmp("one", ax, inf))
    out = fn.select(fn.bin("and", finite_neg, fn.bin("xor", y_int, const("i1", 1))),
                    const("double", math.nan), out)
    out = fn.select(fn.bin("or", fn.fcmp("oeq", x, one), fn.fcmp("oeq", y, zero)), one, out)
    # (-1)^(+-inf) == 1
    out = fn.select(fn.bin("and", fn.fcmp("oeq", ax, one), fn.fcmp("oeq", _fabs(fn, y), inf)), one, out)
    return out


def _body_f32(fn: Fn, name: str, args: list[V]) -> V:
    """The double-precision body of float32 function `name` (args already in double)."""
    x = args[0]
    one = const("double", 1.0)
    if name == "exp":
        return fn.select(_is_nan(fn, x), x, _exp_d(fn, x))
    if name == "expm1":
        return fn.select(_is_nan(fn, x), x, _expm1_d(fn, x))
    if name == "log":
        return _log_special(fn, x, _log_d(fn, x))
    if name == "log1p":
        u = fn.fadd(x, one)
        lu = _log_special(fn, u, _log_d(fn, u))
        corrected = fn.fdiv(fn.fmul(lu, x), fn.fsub(u, one))
        v = fn.select(fn.fcmp("oeq", u, one), x, corrected)
        v = fn.select(fn.fcmp("oeq", x, const("double", math.inf)), x, v)
        return fn.select(fn.fcmp("ole", u, const("double", 0.0)), lu, v)
    if name in ("sin", "tan"):
        tiny = fn.fcmp("olt", _fabs(fn, x), const("double", 2.0 ** -12))
        return fn.select(tiny, x, _trig(fn, x, name))
    if name == "cos":
        return _trig(fn, x, "cos")
    if name == "atan":
        return _atan2_d(fn, x, one)
    if name == "atan2":
        return _atan2_d(fn, x, args[1])
    if name in ("asin", "acos"):
        root = fn.unary_intrinsic("sqrt", fn.fsub(one, fn.fmul(x, x)))
        return _atan2_d(fn, x, root) if name == "asin" else _atan2_d(fn, root, x)
    if name in ("tanh", "sinh"):
        a = _fabs(fn, x)
        if name == "tanh":
            t = _expm1_d(fn, fn.fadd(a, a))
            v = fn.fdiv(t, fn.fadd(t, const("double", 2.0)))
        else:
            t = _expm1_d(fn, a)
            v = fn.fmul(const("double", 0.5), fn.fadd(t, fn.fdiv(t, fn.fadd(t, one))))
            v = fn.select(fn.fcmp("oge", a, const("double", 200.0)), const("double", math.inf), v)
        return fn.select(_is_nan(fn, x), x, _copysign(fn, v, x))
    if name == "cosh":
        e = _exp_d(fn, _fabs(fn, x))
        v = fn.fmul(const("double", 0.5), fn.fadd(e, fn.fdiv(one, e)))
        return fn.select(_is_nan(fn, x), x, v)
    if name == "erf":
        return fn.select(_is_nan(fn, x), x, _erf_d(fn, x))
    if name == "pow":
        return _pow_d(fn, x, args[1])
    raise KeyError(name)


def math_call(fn: Fn, name: str, args: list[V]) -> V:
    """Call transcendental `name` on float/double values, defining it in the module on
    first use. float: inlined arithmetic (vectorizes); double: libm."""
    module: Module = fn.module
    ty = args[0].ty
    if ty == "double":
        sig = ", ".join(["double"] * len(args))
        module.declare(name, f"declare double @{name}({sig}) nounwind readnone")
        fn.scalar_calls += 1
        return fn.call(name, "double", args)
    native = module.f32_math == "native" and name in mathlib_f32.NATIVE_F32
    helper = f"kiln.{name}.f32" + ("n" if native else "d")
    if helper not in module.helpers:
        module.helpers.add(helper)
        body = Fn(module, prefix="m")
        params = [V(f"%a{i}", "float") for i in range(len(args))]
        if native:
            result = mathlib_f32.body(body, name, params[0])
        else:
            wide = [body.cast("fpext", p, "double") for p in params]
            result = body.cast("fptrunc", _body_f32(body, name, wide), "float")
        body.stmt(f"ret float {result.ref}")
        header = (f"define internal float @{helper}({', '.join(map(str, params))}) "
                  "alwaysinline nounwind")
        module.functions.append(body.define(header))
    return fn.call(helper, "float", args)
