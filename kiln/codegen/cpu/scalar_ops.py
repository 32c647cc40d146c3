"""Every elementwise primitive of kiln/ir/ops/elementwise.py as LLVM instructions.

`SCALAR_TABLE` is what the CPU backend emits natively (the backend contract's table,
kiln/codegen/backend.py); every other op reaches this file already legalized
(kiln/codegen/legalize.py: integer div/rem guards, integer pow and shift clamps are
written there, once, around the unchecked machine ops here). Semantics follow the
registry's numpy references exactly: max/min propagate NaN (llvm.maximum), round is
half-to-even, float->int truncates. No fast-math flags: numpy does not contract a*b+c, so neither do we.
Low-precision results are rounded back to their dtype after each op (dtype_map).
"""

from __future__ import annotations

from kiln.errors import KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.dtypes import DType

from kiln.codegen.cpu import dtype_map
from kiln.codegen.cpu.dtype_map import is_unsigned, reg_type, round_to
from kiln.codegen.cpu.ir_builder import Fn, V, const, int_bits
from kiln.codegen.backend import lookup
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
    """Emit scalar primitive `op` on register values `args`; the result has dtype `out`.
    The op must be in SCALAR_TABLE (the backend legalizes every other op first)."""
    for d in list(arg_dtypes) + [out]:
        if d.is_complex:
            raise _unsupported(op, d)
    emitter = lookup(SCALAR_TABLE, op, arg_dtypes, out)
    if emitter is None:
        raise _unsupported(op, arg_dtypes[-1] if arg_dtypes else out)
    value = emitter(fn, args, arg_dtypes, out)
    if op in ("convert", "bitcast_convert", "select"):
        return value
    return round_to(fn, value, out) if out.is_floating else value


# -- the table: op -> emitter(fn, args, arg_dtypes, out) -------------------------------

def _fbin(inst: str):
    return lambda fn, a, ds, out: fn.bin(inst, a[0], a[1])


def _frem(fn: Fn, a, ds, out) -> V:
    fn.scalar_calls += 1  # frem lowers to a fmod call
    return fn.bin("frem", a[0], a[1])


def _fcmp(pred: str):
    return lambda fn, a, ds, out: fn.fcmp(pred, a[0], a[1])


def _fclamp(fn: Fn, a, ds, out) -> V:
    return fn.binary_intrinsic("minimum", fn.binary_intrinsic("maximum", a[0], a[1]), a[2])


def _fsign(fn: Fn, a, ds, out) -> V:
    x, ty = a[0], a[0].ty
    neg = fn.select(fn.fcmp("olt", x, const(ty, 0.0)), const(ty, -1.0), x)
    return fn.select(fn.fcmp("ogt", x, const(ty, 0.0)), const(ty, 1.0), neg)


def _rsqrt(fn: Fn, a, ds, out) -> V:
    x, ty = a[0], a[0].ty
    if ty == "float":  # one rounding: 1/sqrt in double is exact enough to round once
        wide = fn.cast("fpext", x, "double")
        return fn.cast("fptrunc", fn.fdiv(const("double", 1.0), fn.unary_intrinsic("sqrt", wide)), "float")
    return fn.fdiv(const(ty, 1.0), fn.unary_intrinsic("sqrt", x))


def _unary_intrinsic(name: str):
    return lambda fn, a, ds, out: fn.unary_intrinsic(name, a[0])


def _fclass(pred: str):
    return lambda fn, a, ds, out: fn.fcmp(pred, fn.unary_intrinsic("fabs", a[0]), const(a[0].ty, float("inf")))


def _math(name: str):
    return lambda fn, a, ds, out: math_call(fn, name, list(a))


def _icmp(pred: str):
    def emit(fn: Fn, a, ds, out) -> V:
        p = pred if pred in ("eq", "ne") else ("u" if is_unsigned(ds[0]) else "s") + pred
        return fn.icmp(p, a[0], a[1])
    return emit


def _ipick(fn: Fn, p: str, d: DType, u: V, v: V) -> V:
    pred = ("u" if is_unsigned(d) else "s") + ("gt" if p == "max" else "lt")
    return fn.select(fn.icmp(pred, u, v), u, v)


def _iextremum(p: str):
    return lambda fn, a, ds, out: _ipick(fn, p, ds[0], a[0], a[1])


def _iclamp(fn: Fn, a, ds, out) -> V:
    return _ipick(fn, "min", ds[0], _ipick(fn, "max", ds[0], a[0], a[1]), a[2])


def _not(fn: Fn, a, ds, out) -> V:
    return fn.bin("xor", a[0], const(a[0].ty, -1 if a[0].ty != "i1" else 1))


