"""Scalar Kernel IR as OpenCL C: types, literals, index expressions and the scalar table.

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
import sympy

from kiln.errors import KilnBackendContractError

CL_TYPES = {"f32": "float", "f64": "double", "i8": "char", "i16": "short", "i32": "int",
            "i64": "long", "u8": "uchar", "u32": "uint", "i1": "uchar"}
UNSIGNED = {"i8": "uchar", "i16": "ushort", "i32": "uint", "i64": "ulong", "u8": "uchar", "u32": "uint"}
DTYPES = frozenset(CL_TYPES)

HELPERS = """inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
"""


def cl_type(d) -> str:
    """The OpenCL C type of a kiln dtype's buffer elements and registers."""
    try:
        return CL_TYPES[d.short]
    except KeyError:
        raise KilnBackendContractError(f"opencl backend: no OpenCL C type for {d.name}") from None


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


def index_cl(e, names: dict) -> str:
    """A sympy index expression as `long` OpenCL C; `names` maps symbol names to C names.
    Floor division and Mod keep Python's signs (kiln_floordiv / kiln_mod)."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return f"{int(e)}L"
    if e.is_Symbol:
        return names[e.name]
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(index_cl(a, names) for a in e.args) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + " * ".join(index_cl(a, names) for a in e.args) + ")"
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
        return "(" + " * ".join([index_cl(e.base, names)] * int(e.exp)) + ")"
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        top, bottom = index_cl(sympy.expand(num), names), index_cl(den, names)
        if isinstance(e, sympy.ceiling):
            return f"(-kiln_floordiv(-{top}, {bottom}))"
        return f"kiln_floordiv({top}, {bottom})"
    if isinstance(e, sympy.Mod):
        return f"kiln_mod({index_cl(e.args[0], names)}, {index_cl(e.args[1], names)})"
    if isinstance(e, (sympy.Min, sympy.Max)):
        fn = "min" if isinstance(e, sympy.Min) else "max"
        text = index_cl(e.args[0], names)
        for a in e.args[1:]:
            text = f"{fn}({text}, {index_cl(a, names)})"
        return text
    raise KilnBackendContractError(f"opencl backend: index expression {e} uses {type(e).__name__}, "
                                   "which the OpenCL emitter does not print")


# -- the scalar table: op key -> emitter(args, arg dtypes, out dtype) -----------------------

def _binop(sym):
    return lambda a, d, out: f"({a[0]} {sym} {a[1]})"


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


def _cast(a, d, out):
    if out.is_bool:
        return f"(({a[0]}) != 0)"
    return f"(({cl_type(out)}){a[0]})"


def _shift_unsigned(sym):
    return lambda a, d, out: f"(({cl_type(out)})(({UNSIGNED[out.short]}){a[0]} {sym} {a[1]}))"


SCALAR_TABLE: dict = {"convert": _cast, "select": lambda a, d, out: f"({a[0]} ? {a[1]} : {a[2]})",
                      # same width by the op's type rule: OpenCL's as_<type> reinterprets the bits
                      "bitcast_convert": lambda a, d, out: f"as_{cl_type(out)}({a[0]})"}
SCALAR_TABLE.update({f"{op}:float": _binop(sym) for op, sym in (("add", "+"), ("sub", "-"), ("mul", "*"))})
SCALAR_TABLE.update({f"{op}:int": _wrapping(sym) for op, sym in (("add", "+"), ("sub", "-"), ("mul", "*"))})
SCALAR_TABLE["neg:float"] = lambda a, d, out: f"(-{a[0]})"
SCALAR_TABLE["neg:int"] = _neg_int
for _k in ("float", "int", "bool"):
    SCALAR_TABLE.update({f"{op}:{_k}": _binop(sym) for op, sym in
                         (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="))})
for _k in ("int", "bool"):
    SCALAR_TABLE.update({f"{op}:{_k}": _binop(sym) for op, sym in (("and", "&"), ("or", "|"), ("xor", "^"))})
SCALAR_TABLE.update({
    "div:float": _binop("/"), "rem:float": _math("fmod"), "pow:float": _math("pow"),
    "atan2:float": _math("atan2"), "abs:float": _math("fabs"), "round:float": _math("rint"),
    "div_unchecked:int": _binop("/"), "rem_unchecked:int": _binop("%"),
    "shl_unchecked:int": _shift_unsigned("<<"), "shr_logical_unchecked:int": _shift_unsigned(">>"),
    "shr_arith_unchecked:int": _binop(">>"),
})
SCALAR_TABLE.update({f"{f}:float": _math(f) for f in (
    "exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh",
    "tanh", "erf", "sqrt", "floor", "ceil", "trunc")})
SCALAR_TABLE.update({f"reduce.{op}:{k}": op for op in ("sum", "prod", "max", "min") for k in ("float", "int")})
SCALAR_TABLE.update({f"reduce.{op}:{k}": op for op in ("and", "or") for k in ("int", "bool")})

# how a reduction folds value x into accumulator a (max/min propagate NaN, as numpy)
COMBINE = {"sum": "{a} + {x}", "prod": "{a} * {x}", "and": "{a} & {x}", "or": "{a} | {x}",
           "max": "(({x}) > ({a}) || ({x}) != ({x})) ? ({x}) : ({a})",
           "min": "(({x}) < ({a}) || ({x}) != ({x})) ? ({x}) : ({a})"}


def combine(op: str, d, a: str, x: str) -> str:
    """`a` folded with `x` by reduction `op`, cast back to the accumulator type `d`."""
    if op in ("max", "min") and not d.is_floating:  # no NaN to propagate
        return f"(({cl_type(d)})(({x}) {'>' if op == 'max' else '<'} ({a}) ? ({x}) : ({a})))"
    if op in ("sum", "prod") and d.short in ("i32", "i64"):  # wrap, as numpy's integers do
        u = UNSIGNED[d.short]
        a, x = f"(({u}){a})", f"(({u}){x})"
    return f"(({cl_type(d)})({COMBINE[op].format(a=a, x=x)}))"
