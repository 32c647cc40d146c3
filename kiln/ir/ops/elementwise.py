"""Elementwise primitives: the scalar ops every backend implements.

Operands of a primitive already share one dtype and one shape (the frontend inserts
`convert` and `broadcast_in_dim`), so each rule only checks the dtype category.
Integer `div` truncates toward zero and `rem` takes the dividend's sign, as C, LLVM
and XLA do; Python's floor semantics are composites in the frontend.

vjp rules: a complex cotangent is dL/dRe + i dL/dIm (PyTorch's convention, the one
`kiln.testing` checks; JAX's complex cotangents are its conjugate), so a holomorphic f
pulls ct back to ct * conj(f'(z)). Low-precision floats compute their cotangents in
float32 and round back once, as the references do.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.rules import (
    contiguous,
    ANY, FLOATING, INEXACT, INTEGER, INTEGRAL, LOW_PRECISION, NUMERIC, REAL, check_dtype, check_same,
    conj, full_like, via_f32, zeros,
)
from kiln.ir.registry import ELEMENTWISE, defop
from kiln.ir.sharding import Partial, Strategy, kind_rule, partial_through, shard_dims
from kiln.ir.ops.erf_reference import erf_reference as _erf, erfc_reference as _erfc


def _unary(name: str, allowed: str, reference, *, result_dtype=None, differentiable=True,
           vjp=None, doc: str = ""):
    def type_rule(op, x):
        check_dtype(op, x, allowed)
        return x if result_dtype is None else x.with_dtype(result_dtype(x.dtype))

    cls = type(name, (), {"type": type_rule, "reference": reference, "vjp": vjp, "__doc__": doc})
    return defop(name, family="elementwise", kind=ELEMENTWISE, num_operands=1,
                 differentiable=differentiable)(cls)


def _binary(name: str, allowed: str, reference, *, result_dtype=None, differentiable=True,
            vjp=None, doc: str = ""):
    def type_rule(op, x, y):
        t = check_same(op, x, y)
        check_dtype(op, t, allowed, "operands")
        return t if result_dtype is None else t.with_dtype(result_dtype)

    cls = type(name, (), {"type": type_rule, "reference": reference, "vjp": vjp, "__doc__": doc})
    return defop(name, family="elementwise", kind=ELEMENTWISE, num_operands=2,
                 differentiable=differentiable)(cls)


# -- the sharding rule every elementwise op shares (operands have one shape) --------------
# where a Partial value passes through: linear in all operands (Partial sum/avg), and
# non-decreasing in the first (Partial max/min); mul, div, select, max, min, neg below
LINEAR_ALL = {"add", "sub", "neg", "real", "imag", "complex"}
NONDECREASING = {"exp", "expm1", "log", "log1p", "sqrt", "tanh", "erf", "atan", "sinh",
                 "asin", "floor", "ceil", "round", "trunc", "sign", "relu", "sigmoid",
                 "softplus", "convert", "clamp"}


@kind_rule(ELEMENTWISE)
def elementwise_sharding(spec):
    """Shard any dim alike on every operand; Partial where the op allows it."""
    found, op = shard_dims(spec, range(spec.ndim)), spec.op
    if all(d.is_inexact for d in spec.in_dtypes):
        if op in LINEAR_ALL:
            found += [partial_through(spec, "sum"), partial_through(spec, "avg")]
        if op == "mul":  # linear in each operand
            found += [partial_through(spec, "sum", (0,)), partial_through(spec, "sum", (1,))]
        if op == "div":  # linear in the numerator
            found.append(partial_through(spec, "sum", (0,)))
    if op == "select" and spec.in_dtypes[1].is_inexact:
        found.append(partial_through(spec, "sum", (1, 2)))
    if op in ("max", "min") and not spec.in_dtypes[0].is_complex:
        found.append(partial_through(spec, op))
    real = not any(d.is_complex or d.is_bool for d in spec.in_dtypes)
    to_bool = op == "convert" and getattr(spec.attrs.get("dtype"), "is_bool", False)
    if op in NONDECREASING and real and not to_bool:
        found += [partial_through(spec, red, (0,)) for red in ("max", "min")]
    if op == "neg" and real:
        found += [Strategy((Partial("max"),), (Partial("min"),)),
                  Strategy((Partial("min"),), (Partial("max"),))]
    return found


# -- vjp helpers ---------------------------------------------------------------------

def _f32(b, x):
    return b.convert(x, dt.float32) if b.type_of(x).dtype.np_dtype in LOW_PRECISION else x


def _pullback(fn, f32=True):
    """A vjp rule from `fn(b, *cts, *xs, *ys)` -> one cotangent, or a tuple of one per
    operand: low-precision floats go in as float32 (unless `f32` is False: the rule only
    routes or negates), each cotangent comes back in its operand's dtype, and integer or
    bool operands get None."""

    def vjp(b, cts, xs, ys):
        values = [_f32(b, v) if f32 else v for v in (*cts, *xs, *ys)]
        grads = fn(b, *values)
        grads = grads if isinstance(grads, tuple) else (grads,)
        return [b.convert(g, b.type_of(x).dtype)
                if g is not None and b.type_of(x).dtype.is_inexact else None
                for g, x in zip(grads, xs)]

    return vjp


def _full_like(b, like, value):
    return full_like(b, b.type_of(like), value)


def _zeros(b, like):
    return zeros(b, b.type_of(like))


def _square(b, x):
    return b.mul(x, x)


@_pullback
def _abs_vjp(b, ct, x, y):
    # x / |x| is sign(x) for complex x too; sign(0) = 0 gives abs'(0) = 0 (JAX, PyTorch)
    return b.mul(b.convert(ct, b.type_of(x).dtype), b.sign(x))


def _asin_grad(b, ct, x):
    return b.mul(ct, b.rsqrt(b.binary("sub", 1.0, _square(b, x))))


@_pullback
def _erf_vjp(b, ct, x, y):
    return b.mul(ct, b.binary("mul", b.exp(b.neg(_square(b, x))), 2 / math.sqrt(math.pi)))


def _round_half_even(x):
    return np.round(x)


def _rsqrt(x):
    return 1.0 / np.sqrt(x)


def _sign(x):
    return np.sign(x) if not x.dtype.kind == "c" else x / np.where(x == 0, 1, np.abs(x))


# -- unary -------------------------------------------------------------------------
neg = _unary("neg", NUMERIC, lambda x: np.negative(x),
             vjp=_pullback(lambda b, ct, x, y: b.neg(ct), f32=False))
abs_ = _unary("abs", NUMERIC, lambda x: np.abs(x).astype(np.float32) if x.dtype.kind == "c"
              else np.abs(x), result_dtype=lambda d: dt.float32 if d.is_complex else d,
              vjp=_abs_vjp)
sign = _unary("sign", NUMERIC, lambda x: _sign(x).astype(x.dtype), differentiable=False)
exp = _unary("exp", INEXACT, via_f32(np.exp),
             vjp=_pullback(lambda b, ct, x, y: b.mul(ct, conj(b, y))))
expm1 = _unary("expm1", FLOATING, via_f32(np.expm1),
               vjp=_pullback(lambda b, ct, x, y: b.mul(ct, b.binary("add", y, 1.0))))
log = _unary("log", INEXACT, via_f32(np.log),
             vjp=_pullback(lambda b, ct, x, y: b.div(ct, conj(b, x))))
log1p = _unary("log1p", FLOATING, via_f32(np.log1p),
               vjp=_pullback(lambda b, ct, x, y: b.div(ct, b.binary("add", x, 1.0))))
sin = _unary("sin", INEXACT, via_f32(np.sin),
             vjp=_pullback(lambda b, ct, x, y: b.mul(ct, conj(b, b.cos(x)))))
cos = _unary("cos", INEXACT, via_f32(np.cos),
             vjp=_pullback(lambda b, ct, x, y: b.mul(ct, conj(b, b.neg(b.sin(x))))))
tan = _unary("tan", FLOATING, via_f32(np.tan),
             vjp=_pullback(lambda b, ct, x, y: b.mul(ct, b.binary("add", _square(b, y), 1.0))))
asin = _unary("asin", FLOATING, via_f32(np.arcsin),
              vjp=_pullback(lambda b, ct, x, y: _asin_grad(b, ct, x)))
acos = _unary("acos", FLOATING, via_f32(np.arccos),
              vjp=_pullback(lambda b, ct, x, y: b.neg(_asin_grad(b, ct, x))))
atan = _unary("atan", FLOATING, via_f32(np.arctan),
              vjp=_pullback(lambda b, ct, x, y: b.div(ct, b.binary("add", _square(b, x), 1.0))))
sinh = _unary("sinh", FLOATING, via_f32(np.sinh),
              vjp=_pullback(lambda b, ct, x, y: b.mul(ct, b.cosh(x))))
cosh = _unary("cosh", FLOATING, via_f32(np.cosh),
              vjp=_pullback(lambda b, ct, x, y: b.mul(ct, b.sinh(x))))
tanh = _unary("tanh", INEXACT, via_f32(np.tanh), vjp=_pullback(
    lambda b, ct, x, y: b.mul(ct, conj(b, b.sub(_full_like(b, y, 1), _square(b, y))))))
sqrt = _unary("sqrt", INEXACT, via_f32(np.sqrt),
              vjp=_pullback(lambda b, ct, x, y: b.div(ct, conj(b, b.add(y, y)))))
# d/dx x^(-1/2) = -y^3 / 2
rsqrt = _unary("rsqrt", FLOATING, via_f32(_rsqrt), vjp=_pullback(
    lambda b, ct, x, y: b.mul(ct, b.binary("mul", b.mul(_square(b, y), y), -0.5))))
erf = _unary("erf", FLOATING, via_f32(_erf), vjp=_erf_vjp)
floor = _unary("floor", FLOATING, via_f32(np.floor), differentiable=False)


# Numerical Recipes' erfc: t exp(-x^2 + P(t)), t = 1 / (1 + |x| / 2); relative error < 1.2e-7
_ERFC_NR = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
            -1.13520398, 1.48851587, -0.82215223, 0.17087277)
_ERF_SERIES = tuple(2 / math.sqrt(math.pi) * (-1) ** k / (math.factorial(k) * (2 * k + 1)) for k in range(30))


def _horner(b, x, coeffs):
    p = b.full(coeffs[-1], b.type_of(x).dtype, b.shape_of(x))
    for c in reversed(coeffs[:-1]):
        p = b.binary("add", b.mul(p, x), c)
    return p


@defop("erfc", family="elementwise", kind=ELEMENTWISE, num_operands=1)
class erfc:
    """Complementary error function 1 - erf(x), accurate where erf(x) rounds to +-1.

    No backend emits it by name: the legalize pass expands `decompose` for any backend
    whose scalar table lacks it. float32 and narrower: Numerical Recipes' Chebyshev fit
    (relative error < 1.2e-7). float64: erf's Taylor series below |x| = 2, the Laplace
    continued fraction (40 terms) above (relative error < 1e-13)."""

    def type(op, x):
        check_dtype(op, x, FLOATING)
        return x

    reference = via_f32(_erfc)

    def decompose(b, x):
        d = b.type_of(x).dtype
        x = _f32(b, x)
        a = b.binary("min", b.abs(x), 40.0)  # erfc(40) underflows float64; inf would split to NaN
        # exp(-a^2) loses |a^2| ulps when a^2 rounds: split a = hi + lo (Veltkamp), so
        # hi^2 is exact and exp(-a^2) = exp(-hi^2) exp(-lo (a + hi))
        c = b.binary("mul", a, 134217729.0 if d == dt.float64 else 4097.0)
        hi = b.sub(c, b.sub(c, a))
        head = b.exp(b.neg(b.mul(hi, hi)))
        rest = b.neg(b.mul(b.sub(a, hi), b.add(a, hi)))
        if d == dt.float64:
            small = b.binary("sub", 1.0, b.mul(a, _horner(b, b.mul(a, a), _ERF_SERIES)))
            t = a
            for k in range(40, 0, -1):
                t = b.add(a, b.binary("div", k / 2, t))
            tail = b.div(b.mul(head, b.exp(rest)), b.binary("mul", t, math.sqrt(math.pi)))
            y = b.select(b.binary("lt", a, 2.0), small, tail)
        else:
            t = b.binary("div", 1.0, b.binary("add", b.binary("mul", a, 0.5), 1.0))
            y = b.mul(b.mul(t, head), b.exp(b.add(rest, _horner(b, t, _ERFC_NR))))
        y = b.select(b.binary("lt", x, 0.0), b.binary("sub", 2.0, y), y)
        return b.convert(y, d)

    vjp = _pullback(lambda b, ct, x, y: b.mul(ct, b.binary("mul", b.exp(b.neg(_square(b, x))),
                                                          -2 / math.sqrt(math.pi))))
ceil = _unary("ceil", FLOATING, via_f32(np.ceil), differentiable=False)
round_ = _unary("round", FLOATING, via_f32(_round_half_even), differentiable=False,
                doc="Round half to even, as numpy and IEEE roundeven.")
trunc = _unary("trunc", FLOATING, via_f32(np.trunc), differentiable=False)
not_ = _unary("not", INTEGRAL, lambda x: np.logical_not(x) if x.dtype == np.bool_
              else np.invert(x), differentiable=False,
              doc="Logical not for bool, bitwise not for integers.")
isnan = _unary("isnan", FLOATING, lambda x: np.isnan(x.astype(np.float32)),
               result_dtype=lambda d: dt.bool_, differentiable=False)
isinf = _unary("isinf", FLOATING, lambda x: np.isinf(x.astype(np.float32)),
               result_dtype=lambda d: dt.bool_, differentiable=False)
isfinite = _unary("isfinite", FLOATING, lambda x: np.isfinite(x.astype(np.float32)),
                  result_dtype=lambda d: dt.bool_, differentiable=False)


@defop("real", family="elementwise", kind=ELEMENTWISE, num_operands=1)
class real:
    """Real part of a complex64 tensor (float32)."""

    def type(op, x):
        if not x.dtype.is_complex:
            raise KilnDTypeError(f"real: operand of type {x} is not complex")
        return x.with_dtype(dt.float32)

    def reference(x):
        return contiguous(x.real).astype(np.float32)

    def vjp(b, cts, xs, ys):
        return [b.complex(cts[0], _zeros(b, cts[0]))]


@defop("imag", family="elementwise", kind=ELEMENTWISE, num_operands=1)
class imag:
    """Imaginary part of a complex64 tensor (float32)."""

    def type(op, x):
        if not x.dtype.is_complex:
            raise KilnDTypeError(f"imag: operand of type {x} is not complex")
        return x.with_dtype(dt.float32)

    def reference(x):
        return contiguous(x.imag).astype(np.float32)

    def vjp(b, cts, xs, ys):
        return [b.complex(_zeros(b, cts[0]), cts[0])]


@defop("complex", family="elementwise", kind=ELEMENTWISE, num_operands=2)
class complex_:
    """complex64 from float32 real and imaginary parts."""

    def type(op, re, im):
        t = check_same(op, re, im)
        if t.dtype != dt.float32:
            raise KilnDTypeError(f"complex: operands must be float32, got {re} and {im}")
        return t.with_dtype(dt.complex64)

    def reference(re, im):
        # one pass writing the interleaved pairs (re + 1j * im would go through complex128)
        out = np.empty(np.broadcast_shapes(np.shape(re), np.shape(im)), np.complex64)
        out.real, out.imag = re, im
        return out

    def vjp(b, cts, xs, ys):
        return [b.real(cts[0]), b.imag(cts[0])]


def _trunc_div(a, b):
    if a.dtype.kind in "iu":
        with np.errstate(all="ignore"):
            q = np.floor_divide(a, np.where(b == 0, 1, b))
            r = np.remainder(a, np.where(b == 0, 1, b))
            q = q + ((r != 0) & ((a < 0) != (b < 0))).astype(a.dtype)
            return np.where(b == 0, 0, q).astype(a.dtype)
    return np.true_divide(a, b)


def _trunc_rem(a, b):
    if a.dtype.kind in "iu":
        with np.errstate(all="ignore"):
            return np.where(b == 0, 0, np.fmod(a, np.where(b == 0, 1, b))).astype(a.dtype)
    return np.fmod(a, b)


def _int_or_float(fn):
    float_ref = via_f32(fn)

    def reference(a, b):
        if a.dtype.kind in "iub":
            with np.errstate(all="ignore"):
                return fn(a, b).astype(a.dtype)
        return float_ref(a, b)

    reference.float_fn = fn  # what float operands run (rules.float_fn)

    return reference


def _pow(a, b):
    if a.dtype.kind in "iu":
        # integer pow with negative exponents is 0 (or 1 / -1 for bases 1 / -1), as in C
        with np.errstate(all="ignore"):
            safe = np.where(b < 0, 0, b)
            result = np.power(a, safe)
            neg = b < 0
            return np.where(neg, np.where(a == 1, 1, np.where(a == -1, np.where(b % 2 == 0, 1, -1), 0)),
                            result).astype(a.dtype)
    return np.power(a, b)


@_pullback
def _div_vjp(b, ct, x, y, out):
    ct_x = b.div(ct, conj(b, y))
    return ct_x, b.neg(b.mul(ct_x, conj(b, out)))  # -ct x / y^2, without squaring y


@_pullback
def _rem_vjp(b, ct, x, y, out):
    # x - out is trunc(x / y) * y exactly in the reals; rounding recovers the integer
    # that a rounded x / y could miss
    return ct, b.neg(b.mul(ct, b.round(b.div(b.sub(x, out), y))))


def _zero_to_one(b, x):
    return b.select(b.eq(x, _zeros(b, x)), _full_like(b, x, 1), x)


@_pullback
def _pow_vjp(b, ct, x, y, out):
    # zeros replaced before the log and the power, so no NaN hides in a masked branch
    dx = b.mul(y, b.pow(x, b.sub(_zero_to_one(b, y), _full_like(b, y, 1))))
    dy = b.mul(b.log(_zero_to_one(b, x)), out)
    return b.mul(ct, conj(b, dx)), b.mul(ct, conj(b, dy))


@_pullback
def _extremum_vjp(b, ct, x, y, out):
    # the operand equal to the result takes ct; a tie splits it (JAX); NaN operands none
    zero, half = _zeros(b, ct), b.binary("mul", ct, 0.5)
    x_hit, y_hit = b.eq(x, out), b.eq(y, out)
    return (b.select(x_hit, b.select(y_hit, half, ct), zero),
            b.select(y_hit, b.select(x_hit, half, ct), zero))


@_pullback
def _atan2_vjp(b, ct, x, y, out):
    scaled = b.div(ct, b.add(_square(b, x), _square(b, y)))
    return b.mul(scaled, y), b.neg(b.mul(scaled, x))


# -- binary ------------------------------------------------------------------------
add = _binary("add", NUMERIC, _int_or_float(np.add),
              vjp=_pullback(lambda b, ct, x, y, out: (ct, ct), f32=False))
sub = _binary("sub", NUMERIC, _int_or_float(np.subtract),
              vjp=_pullback(lambda b, ct, x, y, out: (ct, b.neg(ct)), f32=False))
mul = _binary("mul", NUMERIC, _int_or_float(np.multiply), vjp=_pullback(
    lambda b, ct, x, y, out: (b.mul(ct, conj(b, y)), b.mul(ct, conj(b, x)))))
div = _binary("div", NUMERIC, _int_or_float(_trunc_div), vjp=_div_vjp,
              doc="True division for floats; integers truncate toward zero (x / 0 is 0).")
rem = _binary("rem", REAL, _int_or_float(_trunc_rem), vjp=_rem_vjp,
              doc="Remainder with the dividend's sign (C fmod); integer x % 0 is 0. "
                  "Gradients: ct to x, -ct * trunc(x / y) to y.")
pow_ = _binary("pow", NUMERIC, _int_or_float(_pow), vjp=_pow_vjp,
               doc="x ** y. Gradients: y x^(y-1) to x (0 where y == 0), log(x) x^y to y (0 "
                   "where x == 0, the limit from y > 0; NaN where x < 0, real only at "
                   "integer y).")
max_ = _binary("max", REAL, _int_or_float(np.maximum), vjp=_extremum_vjp,
               doc="Elementwise maximum; NaN propagates. A tie splits the gradient equally "
                   "(JAX); a NaN result sends none.")
min_ = _binary("min", REAL, _int_or_float(np.minimum), vjp=_extremum_vjp,
               doc="Elementwise minimum; NaN propagates. A tie splits the gradient equally "
                   "(JAX); a NaN result sends none.")
atan2 = _binary("atan2", FLOATING, via_f32(np.arctan2), vjp=_atan2_vjp)
and_ = _binary("and", INTEGRAL, lambda a, b: np.bitwise_and(a, b), differentiable=False)
or_ = _binary("or", INTEGRAL, lambda a, b: np.bitwise_or(a, b), differentiable=False)
xor = _binary("xor", INTEGRAL, lambda a, b: np.bitwise_xor(a, b), differentiable=False)


def _shift_amount(a, b):
    bits = a.dtype.itemsize * 8
    return np.clip(b.astype(np.int64), 0, bits)


def _shift_left(a, b):
    amount = _shift_amount(a, b)
    bits = a.dtype.itemsize * 8
    with np.errstate(all="ignore"):
        out = np.left_shift(a, np.minimum(amount, bits - 1).astype(a.dtype))
    return np.where(amount >= bits, 0, out).astype(a.dtype)


def _shift_right_logical(a, b):
    amount = _shift_amount(a, b)
    bits = a.dtype.itemsize * 8
    unsigned = a.view(np.dtype(f"u{a.dtype.itemsize}"))
    out = np.right_shift(unsigned, np.minimum(amount, bits - 1).astype(unsigned.dtype))
    return np.where(amount >= bits, 0, out).astype(unsigned.dtype).view(a.dtype)


def _shift_right_arithmetic(a, b):
    amount = np.minimum(_shift_amount(a, b), a.dtype.itemsize * 8 - 1)
    return np.right_shift(a, amount.astype(a.dtype)).astype(a.dtype)


shift_left = _binary("shift_left", INTEGER, _shift_left, differentiable=False,
                     doc="Shifts of width or more give 0.")
shift_right_logical = _binary("shift_right_logical", INTEGER, _shift_right_logical,
                              differentiable=False)
shift_right_arithmetic = _binary("shift_right_arithmetic", INTEGER, _shift_right_arithmetic,
                                 differentiable=False)


def _compare(fn):
    def reference(a, b):
        if a.dtype in LOW_PRECISION:
            a, b = a.astype(np.float32), b.astype(np.float32)
        return fn(a, b)

    return reference


eq = _binary("eq", ANY, _compare(np.equal), result_dtype=dt.bool_, differentiable=False)
ne = _binary("ne", ANY, _compare(np.not_equal), result_dtype=dt.bool_, differentiable=False)
lt = _binary("lt", REAL, _compare(np.less), result_dtype=dt.bool_, differentiable=False)
le = _binary("le", REAL, _compare(np.less_equal), result_dtype=dt.bool_, differentiable=False)
gt = _binary("gt", REAL, _compare(np.greater), result_dtype=dt.bool_, differentiable=False)
ge = _binary("ge", REAL, _compare(np.greater_equal), result_dtype=dt.bool_, differentiable=False)


@defop("select", family="elementwise", kind=ELEMENTWISE, num_operands=3)
class select:
    """`pred ? on_true : on_false`, elementwise; pred is bool."""

    def type(op, pred, on_true, on_false):
        if pred.dtype != dt.bool_:
            raise KilnDTypeError(f"select: predicate of type {pred} must be bool")
        t = check_same(op, on_true, on_false)
        check_same(op, pred.with_dtype(t.dtype), t)
        return t

    def reference(pred, on_true, on_false):
        return np.where(pred, on_true, on_false)

    def vjp(b, cts, xs, ys):
        (ct,), pred, zero = cts, xs[0], _zeros(b, cts[0])
        return [None, b.select(pred, ct, zero), b.select(pred, zero, ct)]


@defop("clamp", family="elementwise", kind=ELEMENTWISE, num_operands=3)
class clamp:
    """min(max(x, lo), hi), elementwise. The gradient goes to the one operand the
    result equals: x where lo <= x <= hi (ties go to x), lo where x < lo <= hi, hi
    where x > hi or lo > hi (then the result is hi). That is PyTorch's rule, except that
    PyTorch drops the gradient when lo == hi and x is outside."""

    def type(op, x, lo, hi):
        t = check_same(op, x, lo, hi)
        check_dtype(op, t, REAL, "operands")
        return t

    def reference(x, lo, hi):
        return _clamp(x, lo, hi)

    def vjp(b, cts, xs, ys):
        (ct,), (x, lo, hi), zero = cts, xs, _zeros(b, cts[0])
        to_x = b.call("and", b.le(lo, x), b.le(x, hi))
        to_lo = b.call("and", b.lt(x, lo), b.le(lo, hi))
        to_hi = b.call("or", b.gt(x, hi), b.gt(lo, hi))
        return [b.select(m, ct, zero) for m in (to_x, to_lo, to_hi)]


def _clamp(x, lo, hi):
    if x.dtype.kind in "iub":
        return np.minimum(np.maximum(x, lo), hi)
    return via_f32(lambda a, b, c: np.minimum(np.maximum(a, b), c))(x, lo, hi)


def float_to_int(x: np.ndarray, target: np.dtype) -> np.ndarray:
    """Truncate floats to `target` the way every kiln backend does (see `convert`):
    through int64 for 64-bit and uint32 targets, through int32 otherwise; NaN and values
    out of the intermediate's range become its minimum, then wrap to the target width."""
    wide = target.itemsize >= 8 or target == np.uint32
    inter, bound = (np.int64, 2.0 ** 63) if wide else (np.int32, 2.0 ** 31)
    t = np.trunc(x.astype(np.float64))
    with np.errstate(invalid="ignore"):
        ok = (t >= -bound) & (t < bound)
    out = np.where(ok, t, 0.0).astype(inter)
    out[~ok] = np.iinfo(inter).min
    return out.astype(target)


