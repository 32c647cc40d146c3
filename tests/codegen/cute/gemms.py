"""GemmKernels for the CuTeDSL tests: a bare bf16 GEMM and one whose epilogue uses every
kind of epilogue op (bias, row and column scale, gelu, silu, relu, residual, cast)."""

from __future__ import annotations

import dataclasses

from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, Const, GemmKernel, Load, Op
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

f32, bf16 = dt.float32, dt.bfloat16
gi, gj = symbol("gi"), symbol("gj")


def op(name, *args, dtype=f32):
    return Op(name, tuple(args), dtype)


def widen(x):
    return op("convert", x)


def gemm(m=256, n=512, k=384, epilogue=None, extra=(), in_dtype=bf16, out_dtype=bf16, name="gemm",
         a_rows=True, b_rows=True, batch=1):
    """out = epilogue(a @ b), a (m, k) and b (k, n) row-major unless said otherwise."""
    bufs = (BufferParam("a", in_dtype, (batch, m, k) if batch != 1 else (m, k), IN),
            BufferParam("b", in_dtype, (batch, k, n) if batch != 1 else (k, n), IN)) + tuple(extra) + (
        BufferParam("y", out_dtype, (batch, m, n) if batch != 1 else (m, n), OUT),)
    a_strides = (m * k, k, 1) if a_rows else (m * k, 1, m)
    b_strides = (k * n, n, 1) if b_rows else (k * n, 1, k)
    if epilogue is None:
        epilogue = op("convert", Acc(f32), dtype=out_dtype) if out_dtype != f32 else Acc(f32)
    sizes = tuple(sorted({s.name for d in (m, n, k, batch) for s in getattr(d, "free_symbols", ())}))
    return GemmKernel(name, bufs, sizes, "a", "b", "y", batch, m, n, k, a_strides, b_strides, epilogue, f32)


def full_epilogue(m=256, n=512, k=384):
    """bias[j] (bf16), row_scale[i], col_scale[j] (f32), then gelu(tanh) + silu, relu, + residual, -> bf16."""
    t = op("add", Acc(f32), widen(Load("bias", gj, bf16)))
    t = op("mul", op("mul", t, Load("row_scale", gi, f32)), Load("col_scale", gj, f32))
    inner = op("mul", op("add", t, op("mul", op("mul", op("mul", t, t), t), Const(0.044715, f32))),
               Const(0.7978845608028654, f32))
    gelu = op("mul", op("mul", t, Const(0.5, f32)), op("add", op("tanh", inner), Const(1.0, f32)))
    silu = op("div", t, op("add", Const(1.0, f32), op("exp", op("neg", t))))
    r = op("max", op("add", gelu, silu), Const(0.0, f32))
    r = op("add", r, widen(Load("res", gi * n + gj, bf16)))
    extra = (BufferParam("bias", bf16, (n,), IN), BufferParam("row_scale", f32, (m,), IN),
             BufferParam("col_scale", f32, (n,), IN), BufferParam("res", bf16, (m, n), IN))
    return gemm(m, n, k, op("convert", r, dtype=bf16), extra, name="gemm_epilogue")


def with_k(kernel: GemmKernel, k) -> GemmKernel:
    """`kernel` with reduction length k (strides and buffer shapes follow)."""
    m, n = kernel.m, kernel.n
    bufs = tuple(dataclasses.replace(b, shape=(m, k)) if b.name == "a" else
                 dataclasses.replace(b, shape=(k, n)) if b.name == "b" else b for b in kernel.buffers)
    return dataclasses.replace(kernel, buffers=bufs, k=k, a_strides=(m * k, k, 1), b_strides=(k * n, n, 1))
