"""float32-native vectorizable transcendentals: exp expm1 log log1p tanh erf.

Each body is straight-line float32 arithmetic (selects, no branches, `llvm.fma.f32`), so
the loop vectorizer widens it to full-width float32 vectors (8 lanes on ymm) after
inlining -- twice the lanes of mathlib.py's float64-internal bodies. The price is error
analysis: every step below says why its rounding error stays small, and
tests/codegen/test_cpu_mathlib.py measures the result (bound: 4 ulp; measured worst
cases are listed in docs/cpu-backend.md).

Building blocks: Cody-Waite reduction x = k ln2 + r with ln2 split in two float32
constants (the fma makes k * LN2_HI exact, and r_hi = x - k LN2_HI is exact because
both are multiples of 2^-24 and |r_hi| < 0.5), minimax polynomials fitted offline by
scripts/fit_float32_math.py (coefficients below are the exact float32 values it prints), and
scale factors 2^k built from exponent bits.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.codegen.cpu.ir_builder import Fn, V, const

F = "float"
NATIVE_F32 = ("exp", "expm1", "log", "log1p", "tanh", "erf")


def _hex(*values: str) -> tuple[float, ...]:
    out = tuple(float.fromhex(v) for v in values)
    assert all(float(np.float32(v)) == v for v in out), "coefficients must be exact float32"
    return out


LN2_HI, LN2_LO = _hex("0x1.62e430p-1", "-0x1.05c610p-29")  # LN2_HI + LN2_LO = ln 2 within 9e-17
LOG2E = float(np.float32(1 / math.log(2)))
assert abs(LN2_HI + LN2_LO - math.log(2)) < 2.0 ** -52

# e^r = 1 + r + r^2 P(r), |r| <= ln2/2; max relative error of expm1(r) 1.4e-8
EXP_P = _hex("0x1.fffffep-2", "0x1.5554b4p-3", "0x1.5556f2p-5", "0x1.122544p-7", "0x1.6b9c54p-10")
# log(1+f) = f - f^2/2 + f^3 Q(f), f in [sqrt(1/2)-1, sqrt(2)-1]; relative error 5.8e-9
LOG_Q = _hex("0x1.555554p-2", "-0x1.000226p-2", "0x1.99a01ap-3", "-0x1.547286p-3", "0x1.22d95ep-3",
             "-0x1.0d82aap-3", "0x1.055db6p-3", "-0x1.38c506p-4")
# erf(a) = a + a C(a^2) for a < ERF_SPLIT; error relative to erf(a)/a 1.6e-8
ERF_SPLIT = 0.921875
ERF_C = _hex("0x1.06eba6p-3", "-0x1.8126e8p-2", "0x1.ce1ab4p-4", "-0x1.b68e66p-6", "0x1.474a0ep-8",
             "-0x1.3a48e2p-11")
# erfc(a) = exp(-a^2) Q(a) on [ERF_SPLIT, ERF_ONE]; absolute error of erfc 4.3e-9
ERFC_Q = _hex("0x1.fccf0ap-1", "-0x1.166286p+0", "0x1.c21ec2p-1", "-0x1.13d67cp-1", "0x1.f66a40p-3",
              "-0x1.461c50p-4", "0x1.1aaeaap-6", "-0x1.234a9ap-9", "0x1.0c750cp-13")
# tanh(a) = a + a^3 T(a^2) for a < TANH_SPLIT; relative error 4.5e-9
TANH_SPLIT = 0.625
TANH_T = _hex("-0x1.555532p-2", "0x1.1106f6p-3", "-0x1.b835a4p-5", "0x1.51f8cep-6", "-0x1.750ce2p-8")
# the smallest float32 whose correctly rounded erf / tanh is 1: saturate exactly there
# (near it erfc is ~2^-25, where a relative error of the fit could round the other way)
ERF_ONE, TANH_ONE = _hex("0x1.f5a88ap+1", "0x1.205968p+3")
SQRT_HALF_BITS = 0x3F3504F3  # float32 sqrt(1/2): subtracting it puts m's range at [sqrt(1/2), sqrt(2))


def c(v: float) -> V:
    return const(F, v)


def i32(v: int) -> V:
    return const("i32", v)


def poly(fn: Fn, x: V, coeffs) -> V:
    """sum coeffs[i] x^i by Horner with fma."""
    acc = c(coeffs[-1])
    for k in reversed(coeffs[:-1]):
        acc = fn.fma(acc, x, c(k))
    return acc


def clamp(fn: Fn, x: V, lo: float, hi: float) -> V:
    """min(max(x, lo), hi) with NaN passing through: `x < lo ? lo : x` is one vmaxps
    (x86 max returns its second operand when either is NaN), unlike llvm.maxnum."""
    x = fn.select(fn.fcmp("olt", x, c(lo)), c(lo), x)
    return fn.select(fn.fcmp("ogt", x, c(hi)), c(hi), x)


def pow2(fn: Fn, k: V, bias: int = 127) -> V:
    """2^(k + bias - 127) for i32 k, valid while the exponent stays normal."""
    return fn.cast("bitcast", fn.bin("shl", fn.bin("add", k, i32(bias)), i32(23)), F)


def exp_core(fn: Fn, x: V) -> tuple[V, V]:
    """x (|x| <= 150 ln2) -> (em1, k) with e^x = 2^k (1 + em1), |em1| <= 0.42.

    r_hi = x - k LN2_HI is exact (see the module docstring); the second fma rounds
    once, so |r - (x - k ln2)| <= 2^-25 |r| + |k| 2^-54: em1 is good to ~1 ulp."""
    k = fn.unary_intrinsic("roundeven", fn.fmul(x, c(LOG2E)))
    nk = fn.fneg(k)
    r = fn.fma(nk, c(LN2_LO), fn.fma(nk, c(LN2_HI), x))
    em1 = fn.fma(fn.fmul(r, r), poly(fn, r, EXP_P), r)
    # a NaN x gives a NaN k and em1: fptosi of NaN is poison, so freeze it (any integer
    # then; the result stays NaN through em1, which saves a select per call)
    return em1, fn.freeze(fn.cast("fptosi", k, "i32"))


def is_nan(fn: Fn, x: V) -> V:
    return fn.fcmp("uno", x, x)


def exp(fn: Fn, x: V) -> V:
    # below -104 the result is 0 even for subnormals (exp(-104) rounds to 0), above 89
    # it is inf. Those lanes compute exp(0) and select 0 at the end: computing the
    # underflow itself costs a microcode assist per lane on x86 (~100 cycles), and a
    # masked softmax feeds exp(-inf) for half its elements (6x slower kernels)
    under = fn.fcmp("olt", x, c(-104.0))
    em1, k = exp_core(fn, clamp(fn, fn.select(under, c(0.0), x), -104.0, 89.0))
    # 2^k in two factors (k in [-150, 128] does not fit one normal float): the fma
    # rounds once, and (1+em1) 2^k1 with k1 >= -75 is exact, so a subnormal result is
    # rounded once more at most (the second product)
    k1 = fn.bin("ashr", k, i32(1))
    s1, s2 = pow2(fn, k1), pow2(fn, fn.bin("sub", k, k1))
    # NaN in, NaN out (through em1: NaN is not olt -104)
    return fn.select(under, c(0.0), fn.fmul(fn.fma(s1, em1, s1), s2))


def expm1(fn: Fn, x: V) -> V:
    # below -40 the result rounds to -1; above 89 to inf (2^128 (1+em1) overflows)
    em1, k = exp_core(fn, clamp(fn, x, -40.0, 89.0))
    v = _expm1_finish(fn, em1, k)
    # ±0 keeps its sign (the reduction computes +0 for -0); NaN comes through em1
    return fn.select(fn.fcmp("oeq", x, c(0.0)), x, v)


def _expm1_finish(fn: Fn, em1: V, k: V) -> V:
    """2^k (1 + em1) - 1 as 2 (s em1 + (s - 1/2)), s = 2^(k-1) (normal for k in
    [-58, 128]): s - 1/2 is exact for k <= 25, the fma rounds once, the doubling is
    exact (or overflows to inf exactly when the result does); k == 0 gives em1 itself,
    so small x keep full relative accuracy."""
    s = pow2(fn, k, 126)
    return fn.fmul(fn.fma(s, em1, fn.fsub(s, c(0.5))), c(2.0))


def _log_reduce(fn: Fn, u: V) -> tuple[V, V]:
    """positive normal u = m 2^e, m in [sqrt(1/2), sqrt(2)) -> (m, e as i32)."""
    bits = fn.cast("bitcast", u, "i32")
    e = fn.bin("ashr", fn.bin("sub", bits, i32(SQRT_HALF_BITS)), i32(23))
    m = fn.cast("bitcast", fn.bin("sub", bits, fn.bin("shl", e, i32(23))), F)
    return m, e


def _log1p_poly(fn: Fn, f: V) -> V:
    """log(1+f) = f + f^2 (-1/2 + f Q(f)): the leading f is exact, the f^2 term is at
    most 0.3 of the result, so rounding stays below ~1 ulp."""
    return fn.fma(fn.fmul(f, f), fn.fma(f, poly(fn, f, LOG_Q), c(-0.5)), f)


def _add_e_ln2(fn: Fn, e: V, logm: V) -> V:
    ef = fn.cast("sitofp", e, F)
    return fn.fma(ef, c(LN2_HI), fn.fma(ef, c(LN2_LO), logm))


def log(fn: Fn, x: V) -> V:
    # subnormals: scale by 2^23 first (exact) and take 23 off the exponent
    tiny = fn.fcmp("olt", x, c(2.0 ** -126))
    u = fn.select(tiny, fn.fmul(x, c(2.0 ** 23)), x)
    m, e = _log_reduce(fn, u)
    e = fn.bin("sub", e, fn.select(tiny, i32(23), i32(0)))
    # m - 1 is exact (Sterbenz: m is within a factor 2 of 1)
    v = _add_e_ln2(fn, e, _log1p_poly(fn, fn.fsub(m, c(1.0))))
    v = fn.select(fn.fcmp("oeq", x, c(0.0)), c(-math.inf), v)
    v = fn.select(fn.fcmp("oeq", x, c(math.inf)), x, v)
    v = fn.select(fn.fcmp("olt", x, c(0.0)), c(math.nan), v)
    return fn.select(is_nan(fn, x), x, v)


def log1p(fn: Fn, x: V) -> V:
    """log(u) for u = fl(1 + x), corrected by the rounding error d = (1 + x) - u
    (Fast2Sum, ordered by magnitude): f = (m - 1) + d 2^-e rounds once, and the
    polynomial sees the exact 1 + x to within 2^-24 relative."""
    one = c(1.0)
    u = fn.fadd(x, one)
    big = fn.fcmp("oge", fn.unary_intrinsic("fabs", x), one)
    d = fn.select(big, fn.fsub(one, fn.fsub(u, x)), fn.fsub(x, fn.fsub(u, one)))
    m, e = _log_reduce(fn, u)
    # 2^-e for e <= 126; larger e (u >= 2^126) makes d 2^-e negligible, so use 0
    inv = pow2(fn, fn.bin("sub", i32(0), e))
    inv = fn.select(fn.icmp("sgt", e, i32(126)), c(0.0), inv)
    f = fn.fma(d, inv, fn.fsub(m, one))
    v = _add_e_ln2(fn, e, _log1p_poly(fn, f))
    v = fn.select(fn.fcmp("oeq", x, c(math.inf)), x, v)
    v = fn.select(fn.fcmp("oeq", u, c(0.0)), c(-math.inf), v)
    v = fn.select(fn.fcmp("olt", u, c(0.0)), c(math.nan), v)
    # ±0 keep their sign; NaN passes through
    return fn.select(fn.fcmp("ueq", x, c(0.0)), x, v)


def tanh(fn: Fn, x: V) -> V:
    """|x| < TANH_SPLIT: a + a^3 T(a^2) (the a term exact, so the error near 0 is well
    under 1 ulp). Above: tanh a = t / (t + 2), t = expm1(2a) >= 2.49, where t/(t+2) has
    relative condition 2/(t+2) <= 0.45, so expm1's error shrinks; 1 from TANH_ONE on."""
    a = fn.unary_intrinsic("fabs", x)
    z = fn.fmul(a, a)
    small = fn.fma(fn.fmul(a, z), poly(fn, z, TANH_T), a)
    t2 = fn.fmul(fn.binary_intrinsic("minnum", a, c(10.0)), c(2.0))
    em1, k = exp_core(fn, t2)
    t = _expm1_finish(fn, em1, k)
    big = fn.fdiv(t, fn.fadd(t, c(2.0)))
    big = fn.select(fn.fcmp("oge", a, c(TANH_ONE)), c(1.0), big)
    # NaN takes the small branch (ult), where it propagates: no select needed for it
    v = fn.select(fn.fcmp("ult", a, c(TANH_SPLIT)), small, big)
    return fn.binary_intrinsic("copysign", v, x)


