"""Kernel IR for the Triton backend tests: one builder per kernel kind, plus kernels that
use every scalar primitive on every dtype, and random inputs for them."""

from __future__ import annotations

import numpy as np

from kiln.codegen.kernel_ir import (
    IN, OUT, Acc, BufferParam, Const, GemmKernel, IndexValue, Kernel, Load, Loop, Op, Reduce, ReduceRef,
    Store, loop_var,
)
from kiln.ir import dtypes as dt
from kiln.ir.shapes import evaluate, symbol
from tests.codegen.ir_builders import op

B, N, M = symbol("B"), symbol("N"), symbol("M")
i0, i1, r0, r1 = loop_var("i0"), loop_var("i1"), loop_var("r0"), loop_var("r1")
gb, gi, gj = loop_var("gb"), loop_var("gi"), loop_var("gj")
f32, f64 = dt.float32, dt.float64


def pointwise(d=f32, width=64):
    """A broadcast chain over a symbolic 2-D domain: y = max(tanh(x * a[j] + b[i]), 0.1)."""
    x = Load("x", width * i0 + i1, d)
    y = op("add", op("mul", x, Load("a", i1, d)), Load("b", i0, d))
    y = op("max", op("tanh", y), Const(0.1, d))
    return Kernel("pointwise", (BufferParam("x", d, (B, width), IN), BufferParam("a", d, (width,), IN),
                                BufferParam("b", d, (B,), IN), BufferParam("y", d, (B, width), OUT)),
                  ("B",), (Loop("i0", B), Loop("i1", width)), (Store("y", width * i0 + i1, y),))


def softmax(width=33, d=f32):
    """Inner reduction: persistent for small widths, looped past tiling.PERSISTENT_MAX."""
    x = Load("x", width * i0 + r0, d)
    xf = x if d == f32 else op("convert", x, dtype=f32)
    e = op("exp", op("sub", xf, ReduceRef("m", f32)))
    out = op("div", e, ReduceRef("s", f32))
    out = out if d == f32 else op("convert", out, dtype=d)
    inner = (Loop("r0", width),)
    return Kernel(f"softmax_{width}", (BufferParam("x", d, (B, width), IN), BufferParam("y", d, (B, width), OUT)),
                  ("B",), (Loop("i0", B),),
                  (Reduce("m", "max", inner, xf, f32), Reduce("s", "sum", inner, e, f32),
                   Store("y", width * i0 + r0, out, inner)))


def layer_norm(width=40):
    """Two reductions, the second reading the first, then a store over the row."""
    x = Load("x", width * i0 + r0, f32)
    mean = op("div", ReduceRef("s", f32), Const(float(width), f32))
    centered = op("sub", x, mean)
    var = op("div", ReduceRef("v", f32), Const(float(width), f32))
    y = op("add", op("mul", op("mul", centered, op("rsqrt", op("add", var, Const(1e-5, f32)))),
                     Load("g", r0, f32)), Load("b", r0, f32))
    inner = (Loop("r0", width),)
    return Kernel("layer_norm", (BufferParam("x", f32, (B, width), IN), BufferParam("g", f32, (width,), IN),
                                 BufferParam("b", f32, (width,), IN), BufferParam("y", f32, (B, width), OUT)),
                  ("B",), (Loop("i0", B),),
                  (Reduce("s", "sum", inner, x, f32), Reduce("v", "sum", inner, op("mul", centered, centered), f32),
                   Store("y", width * i0 + r0, y, inner)))


def moments(width=N):
    """Sum and sum of squares in one pass (independent reductions share a loop)."""
    x = Load("x", width * i0 + r0, f32)
    inner = (Loop("r0", width),)
    return Kernel("moments", (BufferParam("x", f32, (B, width), IN), BufferParam("s", f32, (B,), OUT),
                              BufferParam("q", f32, (B,), OUT)), ("B", "N"), (Loop("i0", B),),
                  (Reduce("s", "sum", inner, x, f32), Reduce("q", "sum", inner, op("mul", x, x), f32),
                   Store("s", i0, ReduceRef("s", f32)), Store("q", i0, ReduceRef("q", f32))))


