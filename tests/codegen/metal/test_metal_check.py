"""The checks themselves, and the backend's faces that need no simulator: the
compatibility header catches planted errors (so the syntax check can fail), golden MSL
for reference graphs, `kiln dump --target metal`, float64 refused with K372, and running
without a Mac is K410.

Regenerate the goldens after an intended codegen change, then review the diff:

    KILN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/codegen/metal/test_metal_check.py
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.backend import get_backend
from kiln.codegen.metal.emit import emit_kernel
from kiln.errors import KilnError
from kiln.frontend.compile import compile_graph
from kiln.frontend.stages import render_stage
from kiln.ir.parser import parse_graph
from tests.codegen.metal.conftest import needs_clang
from tests.codegen.metal.simulator import MslError, check_msl

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
GRAPHS = {
    "gelu": """
graph @gelu(%x: f32[B, 1024]) -> f32[B, 1024]
  where B in [1, 65536]
  %0 = gelu(%x) {approximate="tanh"} : f32[B, 1024]
  return %0
""",
    "softmax": """
graph @softmax(%x: f32[B, 1000]) -> f32[B, 1000]
  where B in [1, 65536]
  %0 = softmax(%x) {dim=1} : f32[B, 1000]
  return %0
""",
    "column_sum": """
graph @column_sum(%x: f32[N, 256]) -> f32[256]
  where N in [1, 1048576]
  %0 = reduce_sum(%x) {axes=(0,)} : f32[256]
  return %0
""",
    "linear_relu": """
graph @linear_relu(%x: f16[B, 512], %w: f16[512, 256], %b: f16[256]) -> f16[B, 256]
  where B in [1, 8192]
  %0 = matmul(%x, %w) : f16[B, 256]
  %1 = broadcast_in_dim(%b) {broadcast_dimensions=(1,), shape=(B, 256)} : f16[B, 256]
  %2 = add(%0, %1) : f16[B, 256]
  %3 = relu(%2) : f16[B, 256]
  return %3
""",
}


def _sources(text: str) -> str:
    backend = get_backend("metal")
    kernels = compile_graph(parse_graph(text), "metal", build=False).program.kernels.values()
    return "\n".join(emit_kernel(backend.legalize(k)).source for k in kernels)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_golden_msl(name):
    got = _sources(GRAPHS[name])
    path = GOLDEN_DIR / f"{name}.metal"
    if os.environ.get("KILN_UPDATE_GOLDEN"):
        path.write_text(got)
    assert path.exists(), f"no golden {path.name}: run with KILN_UPDATE_GOLDEN=1 and review it"
    assert got == path.read_text(), f"generated MSL of {name} changed: review, then KILN_UPDATE_GOLDEN=1"


@needs_clang
def test_the_golden_sources_pass_the_syntax_check():
    for name in sorted(GRAPHS):
        check_msl((GOLDEN_DIR / f"{name}.metal").read_text())


@needs_clang
@pytest.mark.parametrize("plant,message", [
    # a device pointer handed to threadgroup memory: a different address space
    ("  if (tid == 0) { threadgroup float* bad = b_out0; bad[0] = 1.0f; }\n",
     "'threadgroup float \\*' with an lvalue of type 'device float \\*'"),
    # a write through a constant reference
    ("  s_B = 3;\n", "const"),
    # a vector with the wrong number of components
    ("  float3 v = float4(1.0f).xyzw;\n", "float"),
])
def test_the_header_catches_planted_errors(plant, message):
    source = _sources(GRAPHS["softmax"])
    check_msl(source)  # the real kernel passes
    planted = source.replace("  const bool valid", plant + "  const bool valid", 1)
    assert planted != source
    with pytest.raises(MslError, match=message):
        check_msl(planted)


def test_float64_is_a_clear_k372_on_metal():
    graph = kn.trace(lambda x: kn.exp(x), np.zeros(4, np.float64))
    with pytest.raises(KilnError, match="K372") as info:
        render_stage(graph, "source", "metal")
    assert "float64" in str(info.value) and "metal" in str(info.value)


@pytest.mark.skipif(sys.platform == "darwin", reason="on a Mac, Metal runs (scripts/metal_check.py checks it)")
def test_running_without_a_mac_says_a_mac_is_needed():
    fn = kn.compile(lambda x: x * 2, backend="metal")
    with pytest.raises(KilnError, match="K410") as info:
        fn(np.ones(4, np.float32))
    assert "macOS" in str(info.value)


def test_kiln_dump_prints_the_generated_msl(tmp_path):
    path = tmp_path / "f.kir"
    kn.export(lambda x: kn.softmax(x, dim=-1), (kn.zeros(4, 8),)).save(str(path))
    done = subprocess.run([sys.executable, "-m", "kiln", "dump", str(path), "--target", "metal", "--stage", "source"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kernel void kiln_" in done.stdout and "simd_shuffle_xor" in done.stdout


@pytest.mark.skipif(sys.platform == "darwin", reason="on a Mac, the metal device exists")
@pytest.mark.parametrize("name", ["metal", "mps:0"])
def test_the_metal_device_kind_without_a_mac_is_k381_carrying_k410(name):
    with pytest.raises(KilnError, match="K381") as info:
        kn.zeros(3, device=name)
    assert "K410" in str(info.value) and "macOS" in str(info.value)
