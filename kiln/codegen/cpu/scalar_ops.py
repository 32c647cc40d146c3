"""Every elementwise primitive of kiln/ir/ops/elementwise.py as LLVM instructions.

Semantics follow the registry's numpy references exactly: integer div truncates and
x/0 == 0 (and INT_MIN/-1 wraps, as numpy), rem takes the dividend's sign, shifts of
>= width give 0, max/min propagate NaN (llvm.maximum), round is half-to-even, float->int
truncates. No fast-math flags: numpy does not contract a*b+c, so neither do we.
Low-precision results are rounded back to their dtype after each op (dtype_map).
"""

from __future__ import annotations

from kiln.errors import KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.dtypes import DType

from kiln.codegen.cpu import dtype_map
from kiln.codegen.cpu.dtype_map import is_unsigned, reg_type, round_to
from kiln.codegen.cpu.ir_builder import Fn, V, const, int_bits
from kiln.codegen.cpu.mathlib import F32_FUNCS, math_call

_FLOAT_BIN = {"add": "fadd", "sub": "fsub", "mul": "fmul", "div": "fdiv", "rem": "frem"}
_INT_BIN = {"add": "add", "sub": "sub", "mul": "mul", "and": "and", "or": "or", "xor": "xor"}
_FCMP = {"eq": "oeq", "ne": "une", "lt": "olt", "le": "ole", "gt": "ogt", "ge": "oge"}
_ICMP = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_ROUNDING = {"floor": "floor", "ceil": "ceil", "round": "roundeven", "trunc": "trunc"}


def _unsupported(op: str, d: DType) -> KilnDTypeError:
    return KilnDTypeError(f"cpu backend: op '{op}' on dtype {d.name} is not supported by the "
                          "CPU code generator")


def emit_op(fn: Fn, op: str, args: list[V], arg_dtypes: list[DType], out: DType) -> V:
    """Emit scalar primitive `op` on register values `args`; the result has dtype `out`."""
    for d in list(arg_dtypes) + [out]:
        if d.is_complex:
            raise _unsupported(op, d)
    if op == "convert":
        return convert(fn, args[0], arg_dtypes[0], out)
    if op == "bitcast_convert":
        return _bitcast(fn, args[0], arg_dtypes[0], out)
    if op == "select":
        return fn.select(args[0], args[1], args[2])
    d = arg_dtypes[-1] if op != "select" else arg_dtypes[1]
    value = _float_op(fn, op, args, d) if d.is_floating else _int_op(fn, op, args, d)
    return round_to(fn, value, out) if out.is_floating else value


def _float_op(fn: Fn, op: str, a: list[V], d: DType) -> V:
    x = a[0]
    ty = x.ty
    if op in _FLOAT_BIN:
        if op == "rem":
            fn.scalar_calls += 1  # frem lowers to a fmod call
        return fn.bin(_FLOAT_BIN[op], a[0], a[1])
    if op in _FCMP:
        return fn.fcmp(_FCMP[op], a[0], a[1])
    if op in ("max", "min"):
        return fn.binary_intrinsic("maximum" if op == "max" else "minimum", a[0], a[1])
    if op == "clamp":
        return fn.binary_intrinsic("minimum", fn.binary_intrinsic("maximum", a[0], a[1]), a[2])
    if op == "neg":
        return fn.fneg(x)
    if op == "abs":
        return fn.unary_intrinsic("fabs", x)
    if op == "sign":
        one = const(ty, 1.0)
        neg = fn.select(fn.fcmp("olt", x, const(ty, 0.0)), const(ty, -1.0), x)
        return fn.select(fn.fcmp("ogt", x, const(ty, 0.0)), one, neg)
    if op == "sqrt":
        return fn.unary_intrinsic("sqrt", x)
    if op == "rsqrt":
        if ty == "float":  # one rounding: 1/sqrt in double is exact enough to round once
            wide = fn.cast("fpext", x, "double")
            return fn.cast("fptrunc", fn.fdiv(const("double", 1.0), fn.unary_intrinsic("sqrt", wide)), "float")
        return fn.fdiv(const(ty, 1.0), fn.unary_intrinsic("sqrt", x))
    if op in _ROUNDING:
        return fn.unary_intrinsic(_ROUNDING[op], x)
    if op == "isnan":
        return fn.fcmp("uno", x, x)
    if op in ("isinf", "isfinite"):
        pred = "oeq" if op == "isinf" else "one"
        return fn.fcmp(pred, fn.unary_intrinsic("fabs", x), const(ty, float("inf")))
    if op in F32_FUNCS:
        return math_call(fn, op, list(a))
    raise _unsupported(op, d)


