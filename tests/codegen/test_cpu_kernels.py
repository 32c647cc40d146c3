"""CPU backend vs the numpy Kernel IR evaluator: pointwise, reductions, dtypes, threads."""


import numpy as np
import pytest
import sympy

from kiln.codegen.cpu import CpuBackend, CpuOptions
from kiln.codegen.kernel_ir import (
    IN, OUT, BufferParam, Const, IndexValue, Kernel, Load, Loop, Op, Reduce, ReduceRef, Store, loop_var,
)
from kiln.errors import KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

from tests.codegen.cpu_helpers import BACKEND, check, make_arrays, single_threaded
from tests.codegen.ir_builders import op

B, N = symbol("B"), symbol("N")
i0, i1, r0 = loop_var("i0"), loop_var("i1"), loop_var("r0")
f32, f64 = dt.float32, dt.float64


def broadcast_chain(d=f32, width=64):
    x = Load("x", width * i0 + i1, d)
    a, b = Load("a", i1, d), Load("b", i0, d)
    y = op("add", op("mul", x, a), b)
    y = op("max", op("tanh", y), Const(0.1, d))
    return Kernel("chain", (BufferParam("x", d, (B, width), IN), BufferParam("a", d, (width,), IN),
                            BufferParam("b", d, (B,), IN), BufferParam("y", d, (B, width), OUT)),
                  ("B",), (Loop("i0", B), Loop("i1", width)), (Store("y", width * i0 + i1, y),))


@pytest.mark.parametrize("b", [0, 1, 3, 37])
def test_broadcast_chain_symbolic_sizes(b):
    check(broadcast_chain(), {"B": b})


def test_transposed_load_and_multi_output():
    x = Load("x", i1 * N + i0, f32)  # x is [M=12, N]; we iterate (i0 < N, i1 < 12)
    k = Kernel("t", (BufferParam("x", f32, (12, N), IN), BufferParam("y", f32, (N, 12), OUT),
                     BufferParam("z", f64, (N, 12), OUT)), ("N",), (Loop("i0", N), Loop("i1", 12)),
               (Store("y", 12 * i0 + i1, op("neg", x)),
                Store("z", 12 * i0 + i1, op("convert", op("mul", x, x), dtype=f64))))
    check(k, {"N": 7})


def softmax(d=f32, width=33):
    x = Load("x", width * i0 + r0, d)
    xf = x if d == f32 else op("convert", x, dtype=f32)
    e = op("exp", op("sub", xf, ReduceRef("m", f32)))
    out = op("div", e, ReduceRef("s", f32))
    out = out if d == f32 else op("convert", out, dtype=d)
    return Kernel("softmax", (BufferParam("x", d, (B, width), IN), BufferParam("y", d, (B, width), OUT)),
                  ("B",), (Loop("i0", B),),
                  (Reduce("m", "max", (Loop("r0", width),), xf, f32),
                   Reduce("s", "sum", (Loop("r0", width),), e, f32),
                   Store("y", width * i0 + r0, out, (Loop("r0", width),))))


def test_row_softmax():
    check(softmax(), {"B": 9})


def test_layer_norm_stages():
    w = 40
    x = Load("x", w * i0 + r0, f32)
    mean = op("div", ReduceRef("s", f32), Const(float(w), f32))
    centered = op("sub", x, mean)
    var = op("div", ReduceRef("v", f32), Const(float(w), f32))
    y = op("add", op("mul", op("mul", centered, op("rsqrt", op("add", var, Const(1e-5, f32)))),
                     Load("g", r0, f32)), Load("b", r0, f32))
    k = Kernel("ln", (BufferParam("x", f32, (B, w), IN), BufferParam("g", f32, (w,), IN),
                      BufferParam("b", f32, (w,), IN), BufferParam("y", f32, (B, w), OUT)), ("B",),
               (Loop("i0", B),),
               (Reduce("s", "sum", (Loop("r0", w),), x, f32),
                Reduce("v", "sum", (Loop("r0", w),), op("mul", centered, centered), f32),
                Store("y", w * i0 + r0, y, (Loop("r0", w),))))
    check(k, {"B": 6}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d,ops", [
    (f32, ("sum", "max", "min", "prod")), (f64, ("sum", "max", "min", "prod")),
    (dt.int32, ("sum", "max", "min", "prod", "and", "or")), (dt.uint8, ("max", "min", "sum")),
    (dt.bool_, ("and", "or", "max", "min")),
])
def test_reductions(d, ops):
    w = 23
    stages = []
    outs = []
    for name in ops:
        stages.append(Reduce(name, name, (Loop("r0", w),), Load("x", w * i0 + r0, d), d))
        stages.append(Store(f"o_{name}", i0, ReduceRef(name, d)))
        outs.append(BufferParam(f"o_{name}", d, (B,), OUT))
    k = Kernel("red", (BufferParam("x", d, (B, w), IN), *outs), ("B",), (Loop("i0", B),), tuple(stages))
    check(k, {"B": 5}, rtol=1e-5, low=0.5, high=1.5)