def column_sum(rows=N, cols=48):
    """Outer reduction (the reduced dim is the strided one): y[j] = sum_i x[i, j], max too."""
    x = Load("x", cols * r0 + i0, f32)
    inner = (Loop("r0", rows),)
    return Kernel("column_sum", (BufferParam("x", f32, (rows, cols), IN), BufferParam("s", f32, (cols,), OUT),
                                 BufferParam("m", f32, (cols,), OUT)), ("N",) if rows is N else (),
                  (Loop("i0", cols),),
                  (Reduce("s", "sum", inner, x, f32), Reduce("m", "max", inner, x, f32),
                   Store("s", i0, ReduceRef("s", f32)), Store("m", i0, ReduceRef("m", f32))))


def full_sum(rows=N, cols=50):
    """Full reduction over a 2-D domain (one program): sum and NaN-propagating max."""
    x = Load("x", cols * r0 + r1, f32)
    inner = (Loop("r0", rows), Loop("r1", cols))
    return Kernel("full_sum", (BufferParam("x", f32, (rows, cols), IN), BufferParam("s", f32, (1,), OUT),
                               BufferParam("m", f32, (1,), OUT)), ("N",) if rows is N else (), (),
                  (Reduce("s", "sum", inner, x, f32), Store("s", 0, ReduceRef("s", f32)),
                   Reduce("m", "max", inner, x, f32), Store("m", 0, ReduceRef("m", f32))))


def gemm(d=f32, m=M, n=24, k=40, batch=1, transposed_b=False, epilogue="bias_relu"):
    """out = epilogue(a @ b): bias + relu by column, or a residual add, or none."""
    acc_d = f32 if d.bits < 32 and d.is_floating else d
    a_strides = (m * k, k, 1)
    b_strides = (k * n, 1, k) if transposed_b else (k * n, n, 1)
    b_shape = (batch, n, k) if transposed_b else (batch, k, n)
    out = Acc(d)
    buffers = [BufferParam("a", d, (batch, m, k), IN), BufferParam("b", d, b_shape, IN)]
    if epilogue == "bias_relu":
        out = op("max", op("add", Acc(d), Load("bias", gj, d)), Const(0, d))
        buffers.append(BufferParam("bias", d, (n,), IN))
    elif epilogue == "residual":
        out = op("add", Acc(d), Load("res", gb * m * n + gi * n + gj, d))
        buffers.append(BufferParam("res", d, (batch, m, n), IN))
    buffers.append(BufferParam("out", d, (batch, m, n), OUT))
    sizes = tuple(sorted({s.name for s in (m, n, k) if not isinstance(s, int)}))
    return GemmKernel(f"gemm_{d.short}", tuple(buffers), sizes, "a", "b", "out", batch, m, n, k,
                      a_strides, b_strides, out, acc_d)


def iota_kernel():
    """Index arithmetic of every kind the lowering produces (floor, Mod, Min, Max)."""
    from sympy import Max, Min, Mod, floor

    idx = floor(i0 / 3) + Mod(i0, 5) + Min(i0, 40 - i0) + Max(i0 - 20, 3 * i0 - 70)
    return Kernel("iota", (BufferParam("x", f32, (N,), IN), BufferParam("y", f32, (N,), OUT),
                           BufferParam("z", dt.int64, (N,), OUT)), ("N",), (Loop("i0", N),),
                  (Store("y", i0, IndexValue(i0 * 2, f32)),
                   Store("z", i0, op("add", IndexValue(idx, dt.int64), Const(1, dt.int64)))))


def scalar_kernel():
    """No loops at all: one value from loads at fixed and size-dependent positions."""
    value = op("add", op("mul", Load("x", 0, f32), Const(2.0, f32)), Load("x", N - 1, f32))
    value = op("add", value, op("convert", IndexValue(N, dt.int64), dtype=f32))
    return Kernel("scalar", (BufferParam("x", f32, (N,), IN), BufferParam("y", f32, (1,), OUT)), ("N",), (),
                  (Store("y", 0, value),))


# -- every scalar primitive -------------------------------------------------------------------

FLOAT_UNARY = ("neg", "abs", "sign", "floor", "ceil", "round", "trunc", "sqrt", "rsqrt", "isnan", "isinf",
               "isfinite", "exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos", "atan",
               "sinh", "cosh", "tanh", "erf")
