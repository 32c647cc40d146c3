"""kiln's CuTeDSL sm_100a GEMM compiled ahead of time, with no GPU: tcgen05 MMA into
tensor memory, TMA loads, the accumulator read back with tcgen05.ld, every epilogue op
in the PTX, masked stores for partial tiles."""

from __future__ import annotations

import re

import pytest

from kiln.codegen import cache_elf
from kiln.codegen.cute.compile import compile_gemm
from kiln.ir import dtypes as dt
from tests.codegen.cute.gemms import full_epilogue, gemm
from tests.codegen.cute.test_sm90_gemm import instructions

TILE = (128, 128)


@pytest.fixture(scope="module")
def bare():
    return compile_gemm(gemm(), "sm_100a", TILE)


def test_ptx_has_tcgen05_and_tma(bare):
    found = set(re.findall(r"tcgen05\.[a-z]+", bare.ptx))
    assert {"tcgen05.mma", "tcgen05.alloc", "tcgen05.ld", "tcgen05.commit", "tcgen05.dealloc"} <= found
    assert ".target sm_100a" in bare.ptx
    assert "tcgen05.mma.cta_group::1.kind::f16" in bare.ptx  # bf16 operands, f32 in TMEM
    ops = instructions(bare.ptx)
    assert any(o.startswith("cp.async.bulk.tensor.2d.shared::cta.global") for o in ops)
    assert "st.global.b16" in ops  # the bfloat16 result, stored under a bounds mask
    cache_elf.check_object(bare.cubin, machine=cache_elf.EM_CUDA)


def test_every_epilogue_op_is_in_the_ptx(bare):
    full = compile_gemm(full_epilogue(), "sm_100a", TILE)
    added = instructions(full.ptx) - instructions(bare.ptx)
    for needed in ("ld.global.b16", "ld.global.b32", "mul.f32", "copysign.f32", "ex2.approx.ftz.f32",
                   "neg.f32", "div.rn.f32", "setp.ge.f32", "selp.f32"):
        assert needed in added, needed
    assert len(re.findall(r"tcgen05\.mma", full.ptx)) == len(re.findall(r"tcgen05\.mma", bare.ptx))


def test_fp8_uses_the_f8f6f4_kind():
    art = compile_gemm(gemm(256, 256, 256, in_dtype=dt.float8_e4m3fn, b_rows=False), "sm_100a", TILE)
    assert "tcgen05.mma.cta_group::1.kind::f8f6f4" in art.ptx
