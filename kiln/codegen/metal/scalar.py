"""Scalar Kernel IR as Metal Shading Language: types, literals and the scalar table.

The table holds what MSL has natively (C++ operators, casts, the metal_stdlib math
functions, overloaded on float and half); the rest -- integer division guards, INT_MIN /
-1, integer pow, shift ranges, NaN-propagating max/min, clamp, sign, isnan, rsqrt,
erf/erfc (MSL has no erf) -- reaches the emitter already rewritten by kiln's shared
legalize pass. Signed add, sub, mul and neg go through the unsigned type, so they wrap
as numpy's do. bool is MSL's one-byte `bool` in buffers and registers.

float64: Metal has no double (no Apple GPU computes it). float64 is not in `DTYPES`, so
a float64 kernel is a clear K372 at compile time instead of silently computing in float32;
convert to float32 first (`x.float()`), as one does for MPS in PyTorch. bfloat16 and
float8 are storage types kiln does not emit arithmetic for here (K372 likewise).
"""

from __future__ import annotations

import math

import numpy as np

from kiln.codegen.cfamily.expr import COMBINE, convert, scalar_table
from kiln.errors import KilnBackendContractError

MSL_TYPES = {"f32": "float", "f16": "half", "i8": "char", "i16": "short", "i32": "int",
             "i64": "long", "u8": "uchar", "u32": "uint", "i1": "bool"}
UNSIGNED = {"i8": "uchar", "i16": "ushort", "i32": "uint", "i64": "ulong", "u8": "uchar", "u32": "uint"}
DTYPES = frozenset(MSL_TYPES)


def msl_type(d) -> str:
    """The MSL type of a kiln dtype's buffer elements and registers."""
    try:
        return MSL_TYPES[d.short]
    except KeyError:
        raise KilnBackendContractError(f"metal backend: no MSL type for {d.name}") from None


def msl_cast(t: str, text: str) -> str:
    """`text` converted to MSL type `t` (a constructor-style cast)."""
    return f"{t}({text})"


def literal(value, d) -> str:
    """A constant of dtype `d` as an exact MSL literal."""
    if d.is_bool:
        return "true" if value else "false"
    t = msl_type(d)
    if d.is_floating:
        v = float(np.asarray(value, dtype=np.float64).astype(d.np_dtype))
        if math.isnan(v):
            return f"{t}(NAN)"
        if math.isinf(v):
            return f"{t}(INFINITY)" if v > 0 else f"{t}(-INFINITY)"
        return f"{t}({v.hex()}f)"  # exact: the hex of the value rounded to the dtype
    v = int(np.asarray(value).astype(d.np_dtype))
    if d.short == "i64":
        text = "(-9223372036854775807L - 1)" if v == -(1 << 63) else f"{v}L"
        return f"{t}({text})"
    return f"{t}({v})"


def _wrapping(sym):
    """Signed integer arithmetic that wraps: computed in the unsigned type."""
    def emit(a, d, out):
        t = msl_type(out)
        u = UNSIGNED.get(out.short, t)
        return f"{t}({u}({a[0]}) {sym} {u}({a[1]}))"
    return emit


def _neg_int(a, d, out):
    t = msl_type(out)
    return f"{t}({UNSIGNED.get(out.short, t)}(0) - {UNSIGNED.get(out.short, t)}({a[0]}))"


def _math(name):
    # metal_stdlib is overloaded: half stays half, float stays float (as numpy)
    return lambda a, d, out: f"{msl_type(out)}({name}({', '.join(a)}))"


def _shift_unsigned(sym):
    return lambda a, d, out: f"{msl_type(out)}({UNSIGNED[out.short]}({a[0]}) {sym} {a[1]})"


def _typed(sym, t=None):
    """`a sym b` converted to the result type (or to `t`)."""
    return lambda a, d, out: f"{t or msl_type(out)}({a[0]} {sym} {a[1]})"


SCALAR_TABLE: dict = scalar_table(
    convert=convert(msl_type, msl_cast), bitcast=lambda a, d, out: f"as_type<{msl_type(out)}>({a[0]})", wrapping=_wrapping,
    neg_int=_neg_int, math=_math, shift_unsigned=_shift_unsigned, int_bitwise=_typed,
    bool_bitwise=lambda sym: _typed(sym, "bool"), div_int=_typed("/"), rem_int=_typed("%"),
    shr_arith=_typed(">>"))

# the simdgroup reduction builtin of each op on float/int (and/or on bool use simd_and/or)
SIMD = {"sum": "simd_sum", "prod": "simd_product", "max": "simd_max", "min": "simd_min",
        "and": "simd_and", "or": "simd_or"}


def combine(op: str, d, a: str, x: str) -> str:
    """`a` folded with `x` by reduction `op`, cast back to the accumulator type `d`."""
    t = msl_type(d)
    if op in ("sum", "prod") and d.short in ("i8", "i16", "i32", "i64"):  # wrap, as numpy's do
        u = UNSIGNED[d.short]
        a, x = f"{u}({a})", f"{u}({x})"
    return f"{t}({COMBINE[op].format(a=a, x=x)})"