FLOAT_BINARY = ("add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "eq", "ne", "lt", "le",
                "gt", "ge")
INT_BINARY = ("add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor", "pow",
              "shift_left", "shift_right_logical", "shift_right_arithmetic", "eq", "ne", "lt", "ge")
INT_UNARY = ("neg", "abs", "sign", "not")
_BOOL_RESULT = {"isnan", "isinf", "isfinite", "eq", "ne", "lt", "le", "gt", "ge"}


def float_ops(d):
    x, y = Load("x", i0, d), Load("y", i0, d)
    stages, outs = [], []

    def out(name, value, dtype):
        stages.append(Store(f"o_{name}", i0, value))
        outs.append(BufferParam(f"o_{name}", dtype, (N,), OUT))

    for name in FLOAT_UNARY + FLOAT_BINARY:
        rd = dt.bool_ if name in _BOOL_RESULT else d
        out(name, Op(name, (x,) if name in FLOAT_UNARY else (x, y), rd), rd)
    out("clamp", op("clamp", x, Const(-0.5, d), Const(0.7, d)), d)
    # constants as operands of library calls take the tensor operand's type
    out("pow_const", op("pow", op("abs", x), Const(2.5, d)), d)
    out("atan2_const", op("atan2", Const(1.0, d), x), d)
    out("rem_const", op("rem", Const(7.0, d), x), d)
    out("select", op("select", op("lt", x, y, dtype=dt.bool_), x, op("neg", y)), d)
    # float -> int is undefined for NaN/inf/out of range: convert a finite input
    z = Load("z", i0, d)
    out("to_i32", op("convert", op("mul", z, Const(3.0, d)), dtype=dt.int32), dt.int32)
    out("to_u8", op("convert", op("abs", op("mul", z, Const(3.0, d))), dtype=dt.uint8), dt.uint8)
    out("to_bool", op("convert", x, dtype=dt.bool_), dt.bool_)
    out("to_f64", op("convert", x, dtype=f64), f64)
    out("to_bf16", op("convert", x, dtype=dt.bfloat16), dt.bfloat16)
    return Kernel(f"floats_{d.short}", (BufferParam("x", d, (N,), IN), BufferParam("y", d, (N,), IN),
                                        BufferParam("z", d, (N,), IN), *outs), ("N",),
                  (Loop("i0", N),), tuple(stages))


def int_ops(d):
    x, y = Load("x", i0, d), Load("y", i0, d)
    stages, outs = [], []

    def out(name, value, dtype):
        stages.append(Store(f"o_{name}", i0, value))
        outs.append(BufferParam(f"o_{name}", dtype, (N,), OUT))

    for name in INT_BINARY:
        rhs = y
        if name == "pow" or name.startswith("shift"):
            rhs = op("rem", y, Const(40 if name != "pow" else 7, d))
        rd = dt.bool_ if name in _BOOL_RESULT else d
        out(name, Op(name, (x, rhs), rd), rd)
    for name in INT_UNARY:
        out(name, op(name, x), d)
    out("clamp", op("clamp", x, Const(-3 if d.category == dt.INT else 2, d), Const(50, d)), d)
    out("to_f32", op("convert", x, dtype=f32), f32)
    out("to_f16", op("convert", x, dtype=dt.float16), dt.float16)
    out("to_i8", op("convert", x, dtype=dt.int8), dt.int8)
    out("to_bool", op("convert", x, dtype=dt.bool_), dt.bool_)
    return Kernel(f"ints_{d.short}", (BufferParam("x", d, (N,), IN), BufferParam("y", d, (N,), IN), *outs),
                  ("N",), (Loop("i0", N),), tuple(stages))