def test_full_reduction_2d_and_nan_max():
    x = Load("x", 50 * r0 + loop_var("r1"), f32)
    k = Kernel("full", (BufferParam("x", f32, (N, 50), IN), BufferParam("s", f32, (1,), OUT),
                        BufferParam("m", f32, (1,), OUT)), ("N",), (),
               (Reduce("s", "sum", (Loop("r0", N), Loop("r1", 50)), x, f32), Store("s", 0, ReduceRef("s", f32)),
                Reduce("m", "max", (Loop("r0", N), Loop("r1", 50)), x, f32), Store("m", 0, ReduceRef("m", f32))))
    check(k, {"N": 301}, rtol=1e-5)
    arrays = make_arrays(k, {"N": 4}, np.random.default_rng(1))
    arrays[0][2, 7] = np.nan
    out = check(k, {"N": 4}, arrays=arrays)
    assert np.isnan(out[2][0])


def test_iota_and_index_arithmetic():
    idx = sympy.floor(i0 / 3) + sympy.Mod(i0, 5) + sympy.Min(i0, 40 - i0) + sympy.Max(i0 - 20, 3 * i0 - 70)
    k = Kernel("iota", (BufferParam("y", f32, (N,), OUT), BufferParam("z", dt.int64, (N,), OUT),
                        BufferParam("x", f32, (N,), IN)), ("N",), (Loop("i0", N),),
               (Store("y", i0, IndexValue(i0 * 2, f32)),
                Store("z", i0, op("add", IndexValue(idx, dt.int64), Const(1, dt.int64))),))
    check(k, {"N": 41})


INT_BINARY = ("add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor", "pow",
              "shift_left", "shift_right_logical", "shift_right_arithmetic")


@pytest.mark.parametrize("d", [dt.int8, dt.int16, dt.int32, dt.int64, dt.uint8, dt.uint32])
def test_integer_ops(d):
    x, y = Load("x", i0, d), Load("y", i0, d)
    stages, outs = [], []
    for name in INT_BINARY:
        rhs = y
        if name == "pow" or name.startswith("shift"):
            rhs = op("rem", y, Const(40 if name != "pow" else 7, d))
        stages.append(Store(f"o_{name}", i0, op(name, x, rhs)))
        outs.append(BufferParam(f"o_{name}", d, (N,), OUT))
    for name in ("neg", "abs", "sign", "not"):
        stages.append(Store(f"o_{name}", i0, op(name, x)))
        outs.append(BufferParam(f"o_{name}", d, (N,), OUT))
    for name in ("lt", "eq", "ge"):
        stages.append(Store(f"o_{name}", i0, op(name, x, y, dtype=dt.bool_)))
        outs.append(BufferParam(f"o_{name}", dt.bool_, (N,), OUT))
    k = Kernel("ints", (BufferParam("x", d, (N,), IN), BufferParam("y", d, (N,), IN), *outs), ("N",),
               (Loop("i0", N),), tuple(stages))
    rng = np.random.default_rng(3)
    arrays = make_arrays(k, {"N": 300}, rng)
    info = np.iinfo(d.np_dtype)
    arrays[0][:6] = [info.min, info.max, 0, -1 if info.min < 0 else 1, 5, info.min]
    arrays[1][:6] = [-1 if info.min < 0 else 1, 0, 0, 3, 0, 1]
    check(k, {"N": 300}, arrays=arrays)


def test_bool_kernel():
    a, b = Load("a", i0, dt.bool_), Load("b", i0, dt.bool_)
    x = Load("x", i0, f32)
    k = Kernel("bools", (BufferParam("a", dt.bool_, (N,), IN), BufferParam("b", dt.bool_, (N,), IN),
                         BufferParam("x", f32, (N,), IN), BufferParam("o", dt.bool_, (N,), OUT),
                         BufferParam("s", f32, (N,), OUT), BufferParam("c", dt.int32, (N,), OUT)), ("N",),
               (Loop("i0", N),),
               (Store("o", i0, op("xor", op("and", a, op("not", b)), op("or", a, op("gt", x, Const(0.0, f32),
                                                                               dtype=dt.bool_)))),
                Store("s", i0, op("select", a, x, op("neg", x), dtype=f32)),
                Store("c", i0, op("convert", b, dtype=dt.int32))))
    check(k, {"N": 77})


