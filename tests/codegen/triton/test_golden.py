"""Golden Triton sources for a few reference graphs (STYLE.md §3): a change to the Triton
code generator shows up as a reviewable diff of tests/codegen/triton/golden/*.py.

Regenerate after an intended change, then review the diff:

    KILN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/codegen/triton/test_golden.py

Emitting source needs no triton; these run everywhere."""

from __future__ import annotations

import os
import pathlib

import pytest

from kiln.codegen.triton.backend import TritonBackend
from kiln.frontend.compile import compile_graph
from kiln.ir.parser import parse_graph

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"

GRAPHS = {
    # inner reduction, persistent: two reductions and the store share one read of x
    "softmax": """
graph @softmax(%x: f32[B, 1000]) -> f32[B, 1000]
  where B in [1, 65536]
  %0 = softmax(%x) {dim=1} : f32[B, 1000]
  return %0
""",
    # inner reduction, looped (the row is wider than one block)
    "softmax_wide": """
graph @softmax_wide(%x: bf16[B, 32000]) -> bf16[B, 32000]
  where B in [1, 4096]
  %0 = softmax(%x) {dim=1} : bf16[B, 32000]
  return %0
""",
    "layer_norm": """
graph @layer_norm(%x: f32[B, 768], %g: f32[768], %b: f32[768]) -> f32[B, 768]
  where B in [1, 65536]
  %0 = layer_norm(%x, %g, %b) {eps=1e-05, has_bias=true, has_weight=true, normalized_ndim=1} : f32[B, 768]
  return %0
""",
    # GEMM with its epilogue (bias + tanh gelu) applied to the accumulator tile
    "mlp": """
graph @mlp(%x: f16[B, 512], %w: f16[512, 1024], %b: f16[1024]) -> f16[B, 1024]
  where B in [1, 8192]
  %0 = matmul(%x, %w) : f16[B, 1024]
  %1 = broadcast_in_dim(%b) {broadcast_dimensions=(1,), shape=(B, 1024)} : f16[B, 1024]
  %2 = add(%0, %1) : f16[B, 1024]
  %3 = gelu(%2) {approximate="tanh"} : f16[B, 1024]
  return %3
""",
    # outer reduction: the reduced dim is the strided one
    "column_sum": """
graph @column_sum(%x: f32[N, 256]) -> f32[256]
  where N in [1, 1048576]
  %0 = reduce_sum(%x) {axes=(0,)} : f32[256]
  return %0
""",
    "gelu": """
graph @gelu(%x: f32[B, 4096]) -> f32[B, 4096]
  where B in [1, 65536]
  %0 = gelu(%x) {approximate="none"} : f32[B, 4096]
  return %0
""",
}


def generated(name: str) -> str:
    graph = parse_graph(GRAPHS[name].strip())
    kernels = compile_graph(graph, "reference").program.kernels
    backend = TritonBackend("cuda")
    parts = [f"# ---- kernel {k} (target cuda, {backend.arch}) ----\n{backend.emit(v).source}"
             for k, v in kernels.items()]
    return "\n".join(parts)


@pytest.mark.parametrize("name", list(GRAPHS))
def test_golden_triton_source(name):
    path = GOLDEN_DIR / f"{name}.py"
    text = generated(name)
    if os.environ.get("KILN_UPDATE_GOLDEN"):
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with KILN_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), (
        f"the generated Triton source of {name!r} changed; review the diff and regenerate with "
        "KILN_UPDATE_GOLDEN=1 if intended")
