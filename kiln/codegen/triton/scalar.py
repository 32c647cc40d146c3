"""kiln dtypes and scalar primitives as Triton expressions (source text).

Semantics follow the registry's numpy references, as the CPU backend does
(kiln/codegen/cpu/scalar_ops.py):

- Low-precision floats (float16, bfloat16, float8) are held in float32 registers and
  every inexact op whose result is low precision rounds back (RNE) right away: compute
  in float32, round once per op, exactly the references' `via_f32`.
- float32 division and square root are IEEE (`tl.div_rn`, `tl.sqrt_rn`: Triton's `/`
  and `tl.sqrt` are the approximate PTX instructions); transcendental functions come
  from libdevice (CUDA) / OCML (ROCm), within 1-2 ulp. `fast_math=True` trades those
  for the hardware approximations (`/`, `tl.sqrt`, `tl.exp`, `tl.rsqrt`, ...).
- max/min propagate NaN; integer div truncates with x/0 == 0 and INT_MIN/-1 == INT_MIN;
  rem takes the dividend's sign; shifts by >= the width give 0 (or the sign); round is
  half-to-even; float -> int truncates (NaN/out-of-range as the CPU backend does).

Every function here returns source text and pulls operand text from its arguments;
operands are always temporaries or literals, so repeating one costs nothing.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.dtypes import DType

# kiln short name -> Triton dtype (storage) and pointer signature element
TL_DTYPE = {
    "i1": "tl.int1", "u8": "tl.uint8", "u32": "tl.uint32", "i8": "tl.int8", "i16": "tl.int16",
    "i32": "tl.int32", "i64": "tl.int64", "f8e4m3fn": "tl.float8e4nv", "f8e5m2": "tl.float8e5",
    "bf16": "tl.bfloat16", "f16": "tl.float16", "f32": "tl.float32", "f64": "tl.float64",
}
SIGNATURE = {
    "i1": "i1", "u8": "u8", "u32": "u32", "i8": "i8", "i16": "i16", "i32": "i32", "i64": "i64",
    "f8e4m3fn": "fp8e4nv", "f8e5m2": "fp8e5", "bf16": "bf16", "f16": "fp16", "f32": "fp32", "f64": "fp64",
}
UNSIGNED_OF = {"i8": "tl.uint8", "i16": "tl.uint16", "i32": "tl.uint32", "i64": "tl.uint64"}

# libdevice (CUDA) / OCML (ROCm) names, resolved per target by triton.language.extra.libdevice
LIBDEVICE_UNARY = ("exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos", "atan",
                   "sinh", "cosh", "tanh", "erf")
# fast_math: the hardware approximations Triton exposes directly
FAST_UNARY = {"exp": "tl.exp", "log": "tl.log", "sin": "tl.sin", "cos": "tl.cos"}
# exact ops: a low-precision result needs no rounding (it is one of the operands, or an
# integer-valued float of an operand's magnitude)
_EXACT = {"neg", "abs", "sign", "max", "min", "clamp", "select", "floor", "ceil", "round", "trunc"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"


def unsupported(what: str, d: DType) -> KilnDTypeError:
    return KilnDTypeError(f"triton backend: {what} on dtype {d.name} is not supported "
                          "(complex kernels run on the cpu backend)")


def tl_dtype(d: DType) -> str:
    try:
        return TL_DTYPE[d.short]
    except KeyError:
        raise unsupported("a buffer", d) from None


def pointer_type(d: DType) -> str:
    """The signature string of a pointer to `d` ("*fp32", "*bf16", "*i1", ...)."""
    try:
        return "*" + SIGNATURE[d.short]
    except KeyError:
        raise unsupported("a buffer", d) from None


def is_low_precision(d: DType) -> bool:
    return d.is_floating and d.bits < 32


def reg_dtype(d: DType) -> str:
    """The Triton dtype a value of `d` has in registers (float32 for low precision)."""
    return "tl.float32" if is_low_precision(d) else tl_dtype(d)


def is_unsigned(d: DType) -> bool:
    return d.category == dt.UINT


def round_to(x: str, d: DType) -> str:
    """A float32 register value rounded (RNE) to low-precision `d` and held as float32."""
    return f"{x}.to({tl_dtype(d)}).to(tl.float32)" if is_low_precision(d) else x


def literal(value, d: DType) -> str:
    """A constant of dtype `d`. float32 / int32 / bool literals are Python literals (Triton
    types them so); other dtypes are explicit `tl.full((), v, dtype)` scalars, so an int64
    or float64 constant keeps its type and value."""
    if d.is_complex:
        raise unsupported("a constant", d)
    if d.is_bool:
        return "True" if bool(value) else "False"
    if d.is_floating:
        v = float(np.asarray(value, dtype=np.float64).astype(d.np_dtype).astype(np.float64))
        text = _float_text(v)
        normal = v == 0 or math.isinf(v) or math.isnan(v) or 2.0 ** -126 <= abs(v) <= 3.4028234663852886e38
        if reg_dtype(d) == "tl.float32" and normal:
            return text
        return f"tl.full((), {text}, {reg_dtype(d)})"
    v = int(np.asarray(value).astype(d.np_dtype))
    if d == dt.int32:
        return str(v)
    return f"tl.full((), {v}, {tl_dtype(d)})"


def _float_text(v: float) -> str:
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else '-float("inf")'
    return repr(v)


def int_min(d: DType) -> int:
    return int(np.iinfo(d.np_dtype).min)


class ScalarOps:
    """Scalar primitives as Triton source. `emit(line)` appends a statement (for the ops
    that need several, e.g. integer pow); `temp()` names a fresh temporary."""

    def __init__(self, emit, temp, fast_math: bool = False):
        self.emit, self.temp, self.fast_math = emit, temp, fast_math

    def op(self, op: str, args: list[str], arg_dtypes: list[DType], out: DType) -> str:
        """The source of `op` (which must be in SCALAR_TABLE: the backend legalizes the rest)."""
        for d in list(arg_dtypes) + [out]:
            if d.is_complex:
                raise unsupported(f"op '{op}'", d)
        from kiln.codegen.backend import lookup

        emitter = lookup(SCALAR_TABLE, op, arg_dtypes, out)
        if emitter is None:
            raise unsupported(f"op '{op}'", arg_dtypes[-1] if arg_dtypes else out)
        value = emitter(self, op, args, arg_dtypes, out)
        if op in ("convert", "bitcast_convert", "select") or op in _COMPARE or not arg_dtypes[-1].is_floating:
            return value
        return value if op in _EXACT or not is_low_precision(out) else round_to(f"({value})", out)

    # -- floats (registers are float32 or float64) -------------------------------------
    def _float(self, op: str, a: list[str], d: DType) -> str:
        x = a[0]
        f64 = d == dt.float64
        fast = self.fast_math
        if op in ("add", "sub", "mul"):
            return f"{a[0]} {dict(add='+', sub='-', mul='*')[op]} {a[1]}"
        if op == "div":
            return f"{a[0]} / {a[1]}" if (f64 or fast) else f"tl.div_rn({a[0]}, {a[1]})"
        if op == "rem":
            return f"libdevice.fmod({a[0]}, {a[1]})"
        if op == "pow":
            return f"libdevice.pow({a[0]}, {a[1]})"
        if op == "atan2":
            return f"libdevice.atan2({a[0]}, {a[1]})"
        if op in ("max", "min"):
            return f"tl.{op}imum({a[0]}, {a[1]}, {_NAN_ALL})"
        if op == "clamp":
            return f"tl.minimum(tl.maximum({a[0]}, {a[1]}, {_NAN_ALL}), {a[2]}, {_NAN_ALL})"
        if op == "neg":
            return f"-{x}"
        if op == "abs":
            return f"tl.abs({x})"
        if op == "sign":
            one, minus = literal(1.0, d), literal(-1.0, d)
            return f"tl.where({x} > 0, {one}, tl.where({x} < 0, {minus}, {x}))"
        # float64 sqrt is IEEE (sqrt.rn.f64); tl.sqrt_rn is the float32 spelling of it
        if op == "sqrt":
            return f"tl.sqrt({x})" if (fast or f64) else f"tl.sqrt_rn({x})"
        if op == "rsqrt":
            if fast:
                return f"tl.rsqrt({x})"
            if f64:
                return f"1.0 / tl.sqrt({x})"
            # one rounding: 1/sqrt in float64 is exact enough to round once to float32
            return f"(1.0 / tl.sqrt({x}.to(tl.float64))).to(tl.float32)"
        if op in ("floor", "ceil"):
            return f"tl.{op}({x})"
        if op == "round":
            return f"libdevice.rint({x})"
        if op == "trunc":
            return f"libdevice.trunc({x})"
        if op == "isnan":
            return f"{x} != {x}"
        if op == "isinf":
            return f'tl.abs({x}) == float("inf")'
        if op == "isfinite":
            return f'tl.abs({x}) < float("inf")'
        if op in LIBDEVICE_UNARY:
            if fast and op in FAST_UNARY and not f64:
                return f"{FAST_UNARY[op]}({x})"
            return f"libdevice.{op}({x})"
        raise unsupported(f"op '{op}'", d)

    # -- integers and bool ----------------------------------------------------------------
    def _int(self, op: str, a: list[str], d: DType) -> str:
        x = a[0]
        if d.is_bool:
            table = {"and": "&", "or": "|", "xor": "^", "max": "|", "min": "&"}
            if op in table:
                return f"{a[0]} {table[op]} {a[1]}"
            if op == "not":
                return f"~{x}"
            if op == "clamp":
                return f"({a[0]} | {a[1]}) & {a[2]}"
            raise unsupported(f"op '{op}'", d)
        arith = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^"}
        if op in arith:
            return f"{a[0]} {arith[op]} {a[1]}"
        if op in ("max", "min"):
            return f"tl.{op}imum({a[0]}, {a[1]})"
        if op == "clamp":
            return f"tl.minimum(tl.maximum({a[0]}, {a[1]}), {a[2]})"
        if op == "not":
            return f"~{x}"
        if op == "neg":
            return f"-{x}"
        if op == "abs":
            return x if is_unsigned(d) else f"tl.abs({x})"
        if op == "sign":
            t = tl_dtype(d)
            if is_unsigned(d):
                return f"({x} != 0).to({t})"
            return f"({x} > 0).to({t}) - ({x} < 0).to({t})"
        if op.endswith("_unchecked"):
            return self._machine(op, a, d)
        raise unsupported(f"op '{op}'", d)

    def _machine(self, op: str, a: list[str], d: DType) -> str:
        """The unchecked C-semantics ops legalize wraps its guards around."""
        if op == "div_unchecked":
            return f"{a[0]} // {a[1]}"
        if op == "rem_unchecked":
            return f"{a[0]} % {a[1]}"
        if op == "shl_unchecked":
            return f"{a[0]} << {a[1]}"
        if op == "shr_logical_unchecked" and not is_unsigned(d):
            u, t = UNSIGNED_OF[d.short], tl_dtype(d)
            amount = a[1] if a[1].lstrip("-").isdigit() else f"{a[1]}.to({u}, bitcast=True)"
            return f"({a[0]}.to({u}, bitcast=True) >> {amount}).to({t}, bitcast=True)"
        return f"{a[0]} >> {a[1]}"  # arithmetic on signed, logical on unsigned

    # -- conversions ----------------------------------------------------------------------
    def convert(self, x: str, src: DType, dst: DType) -> str:
        """Value conversion with the references' rules (float -> int truncates; -> bool is != 0)."""
        if src.is_complex or dst.is_complex:
            raise unsupported("convert", src if src.is_complex else dst)
        if src == dst:
            return x
        if dst.is_bool:
            return f"{x} != 0"
        if src.is_bool or (src.is_integer and dst.is_integer):
            return round_to(f"{x}.to({tl_dtype(dst)})", dst) if dst.is_floating else f"{x}.to({tl_dtype(dst)})"
        if src.is_integer:  # -> float: one rounding, straight to the destination format
            return round_to(f"{x}.to({tl_dtype(dst)})", dst)
        if dst.is_integer:  # float -> int truncates; NaN/out-of-range as the reference says
            wide = dst.bits >= 64 or dst == dt.uint32
            inter, bound = ("tl.int64", 2.0 ** 63) if wide else ("tl.int32", 2.0 ** 31)
            lowest = -(1 << 63) if wide else -(1 << 31)
            r = self.temp()
            self.emit(f"{r} = tl.where(({x} >= {-bound!r}) & ({x} < {bound!r}), {x}, 0.0).to({inter})")
            self.emit(f"{r} = tl.where(({x} >= {-bound!r}) & ({x} < {bound!r}), {r}, {lowest}).to({inter})")
            return r if tl_dtype(dst) == inter else f"{r}.to({tl_dtype(dst)})"
        # float -> float
        if dst == dt.float32 and is_low_precision(src):
            return x  # a low-precision value is already an exact float32 register
        if dst == dt.float64 or dst == dt.float32:
            return f"{x}.to({tl_dtype(dst)})"
        if src == dt.float64 and dst.bits == 8:
            # float64 -> float8 through a round-to-odd float32 (no double-rounding error)
            return round_to(self._f64_to_f32_round_odd(x), dst)
        return round_to(x, dst)

    def _f64_to_f32_round_odd(self, x: str) -> str:
        r, bits = self.temp(), self.temp()
        self.emit(f"{r} = {x}.to(tl.float32)")
        self.emit(f"{bits} = {r}.to(tl.int32, bitcast=True)")
        # RN went away from zero: step one ulp toward zero to get the truncation
        self.emit(f"{bits} = tl.where((tl.abs({r}.to(tl.float64)) > tl.abs({x})) & "
                  f"(tl.abs({r}) < float(\"inf\")), {bits} - 1, {bits})")
        self.emit(f"{bits} = tl.where(({r}.to(tl.float64) != {x}) & ({x} == {x}), {bits} | 1, {bits})")
        return f"{bits}.to(tl.float32, bitcast=True)"

    def bitcast(self, x: str, src: DType, dst: DType) -> str:
        if src.bits != dst.bits or src.is_bool or dst.is_bool or src.is_complex or dst.is_complex:
            raise KilnDTypeError(f"triton backend: bitcast_convert from {src.name} to {dst.name} needs "
                                 "two non-bool dtypes of one width")
        bits = f"{x}.to({tl_dtype(src)})" if is_low_precision(src) else x
        value = f"{bits}.to({tl_dtype(dst)}, bitcast=True)"
        return f"{value}.to(tl.float32)" if is_low_precision(dst) else value


