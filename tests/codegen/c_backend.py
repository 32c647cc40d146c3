"""A toy backend that emits C and builds it with the system C compiler: the worked
example of docs/backends.md. It lives in the tests and edits no kiln module; a test
registers it (`register_backend("c", CBackend)`) and compiles graphs through it.

It lowers `Kernel`s (loop nests with reductions), not templates. Its scalar table is
what C has: operators, casts and <math.h>. Everything else -- integer division by zero,
INT_MIN / -1, integer pow, shift amounts out of range, NaN-propagating max/min, clamp,
sign, isnan, rsqrt, erfc -- reaches it already rewritten by kiln's legalize pass.
float16/bfloat16/float8 are not in its table, so they are a clear K372 error.
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import tempfile
from typing import Sequence

import numpy as np
import sympy

from kiln.codegen.backend import Backend, lookup
from kiln.codegen.kernel_ir import Acc, Const, IndexValue, Kernel, Load, Op, Reduce, ReduceRef, walk
from kiln.codegen.legalize import reduce_identity
from kiln.errors import KilnBackendContractError

C_TYPES = {"f32": "float", "f64": "double", "i8": "int8_t", "i16": "int16_t", "i32": "int32_t",
           "i64": "int64_t", "u8": "uint8_t", "u32": "uint32_t", "i1": "_Bool"}
UNSIGNED = {"i8": "uint8_t", "i16": "uint16_t", "i32": "uint32_t", "i64": "uint64_t",
            "u8": "uint8_t", "u32": "uint32_t"}
HEADER = """#include <math.h>
#include <stdint.h>
static inline int64_t kiln_floordiv(int64_t a, int64_t b) {
  int64_t q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
static inline int64_t kiln_mod(int64_t a, int64_t b) { int64_t r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
"""


def _binop(sym):
    return lambda a, d, out: f"({a[0]} {sym} {a[1]})"


def _math(name):
    # float32 calls the f-suffixed <math.h> function: one float32 rounding, as numpy
    return lambda a, d, out: f"{name}{'f' if d[0].short == 'f32' else ''}({', '.join(a)})"


def _cast(a, d, out):
    if out.is_bool:
        return f"({a[0]} != 0)"
    return f"(({C_TYPES[out.short]}){a[0]})"


def _shift_unsigned(sym):
    return lambda a, d, out: f"(({C_TYPES[out.short]})(({UNSIGNED[out.short]}){a[0]} {sym} {a[1]}))"


# the scalar table: op (or "op:float" / "op:int" / "op:bool") -> emitter(args, dtypes, out)
SCALAR_TABLE: dict = {"convert": _cast, "select": lambda a, d, out: f"({a[0]} ? {a[1]} : {a[2]})"}
for _k in ("float", "int"):
    SCALAR_TABLE.update({f"{op}:{_k}": _binop(sym) for op, sym in
                         (("add", "+"), ("sub", "-"), ("mul", "*"))})
    SCALAR_TABLE[f"neg:{_k}"] = lambda a, d, out: f"(-{a[0]})"
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
SCALAR_TABLE.update({f"reduce.{op}:{k}": op for op in ("sum", "prod", "max", "min")
                     for k in ("float", "int")})
SCALAR_TABLE.update({f"reduce.{op}:{k}": op for op in ("and", "or") for k in ("int", "bool")})
_COMBINE = {"sum": "{a} + {x}", "prod": "{a} * {x}", "and": "{a} & {x}", "or": "{a} | {x}",
            "max": "({x} > {a} || {x} != {x}) ? {x} : {a}", "min": "({x} < {a} || {x} != {x}) ? {x} : {a}"}


def _literal(value, d) -> str:
    if d.is_bool:
        return "1" if value else "0"
    if d.is_floating:
        v = float(np.asarray(value, dtype=np.float64).astype(d.np_dtype))
        if math.isnan(v):
            text = "NAN"
        elif math.isinf(v):
            text = "INFINITY" if v > 0 else "(-INFINITY)"
        else:
            text = repr(v) + ("f" if d.short == "f32" else "")
        return f"(({C_TYPES[d.short]}){text})"
    v = int(np.asarray(value).astype(d.np_dtype))
    text = f"({v + 1}LL - 1)" if v == -(1 << 63) else f"{v}LL"
    return f"(({C_TYPES[d.short]}){text})"


def index_c(e) -> str:
    """A sympy index expression as int64 C (floor division and mod with Python's signs)."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return f"{int(e)}LL"
    if e.is_Symbol:
        return f"(int64_t){e.name}"
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(index_c(a) for a in e.args) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + " * ".join(index_c(a) for a in e.args) + ")"
    if isinstance(e, sympy.floor):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        return f"kiln_floordiv({index_c(num)}, {index_c(den)})"
    if isinstance(e, sympy.Mod):
        return f"kiln_mod({index_c(e.args[0])}, {index_c(e.args[1])})"
    raise KilnBackendContractError(f"c backend: cannot print index expression {e}")


class CBackend(Backend):
    """Kernel IR -> C -> a shared library built by `cc`, called through ctypes."""

    name = "c"
    stages = ("c",)
    dump_stages = {"source": "c"}
    keep = frozenset()  # no GEMM template: matmul decomposes into loops
    scalar_table = SCALAR_TABLE
    dtypes = frozenset(C_TYPES)  # no float16 / bfloat16 / float8 in C

    def comment(self, stage: str) -> str:
        return "//"

    def render(self, kernel, stage: str) -> str:
        return HEADER + _emit_kernel(kernel, "kiln_" + kernel.name)

    def build(self, kernels: Sequence) -> list:
        symbols = [f"kiln_k{i}" for i in range(len(kernels))]
        source = HEADER + "\n".join(_emit_kernel(k, s) for k, s in zip(kernels, symbols))
        with tempfile.TemporaryDirectory() as tmp:
            c_path, so_path = os.path.join(tmp, "k.c"), os.path.join(tmp, "k.so")
            with open(c_path, "w") as f:
                f.write(source)
            # -fwrapv: signed overflow wraps, as numpy's integers do
            subprocess.run(["cc", "-O2", "-std=c11", "-fwrapv", "-shared", "-fPIC", "-o", so_path, c_path, "-lm"],
                           check=True, capture_output=True, timeout=120)
            lib = ctypes.CDLL(so_path)  # mapped now: the file may go
        return [_Callable(getattr(lib, s), k, lib) for k, s in zip(kernels, symbols)]


class _Callable:
    """fn(arrays, sizes): runs one kernel in place on contiguous numpy arrays."""

    def __init__(self, fn, kernel, lib):
        self.fn, self.kernel, self.lib = fn, kernel, lib
        fn.restype = None
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)]

    def __call__(self, arrays, sizes):
        ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        values = (ctypes.c_int64 * max(1, len(self.kernel.sizes)))(*[int(sizes[n]) for n in self.kernel.sizes])
        self.fn(ptrs, values)


def _emit_kernel(k, symbol: str) -> str:
    if not isinstance(k, Kernel):
        raise KilnBackendContractError(f"c backend: no template for {type(k).__name__}")
    lines = [f"void {symbol}(void **bufs, const int64_t *sizes) {{"]
    for i, name in enumerate(k.sizes):
        lines.append(f"  const int64_t {name} = sizes[{i}];")
    for i, b in enumerate(k.buffers):
        const = "const " if b.role == "in" else ""
        lines.append(f"  {const}{C_TYPES[b.dtype.short]} *b_{b.name} = ({const}{C_TYPES[b.dtype.short]} *)bufs[{i}];")
    depth = 1
    for loop in k.outer:
        lines.append("  " * depth + f"for (int64_t {loop.var} = 0; {loop.var} < {index_c(loop.extent)}; ++{loop.var}) {{")
        depth += 1
    accs: dict = {}
    for st in k.stages:
        pad = "  " * depth
        if isinstance(st, Reduce):
            ty = C_TYPES[st.dtype.short]
            accs[st.name] = st.dtype
            lines.append(f"{pad}{ty} a_{st.name} = {_literal(reduce_identity(st.op, st.dtype), st.dtype)};")
        inner = depth
        for loop in st.loops:
            lines.append("  " * inner + f"for (int64_t {loop.var} = 0; {loop.var} < {index_c(loop.extent)}; ++{loop.var}) {{")
            inner += 1
        value = _emit_value(st.value, lines, "  " * inner, accs)
        if isinstance(st, Reduce):
            lines.append("  " * inner + f"a_{st.name} = {_COMBINE[st.op].format(a=f'a_{st.name}', x=value)};")
        else:
            lines.append("  " * inner + f"b_{st.buffer}[{index_c(st.index)}] = {value};")
        for _ in st.loops:
            inner -= 1
            lines.append("  " * inner + "}")
    for _ in k.outer:
        depth -= 1
        lines.append("  " * depth + "}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _emit_value(e, lines: list, pad: str, accs: dict) -> str:
    """Bind every node of expression DAG `e` to a temporary once; return the root's name."""
    names: dict = {}
    for x in walk(e):
        if isinstance(x, Const):
            names[x] = _literal(x.value, x.dtype)
            continue
        if isinstance(x, Load):
            text = f"b_{x.buffer}[{index_c(x.index)}]"
        elif isinstance(x, IndexValue):
            text = f"(({C_TYPES[x.dtype.short]}){index_c(x.expr)})"
        elif isinstance(x, ReduceRef):
            text = f"(({C_TYPES[x.dtype.short]})a_{x.name})"
        elif isinstance(x, Acc):
            raise KilnBackendContractError("c backend: no GEMM template")
        else:
            assert isinstance(x, Op)
            dtypes = [a.dtype for a in x.args]
            emitter = lookup(SCALAR_TABLE, x.op, dtypes, x.dtype)  # legalize left only these
            text = emitter([names[a] for a in x.args], dtypes, x.dtype)
        name = f"t{len(lines)}_{len(names)}"
        lines.append(f"{pad}const {C_TYPES[x.dtype.short]} {name} = {text};")
        names[x] = name
    return names[e]
