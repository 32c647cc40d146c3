"""Golden OpenCL C for a few reference graphs (STYLE.md §3): a change to the OpenCL code
generator shows up as a reviewable diff of tests/codegen/opencl/golden/*.cl.

Regenerate after an intended change, then review the diff:

    KILN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/codegen/opencl/test_opencl_golden.py

Sources are emitted for the default limits (no device needed); these run everywhere."""

from __future__ import annotations

import os
import pathlib

import pytest

from kiln.codegen.opencl.backend import OpenCLBackend
from kiln.codegen.opencl.emit import DEFAULT_LIMITS, emit_kernel
from kiln.frontend.compile import compile_graph
from kiln.ir.parser import parse_graph

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
    "mlp": """
graph @mlp(%x: f32[B, 512], %w: f32[512, 1024], %b: f32[1024]) -> f32[B, 1024]
  where B in [1, 8192]
  %0 = matmul(%x, %w) : f32[B, 1024]
  %1 = broadcast_in_dim(%b) {broadcast_dimensions=(1,), shape=(B, 1024)} : f32[B, 1024]
  %2 = add(%0, %1) : f32[B, 1024]
  %3 = relu(%2) : f32[B, 1024]
  return %3
""",
}


def sources(name: str) -> str:
    backend = OpenCLBackend("opencl")
    program = compile_graph(parse_graph(GRAPHS[name]), "opencl", build=False).program
    return "\n".join(emit_kernel(backend.legalize(k), DEFAULT_LIMITS).source for k in program.kernels.values())


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_golden_opencl_source(name):
    path = GOLDEN_DIR / f"{name}.cl"
    text = sources(name)
    if os.environ.get("KILN_UPDATE_GOLDEN"):
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with KILN_UPDATE_GOLDEN=1 once"
    assert text == path.read_text(), f"generated OpenCL C for {name} changed; review and regenerate"


def test_golden_kernels_are_the_kinds_they_claim():
    assert "local-memory tree" in sources("softmax") and "reduction inner" in sources("softmax")
    assert "reduction outer" in sources("column_sum")
    assert "barrier(CLK_LOCAL_MEM_FENCE)" in sources("mlp") and "As[kk][r]" in sources("mlp")
    assert "const long s_B" in sources("gelu")  # the symbolic size is a kernel argument
