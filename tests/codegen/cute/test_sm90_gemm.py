"""kiln's CuTeDSL sm_90a GEMM compiled ahead of time, with no GPU: the PTX has Hopper's
wgmma and TMA, every epilogue op shows up as its instructions, the cubin is CUDA ELF,
and a second compile comes from the authenticated artifact cache."""

from __future__ import annotations

import re

import pytest

from kiln.codegen import artifact_cache, cache_elf
from kiln.codegen.cute.compile import compile_gemm
from tests.codegen.cute.gemms import full_epilogue, gemm

TILE = (128, 128)


def instructions(ptx: str) -> set[str]:
    return {line.split()[0] for line in ptx.splitlines()
            if line.strip() and not line.strip().startswith(("//", ".", "{", "}", "$", "@"))}


@pytest.fixture(scope="module")
def bare():
    return compile_gemm(gemm(), "sm_90a", TILE)


@pytest.fixture(scope="module")
def full():
    return compile_gemm(full_epilogue(), "sm_90a", TILE)


def test_ptx_has_wgmma_and_tma(bare):
    ops = instructions(bare.ptx)
    assert ".target sm_90a" in bare.ptx
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ops
    assert any(o.startswith("cp.async.bulk.tensor.2d.shared::cta.global") for o in ops)  # TMA loads
    assert any(o.startswith("cp.async.bulk.tensor.2d.global.shared::cta") for o in ops)  # TMA store
    assert "mbarrier.try_wait.parity.shared.b64" in ops  # the producer/consumer ring
    assert "setmaxnreg" in bare.ptx  # warp specialization: producer gives registers to consumers
    cache_elf.check_object(bare.cubin, machine=cache_elf.EM_CUDA)
    assert bare.tile == TILE and bare.arch == "sm_90a"


def test_every_epilogue_op_is_in_the_ptx(bare, full):
    base, ops = instructions(bare.ptx), instructions(full.ptx)
    added = ops - base
    assert "ld.global.b16" in added  # bias[j] and residual[i, j] (bfloat16)
    assert "ld.global.b32" in added  # row_scale[i], col_scale[j] (float32)
    assert "cvt.f32.bf16" in added   # the bfloat16 operands widened
    assert "mul.f32" in added        # the scales
    assert "copysign.f32" in added   # tanh (gelu)
    assert "ex2.approx.ftz.f32" in added and "neg.f32" in added  # exp(-t) (silu)
    assert "div.rn.f32" in added     # silu's division, IEEE
    assert {"setp.ge.f32", "selp.f32"} <= added  # relu: max(x, 0)
    assert "cvt.rn.bf16.f32" in ops  # the cast to the bfloat16 output
    # the epilogue runs on the accumulators: the wgmma loop is the same as the bare one
    assert len(re.findall(r"wgmma\.mma_async", full.ptx)) == len(re.findall(r"wgmma\.mma_async", bare.ptx))
    assert full.operands == ("bias", "row_scale", "col_scale", "res")


def test_second_compile_is_a_cache_hit(bare):
    # each test has a cache folder of its own: the first call here compiles and stores
    first = compile_gemm(gemm(), "sm_90a", TILE)
    hits = artifact_cache.STATS["hits"]
    again = compile_gemm(gemm(), "sm_90a", TILE)
    assert artifact_cache.STATS["hits"] == hits + 1
    assert again.ptx == first.ptx == bare.ptx and again.cubin == first.cubin and again.key == first.key


def test_batched_fp16_gemm_tiles_every_batch():
    from kiln.ir import dtypes as dt

    art = compile_gemm(gemm(256, 256, 128, in_dtype=dt.float16, out_dtype=dt.float16, batch=4), "sm_90a", TILE)
    ops = instructions(art.ptx)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ops
    # A, B and C are (rows, cols, batch): the TMA boxes are 3-D, the batch a coordinate
    assert any(o.startswith("cp.async.bulk.tensor.3d.shared::cta.global") for o in ops)
    assert any(o.startswith("cp.async.bulk.tensor.3d.global.shared::cta") for o in ops)


def test_fp8_gemm_uses_the_fp8_wgmma():
    from kiln.ir import dtypes as dt

    art = compile_gemm(gemm(256, 256, 256, in_dtype=dt.float8_e4m3fn, b_rows=False), "sm_90a", TILE)
    assert any(o.startswith("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") for o in instructions(art.ptx))
