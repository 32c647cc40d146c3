"""Sharding rules: every op of the registry has one; strategies ranked by communication;
every op run sharded on 4 ranks against its unsharded numpy reference; meshes and
redistribution (uneven shards as torch.chunk cuts them) on 4 real processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.distributed.errors import PlacementError, ShardingRuleError
from kiln.distributed.placements import (
    Partial, Replicate, Shard, chunk_bounds, local_shape, normalize,
)
from kiln.distributed.sharding import rule_for
from kiln.distributed.sharding.dispatch import plan
from kiln.ir import dtypes as dt
from kiln.ir import registry

from tests.distributed.harness import check_all_ok, run_scenario
from tests.distributed.sharding_cases import NOT_RUN, case, runnable_ops

WORKERS = Path(__file__).with_name("sharding_workers.py")
R, F = Replicate(), dt.float32


@pytest.mark.parametrize("name", sorted(registry.all_ops()))
def test_every_op_has_a_sharding_rule_and_a_case(name):
    assert callable(rule_for(name))
    if name in NOT_RUN:
        return
    import numpy as np

    arrays, attrs = case(name, np.random.default_rng(0))  # the 4-rank walk runs it
    p = plan(name, [(a.shape, dt.from_numpy(a.dtype)) for a in arrays],
             [(R,)] * len(arrays), attrs, (4,))
    assert all(o == (R,) for o in p.outputs) and p.bytes == 0.0


def test_an_op_without_a_rule_is_a_numbered_error(monkeypatch):
    from kiln.distributed.sharding import strategy

    monkeypatch.delitem(strategy.RULES, "matmul")
    with pytest.raises(ShardingRuleError, match=r"K242.*matmul \(kind composite\) has no"):
        rule_for("matmul")


def test_chunks_follow_torch_chunk():
    torch = pytest.importorskip("torch")
    for size in range(0, 11):
        for parts in (1, 2, 3, 4):
            chunks = torch.arange(size).chunk(parts)
            got = [chunk_bounds(size, parts, c) for c in range(parts)]
            want = [(int(ch[0]), int(ch[-1]) + 1) for ch in chunks if len(ch)]
            assert [g for g in got if g[0] < g[1]] == want, (size, parts)


def test_placement_algebra():
    assert normalize([Shard(-1)], 3, 1) == (Shard(2),)
    assert local_shape((10, 4), (Shard(0), Shard(0)), (2, 2), (1, 1)) == (2, 4)
    assert local_shape((10, 4), (Shard(0), Shard(1)), (2, 2), (0, 1)) == (5, 2)
    with pytest.raises(PlacementError, match="K241.*Shard\\(2\\) on a tensor of rank 2"):
        normalize([Shard(2)], 2, 1)
    with pytest.raises(PlacementError, match="2 placement\\(s\\).*mesh of 1"):
        normalize([R, R], 2, 1)
    with pytest.raises(PlacementError, match="Partial\\('mean'\\)"):
        Partial("mean")


@pytest.mark.parametrize("op, shapes, placements, attrs, want_in, want_out, cost", [
    # row-parallel matmul: contracted dim sharded on both sides -> Partial, no traffic
    ("matmul", [(8, 64), (64, 64)], [Shard(1), Shard(0)], {}, [Shard(1), Shard(0)],
     [Partial("sum")], 0.0),
    # FSDP: batch and weight rows sharded: gather the weight (3/4 of 48 bytes), not the
    # activations into a Partial that must be reduced later
    ("matmul", [(8, 4), (4, 3)], [Shard(0), Shard(0)], {}, [Shard(0), R], [Shard(0)], 36.0),
    # column parallel: weight columns sharded, activations replicated
    ("matmul", [(8, 4), (4, 6)], [R, Shard(1)], {}, [R, Shard(1)], [Shard(1)], 0.0),
    # a Partial operand of exp: reduce_scatter (3/4 of 128 bytes) beats all_reduce
    ("exp", [(8, 4)], [Partial("sum")], {}, [Shard(0)], [Shard(0)], 96.0),
    # add of Partial sums stays Partial
    ("add", [(8, 4), (8, 4)], [Partial("sum"), Partial("sum")], {}, [Partial("sum")] * 2,
     [Partial("sum")], 0.0),
    # softmax over the sharded dim: all_to_all to the other dim is the cheapest move
    ("softmax", [(8, 4)], [Shard(1)], {"dim": 1}, [Shard(0)], [Shard(0)], 24.0),
    # reshape keeps an evenly cut leading dim
    ("reshape", [(8, 6)], [Shard(0)], {"shape": (4, 2, 6)}, [Shard(0)], [Shard(0)], 0.0),
    ("reduce_sum", [(8, 4)], [Shard(0)], {"axes": (0,)}, [Shard(0)], [Partial("sum")], 0.0),
    ("transpose", [(8, 4)], [Shard(0)], {"permutation": (1, 0)}, [Shard(0)], [Shard(1)], 0.0),
])
def test_strategy_ranked_by_communication(op, shapes, placements, attrs, want_in, want_out,
                                          cost):
    p = plan(op, [(s, F) for s in shapes], [(pl,) for pl in placements], attrs, (4,))
    assert [pl[0] for pl in p.inputs] == want_in
    assert [pl[0] for pl in p.outputs] == want_out
    assert p.bytes == cost


def test_every_op_sharded_on_4_ranks(tmp_path):
    results = run_scenario("every_op_sharded", 4, tmp_path, workers=WORKERS, timeout=170.0)
    data = check_all_ok(results)
    assert data[0]["ops"] == len(runnable_ops()) and data[0]["runs"] > 4 * data[0]["ops"]
    sharded = data[0]["sharded"]
    # the rules keep real sharding, not just replicate everything
    for name in ("matmul", "add", "exp", "reduce_sum", "layer_norm", "softmax", "take",
                 "scaled_dot_product_attention", "conv2d", "dot_general", "cholesky"):
        assert name in sharded, name
    assert len(sharded) > 100


def test_mesh_and_redistribute_on_4_ranks(tmp_path):
    data = check_all_ok(run_scenario("mesh_and_redistribute", 4, tmp_path, workers=WORKERS,
                                     timeout=120.0))
    assert data[0]["pairs_1d"] == 25 and data[0]["pairs_2d"] == 256
    # x [Shard(0), Shard(1)] @ w [Replicate(), Shard(0)] on the 2 x 2 mesh: rows over dp,
    # the contraction over tp
    assert data[0]["placements_2d"] == "(Shard(0), Partial('sum'))"