@defop("convert", family="elementwise", kind=ELEMENTWISE, num_operands=1,
       attrs={"dtype": None})
class convert:
    """Value conversion to `dtype`: floats to ints truncate toward zero; to bool is
    `x != 0`. NaN and out-of-range floats give PyTorch's (x86) result on every backend:
    64-bit and uint32 targets convert through int64 and get INT64_MIN's low bits, the
    narrower ones through int32 and get INT_MIN's (so int32 is -2**31, int8 is 0). The
    gradient is the cotangent converted back (its real part for a real operand)."""

    def type(op, x, *, dtype):
        if dtype is None:
            raise KilnArgumentError("convert: missing required attribute 'dtype'")
        target = dt.dtype(dtype)
        if x.dtype.is_complex and not target.is_complex:
            raise KilnDTypeError(f"convert: {x} to {target.short} would drop the imaginary "
                                 "part; take real() or abs() first")
        return x.with_dtype(target)

    def reference(x, *, dtype):
        target = dt.dtype(dtype).np_dtype
        if target == np.bool_:
            return x != 0
        if x.dtype.kind == "f" or x.dtype.kind == "V" or x.dtype in LOW_PRECISION:
            if target.kind in "iu":
                return float_to_int(x, target)
            if x.dtype in LOW_PRECISION and target in LOW_PRECISION:
                return x.astype(np.float32).astype(target)
        return x.astype(target)

    def vjp(b, cts, xs, ys, *, dtype):
        (ct,), d = cts, b.type_of(xs[0]).dtype
        if not d.is_inexact:
            return [None]
        if b.type_of(ct).dtype.is_complex and not d.is_complex:
            ct = b.real(ct)  # the imaginary direction does not reach a real operand
        return [b.convert(ct, d)]




@defop("bitcast_convert", family="elementwise", kind=ELEMENTWISE, num_operands=1,
       attrs={"dtype": None}, differentiable=False)
class bitcast_convert:
    """Reinterpret the bits as `dtype`, which must have the same width."""

    def type(op, x, *, dtype):
        target = dt.dtype(dtype) if dtype is not None else None
        if target is None:
            raise KilnArgumentError("bitcast_convert: missing required attribute 'dtype'")
        if target.bits != x.dtype.bits or target.is_bool or x.dtype.is_bool:
            raise KilnDTypeError(f"bitcast_convert: {x} to {target.short} needs two non-bool "
                                 f"dtypes of one width ({x.dtype.bits} vs {target.bits} bits)")
        return x.with_dtype(target)

    def reference(x, *, dtype):
        return contiguous(x).view(dt.dtype(dtype).np_dtype)