# -- the table: what this backend emits natively (kiln/codegen/backend.py) ----------------
# Integer div/rem guards, integer pow and shift clamps come from the shared legalize
# pass (kiln/codegen/legalize.py), around the unchecked machine ops below.

def _via(method: str):
    return lambda ops, op, a, ds, out: getattr(ops, method)(op, a, ds[-1])


_FLOAT_OPS = ("add", "sub", "mul", "div", "rem", "pow", "atan2", "max", "min", "clamp", "neg", "abs",
              "sign", "sqrt", "rsqrt", "floor", "ceil", "round", "trunc", "isnan", "isinf", "isfinite",
              *LIBDEVICE_UNARY)
_INT_OPS = ("add", "sub", "mul", "and", "or", "xor", "max", "min", "clamp", "not", "neg", "abs", "sign",
            "div_unchecked", "rem_unchecked", "shl_unchecked", "shr_logical_unchecked", "shr_arith_unchecked")
_BOOL_OPS = ("and", "or", "xor", "max", "min", "not", "clamp")
SCALAR_TABLE: dict = {
    "convert": lambda ops, op, a, ds, out: ops.convert(a[0], ds[0], out),
    "bitcast_convert": lambda ops, op, a, ds, out: ops.bitcast(a[0], ds[0], out),
    "select": lambda ops, op, a, ds, out: f"tl.where({a[0]}, {a[1]}, {a[2]})",
}
SCALAR_TABLE.update({f"{op}:{k}": (lambda ops, op, a, ds, out: f"{a[0]} {_COMPARE[op]} {a[1]}")
                     for op in _COMPARE for k in ("float", "int", "bool")})
