"""The subgroup variants: generated for a device that reports cl_khr_subgroups /
cl_intel_subgroups, compile-checked by clang for spir64 (and to SPIR-V), run where the
device has them, and never chosen for a device without them (PoCL)."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.opencl.backend import OpenCLBackend
from kiln.codegen.opencl.clang_check import clang, llvm_spirv, spir_text, spirv_binary
from kiln.codegen.opencl.emit import Limits, emit_kernel
from kiln.frontend.compile import compile_graph
from kiln.ir.parser import parse_graph
from tests.codegen.opencl.conftest import needs_device
from tests.codegen.opencl.test_opencl_golden import GRAPHS

INTEL = Limits(max_work_group_size=512, local_mem_size=65536, compute_units=32, subgroups=True,
               intel_subgroups=True)
KHR = Limits(max_work_group_size=256, local_mem_size=32768, compute_units=8, subgroups=True)
needs_clang = pytest.mark.skipif(clang() is None, reason="needs clang (apt-get install clang)")


def sources(graph: str, limits: Limits) -> list[str]:
    backend = OpenCLBackend()
    program = compile_graph(parse_graph(graph), "opencl", build=False).program
    return [emit_kernel(backend.legalize(k), limits).source for k in program.kernels.values()]


SUM_ROWS = """
graph @rows(%x: f32[B, 4096]) -> f32[B]
  where B in [1, 65536]
  %0 = reduce_sum(%x) {axes=(1,)} : f32[B]
  return %0
"""
MAX_ROWS = SUM_ROWS.replace("reduce_sum", "reduce_max")


def test_subgroup_variants_are_chosen_only_where_the_device_reports_them():
    (khr,) = sources(SUM_ROWS, KHR)
    assert "sub_group_reduce_add" in khr and "cl_khr_subgroups" in khr
    (plain,) = sources(SUM_ROWS, Limits())
    assert "sub_group" not in plain and "for (int s = " in plain
    # a float max must propagate NaN, which sub_group_reduce_max does not promise
    (fmax,) = sources(MAX_ROWS, KHR)
    assert "sub_group_reduce" not in fmax
    (gemm,) = sources(GRAPHS["mlp"], INTEL)
    assert "intel_sub_group_block_read" in gemm and "intel_reqd_sub_group_size(16)" in gemm
    (gemm_khr,) = sources(GRAPHS["mlp"], KHR)  # block reads are Intel's only
    assert "intel_sub_group" not in gemm_khr
    odd = GRAPHS["mlp"].replace("1024", "1000")  # N not a multiple of the subgroup size
    assert "intel_sub_group" not in sources(odd, INTEL)[0]


@needs_clang
@pytest.mark.parametrize("graph", ["softmax", "mlp", "rows"])
def test_subgroup_kernels_compile_for_an_intel_spir64_target(graph):
    text = SUM_ROWS if graph == "rows" else GRAPHS[graph]
    for src in sources(text, INTEL):
        assert "spir64" in spir_text(src)
        if llvm_spirv() is not None:
            assert spirv_binary(src)[:4] == bytes.fromhex("03022307")  # the SPIR-V magic


@needs_device
def test_on_this_device_the_chosen_variant_runs_and_matches_numpy():
    from kiln.codegen.opencl.runtime import context

    limits = context().limits
    x = np.random.default_rng(0).standard_normal((33, 4096)).astype(np.float32)
    got = kn.compile(lambda a: a.sum(-1), backend="opencl")(x).numpy()
    np.testing.assert_allclose(got, x.sum(-1), rtol=1e-4, atol=1e-4)
    src = sources(SUM_ROWS, limits)[0]
    assert ("sub_group_reduce_add" in src) == limits.subgroups
