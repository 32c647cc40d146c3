"""The CuTeDSL grouped GEMMs of kn.grouped_matmul (MoE) for sm_100a and sm_90a, compiled without a GPU:
tcgen05 into tensor memory, TMA loads of x rows from any offset and of expert e's w, the
group-size walk on the device, the fused epilogue (bias per expert, activation, router
scale) and masked stores; for both weight layouts."""

from __future__ import annotations

import re

import pytest

from kiln.codegen import cache_elf
from kiln.codegen.cute.compile import compile_grouped_gemm
from kiln.ir import dtypes as dt
from tests.codegen.cute.test_sm90_gemm import instructions


@pytest.fixture(scope="module")
def bare():
    return compile_grouped_gemm("sm_100a", dt.bfloat16, dt.bfloat16, 1024, 768, 8)


def test_grouped_gemm_ptx(bare):
    found = set(re.findall(r"tcgen05\.[a-z]+", bare.ptx))
    assert {"tcgen05.mma", "tcgen05.alloc", "tcgen05.ld", "tcgen05.commit"} <= found
    ops = instructions(bare.ptx)
    # x is [T, K] with T symbolic, w is (N, K, E): 3-D TMA boxes, the expert a coordinate
    assert any(o.startswith("cp.async.bulk.tensor.3d.shared::cta.global") for o in ops)
    assert "ld.global.b32" in ops  # group_sizes, read on the device (no host sync)
    assert "st.global.b16" in ops  # masked bfloat16 stores
    cache_elf.check_object(bare.cubin, machine=cache_elf.EM_CUDA)


def test_grouped_gemm_epilogue_in_the_ptx(bare):
    full = compile_grouped_gemm("sm_100a", dt.bfloat16, dt.bfloat16, 1024, 768, 8, activation="silu",
                                alpha=0.5, bias=True, row_scale=True, transpose_rhs=True)
    added = instructions(full.ptx) - instructions(bare.ptx)
    assert "ld.global.b16" in added                          # bias[e, col]
    assert "ex2.approx.ftz.f32" in added and "div.rn.f32" in added  # silu
    assert "mul.f32" in added                                # alpha and the router's row scale
    assert full.operands == ("bias", "row_scale")
    gelu = compile_grouped_gemm("sm_100a", dt.float16, dt.float32, 512, 256, 4, activation="gelu_tanh")
    assert "copysign.f32" in instructions(gelu.ptx)          # tanh
    assert "st.global.b32" in instructions(gelu.ptx)         # float32 output


def test_sm90_grouped_gemm_ptx():
    """The Hopper variant: the persistent warp-specialized wgmma kernel over the work list."""
    art = compile_grouped_gemm("sm_90a", dt.bfloat16, dt.bfloat16, 1024, 768, 8, activation="silu",
                               bias=True, row_scale=True)
    ops = instructions(art.ptx)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ops
    assert any(o.startswith("cp.async.bulk.tensor.3d.shared::cta.global") for o in ops)  # w[e] by TMA
    assert "setmaxnreg" in art.ptx and "mbarrier.try_wait.parity.shared.b64" in ops
    assert {"ld.global.b32", "ld.global.b16", "st.global.b16", "ex2.approx.ftz.f32", "div.rn.f32"} <= ops
    assert not any(o.startswith("cp.async.bulk.tensor.2d.global.shared::cta") for o in ops)  # no TMA store
    cache_elf.check_object(art.cubin, machine=cache_elf.EM_CUDA)
