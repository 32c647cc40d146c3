"""Kernel IR expressions as C-family statements, parametrized by a `Dialect`, and the
scalar table a dialect's expressions are printed with.

The table maps an op key (`add:float`, `reduce.max:int`, ...) to an emitter
`fn(args: list[str], arg dtypes, out dtype) -> str`. What C's operators and math library
do alike in every dialect is built here (`scalar_table`); what a dialect writes its own
way (casts, wrapping integer arithmetic, bitwise results, bitcasts) it passes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kiln.codegen.backend import lookup
from kiln.codegen.cfamily.index import index_c
from kiln.codegen.kernel_ir import Acc, Const, IndexValue, Load, Op, ReduceRef, walk
from kiln.errors import KilnBackendContractError


@dataclass(frozen=True)
class Dialect:
    """What a C-family language says its own way: `type_of(dtype)` its type name,
    `cast(type, text)` a conversion (`float(x)` in MSL, `((float)x)` in OpenCL C),
    `literal(value, dtype)` an exact constant, and its scalar table."""

    backend: str
    type_of: Callable
    cast: Callable[[str, str], str]
    literal: Callable
    table: dict


def store_cast(dialect: Dialect, value: str, src, dst) -> str:
    """`value` of dtype `src` as a `dst` to store (bool: compared with zero)."""
    if src == dst:
        return value
    if dst.is_bool:
        return f"(({value}) != 0)"
    return dialect.cast(dialect.type_of(dst), value)


class ExprEmitter:
    """Binds every node of an expression DAG to a `const` temporary once per scope.

    `override` maps Load nodes to text that replaces their buffer read (MSL's vec4
    components); `acc` names a GEMM epilogue's accumulator."""

    def __init__(self, dialect: Dialect, names: dict, buffers: dict):
        self.dialect = dialect
        self.names, self.buffers = names, buffers  # symbol -> C name; buffer -> (C name, dtype)
        self.counter = 0
        self.refs: dict = {}  # ReduceRef name -> C name
        self.acc: str | None = None
        self.override: dict = {}

    def emit(self, e, lines: list, pad: str) -> str:
        dl = self.dialect
        memo: dict = {}
        for x in walk(e):
            if isinstance(x, Const):
                memo[x] = dl.literal(x.value, x.dtype)
                continue
            if isinstance(x, Load) and x in self.override:
                text = self.override[x]
            elif isinstance(x, Load):
                cname, d = self.buffers[x.buffer]
                text = f"{cname}[{index_c(x.index, self.names)}]"
                if d != x.dtype:
                    text = dl.cast(dl.type_of(x.dtype), text)
            elif isinstance(x, IndexValue):
                text = dl.cast(dl.type_of(x.dtype), index_c(x.expr, self.names))
            elif isinstance(x, ReduceRef):
                text = dl.cast(dl.type_of(x.dtype), self.refs[x.name])
            elif isinstance(x, Acc):
                if self.acc is None:
                    raise KilnBackendContractError(f"{dl.backend} backend: Acc outside a GEMM epilogue")
                text = dl.cast(dl.type_of(x.dtype), self.acc)
            elif isinstance(x, Op):
                dts = [a.dtype for a in x.args]
                emitter = lookup(dl.table, x.op, dts, x.dtype)
                if emitter is None:
                    raise KilnBackendContractError(f"{dl.backend} backend: scalar op {x.op!r} reached the "
                                                   "emitter unlegalized")
                text = emitter([memo[a] for a in x.args], dts, x.dtype)
            else:
                raise KilnBackendContractError(f"{dl.backend} backend: not a Kernel IR expression: {x!r}")
            name = f"t{self.counter}"
            self.counter += 1
            lines.append(f"{pad}const {dl.type_of(x.dtype)} {name} = {text};")
            memo[x] = name
        return memo[e]


# -- the scalar table ------------------------------------------------------------------

ARITH = (("add", "+"), ("sub", "-"), ("mul", "*"))
COMPARE = (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="))
BITWISE = (("and", "&"), ("or", "|"), ("xor", "^"))
MATH = ("exp", "log", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "sqrt",
        "floor", "ceil", "trunc")

# how a reduction folds value x into accumulator a (max/min propagate NaN, as numpy)
COMBINE = {"sum": "{a} + {x}", "prod": "{a} * {x}", "and": "{a} & {x}", "or": "{a} | {x}",
           "max": "(({x}) > ({a}) || ({x}) != ({x})) ? ({x}) : ({a})",
           "min": "(({x}) < ({a}) || ({x}) != ({x})) ? ({x}) : ({a})"}


def binop(sym: str) -> Callable:
    return lambda a, d, out: f"({a[0]} {sym} {a[1]})"


def convert(type_of: Callable, cast: Callable) -> Callable:
    """The `convert` emitter of a dialect: to bool by comparing with zero, else its cast."""
    def emit(a, d, out):
        if out.is_bool:
            return f"(({a[0]}) != 0)"
        return cast(type_of(out), a[0])
    return emit


def scalar_table(*, convert: Callable, bitcast: Callable, wrapping: Callable, neg_int: Callable,
                 math: Callable, shift_unsigned: Callable, int_bitwise: Callable, bool_bitwise: Callable,
                 div_int: Callable, rem_int: Callable, shr_arith: Callable, extra_math: tuple = ()) -> dict:
    """The table: the dialect's emitters where it differs, C's operators elsewhere.
    wrapping(sym), int_bitwise(sym), bool_bitwise(sym), shift_unsigned(sym) and math(name)
    make emitters; the others are emitters."""
    table: dict = {"convert": convert, "select": lambda a, d, out: f"({a[0]} ? {a[1]} : {a[2]})",
                   "bitcast_convert": bitcast}
    table.update({f"{op}:float": binop(sym) for op, sym in ARITH})
    table.update({f"{op}:int": wrapping(sym) for op, sym in ARITH})
    table["neg:float"] = lambda a, d, out: f"(-{a[0]})"
    table["neg:int"] = neg_int
    for kind in ("float", "int", "bool"):
        table.update({f"{op}:{kind}": binop(sym) for op, sym in COMPARE})
    table.update({f"{op}:int": int_bitwise(sym) for op, sym in BITWISE})
    table.update({f"{op}:bool": bool_bitwise(sym) for op, sym in BITWISE})
    table.update({
        "div:float": binop("/"), "rem:float": math("fmod"), "pow:float": math("pow"),
        "atan2:float": math("atan2"), "abs:float": math("fabs"), "round:float": math("rint"),
        "div_unchecked:int": div_int, "rem_unchecked:int": rem_int,
        "shl_unchecked:int": shift_unsigned("<<"), "shr_logical_unchecked:int": shift_unsigned(">>"),
        "shr_arith_unchecked:int": shr_arith,
    })
    table.update({f"{f}:float": math(f) for f in MATH + tuple(extra_math)})
    table.update({f"reduce.{op}:{k}": op for op in ("sum", "prod", "max", "min") for k in ("float", "int")})
    table.update({f"reduce.{op}:{k}": op for op in ("and", "or") for k in ("int", "bool")})
    return table
