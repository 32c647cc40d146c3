"""SPMD compilation: the pass's local graphs (before/after, in the text IR) and the
compiled tensor-parallel MLP and FSDP transformer-block training on 4 ranks against
one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kiln as kn
from kiln.distributed.errors import ShardingRuleError
from kiln.distributed.placements import Partial, Replicate, Shard
from kiln.ir.parser import parse_graph
from kiln.passes.spmd import spmd_partition

from tests.distributed.harness import check_all_ok, run_scenario

WORKERS = Path(__file__).with_name("spmd_workers.py")
R = Replicate()


def _mlp(x, w1, w2):
    return kn.relu(x @ w1) @ w2


def _args(*shapes):
    return [np.ones(s, np.float32) for s in shapes]


def test_column_then_row_parallel_mlp_needs_one_all_reduce():
    g = kn.trace(_mlp, *_args((8, 16), (16, 32), (32, 16)))
    res = spmd_partition(g, [R, Shard(1), Shard(0)], world_size=4, out_placements=[R])
    expected = parse_graph("""
graph @_mlp(%x: f32[8, 16], %w1: f32[16, 8], %w2: f32[8, 16]) -> f32[8, 16]
  %0 = matmul(%x, %w1) : f32[8, 8]
  %1 = relu(%0) : f32[8, 8]
  %2 = matmul(%1, %w2) : f32[8, 16]
  %3 = all_reduce(%2) {group="world", reduce_op="sum", world_size=4} : f32[8, 16]
  return %3
""")
    assert str(res.graph) == str(expected)
    assert not res.takes_rank


def test_partial_result_without_out_placements_stays_partial():
    g = kn.trace(_mlp, *_args((8, 16), (16, 32), (32, 16)))
    res = spmd_partition(g, [R, Shard(1), Shard(0)], world_size=4)
    assert res.out_placements == [Partial("sum")]
    assert "all_reduce" not in str(res.graph)


def _sgd_step(w, x):
    loss, g = kn.value_and_grad(lambda w: (kn.gelu(x @ w)).sum())(w)
    return loss, w - 0.1 * g


def _fsdp_graph():
    """The local graph of one SGD step, weight and batch Shard(0) over 4 ranks."""
    g = kn.trace(_sgd_step, *_args((16, 8), (64, 16)))
    return spmd_partition(g, [Shard(0), Shard(0)], world_size=4, out_placements=[R, Shard(0)])


def test_fsdp_gathers_weights_and_reduce_scatters_gradients():
    # 64 tokens of width 16: gathering the 16 x 8 weight moves fewer bytes than moving
    # the activations (the cost model's choice, not a rule: small batches go the other way)
    res = _fsdp_graph()
    text = str(res.graph)
    counts = res.graph.op_counts()
    assert counts.get("all_gather") == 1 and counts.get("reduce_scatter") == 1, text
    assert counts.get("all_reduce") == 1 and "all_to_all" not in counts  # the loss
    assert "%w: f32[4, 8]" in text and "%x: f32[16, 16]" in text


def test_2d_mesh_partitions_dp_then_tp():
    from kiln.passes.spmd import spmd_partition_nd

    g = kn.trace(_mlp, *_args((8, 16), (16, 32), (32, 16)))
    res = spmd_partition_nd(g, [(Shard(0), R), (R, Shard(1)), (R, Shard(0))], mesh_shape=(2, 2),
                            groups=["dp", "tp"], out_placements=[(Shard(0), R)])
    expected = parse_graph("""
graph @_mlp(%x: f32[4, 16], %w1: f32[16, 16], %w2: f32[16, 16]) -> f32[4, 16]
  %0 = matmul(%x, %w1) : f32[4, 16]
  %1 = relu(%0) : f32[4, 16]
  %2 = matmul(%1, %w2) : f32[4, 16]
  %3 = all_reduce(%2) {group="tp", reduce_op="sum", world_size=2} : f32[4, 16]
  return %3
""")
    assert str(res.graph) == str(expected)
    assert res.out_placements == [(Shard(0), R)] and res.rank_dims == []


def _foreign(text: str, placements, out=None):
    return spmd_partition(parse_graph(text), placements, world_size=2, group="tp",
                          out_placements=out)


def test_collective_over_another_mesh_dim_keeps_this_dims_shards():
    # the dp all_reduce of a gradient sharded over tp runs on the tp shard: no tp traffic
    res = _foreign("""
graph @g(%x: f32[4, 8]) -> f32[4, 8]
  %0 = all_reduce(%x) {group="dp", reduce_op="sum", world_size=2} : f32[4, 8]
  return %0
""", [Shard(1)])
    assert str(res.graph) == str(parse_graph("""
graph @g(%x: f32[4, 4]) -> f32[4, 4]
  %0 = all_reduce(%x) {group="dp", reduce_op="sum", world_size=2} : f32[4, 4]
  return %0
"""))
    assert res.out_placements == [Shard(1)]
    # a Partial sum passes through a dp sum; a Partial max does not
    text = """
graph @g(%x: f32[4, 8]) -> f32[4, 8]
  %0 = all_reduce(%x) {group="dp", reduce_op="sum", world_size=2} : f32[4, 8]
  return %0
