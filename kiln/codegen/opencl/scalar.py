"""Scalar Kernel IR as OpenCL C: types, literals and the scalar table.

The table holds what OpenCL C 1.2 has natively (operators, casts, the built-in math
functions); everything else -- integer division guards, INT_MIN / -1, integer pow,
shift ranges, NaN-propagating max/min, clamp, sign, isnan, rsqrt, erfc -- reaches the
emitter already rewritten by kiln's shared legalize pass. Signed integer add, sub, mul
and neg go through the unsigned type, so they wrap as numpy's do (signed overflow is
undefined in OpenCL C). bool is `uchar` (0/1) in buffers and registers. float16,
bfloat16 and float8 are not in `DTYPES` (OpenCL C 1.2 without cl_khr_fp16 has no
arithmetic on them): a kernel using them is a clear K372 from legalize.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.codegen.cfamily.expr import COMBINE, binop, convert, scalar_table
from kiln.codegen.cfamily.index import INDEX_HELPERS, index_c
from kiln.errors import KilnBackendContractError

CL_TYPES = {"f32": "float", "f64": "double", "i8": "char", "i16": "short", "i32": "int",
            "i64": "long", "u8": "uchar", "u32": "uint", "i1": "uchar"}
UNSIGNED = {"i8": "uchar", "i16": "ushort", "i32": "uint", "i64": "ulong", "u8": "uchar", "u32": "uint"}
DTYPES = frozenset(CL_TYPES)

HELPERS = INDEX_HELPERS
index_cl = index_c  # the C-family index printer (kiln/codegen/cfamily/index.py), by its old name


def cl_type(d) -> str:
    """The OpenCL C type of a kiln dtype's buffer elements and registers."""
    try:
        return CL_TYPES[d.short]
    except KeyError:
        raise KilnBackendContractError(f"opencl backend: no OpenCL C type for {d.name}") from None


def cl_cast(t: str, text: str) -> str:
    """`text` converted to OpenCL C type `t` (a C cast)."""
    return f"(({t}){text})"


def literal(value, d) -> str:
    """A constant of dtype `d` as an exact OpenCL C literal."""
    if d.is_bool:
        return "((uchar)1)" if value else "((uchar)0)"
    if d.is_floating:
        v = float(np.asarray(value, dtype=np.float64).astype(d.np_dtype))
        if math.isnan(v):
            text = "NAN"
        elif math.isinf(v):
            text = "INFINITY" if v > 0 else "(-INFINITY)"
        else:
            # repr of the float64 holding the rounded value: exact in the target type
            text = repr(v) + ("f" if d.short == "f32" else "")
        return f"(({cl_type(d)}){text})"
    v = int(np.asarray(value).astype(d.np_dtype))
    text = "(-9223372036854775807L - 1)" if v == -(1 << 63) else f"{v}L"
    return f"(({cl_type(d)}){text})"


# -- the scalar table: op key -> emitter(args, arg dtypes, out dtype) -----------------------

def _wrapping(sym):
    """Signed integer arithmetic that wraps: computed in the unsigned type."""
    def emit(a, d, out):
        t = cl_type(out)
        if out.short not in ("i32", "i64"):
            return f"(({t})({a[0]} {sym} {a[1]}))"  # narrower types promote to int: no overflow
        u = UNSIGNED[out.short]
        return f"(({t})(({u}){a[0]} {sym} ({u}){a[1]}))"
    return emit


def _neg_int(a, d, out):
    t = cl_type(out)
    if out.short in ("i32", "i64"):
        return f"(({t})(0 - ({UNSIGNED[out.short]}){a[0]}))"
    return f"(({t})(-{a[0]}))"


def _math(name):
    # OpenCL's built-ins are overloaded: float32 stays float32 (one rounding, as numpy)
    return lambda a, d, out: f"{name}({', '.join(a)})"


def _shift_unsigned(sym):
    return lambda a, d, out: f"(({cl_type(out)})(({UNSIGNED[out.short]}){a[0]} {sym} {a[1]}))"


SCALAR_TABLE: dict = scalar_table(
    # same width by the op's type rule: OpenCL's as_<type> reinterprets the bits
    convert=convert(cl_type, cl_cast), bitcast=lambda a, d, out: f"as_{cl_type(out)}({a[0]})", wrapping=_wrapping,
    neg_int=_neg_int, math=_math, shift_unsigned=_shift_unsigned, int_bitwise=binop, bool_bitwise=binop,
    div_int=binop("/"), rem_int=binop("%"), shr_arith=binop(">>"), extra_math=("expm1", "log1p", "erf"))


def combine(op: str, d, a: str, x: str) -> str:
    """`a` folded with `x` by reduction `op`, cast back to the accumulator type `d`."""
    if op in ("max", "min") and not d.is_floating:  # no NaN to propagate
        return f"(({cl_type(d)})(({x}) {'>' if op == 'max' else '<'} ({a}) ? ({x}) : ({a})))"
    if op in ("sum", "prod") and d.short in ("i32", "i64"):  # wrap, as numpy's integers do
        u = UNSIGNED[d.short]
        a, x = f"(({u}){a})", f"(({u}){x})"
    return f"(({cl_type(d)})({COMBINE[op].format(a=a, x=x)}))"