def _int_op(fn: Fn, op: str, a: list[V], d: DType) -> V:
    x = a[0]
    ty = x.ty
    unsigned = is_unsigned(d)
    if op in _INT_BIN and not (d.is_bool and op in ("add", "sub", "mul")):
        return fn.bin(_INT_BIN[op], a[0], a[1])
    if op in _ICMP:
        pred = _ICMP[op]
        if op not in ("eq", "ne"):
            pred = ("u" if unsigned else "s") + pred
        return fn.icmp(pred, a[0], a[1])
    if op in ("max", "min", "clamp"):
        def pick(p, u, v):
            pred = ("u" if unsigned else "s") + ("gt" if p == "max" else "lt")
            return fn.select(fn.icmp(pred, u, v), u, v)
        if op == "clamp":
            return pick("min", pick("max", a[0], a[1]), a[2])
        return pick(op, a[0], a[1])
    if op == "not":
        return fn.bin("xor", x, const(ty, -1 if ty != "i1" else 1))
    if d.is_bool:
        raise _unsupported(op, d)
    zero = const(ty, 0)
    if op == "neg":
        return fn.bin("sub", zero, x)
    if op == "abs":
        return x if unsigned else fn.select(fn.icmp("slt", x, zero), fn.bin("sub", zero, x), x)
    if op == "sign":
        if unsigned:
            return fn.cast("zext", fn.icmp("ne", x, zero), ty)
        pos = fn.cast("zext", fn.icmp("sgt", x, zero), ty)
        neg = fn.cast("zext", fn.icmp("slt", x, zero), ty)
        return fn.bin("sub", pos, neg)
    if op in ("div", "rem"):
        return _int_divrem(fn, op, a[0], a[1], unsigned)
    if op == "pow":
        return _int_pow(fn, a[0], a[1], unsigned)
    if op.startswith("shift_"):
        return _shift(fn, op, a[0], a[1], unsigned)
    raise _unsupported(op, d)


def _int_divrem(fn: Fn, op: str, a: V, b: V, unsigned: bool) -> V:
    ty = a.ty
    zero, one = const(ty, 0), const(ty, 1)
    b_zero = fn.icmp("eq", b, zero)
    safe = fn.select(b_zero, one, b)
    if unsigned:
        return fn.select(b_zero, zero, fn.bin("udiv" if op == "div" else "urem", a, safe))
    # INT_MIN / -1 overflows (UB in LLVM); numpy wraps to INT_MIN, and a / 1 == a gives that
    int_min = const(ty, -(1 << (int_bits(ty) - 1)))
    overflow = fn.bin("and", fn.icmp("eq", a, int_min), fn.icmp("eq", b, const(ty, -1)))
    safe = fn.select(overflow, one, safe)
    value = fn.bin("sdiv" if op == "div" else "srem", a, safe)
    if op == "rem":
        value = fn.select(overflow, zero, value)
    return fn.select(b_zero, zero, value)


def _int_pow(fn: Fn, base: V, exp: V, unsigned: bool) -> V:
    """Branch-free square-and-multiply over every exponent bit (vectorizable), then the
    C rules for negative exponents: 1 and -1 bases give +-1, others 0."""
    ty = base.ty
    bits = int_bits(ty)
    one, zero = const(ty, 1), const(ty, 0)
    result, b, e = one, base, exp
    for _ in range(bits if unsigned else bits - 1):
        bit = fn.icmp("ne", fn.bin("and", e, one), zero)
        result = fn.select(bit, fn.bin("mul", result, b), result)
        b = fn.bin("mul", b, b)
        e = fn.bin("lshr", e, one)
    if unsigned:
        return result
    negative = fn.icmp("slt", exp, zero)
    odd = fn.icmp("ne", fn.bin("and", exp, one), zero)
    minus_one = const(ty, -1)
    neg_value = fn.select(fn.icmp("eq", base, one), one,
                          fn.select(fn.icmp("eq", base, minus_one), fn.select(odd, minus_one, one), zero))
    return fn.select(negative, neg_value, result)


def _shift(fn: Fn, op: str, a: V, b: V, unsigned: bool) -> V:
    ty = a.ty
    bits = int_bits(ty)
    amount = b if unsigned else fn.select(fn.icmp("slt", b, const(ty, 0)), const(ty, 0), b)
    too_big = fn.icmp("uge", amount, const(ty, bits))
    capped = fn.select(too_big, const(ty, bits - 1), amount)
    if op == "shift_left":
        return fn.select(too_big, const(ty, 0), fn.bin("shl", a, capped))
    if op == "shift_right_logical":
        return fn.select(too_big, const(ty, 0), fn.bin("lshr", a, capped))
    return fn.bin("ashr", a, capped)


