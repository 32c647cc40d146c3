"""The default CPU pipeline: its stages by name, one before/expected pair through all
of them, and every real graph through it (verified after each stage)."""

import pytest

from kiln.passes.decompose import composites
from kiln.passes.pipeline import CPU_KEEP, DEFAULT_PASSES, default_pipeline, optimize
from tests.passes.examples import EXAMPLES, assert_rewrites, check_preserves, example

TOL = {"rtol": 2e-6, "atol": 2e-6}


def test_stage_names_are_the_documented_list():
    assert [name for name, _ in DEFAULT_PASSES] == [
        "decompose", "complex", "canonicalize", "fold_constants", "cse", "licm", "unroll",
        "dce"]
    assert default_pipeline().names() == [name for name, _ in DEFAULT_PASSES]


def test_extra_stages_append_without_touching_the_default():
    def fuse(graph):
        return graph

    p = default_pipeline(extra=[("fuse", fuse)])
    assert p.names()[-1] == "fuse" and len(DEFAULT_PASSES) == 8
    assert default_pipeline().names()[-1] == "dce"


def test_whole_pipeline_before_and_expected():
    before = """
graph @g(%x: f32[4, 8], %w: f32[8, 8]) -> f32[4, 8]
  %0 = matmul(%x, %w) : f32[4, 8]
  %1 = full() {dtype=f32, shape=(), value=1.0} : f32[]
  %2 = broadcast_in_dim(%1) {broadcast_dimensions=(), shape=(4, 8)} : f32[4, 8]
  %3 = mul(%2, %0) : f32[4, 8]
  %4 = transpose(%3) {permutation=(1, 0)} : f32[8, 4]
  %5 = transpose(%4) {permutation=(1, 0)} : f32[4, 8]
  %6 = relu(%5) : f32[4, 8]
  %7 = iota() {dimension=0, dtype=i32, shape=(4, 8)} : i32[4, 8]
  %8 = full() {dtype=i32, shape=(4, 8), value=3} : i32[4, 8]
  %9 = mul(%7, %8) : i32[4, 8]
  %10 = convert(%9) {dtype=f32} : f32[4, 8]
  %11 = relu(%5) : f32[4, 8]
  %12 = add(%6, %11) : f32[4, 8]
  %13 = add(%12, %10) : f32[4, 8]
  return %13
"""
    expected = """
graph @g(%x: f32[4, 8], %w: f32[8, 8]) -> f32[4, 8]
  %0 = matmul(%x, %w) : f32[4, 8]
  %1 = full() {dtype=f32, shape=(4, 8), value=0} : f32[4, 8]
  %2 = max(%0, %1) : f32[4, 8]
  %3 = constant() {dtype=f32, name="k1", shape=(4, 8)} : f32[4, 8]
  %4 = add(%2, %2) : f32[4, 8]
  %5 = add(%4, %3) : f32[4, 8]
  return %5
"""
    result = assert_rewrites(default_pipeline(debug=True), before, expected)
    assert set(result.constants) == {"k1"}
    assert result.constants["k1"][3, 0] == 9.0


def test_each_stage_can_be_dumped_by_name():
    graph, _ = example("layer_norm")
    stages = default_pipeline(debug=True).run_stages(graph)
    assert list(stages) == [name for name, _ in DEFAULT_PASSES]
    assert "layer_norm" in graph.op_counts()
    assert "layer_norm" not in stages["decompose"].op_counts()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_real_graphs_through_the_pipeline(name):
    result = check_preserves(default_pipeline(debug=True), name, exact=False, **TOL)
    assert set(result.op_counts()) & composites() <= CPU_KEEP
    again = optimize(result)  # a second run finds little left to do
    assert sum(1 for _ in again.walk()) <= sum(1 for _ in result.walk())