"""
    assert _foreign(text, [Partial("sum")]).out_placements == [Partial("sum")]
    res = _foreign(text, [Partial("max")])
    assert res.out_placements == [R]
    assert [n.op for n in res.graph.nodes] == ["all_reduce", "all_reduce"]
    assert res.graph.nodes[0].attrs["group"] == "tp"


def test_collective_over_another_mesh_dim_gathers_the_dim_it_moves():
    # a dp all_gather along dim 0 of a value tp cut along dim 0: tp must gather first
    # (the dp chunks of tp shards would interleave), then the dp gather runs whole
    res = _foreign("""
graph @g(%x: f32[4, 8]) -> f32[8, 8]
  %0 = all_gather(%x) {axis=0, group="dp", world_size=2} : f32[8, 8]
  return %0
""", [Shard(0)])
    assert str(res.graph) == str(parse_graph("""
graph @g(%x: f32[2, 8]) -> f32[8, 8]
  %0 = all_gather(%x) {axis=0, group="tp", world_size=2} : f32[4, 8]
  %1 = all_gather(%0) {axis=0, group="dp", world_size=2} : f32[8, 8]
  return %1
"""))
    assert res.out_placements == [R]


def test_2d_placements_must_match_the_mesh():
    from kiln.passes.spmd import spmd_partition_nd

    g = kn.trace(_mlp, *_args((8, 16), (16, 32), (32, 16)))
    with pytest.raises(ShardingRuleError, match="1 mesh dim.*shape \\[2, 2\\]"):
        spmd_partition_nd(g, [(R,), (R, R), (R, R)], mesh_shape=(2, 2), groups=["dp", "tp"])
    with pytest.raises(ShardingRuleError, match="distinct group names"):
        spmd_partition_nd(g, [(R, R)] * 3, mesh_shape=(2, 2), groups=["dp", "dp"])


def test_uneven_input_shard_is_refused():
    g = kn.trace(_mlp, *_args((6, 16), (16, 32), (32, 16)))
    with pytest.raises(ShardingRuleError, match="K242.*Shard\\(0\\) over 4 ranks.*divide"):
        spmd_partition(g, [Shard(0), R, R], world_size=4)


def test_single_rank_mesh_compiles_and_matches():
    from kiln.distributed import DeviceMesh, distribute_tensor

    mesh = DeviceMesh((1,), ("x",))
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8, 6), (6, 3)))
    f = kn.compile(_mlp)
    y = f(*(distribute_tensor(a, mesh, [p]) for a, p in zip((x, w1, w2), (R, Shard(1), Shard(0)))))
    np.testing.assert_allclose(y.full_tensor().numpy(), np.maximum(x @ w1, 0) @ w2, rtol=1e-5,
                               atol=1e-5)


def test_tp_mlp_and_fsdp_block_on_4_ranks(tmp_path):
    data = check_all_ok(run_scenario("tp_and_fsdp", 4, tmp_path, workers=WORKERS,
                                     args={"steps": 3}, timeout=240.0))
    single = data[0]["single"]
    assert single[-1] < single[0]  # it trains
    for d in data:  # every rank sees the single-process loss curve
        np.testing.assert_allclose(d["sharded"], single, rtol=2e-4)


def test_inserted_collectives_are_overlapped_by_the_scheduling_pass():
    from kiln.frontend.compile import compile_graph

    optimized = compile_graph(_fsdp_graph().graph, build=False).optimized
    ops = [n.op for n in optimized.nodes]
    # every inserted collective is split into start/wait; the gradient's reduce_scatter
    # runs while the kernels after it compute (its wait comes later)
    assert ops[0] == "all_gather_start" and "all_gather" not in ops, ops
    start = ops.index("reduce_scatter_start")
    assert "fused" in ops[start + 1:ops.index("collective_wait", start)], ops


def test_dp_x_tp_and_fsdp_x_tp_on_a_2x2_mesh(tmp_path):
    data = check_all_ok(run_scenario("mesh_2d", 4, tmp_path, workers=WORKERS,
                                     args={"steps": 3}, timeout=240.0))
    single = data[0]["single"]
    assert single[-1] < single[0]  # it trains
    assert sorted(tuple(d["coord"]) for d in data) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for d in data:  # every rank of both layouts sees the single-process loss curve
        np.testing.assert_allclose(d["dp_tp"], single, rtol=2e-4)
        np.testing.assert_allclose(d["fsdp_tp"], single, rtol=2e-4)
    # the TP MLP on mesh["tp"] ran over two distinct pairs (one per dp row)
    assert len({d["tp_group"] for d in data}) == 2


def test_2d_training_on_a_one_rank_mesh_matches_one_process():
    # a mesh of one rank: every collective is the identity. (This caught the runtime
    # reusing an operand's storage while an extern's result, dynamic_slice of the whole
    # operand, still viewed it.)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import sharded_training as ex
    from kiln.distributed import DeviceMesh

    mesh = DeviceMesh((1, 1), ("dp", "tp"))
    single = ex.mesh_2d_losses(None, steps=3)
    assert single[-1] < single[0]
    np.testing.assert_allclose(ex.mesh_2d_losses(mesh, steps=3), single, rtol=1e-5)
    np.testing.assert_allclose(ex.mesh_2d_losses(mesh, steps=3, fsdp=True), single, rtol=1e-5)