def convert(fn: Fn, x: V, src: DType, dst: DType) -> V:
    """Value conversion with the reference's rules (float->int truncates; ->bool is != 0)."""
    out_ty = reg_type(dst)
    if src == dst:
        return x
    if dst.is_bool:
        if src.is_floating:
            return fn.fcmp("une", x, const(x.ty, 0.0))
        return fn.icmp("ne", x, const(x.ty, 0))
    if src.is_bool:
        if dst.is_floating:
            return fn.cast("uitofp", x, out_ty)
        return fn.cast("zext", x, out_ty)
    if src.is_integer and dst.is_integer:
        sb, db = int_bits(x.ty), int_bits(out_ty)
        if db < sb:
            return fn.cast("trunc", x, out_ty)
        return fn.cast("zext" if is_unsigned(src) else "sext", x, out_ty) if db > sb else x
    if src.is_integer:  # -> float
        op = "uitofp" if is_unsigned(src) else "sitofp"
        if dst == dt.float64 or dst == dt.float32:
            return fn.cast(op, x, out_ty)
        return round_to(fn, fn.cast(op, x, "float"), dst)
    if dst.is_integer:  # float -> int truncates; NaN/out-of-range as the reference says
        wide = dst.bits >= 64 or dst == dt.uint32
        inter, bound = ("i64", 2.0 ** 63) if wide else ("i32", 2.0 ** 31)
        ok = fn.bin("and", fn.fcmp("oge", x, const(x.ty, -bound)), fn.fcmp("olt", x, const(x.ty, bound)))
        r = fn.select(ok, fn.freeze(fn.cast("fptosi", x, inter)), const(inter, -(1 << (int_bits(inter) - 1))))
        return r if int_bits(out_ty) == int_bits(inter) else fn.cast("trunc", r, out_ty)
    # float -> float
    if dst == dt.float64:
        return fn.cast("fpext", x, "double")
    if x.ty == "double":
        if dst == dt.float32:
            return fn.cast("fptrunc", x, "float")
        if dst.short == "f16":
            return fn.cast("fpext", fn.cast("fptrunc", x, "half"), "float")
        return round_to(fn, _to_f32_round_odd(fn, x), dst)
    return round_to(fn, x, dst)


def _to_f32_round_odd(fn: Fn, x: V) -> V:
    """double -> float with round-to-odd, so a second rounding to a narrower format
    equals one direct rounding from double (no double-rounding error)."""
    r = fn.cast("fptrunc", x, "float")
    back = fn.cast("fpext", r, "double")
    bits = fn.cast("bitcast", r, "i32")
    # RN went away from zero: step one ulp toward zero to get the truncation
    overshoot = fn.fcmp("ogt", fn.unary_intrinsic("fabs", back), fn.unary_intrinsic("fabs", x))
    finite = fn.fcmp("one", fn.unary_intrinsic("fabs", back), const("double", float("inf")))
    bits = fn.select(fn.bin("and", overshoot, finite), fn.bin("sub", bits, const("i32", 1)), bits)
    inexact = fn.fcmp("une", back, x)
    bits = fn.select(fn.bin("and", inexact, fn.fcmp("ord", x, x)), fn.bin("or", bits, const("i32", 1)), bits)
    return fn.cast("bitcast", bits, "float")


def _bits_of(fn: Fn, x: V, d: DType) -> V:
    if dtype_map.is_low_precision(d):
        return dtype_map.store_convert(fn, x, d) if d.short != "f16" else \
            fn.cast("bitcast", fn.cast("fptrunc", x, "half"), "i16")
    if d.is_floating:
        return fn.cast("bitcast", x, "i32" if x.ty == "float" else "i64")
    return x


def _bitcast(fn: Fn, x: V, src: DType, dst: DType) -> V:
    if src.bits != dst.bits or src.is_bool or dst.is_bool:
        raise KilnDTypeError(f"cpu backend: bitcast_convert from {src.name} to {dst.name} needs two "
                             "non-bool dtypes of one width")
    bits = _bits_of(fn, x, src)
    if dst.short == "f16":
        return fn.cast("fpext", fn.cast("bitcast", bits, "half"), "float")
    if dtype_map.is_low_precision(dst):
        return dtype_map.load_convert(fn, bits, dst)
    if dst.is_floating:
        return fn.cast("bitcast", bits, reg_type(dst))
    return bits
