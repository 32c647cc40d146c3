"""The Kernel IR epilogue of a GemmKernel as a CuTeDSL scalar function.

`make_epilogue(kernel)` returns `(fn, operand_names, size_names)`. The GEMM kernel calls
`fn(acc, coord, operands, sizes, c_shape)` once per accumulator element while CuTeDSL
traces it: `acc` is the Float32 accumulator, `coord` its (row, col, batch), `operands`
the epilogue's input buffers as flat 1-D tensors (in `operand_names` order) and `sizes`
the kernel's symbolic sizes (Int32, in `size_names` order). The expression is walked
once per element at trace time, memoized as the DAG it is, so every op appears in the
generated code once per element, as it does in the Triton backend.

Loads read `buffer[index]` with the index expression of the Kernel IR evaluated on the
element's coordinate. Rows and columns past M and N (a partial tile) read the last row
or column instead: a valid address; the TMA store never writes those elements.

`unsupported(kernel)` names the first thing this module cannot express (an op, a dtype),
which the selector turns into a fallback reason.
"""

from __future__ import annotations

from typing import Callable

import sympy

from kiln.codegen.kernel_ir import Acc, Const, GemmKernel, IndexValue, Load, Op, walk
from kiln.ir import dtypes as dt

_UNARY_MATH = ("exp", "log", "tanh", "erf", "sqrt", "rsqrt", "sin", "cos", "tan", "asin", "acos", "atan",
               "sinh", "cosh", "expm1", "log1p", "floor", "ceil", "trunc")
_BINARY = ("add", "sub", "mul", "div", "max", "min", "pow", "atan2")
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_OTHER = ("neg", "abs", "select", "convert", "not", "and", "or", "clamp", "isnan")
_LOW = (dt.float16, dt.bfloat16)
SUPPORTED_OPS = frozenset(_UNARY_MATH + _BINARY + tuple(_COMPARE) + _OTHER)
# kiln dtype short name -> cutlass numeric type name
DTYPES = {"f32": "Float32", "f16": "Float16", "bf16": "BFloat16", "f64": "Float64", "i32": "Int32",
          "i64": "Int64", "i8": "Int8", "u8": "Uint8", "i16": "Int16", "bool": "Boolean",
          "f8e4m3fn": "Float8E4M3FN", "f8e5m2": "Float8E5M2"}


def cutlass_type(d):
    """The cutlass Numeric type of a kiln dtype."""
    import cutlass

    return getattr(cutlass, DTYPES[d.short])


def unsupported(kernel: GemmKernel) -> str | None:
    """Why the epilogue has no CuTeDSL form, or None when it has one."""
    for x in walk(kernel.epilogue):
        if x.dtype.short not in DTYPES:
            return f"the epilogue computes in {x.dtype.name}, which CuTeDSL registers do not hold"
        if isinstance(x, Op) and x.op not in SUPPORTED_OPS:
            return f"the epilogue op {x.op!r} has no CuTeDSL form here"
    return None


def operand_names(kernel: GemmKernel) -> tuple[str, ...]:
    """The buffers the epilogue loads, in first-use order."""
    names: list[str] = []
    for x in walk(kernel.epilogue):
        if isinstance(x, Load) and x.buffer not in names:
            names.append(x.buffer)
    return tuple(names)


def make_epilogue(kernel: GemmKernel) -> tuple[Callable, tuple[str, ...], tuple[str, ...]]:
    """(fn, operand names, size names) for `kernel`'s epilogue; see the module docstring."""
    operands = operand_names(kernel)
    size_names = tuple(kernel.sizes)
    expr = kernel.epilogue
    gb, gi, gj = sympy.symbols("gb gi gj", integer=True)

    def fn(acc, coord, tensors, sizes, c_shape):
        import cutlass
        import cutlass.cute as cute

        row = cutlass.min(coord[0], c_shape[0] - 1)
        col = cutlass.min(coord[1], c_shape[1] - 1)
        env = {"gi": row, "gj": col, "gb": coord[2]}
        env.update({name: sizes[i] for i, name in enumerate(size_names)})
        memo: dict = {}

        def index(e) -> object:
            e = sympy.sympify(e)
            if e.is_Integer:
                return cutlass.Int32(int(e))
            if e.is_Symbol:
                return env[e.name]
            if e.is_Add:
                parts = [index(a) for a in e.args]
            elif e.is_Mul:
                parts = [index(a) for a in e.args]
            else:
                raise ValueError(f"cute epilogue: index {e} is not affine")
            out = parts[0]
            for p in parts[1:]:
                out = out + p if e.is_Add else out * p
            return out

        def value(x):
            if x in memo:
                return memo[x]
            if isinstance(x, Acc):  # the accumulator rounded to the GEMM's result dtype
                v = acc if x.dtype == dt.float32 else acc.to(cutlass_type(x.dtype))
            elif isinstance(x, Const):
                v = cutlass_type(x.dtype)(x.value)
            elif isinstance(x, Load):
                v = tensors[operands.index(x.buffer)][index(x.index)]
            elif isinstance(x, IndexValue):
                v = cutlass_type(x.dtype)(index(x.expr))
            else:
                # float16/bfloat16 ops compute in float32 and round once to their dtype,
                # as numpy (and the registry's references) do
                low = x.op not in ("convert", "select")
                args = [value(a).to(cutlass.Float32) if low and a.dtype in _LOW else value(a) for a in x.args]
                v = _op(x, args, cutlass, cute)
                if low and x.dtype in _LOW:
                    v = v.to(cutlass_type(x.dtype))
            memo[x] = v
            return v

        out = value(expr)
        return out.to(cutlass.Float32) if expr.dtype != dt.float32 else out

    return fn, operands, size_names


def _op(x: Op, args: list, cutlass, cute):
    """One scalar op of the registry on CuTeDSL values."""
    op = x.op
    if op == "convert":
        return args[0].to(cutlass_type(x.dtype))
    if op in _UNARY_MATH:
        return getattr(cute.math, op)(args[0])
    if op == "add":
        return args[0] + args[1]
    if op == "sub":
        return args[0] - args[1]
    if op == "mul":
        return args[0] * args[1]
    if op == "div":
        return args[0] / args[1]
    if op == "max":
        return cutlass.max(args[0], args[1])
    if op == "min":
        return cutlass.min(args[0], args[1])
    if op == "clamp":
        return cutlass.min(cutlass.max(args[0], args[1]), args[2])
    if op == "pow":
        return cute.math.pow(args[0], args[1])
    if op == "atan2":
        return cute.math.atan2(args[0], args[1])
    if op == "neg":
        return -args[0]
    if op == "abs":
        return cute.math.abs(args[0])
    if op == "isnan":
        return args[0] != args[0]
    if op in _COMPARE:
        a, b = args
        return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b}[op]
    if op == "select":
        return cutlass_type(x.dtype)(cutlass.select_(args[0], args[1], args[2]))
    if op == "not":
        return ~args[0] if x.dtype != dt.bool_ else args[0] == cutlass.Boolean(False)
    if op == "and":
        return args[0] & args[1]
    if op == "or":
        return args[0] | args[1]
    raise ValueError(f"cute epilogue: op {op!r} has no CuTeDSL form")
