"""kiln/codegen/cute/builders.py holds the tile and pipeline setup the five GEMM kernels
share; moving it there must not change one byte of what they compile to. Every kernel
kind's PTX is hashed against the hashes recorded before the move (nvidia-cutlass-dsl
4.8.1, whose output is deterministic and independent of the host). A kernel changed on
purpose changes its hash: record the new one here, with the reason in the commit."""

from __future__ import annotations

import hashlib

import pytest

from kiln.codegen.cute.compile import compile_blockscaled_gemm, compile_gemm, compile_grouped_gemm
from kiln.codegen.kernel_ir import IN, Acc, BufferParam, Load, Op
from kiln.ir import dtypes as dt
from tests.codegen.cute.gemms import full_epilogue, gemm, gi, gj

f32 = dt.float32
CUTLASS_DSL = "4.8.1"
PTX_SHA256 = {
    "sm_90a dense bf16": "01a33ca6d2d3a0f521b0897bef75b20d898c0971232f2fc9503d0da6149c6b67",
    "sm_90a dense full epilogue": "5669ffd9a33ee7258c60a2b903d24e2d8039dc52e278485bc364282ec0d53d27",
    "sm_90a batched fp16 colmajor": "a58f74edbbfb5008679ac45e8a2b8cb3294df556d58757ad6ecdfc23d3299de3",
    "sm_90a fp8 scaled": "fb23d1c89c6fcb58b36b8243b10e239d9b07ef5e5ac93815b1bcfeae863737ef",
    "sm_90a grouped silu bias rowscale": "c9af9a4e0e784f67d99c6269143c79b67f7d00011d881741f18e501752b3a8b0",
    "sm_90a grouped gelu_tanh f16->f32 transposed": "45043da098a4d1421db6d413d007c062b8b14311737349210e4f1433913a686e",
    "sm_100a dense bf16": "2ca61170f56014f763c70deea2822dfa1e7daaea0639acb32f8da8176c692df2",
    "sm_100a dense full epilogue": "acc06ff2357ff6c4195d39356ac9310e7e81405e29cbfe6a82a456cfea0d74ae",
    "sm_100a batched fp16 colmajor": "2ed11e8d2f5301f54b0aa3e8be481302641e6270b73f8c60c9abe53ba114faac",
    "sm_100a fp8 scaled": "f110bb762e867259f8a14d31e1e03922de0f61d8f1cc3a4ebdc79c1bd13445a0",
    "sm_100a grouped silu bias rowscale": "d4b30562bd3af49afbd08dd3b8cf43dc6b169dfd3f18414efd9c77871dae7f40",
    "sm_100a grouped gelu_tanh f16->f32 transposed": "dc99f18a02e866dedbe77c0063c8bfc1fa350da5b6654faf7922a527d6d3ace9",
    "sm_100a blockscaled nvfp4": "78be9618d7460c609e232557f49bef8141b1cc098b3a3e5ef6f12f3beb65bce9",
    "sm_100a blockscaled mxfp8": "c95ba944c993332d019940b2bf80c1e22332ecee4bc6b445ce2549fc5892dd16",
}


def scaled_fp8():
    """kn.scaled_matmul's fp8 form: e4m3 a @ b (K-major), * scale_a[row] * scale_b[col] -> bf16."""
    epi = Op("convert", (Op("mul", (Op("mul", (Acc(f32), Load("scale_a", gi, f32)), f32),
                                    Load("scale_b", gj, f32)), f32),), dt.bfloat16)
    return gemm(256, 256, 256, epi, (BufferParam("scale_a", f32, (256,), IN), BufferParam("scale_b", f32, (256,), IN)),
                in_dtype=dt.float8_e4m3fn, b_rows=False, name="scaled_fp8")


def build(kind: str):
    arch, what = kind.split(" ", 1)
    if what == "dense bf16":
        return compile_gemm(gemm(), arch, (128, 128))
    if what == "dense full epilogue":
        return compile_gemm(full_epilogue(), arch, (128, 128))
    if what == "batched fp16 colmajor":
        k = gemm(128, 256, 192, batch=3, in_dtype=dt.float16, out_dtype=f32, a_rows=False)
        return compile_gemm(k, arch, (128, 256) if arch == "sm_90a" else (128, 128))
    if what == "fp8 scaled":
        return compile_gemm(scaled_fp8(), arch, (128, 128))
    if what == "grouped silu bias rowscale":
        return compile_grouped_gemm(arch, dt.bfloat16, dt.bfloat16, 1024, 768, 8, activation="silu", bias=True,
                                    row_scale=True)
    if what == "grouped gelu_tanh f16->f32 transposed":
        return compile_grouped_gemm(arch, dt.float16, f32, 512, 256, 4, activation="gelu_tanh", transpose_rhs=True,
                                    alpha=0.5)
    fmt = what.rsplit(" ", 1)[1]
    return compile_blockscaled_gemm(fmt, 512, 256, 1024, dt.bfloat16, tensor_scale=fmt == "nvfp4")


@pytest.mark.parametrize("kind", sorted(PTX_SHA256))
def test_ptx_is_byte_identical_to_before_the_builders(kind):
    import cutlass

    if cutlass.__version__ != CUTLASS_DSL:
        pytest.skip(f"the hashes are of nvidia-cutlass-dsl {CUTLASS_DSL}'s output, this is {cutlass.__version__}")
    art = build(kind)
    assert hashlib.sha256(art.ptx.encode()).hexdigest() == PTX_SHA256[kind], f"{kind}: its PTX changed"