SCALAR_TABLE.update({f"{op}:float": _via("_float") for op in _FLOAT_OPS})
SCALAR_TABLE.update({f"{op}:int": _via("_int") for op in _INT_OPS})
SCALAR_TABLE.update({f"{op}:bool": _via("_int") for op in _BOOL_OPS})
# Kernel IR reductions (emitted by reduce_combine / reduce_across below); bool
# sum/max/prod/min arrive as or/and from legalize
SCALAR_TABLE.update({f"reduce.{op}:float": "reduce_combine" for op in ("sum", "prod", "max", "min")})
SCALAR_TABLE.update({f"reduce.{op}:int": "reduce_combine" for op in ("sum", "prod", "max", "min", "and", "or")})
SCALAR_TABLE.update({f"reduce.{op}:bool": "reduce_combine" for op in ("and", "or")})


# -- reductions -----------------------------------------------------------------------------

def reduce_init(op: str, d: DType) -> str:
    """The reduction's identity (legalize.reduce_identity, the one definition) as source."""
    from kiln.codegen.legalize import reduce_identity

    value = reduce_identity(op, d)
    if d.is_bool:
        return "True" if value else "False"
    return literal(value, d)


def _bool_op(op: str) -> str:
    """On bool, sum/max are `or` and prod/min are `and` (what numpy's reductions give)."""
    return {"sum": "or", "max": "or", "prod": "and", "min": "and"}.get(op, op)


