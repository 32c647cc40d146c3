"""Ahead-of-time compilation without a GPU: every kernel kind to PTX/cubin (sm_90) and
AMDGCN/hsaco (gfx942), tensor-core instructions in the GEMMs, and the artifact cache
that lets a second process skip the build."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="the Triton backend tests need the triton package")

from kiln.codegen import artifact_cache  # noqa: E402
from kiln.codegen.triton import aot  # noqa: E402
from kiln.errors import KilnArgumentError  # noqa: E402
from tests.codegen.triton.conftest import ROOT  # noqa: E402

KINDS = ("pointwise", "inner_persistent", "inner_looped", "outer_persistent", "outer_looped",
         "full_persistent", "full_looped", "gemm_f32", "gemm_f16")

ADD = '''
import triton
import triton.language as tl


@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)
'''
ADD_SIG = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"}


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kernel_kind_compiles(aot_kinds, kind, target):
    emitted, art = aot_kinds[kind, target]
    assert art.target == target and art.name == emitted.name
    assert {"ttir", "ttgir", "llir"} <= set(art.asm)
    if target == "sm_90":
        assert art.asm["ptx"].lstrip().startswith("//") and ".target sm_90" in art.asm["ptx"]
        assert isinstance(art.binary, bytes) and art.binary[:4] == b"\x7fELF"  # cubin
    else:
        assert 'amdgcn_target "amdgcn-amd-amdhsa--gfx942' in art.assembly or "gfx942" in art.assembly
        assert art.binary[:4] == b"\x7fELF"  # hsaco
    assert art.metadata["num_warps"] == emitted.num_warps
    assert emitted.kind == ("gemm" if kind.startswith("gemm") else "pointwise" if kind == "pointwise"
                            else "reduction_" + kind.split("_")[0])
    if kind != "pointwise" and not kind.startswith("gemm"):
        assert emitted.persistent == kind.endswith("persistent")


def test_gemm_uses_tensor_cores(aot_kinds):
    _, nv = aot_kinds["gemm_f16", "sm_90"]
    assert "wgmma.mma_async" in nv.asm["ptx"]
    _, amd = aot_kinds["gemm_f16", "gfx942"]
    assert "v_mfma_f32" in amd.asm["amdgcn"]
    # an IEEE float32 product stays on the FMA units on NVIDIA (exact like numpy)
    _, f32 = aot_kinds["gemm_f32", "sm_90"]
    assert "mma" not in f32.asm["ptx"] and "fma.rn.f32" in f32.asm["ptx"]


def test_ieee_division_and_libdevice_in_ptx(aot_kinds):
    _, art = aot_kinds["inner_persistent", "sm_90"]  # softmax: exp and a division
    ptx = art.asm["ptx"]
    assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx
    assert "ex2.approx" in ptx  # libdevice's expf is built on ex2 plus a correction


def test_aot_compile_source_text_and_cache_hit():
    art = aot.aot_compile(ADD, ADD_SIG, {"BLOCK": 256}, "sm_90")
    assert art.name == "add" and "add.f32" in art.asm["ptx"] and art.metadata["shared"] == 0
    hits = artifact_cache.STATS["hits"]
    again = aot.aot_compile(ADD, ADD_SIG, {"BLOCK": 256}, "sm_90")
    assert artifact_cache.STATS["hits"] == hits + 1 and again.asm == art.asm and again.key == art.key
    other = aot.aot_compile(ADD, ADD_SIG, {"BLOCK": 256}, "cuda", num_warps=8)
    assert other.key != art.key and other.metadata["num_warps"] == 8
    amd = aot.aot_compile(ADD, ADD_SIG, {"BLOCK": 256}, "rocm")
    assert amd.target == "gfx942" and "v_add_f32" in amd.assembly and amd.vendor == "rocm"


def test_second_process_loads_from_the_cache(tmp_path):
    """The promise of the artifact cache: another process gets the build without compiling."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from kiln.codegen import artifact_cache
        from kiln.codegen.triton import aot
        import triton
        calls = []
        real = triton.compile
        triton.compile = lambda *a, **k: calls.append(1) or real(*a, **k)
        art = aot.aot_compile({ADD!r}, {ADD_SIG!r}, {{"BLOCK": 128}}, "gfx942")
        print(len(calls), artifact_cache.STATS["hits"], art.name)
    """)
    env = {"KILN_CACHE_DIR": str(tmp_path), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "TRITON_DEFAULT_FP_FUSION": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           timeout=120) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout.split() == ["1", "0", "add"]  # built
    assert runs[1].stdout.split() == ["0", "1", "add"]  # loaded: triton.compile never called


def test_targets_and_arch_names():
    assert set(aot.TARGETS) == {"sm_80", "sm_90", "sm_100", "gfx90a", "gfx942", "gfx950"}
    assert (aot.TARGETS["sm_100"].backend, aot.TARGETS["sm_100"].arch, aot.TARGETS["sm_100"].warp_size) == \
        ("cuda", 100, 32)
    assert (aot.TARGETS["gfx950"].backend, aot.TARGETS["gfx950"].warp_size) == ("hip", 64)
    assert aot.DEFAULT_TARGET == {"cuda": "sm_90", "rocm": "gfx942"}
    assert aot.target_name(aot.TARGETS["sm_80"]) == "sm_80" and aot.target_name(aot.TARGETS["gfx90a"]) == "gfx90a"


def test_signature_mismatch_is_a_clear_error():
    with pytest.raises(KilnArgumentError, match=r"missing \['n'\]"):
        aot.aot_compile(ADD, {k: v for k, v in ADD_SIG.items() if k != "n"}, {"BLOCK": 64}, "sm_90")
    with pytest.raises(KilnArgumentError, match="constexpr without a value"):
        aot.aot_compile(ADD, ADD_SIG, {}, "sm_90")
    with pytest.raises(KilnArgumentError, match="unknown GPU target"):
        aot.aot_compile(ADD, ADD_SIG, {"BLOCK": 64}, "sm_75")
    with pytest.raises(KilnArgumentError, match="2 @triton.jit functions"):
        aot.load_source(ADD + "\n\n@triton.jit\ndef scale(x):\n    return x * 2\n")