def bool_ops():
    a, b, x = Load("a", i0, dt.bool_), Load("b", i0, dt.bool_), Load("x", i0, f32)
    bools = [("and", op("and", a, b)), ("or", op("or", a, b)), ("xor", op("xor", a, b)), ("not", op("not", a)),
             ("max", op("max", a, b)), ("min", op("min", a, b)), ("eq", op("eq", a, b)),
             ("gt", op("gt", x, Const(0.0, f32), dtype=dt.bool_))]
    stages = [Store(f"o_{n}", i0, v) for n, v in bools]
    outs = [BufferParam(f"o_{n}", dt.bool_, (N,), OUT) for n, _ in bools]
    stages += [Store("o_sel", i0, op("select", a, x, op("neg", x))),
               Store("o_i32", i0, op("convert", b, dtype=dt.int32)),
               Store("o_f32", i0, op("convert", a, dtype=f32))]
    outs += [BufferParam("o_sel", f32, (N,), OUT), BufferParam("o_i32", dt.int32, (N,), OUT),
             BufferParam("o_f32", f32, (N,), OUT)]
    return Kernel("bools", (BufferParam("a", dt.bool_, (N,), IN), BufferParam("b", dt.bool_, (N,), IN),
                            BufferParam("x", f32, (N,), IN), *outs), ("N",), (Loop("i0", N),), tuple(stages))


def low_precision(d):
    """A pointwise chain, a reduction and conversions in a low-precision dtype."""
    x, a = Load("x", 16 * i0 + r0, d), Load("a", r0, d)
    y = op("exp", op("add", op("mul", x, a), Const(0.3, d)))
    inner = (Loop("r0", 16),)
    return Kernel(f"lowp_{d.short}", (BufferParam("x", d, (B, 16), IN), BufferParam("a", d, (16,), IN),
                                      BufferParam("y", d, (B, 16), OUT), BufferParam("s", f32, (B,), OUT),
                                      BufferParam("c", d, (B, 16), OUT), BufferParam("w", f64, (B, 16), OUT)),
                  ("B",), (Loop("i0", B),),
                  (Store("y", 16 * i0 + r0, y, inner),
                   Reduce("s", "sum", inner, op("convert", x, dtype=f32), f32),
                   Store("s", i0, ReduceRef("s", f32)),
                   Store("c", 16 * i0 + r0, op("convert", op("mul", op("convert", x, dtype=f32), Const(1.37, f32)),
                                               dtype=d), inner),
                   Store("w", 16 * i0 + r0, op("convert", x, dtype=f64), inner)))


def reductions(d, ops):
    w = 23
    stages, outs = [], []
    for name in ops:
        stages.append(Reduce(name, name, (Loop("r0", w),), Load("x", w * i0 + r0, d), d))
        stages.append(Store(f"o_{name}", i0, ReduceRef(name, d)))
        outs.append(BufferParam(f"o_{name}", d, (B,), OUT))
    return Kernel(f"reduce_{d.short}", (BufferParam("x", d, (B, w), IN), *outs), ("B",), (Loop("i0", B),),
                  tuple(stages))


def bitcasts():
    x = Load("x", i0, f32)
    return Kernel("bitcasts", (BufferParam("x", f32, (N,), IN), BufferParam("y", dt.int32, (N,), OUT),
                               BufferParam("h", dt.int16, (N,), OUT), BufferParam("f", f32, (N,), OUT)),
                  ("N",), (Loop("i0", N),),
                  (Store("y", i0, op("bitcast_convert", x, dtype=dt.int32)),
                   Store("h", i0, op("bitcast_convert", op("convert", x, dtype=dt.bfloat16), dtype=dt.int16)),
                   Store("f", i0, op("bitcast_convert", op("bitcast_convert", x, dtype=dt.int32), dtype=f32))))


# -- inputs -----------------------------------------------------------------------------------

def random_array(dtype, shape, rng, low=-3.0, high=3.0):
    npd = dtype.np_dtype
    if dtype.is_bool:
        return rng.random(shape) < 0.5
    if dtype.is_integer:
        info = np.iinfo(npd)
        return rng.integers(max(info.min, -100), min(info.max, 100) + 1, size=shape).astype(npd)
    return rng.uniform(low, high, size=shape).astype(npd)


def make_arrays(kernel, sizes, seed=0, **ranges):
    rng = np.random.default_rng(seed)
    arrays = []
    for b in kernel.buffers:
        shape = tuple(evaluate(d, sizes) for d in b.shape)
        arrays.append(random_array(b.dtype, shape, rng, **ranges) if b.role == IN
                      else np.zeros(shape, b.dtype.np_dtype))
    return arrays