def reduce_combine(op: str, d: DType, acc: str, x: str) -> str:
    """The elementwise step of a looped reduction (per lane)."""
    op = _bool_op(op) if d.is_bool else op
    if op == "sum":
        return f"{acc} + {x}"
    if op == "prod":
        return f"{acc} * {x}"
    if op in ("and", "or"):
        return f"{acc} {'&' if op == 'and' else '|'} {x}"
    if d.is_floating:
        return f"tl.{op}imum({acc}, {x}, {_NAN_ALL})"
    return f"tl.{op}imum({acc}, {x})"


# jit helpers a reduction may call (defined once at the top of the source), by name
COMBINE_HELPERS = {
    "_kiln_maximum": "return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)",
    "_kiln_minimum": "return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)",
    "_kiln_mul": "return a * b",
    "_kiln_and": "return a & b",
    "_kiln_or": "return a | b",
}


def reduce_across(op: str, d: DType, x: str, axis: int) -> tuple[str, str | None]:
    """(text reducing `x` along `axis`, the jit helper it needs or None)."""
    op = _bool_op(op) if d.is_bool else op
    if op == "sum":
        # tl.sum widens small integers to int32: wrap back to the accumulator's type
        return (f"tl.sum({x}, {axis})" if d.is_floating else f"tl.sum({x}, {axis}).to({reg_dtype(d)})"), None
    if op in ("max", "min") and not d.is_floating:
        return f"tl.{op}({x}, {axis})", None
    helper = {"max": "_kiln_maximum", "min": "_kiln_minimum", "prod": "_kiln_mul",
              "and": "_kiln_and", "or": "_kiln_or"}[op]
    return f"tl.reduce({x}, {axis}, {helper})", helper
