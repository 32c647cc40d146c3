"""Which implementation a cuda GEMM gets (CuTeDSL or Triton) and why; the choice in
`kiln dump --stage kernels`, the CuTeDSL PTX in `kiln dump --stage asm --target cuda`;
forcing one with the cuda_gemm option or KILN_CUDA_GEMM. Only the asm test compiles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cute.select import choose
from kiln.codegen.kernel_ir import IN, Acc, BufferParam, Load, Op
from kiln.codegen.triton.backend import TritonBackend, TritonOptions
from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.ir.archive import save_graph
from kiln.ir.shapes import symbol
from tests.cli_helpers import kiln_cli
from tests.codegen.cute.gemms import f32, gemm, gi, gj, with_k


def test_aligned_bf16_gemm_goes_to_cute():
    c = choose(gemm(), "sm_90")
    assert c.impl == "cute" and c.arch == "sm_90a" and c.tile in {(128, 256), (128, 128), (128, 64),
                                                                  (64, 256), (64, 128), (64, 64)}
    assert "model: CuTeDSL" in c.reason and "Triton" in c.reason
    # the model ranks tiles per shape: a big square GEMM gets a bigger tile than a skinny one
    big, skinny = choose(gemm(8192, 8192, 8192), "sm_90"), choose(gemm(64, 256, 4096), "sm_90")
    assert big.tile[0] * big.tile[1] > skinny.tile[0] * skinny.tile[1]


@pytest.mark.parametrize("kernel, words", [
    (with_k(gemm(), 1001), "16 bytes"),                              # K row pitch of 2002 bytes
    (gemm(in_dtype=dt.float32, out_dtype=dt.float32), "tf32"),       # exact float32 stays on Triton
    (gemm(n=symbol("N")), "symbolic"),                               # unknown row pitch
    (dataclasses.replace(gemm(), a_strides=(0, 2 * 384, 1)), "not a compact"),
    (gemm(in_dtype=dt.float8_e4m3fn), "K-major"),                    # fp8 B row-major
    (gemm(epilogue=Op("rem", (Acc(f32), Load("d", gi * 512 + gj, f32)), f32),
          extra=(BufferParam("d", f32, (256, 512), IN),), out_dtype=f32), "'rem'"),
])
def test_unsupported_cases_fall_back_to_triton_with_the_reason(kernel, words):
    c = choose(kernel, "sm_90")
    assert c.impl == "triton" and c.reason.startswith("fallback: ") and words in c.reason, c.reason
    assert choose(kernel, "sm_90", "cute").impl == "triton"  # forcing never makes a wrong kernel


def test_arch_without_a_cute_kernel_and_forcing():
    assert "no CuTeDSL GEMM for sm_80" in choose(gemm(), "sm_80").reason
    blackwell = choose(gemm(), "sm_100")
    assert blackwell.impl == "cute" and blackwell.arch == "sm_100a"
    assert choose(gemm(), "sm_90", "triton").impl == "triton"
    assert choose(gemm(), "sm_90", "cute").reason.startswith("forced by cuda_gemm='cute'")


def test_option_and_environment(monkeypatch):
    assert TritonBackend("cuda").options.cuda_gemm == "auto"
    monkeypatch.setenv("KILN_CUDA_GEMM", "triton")
    backend = TritonBackend("cuda")
    assert backend.options.cuda_gemm == "triton"
    assert backend.gemm_choice(gemm()).impl == "triton"
    assert "cuda_gemm='triton'" in backend.options.cache_text()  # part of every cache key
    monkeypatch.setenv("KILN_CUDA_GEMM", "cutlass")
    with pytest.raises(KilnArgumentError, match="KILN_CUDA_GEMM='cutlass'"):
        TritonBackend("cuda")
    with pytest.raises(KilnArgumentError, match="cuda_gemm must be auto, cute or triton"):
        TritonOptions(cuda_gemm="cublas")
    assert TritonBackend("cuda", TritonOptions(cuda_gemm="cute")).gemm_choice(gemm()).impl == "cute"


def _mlp(k: int):
    def f(x, w, b):
        return kn.relu(x @ w + b)

    x = kn.tensor(np.ones((256, k), np.float32)).to(kn.bfloat16)
    w = kn.tensor(np.ones((k, 512), np.float32)).to(kn.bfloat16)
    b = kn.tensor(np.ones((512,), np.float32)).to(kn.bfloat16)
    return kn.trace(f, x, w, b)


def test_dump_kernels_shows_the_choice_and_why(tmp_path):
    aligned, unaligned = tmp_path / "a.kir", tmp_path / "u.kir"
    save_graph(_mlp(128), aligned)
    save_graph(_mlp(100), unaligned)  # rows of 200 bytes: not a multiple of 16
    code, out, err = kiln_cli("dump", aligned, "--stage", "kernels", "--target", "cuda")
    assert code == 0, err
    assert "# cuda gemm: CuTeDSL sm_90a tile" in out
    code, out, err = kiln_cli("dump", unaligned, "--stage", "kernels", "--target", "cuda")
    assert code == 0, err
    assert "# cuda gemm: Triton (fallback: the leading dimension of a (K) = 100 elements of 2 bytes" in out
    code, out, _ = kiln_cli("dump", unaligned, "--stage", "source", "--target", "cuda")
    assert "@triton.jit" in out and "tl.dot(" in out
    code, out, _ = kiln_cli("dump", aligned, "--stage", "source", "--target", "cuda")
    assert "# CuTeDSL GEMM: kiln/codegen/cute/sm90_gemm.py" in out and "@triton.jit" not in out


def test_dump_asm_target_cuda_is_the_cute_ptx(tmp_path):
    path = tmp_path / "a.kir"
    save_graph(_mlp(128), path)
    code, out, err = kiln_cli("dump", path, "--stage", "asm", "--target", "cuda")
    assert code == 0, err
    assert "// kiln: CuTeDSL sm_90a GEMM" in out and ".target sm_90a" in out
    assert "wgmma.mma_async.sync.aligned" in out and "cp.async.bulk.tensor" in out
    assert "ld.global.b16" in out  # the bias, loaded in the epilogue
