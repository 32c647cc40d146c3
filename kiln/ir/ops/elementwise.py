"""Elementwise primitives: the scalar ops every backend implements.

Operands of a primitive already share one dtype and one shape (the frontend inserts
`convert` and `broadcast_in_dim`), so each rule only checks the dtype category.
Integer `div` truncates toward zero and `rem` takes the dividend's sign, as C, LLVM
and XLA do; Python's floor semantics are composites in the frontend.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.rules import (
    contiguous,
    ANY, FLOATING, INEXACT, INTEGER, INTEGRAL, LOW_PRECISION, NUMERIC, REAL, check_dtype, check_same,
    via_f32,
)
from kiln.ir.registry import ELEMENTWISE, defop


def _unary(name: str, allowed: str, reference, *, result_dtype=None, differentiable=True,
           doc: str = ""):
    def type_rule(op, x):
        check_dtype(op, x, allowed)
        return x if result_dtype is None else x.with_dtype(result_dtype(x.dtype))

    cls = type(name, (), {"type": type_rule, "reference": reference, "__doc__": doc})
    return defop(name, family="elementwise", kind=ELEMENTWISE, num_operands=1,
                 differentiable=differentiable)(cls)


def _binary(name: str, allowed: str, reference, *, result_dtype=None, differentiable=True,
            doc: str = ""):
    def type_rule(op, x, y):
        t = check_same(op, x, y)
        check_dtype(op, t, allowed, "operands")
        return t if result_dtype is None else t.with_dtype(result_dtype)

    cls = type(name, (), {"type": type_rule, "reference": reference, "__doc__": doc})
    return defop(name, family="elementwise", kind=ELEMENTWISE, num_operands=2,
                 differentiable=differentiable)(cls)


def _erf(x):
    # numpy has no erf; math.erf is correctly rounded in float64
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(x.astype(np.float64))).astype(np.float64)


def _round_half_even(x):
    return np.round(x)


def _rsqrt(x):
    return 1.0 / np.sqrt(x)


def _sign(x):
    return np.sign(x) if not x.dtype.kind == "c" else np.where(x == 0, 0, x / np.abs(x))


# -- unary -------------------------------------------------------------------------
neg = _unary("neg", NUMERIC, lambda x: np.negative(x))
abs_ = _unary("abs", NUMERIC, lambda x: np.abs(x).astype(np.float32) if x.dtype.kind == "c"
              else np.abs(x), result_dtype=lambda d: dt.float32 if d.is_complex else d)
sign = _unary("sign", NUMERIC, lambda x: _sign(x).astype(x.dtype), differentiable=False)
exp = _unary("exp", INEXACT, via_f32(np.exp))
expm1 = _unary("expm1", FLOATING, via_f32(np.expm1))
log = _unary("log", INEXACT, via_f32(np.log))
log1p = _unary("log1p", FLOATING, via_f32(np.log1p))
sin = _unary("sin", INEXACT, via_f32(np.sin))
cos = _unary("cos", INEXACT, via_f32(np.cos))
tan = _unary("tan", FLOATING, via_f32(np.tan))
asin = _unary("asin", FLOATING, via_f32(np.arcsin))
acos = _unary("acos", FLOATING, via_f32(np.arccos))
atan = _unary("atan", FLOATING, via_f32(np.arctan))
sinh = _unary("sinh", FLOATING, via_f32(np.sinh))
cosh = _unary("cosh", FLOATING, via_f32(np.cosh))
tanh = _unary("tanh", INEXACT, via_f32(np.tanh))
sqrt = _unary("sqrt", INEXACT, via_f32(np.sqrt))
rsqrt = _unary("rsqrt", FLOATING, via_f32(_rsqrt))
erf = _unary("erf", FLOATING, via_f32(_erf))
floor = _unary("floor", FLOATING, via_f32(np.floor), differentiable=False)
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


@defop("imag", family="elementwise", kind=ELEMENTWISE, num_operands=1)
class imag:
    """Imaginary part of a complex64 tensor (float32)."""

    def type(op, x):
        if not x.dtype.is_complex:
            raise KilnDTypeError(f"imag: operand of type {x} is not complex")
        return x.with_dtype(dt.float32)

    def reference(x):
        return contiguous(x.imag).astype(np.float32)


@defop("complex", family="elementwise", kind=ELEMENTWISE, num_operands=2)
class complex_:
    """complex64 from float32 real and imaginary parts."""

    def type(op, re, im):
        t = check_same(op, re, im)
        if t.dtype != dt.float32:
            raise KilnDTypeError(f"complex: operands must be float32, got {re} and {im}")
        return t.with_dtype(dt.complex64)

    def reference(re, im):
        return (re + 1j * im).astype(np.complex64)


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


# -- binary ------------------------------------------------------------------------
add = _binary("add", NUMERIC, _int_or_float(np.add))
sub = _binary("sub", NUMERIC, _int_or_float(np.subtract))
mul = _binary("mul", NUMERIC, _int_or_float(np.multiply))
div = _binary("div", NUMERIC, _int_or_float(_trunc_div),
              doc="True division for floats; integers truncate toward zero (x / 0 is 0).")
rem = _binary("rem", REAL, _int_or_float(_trunc_rem),
              doc="Remainder with the dividend's sign (C fmod); integer x % 0 is 0.")
pow_ = _binary("pow", NUMERIC, _int_or_float(_pow))
max_ = _binary("max", REAL, _int_or_float(np.maximum), doc="Elementwise maximum; NaN propagates.")
min_ = _binary("min", REAL, _int_or_float(np.minimum), doc="Elementwise minimum; NaN propagates.")
atan2 = _binary("atan2", FLOATING, via_f32(np.arctan2))
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


@defop("clamp", family="elementwise", kind=ELEMENTWISE, num_operands=3)
class clamp:
    """min(max(x, lo), hi), elementwise."""

    def type(op, x, lo, hi):
        t = check_same(op, x, lo, hi)
        check_dtype(op, t, REAL, "operands")
        return t

    def reference(x, lo, hi):
        return _clamp(x, lo, hi)


def _clamp(x, lo, hi):
    if x.dtype.kind in "iub":
        return np.minimum(np.maximum(x, lo), hi)
    return via_f32(lambda a, b, c: np.minimum(np.maximum(a, b), c))(x, lo, hi)


@defop("convert", family="elementwise", kind=ELEMENTWISE, num_operands=1,
       attrs={"dtype": None})
class convert:
    """Value conversion to `dtype`: floats to ints truncate toward zero (NaN and
    out-of-range values are undefined, as in C); to bool is `x != 0`."""

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
                with np.errstate(all="ignore"):
                    return np.trunc(x.astype(np.float64)).astype(target)
            if x.dtype in LOW_PRECISION and target in LOW_PRECISION:
                return x.astype(np.float32).astype(target)
        return x.astype(target)




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