def erf(fn: Fn, x: V) -> V:
    """|x| < ERF_SPLIT: a + a C(a^2) (the a term exact, so near 0 the error is tiny).
    Above: 1 - exp(-a^2) Q(a), where erfc <= 0.2 so its absolute error is what counts;
    a^2 = hi + lo exactly (fma), exp(-a^2) = exp(-hi) (1 - lo). 1 from ERF_ONE on."""
    a = fn.unary_intrinsic("fabs", x)
    small = fn.fma(a, poly(fn, fn.fmul(a, a), ERF_C), a)
    ac = fn.binary_intrinsic("minnum", a, c(ERF_ONE))
    hi = fn.fmul(ac, ac)
    lo = fn.fma(ac, ac, fn.fneg(hi))
    em1, k = exp_core(fn, fn.fneg(hi))  # -hi in [-15.4, -0.84]: k in [-23, -1], 2^k normal
    s = pow2(fn, k)
    eq = fn.fmul(fn.fma(s, em1, s), poly(fn, ac, ERFC_Q))
    big = fn.fsub(c(1.0), fn.fma(fn.fneg(lo), eq, eq))
    big = fn.select(fn.fcmp("oge", a, c(ERF_ONE)), c(1.0), big)
    v = fn.select(fn.fcmp("ult", a, c(ERF_SPLIT)), small, big)  # NaN: small, propagates
    return fn.binary_intrinsic("copysign", v, x)


BODIES = {"exp": exp, "expm1": expm1, "log": log, "log1p": log1p, "tanh": tanh, "erf": erf}


def body(fn: Fn, name: str, x: V) -> V:
    """The float32 result of native function `name` on float32 value `x`."""
    return BODIES[name](fn, x)