def _ineg(fn: Fn, a, ds, out) -> V:
    return fn.bin("sub", const(a[0].ty, 0), a[0])


def _iabs(fn: Fn, a, ds, out) -> V:
    x, zero = a[0], const(a[0].ty, 0)
    return x if is_unsigned(ds[0]) else fn.select(fn.icmp("slt", x, zero), fn.bin("sub", zero, x), x)


def _isign(fn: Fn, a, ds, out) -> V:
    x, ty = a[0], a[0].ty
    zero = const(ty, 0)
    if is_unsigned(ds[0]):
        return fn.cast("zext", fn.icmp("ne", x, zero), ty)
    pos = fn.cast("zext", fn.icmp("sgt", x, zero), ty)
    neg = fn.cast("zext", fn.icmp("slt", x, zero), ty)
    return fn.bin("sub", pos, neg)


def _signed_or_not(signed: str, unsigned: str):
    return lambda fn, a, ds, out: fn.bin(unsigned if is_unsigned(ds[0]) else signed, a[0], a[1])


SCALAR_TABLE: dict = {
    "convert": lambda fn, a, ds, out: convert(fn, a[0], ds[0], out),
    "bitcast_convert": lambda fn, a, ds, out: _bitcast(fn, a[0], ds[0], out),
    "select": lambda fn, a, ds, out: fn.select(a[0], a[1], a[2]),
    "rem:float": _frem, "max:float": lambda fn, a, ds, out: fn.binary_intrinsic("maximum", a[0], a[1]),
    "min:float": lambda fn, a, ds, out: fn.binary_intrinsic("minimum", a[0], a[1]),
    "clamp:float": _fclamp, "neg:float": lambda fn, a, ds, out: fn.fneg(a[0]),
    "abs:float": _unary_intrinsic("fabs"), "sign:float": _fsign, "sqrt:float": _unary_intrinsic("sqrt"),
    "rsqrt:float": _rsqrt, "isnan:float": lambda fn, a, ds, out: fn.fcmp("uno", a[0], a[0]),
    "isinf:float": _fclass("oeq"), "isfinite:float": _fclass("one"),
    "max:int": _iextremum("max"), "min:int": _iextremum("min"), "clamp:int": _iclamp,
    "max:bool": _iextremum("max"), "min:bool": _iextremum("min"), "clamp:bool": _iclamp,
    "not:int": _not, "not:bool": _not, "neg:int": _ineg, "abs:int": _iabs, "sign:int": _isign,
    # C-semantics machine ops; legalize adds div/rem guards, pow and shift clamps around them
    "div_unchecked:int": _signed_or_not("sdiv", "udiv"), "rem_unchecked:int": _signed_or_not("srem", "urem"),
    "shl_unchecked:int": _fbin("shl"), "shr_logical_unchecked:int": _fbin("lshr"),
    "shr_arith_unchecked:int": _fbin("ashr"),
}
SCALAR_TABLE.update({f"{op}:float": _fbin(inst) for op, inst in _FLOAT_BIN.items() if op != "rem"})
SCALAR_TABLE.update({f"{op}:float": _fcmp(pred) for op, pred in _FCMP.items()})
SCALAR_TABLE.update({f"{op}:float": _unary_intrinsic(name) for op, name in _ROUNDING.items()})
SCALAR_TABLE.update({f"{op}:float": _math(op) for op in F32_FUNCS})
SCALAR_TABLE.update({f"{op}:int": _fbin(inst) for op, inst in _INT_BIN.items()})
SCALAR_TABLE.update({f"{op}:bool": _fbin(inst) for op, inst in _INT_BIN.items() if op in ("and", "or", "xor")})
SCALAR_TABLE.update({f"{op}:{k}": _icmp(pred) for op, pred in _ICMP.items() for k in ("int", "bool")})
# Kernel IR reductions (llvm_emit._combine emits them); bool sum/max/prod/min arrive as
# or/and from legalize
SCALAR_TABLE.update({f"reduce.{op}:float": "llvm_emit._combine" for op in ("sum", "prod", "max", "min")})
SCALAR_TABLE.update({f"reduce.{op}:int": "llvm_emit._combine" for op in ("sum", "prod", "max", "min", "and", "or")})
SCALAR_TABLE.update({f"reduce.{op}:bool": "llvm_emit._combine" for op in ("and", "or")})
# float64 -> bfloat16 / float8 go through legalize's round-to-odd float32
SCALAR_TABLE.update({f"convert:f64>{short}": None for short in ("bf16", "f8e4m3fn", "f8e5m2")})


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