LOW = [dt.float16, dt.bfloat16, dt.float8_e4m3fn, dt.float8_e5m2]


@pytest.mark.parametrize("d", LOW, ids=lambda d: d.short)
def test_low_precision_pointwise_and_reduce(d):
    x, a = Load("x", 16 * i0 + r0, d), Load("a", r0, d)
    y = op("exp", op("add", op("mul", x, a), Const(0.3, d)))
    k = Kernel("lowp", (BufferParam("x", d, (B, 16), IN), BufferParam("a", d, (16,), IN),
                        BufferParam("y", d, (B, 16), OUT), BufferParam("s", f32, (B,), OUT),
                        BufferParam("c", d, (B, 16), OUT)), ("B",), (Loop("i0", B),),
               (Store("y", 16 * i0 + r0, y, (Loop("r0", 16),)),
                Reduce("s", "sum", (Loop("r0", 16),), op("convert", x, dtype=f32), f32),
                Store("s", i0, ReduceRef("s", f32)),
                Store("c", 16 * i0 + r0, op("convert", op("mul", op("convert", x, dtype=f32), Const(1.37, f32)),
                                            dtype=d), (Loop("r0", 16),))))
    check(k, {"B": 11}, rtol=0, atol=0, low=-2.0, high=2.0)


@pytest.mark.parametrize("d", LOW, ids=lambda d: d.short)
def test_low_precision_conversion_edge_values(d):
    k = Kernel("cvt", (BufferParam("x", f32, (N,), IN), BufferParam("y", d, (N,), OUT)), ("N",),
               (Loop("i0", N),), (Store("y", i0, op("convert", Load("x", i0, f32), dtype=d)),))
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448, 464, 470, 480, 57344, 61440, 65504, 65520,
                        1e-3, 2.0 ** -9, 2.0 ** -10, 2.0 ** -17, 1.5 * 2.0 ** -16, 3e38, 1e-40], np.float32)
    x = np.concatenate([special, -special, rng.standard_normal(4000).astype(np.float32) * 100,
                        rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    y = np.zeros(x.size, d.np_dtype)
    BACKEND.compile(k)([x, y], {"N": x.size})
    with np.errstate(all="ignore"):
        want = x.astype(d.np_dtype)
    bits = np.dtype(f"u{d.itemsize}")
    same = (y.view(bits) == want.view(bits)) | (np.isnan(y.astype(np.float32)) & np.isnan(want.astype(np.float32)))
    assert same.all(), (x[~same][:5], y[~same][:5], want[~same][:5])


FLOAT_UNARY = ("neg", "abs", "sign", "floor", "ceil", "round", "trunc", "sqrt", "rsqrt", "isnan", "isinf",
               "isfinite", "exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos", "atan",
               "sinh", "cosh", "tanh", "erf")
FLOAT_BINARY = ("add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "lt", "ne")


@pytest.mark.parametrize("d", [f32, f64, dt.bfloat16], ids=lambda d: d.short)
def test_every_float_op(d):
    x, y = Load("x", i0, d), Load("y", i0, d)
    stages, outs = [], []
    for name in FLOAT_UNARY + FLOAT_BINARY:
        args = (x,) if name in FLOAT_UNARY else (x, y)
        out = dt.bool_ if name in ("isnan", "isinf", "isfinite", "lt", "ne") else d
        stages.append(Store(f"o_{name}", i0, Op(name, args, out)))
        outs.append(BufferParam(f"o_{name}", out, (N,), OUT))
    stages.append(Store("o_clamp", i0, op("clamp", x, Const(-0.5, d), Const(0.7, d))))
    outs.append(BufferParam("o_clamp", d, (N,), OUT))
    # float -> int is undefined for NaN/inf/out of range: convert a finite input
    stages.append(Store("o_i", i0, op("convert", op("mul", Load("z", i0, d), Const(3.0, d)), dtype=dt.int32)))
    outs.append(BufferParam("o_i", dt.int32, (N,), OUT))
    k = Kernel("floats", (BufferParam("x", d, (N,), IN), BufferParam("y", d, (N,), IN),
                          BufferParam("z", d, (N,), IN), *outs), ("N",),
               (Loop("i0", N),), tuple(stages))
    arrays = make_arrays(k, {"N": 500}, np.random.default_rng(5), low=-2.0, high=2.0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 0.5, -2.5, 1.0, -1.0, 3.0], np.float64)
    arrays[0][:10] = special.astype(d.np_dtype)
    arrays[1][:10] = special[::-1].astype(d.np_dtype)
    check(k, {"N": 500}, arrays=arrays, rtol=4e-7 if d == f32 else (1e-15 if d == f64 else 0), atol=0)


def test_bitcast_convert():
    x = Load("x", i0, f32)
    k = Kernel("bc", (BufferParam("x", f32, (N,), IN), BufferParam("y", dt.int32, (N,), OUT),
                      BufferParam("h", dt.int16, (N,), OUT)), ("N",), (Loop("i0", N),),
               (Store("y", i0, op("bitcast_convert", x, dtype=dt.int32)),
                Store("h", i0, op("bitcast_convert", op("convert", x, dtype=dt.bfloat16), dtype=dt.int16))))
    check(k, {"N": 64})


def test_complex_is_a_clear_error():
    k = Kernel("c", (BufferParam("x", dt.complex64, (N,), IN), BufferParam("y", dt.complex64, (N,), OUT)),
               ("N",), (Loop("i0", N),), (Store("y", i0, op("neg", Load("x", i0, dt.complex64))),))
    with pytest.raises(KilnDTypeError, match="complex64"):
        BACKEND.compile(k)


def test_threaded_equals_single_threaded():
    k = broadcast_chain(width=1000)
    sizes = {"B": 700}
    arrays = make_arrays(k, sizes, np.random.default_rng(2))
    one = [a.copy() for a in arrays]
    two = [a.copy() for a in arrays]
    single_threaded().compile(k)(one, sizes)
    CpuBackend(CpuOptions(threads=2, parallel_threshold=1)).compile(k)(two, sizes)
    np.testing.assert_array_equal(one[-1], two[-1])
    s1 = [a.copy() for a in make_arrays(softmax(width=257), {"B": 999}, np.random.default_rng(4))]
    s2 = [a.copy() for a in s1]
    single_threaded().compile(softmax(width=257))(s1, {"B": 999})
    CpuBackend(CpuOptions(threads=2, parallel_threshold=1)).compile(softmax(width=257))(s2, {"B": 999})
    np.testing.assert_array_equal(s1[1], s2[1])


def test_pointwise_float32_is_vectorized():
    k = broadcast_chain()
    assert "<8 x float>" in BACKEND.stage_text(k, "optimized")
    asm = BACKEND.stage_text(k, "asm")
    assert "ymm" in asm or "zmm" in asm
    assert "llvm.loop.vectorize.enable" in BACKEND.stage_text(k, "llvm")


def test_float32_sum_is_accurate():
    x = Load("x", r0, f32)
    k = Kernel("s", (BufferParam("x", f32, (N,), IN), BufferParam("o", f32, (1,), OUT)), ("N",), (),
               (Reduce("s", "sum", (Loop("r0", N),), x, f32), Store("o", 0, ReduceRef("s", f32))))
    x = np.full(1 << 22, 0.1, np.float32)
    o = np.zeros(1, np.float32)
    BACKEND.compile(k)([x, o], {"N": x.size})
    exact = np.float64(np.float32(0.1)) * x.size
    naive = np.cumsum(x, dtype=np.float32)[-1]  # one float32 accumulator drifts badly
    assert abs(o[0] - exact) / exact < 3e-7 < abs(naive - exact) / exact


def test_compile_many_and_object_code_roundtrip():
    kernels = [broadcast_chain(), softmax(), softmax(dt.bfloat16, 8)]
    compiled = BACKEND.compile_many(kernels)
    blob = BACKEND.object_code(kernels)
    loaded = BACKEND.load_object_code(kernels, blob)
    for k, a, b in zip(kernels, compiled, loaded):
        sizes = {"B": 13}
        arrays = make_arrays(k, sizes, np.random.default_rng(0))
        x1 = [v.copy() for v in arrays]
        x2 = [v.copy() for v in arrays]
        a(x1, sizes)
        b(x2, sizes)
        np.testing.assert_array_equal(x1[-1], x2[-1])
    assert BACKEND.supports("cpu") and not BACKEND.supports("cuda")
    assert hash(CpuOptions()) == hash(CpuOptions())


def test_bad_arguments_are_clear():
    ck = BACKEND.compile(softmax())
    x = np.zeros((3, 33), np.float64)
    with pytest.raises(KilnDTypeError, match="float32"):
        ck([x, np.zeros((3, 33), np.float32)], {"B": 3})
