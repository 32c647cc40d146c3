"""Multiprocess scenarios of the mesh, DTensor and sharded-op tests (see harness.py).

    python sharding_workers.py SCENARIO RANK WORLD STORE_ADDR RESULT_JSON ARGS_JSON

Each scenario checks its results against numpy on the rank itself and returns
JSON-able data for the test.
"""

from __future__ import annotations

import itertools
import os
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workers  # noqa: E402
from workers import join, scenario  # noqa: E402

from kiln.distributed.dtensor import DTensor, distribute_tensor  # noqa: E402
from kiln.distributed.mesh import DeviceMesh  # noqa: E402
from kiln.distributed.placements import Partial, Replicate, Shard  # noqa: E402
from kiln.distributed.sharding.dispatch import run_op  # noqa: E402
from kiln.ir import registry  # noqa: E402


def _placements_1d(ndim: int):
    found = [Replicate(), Partial("sum"), Partial("max")]
    return found + [Shard(d) for d in range(ndim)]


@scenario
def mesh_and_redistribute(rank, world, addr, args):
    """Every pair of placements on a 1-d mesh of `world` and a 2 x 2 mesh, uneven
    shapes included: local blocks (torch.chunk sizes) and full_tensor round trips."""
    join(rank, world, addr)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 5)).astype(np.float32)
    mesh = DeviceMesh((world,), ("x",))
    checked = 0
    for src, dst in itertools.product(_placements_1d(2), repeat=2):
        a = distribute_tensor(x, mesh, [src], src_data_rank=None)
        b = a.redistribute(mesh, [dst])
        np.testing.assert_allclose(b.full_tensor().numpy(), x, rtol=1e-6, atol=1e-6)
        if dst.is_shard():
            step = -(-x.shape[dst.dim] // world)
            lo = min(rank * step, x.shape[dst.dim])
            want = np.take(x, np.arange(lo, min(lo + step, x.shape[dst.dim])), axis=dst.dim)
            np.testing.assert_array_equal(b.to_local().numpy(), want)
        checked += 1
    data = {"pairs_1d": checked}
    if world == 4:
        mesh2 = DeviceMesh((2, 2), ("dp", "tp"))
        coord = mesh2.get_coordinate()
        assert coord == (rank // 2, rank % 2), coord
        assert mesh2["tp"].size() == 2 and mesh2["tp"].get_group().world_size == 2
        assert mesh2.get_group("dp").world_size == 2
        y = rng.standard_normal((6, 9)).astype(np.float32)
        options = [Replicate(), Shard(0), Shard(1), Partial("sum")]
        pairs = 0
        for src in itertools.product(options, repeat=2):
            a = distribute_tensor(y, mesh2, list(src), src_data_rank=None)
            for dst in itertools.product(options, repeat=2):
                b = a.redistribute(mesh2, list(dst))
                np.testing.assert_allclose(b.full_tensor().numpy(), y, rtol=1e-5, atol=1e-5)
                pairs += 1
        # nested sharding: [Shard(0), Shard(0)] cuts dp's chunk again along tp
        n = distribute_tensor(y, mesh2, [Shard(0), Shard(0)], src_data_rank=None)
        bounds = n.local_bounds()[0]
        outer = (0, 3) if coord[0] == 0 else (3, 6)
        inner_step = 2
        start = outer[0] + min(coord[1] * inner_step, 3)
        assert bounds == (start, min(start + inner_step, outer[1])), (bounds, coord)
        data["pairs_2d"] = pairs
    if world == 4:
        data["placements_2d"] = _ops_on_2d_mesh()
    # distribute_tensor takes rank 0's value by default
    mine = np.full((4, 2), float(rank), np.float32)
    d = distribute_tensor(mine, mesh, [Shard(0)])
    assert np.all(d.full_tensor().numpy() == 0.0)
    # from_local: even shards infer the global shape
    f = DTensor.from_local(np.full((2, 3), rank, np.float32), mesh, [Shard(0)])
    assert f.shape == (2 * world, 3)
    return data


def _combos(arrays):
    floats = [a.dtype.kind == "f" for a in arrays]
    yield [Replicate() for _ in arrays]
    if arrays and arrays[0].ndim:
        yield [Shard(0)] + [Replicate() for _ in arrays[1:]]
    yield [Shard(0) if a.ndim else Replicate() for a in arrays]
    yield [Shard(a.ndim - 1) if a.ndim else Replicate() for a in arrays]
    if arrays and floats[0]:
        yield [Partial("sum")] + [Replicate() for _ in arrays[1:]]
        yield [Partial("max") if f else Replicate() for f in floats]


@scenario
def every_op_sharded(rank, world, addr, args):
    """Every runnable op of the registry on DTensors with several input placements:
    full_tensor() of every result equals the op's numpy reference on whole arrays."""
    from sharding_cases import case, runnable_ops

    join(rank, world, addr)
    mesh = DeviceMesh((world,), ("x",))
    sharded_results, runs = {}, 0
    for name in runnable_ops():
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        arrays, attrs = case(name, rng)
        op = registry.get(name)
        want = op.reference(*arrays, **op.normalize_attrs(attrs))
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        for combo in _combos(arrays):
            ins = [distribute_tensor(a, mesh, [p], src_data_rank=None)
                   for a, p in zip(arrays, combo)]
            outs = run_op(name, ins, attrs, mesh=mesh)
            for k, (o, w) in enumerate(zip(outs, want)):
                got = o.full_tensor().numpy()
                assert got.shape == w.shape and got.dtype == w.dtype, (name, combo, got.shape)
                if got.dtype.kind in "fc":
                    np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5,
                                               err_msg="%s %s result %d" % (name, combo, k))
                else:
                    np.testing.assert_array_equal(got, w, err_msg="%s %s" % (name, combo))
                if not o.placements[0].is_replicate():
                    sharded_results.setdefault(name, str(o.placements[0]))
            runs += 1
    return {"runs": runs, "ops": len(runnable_ops()), "sharded": sharded_results}


def _ops_on_2d_mesh():
    """matmul, add and a reduction on a 2 x 2 mesh, inputs sharded two ways."""
    mesh = DeviceMesh((2, 2), ("dp", "tp"))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    w = rng.standard_normal((8, 10)).astype(np.float32)
    xs = distribute_tensor(x, mesh, [Shard(0), Shard(1)], src_data_rank=None)
    ws = distribute_tensor(w, mesh, [Replicate(), Shard(0)], src_data_rank=None)
    y = xs @ ws
    assert y.placements == (Shard(0), Partial("sum")), y.placements
    np.testing.assert_allclose(y.full_tensor().numpy(), x @ w, rtol=1e-4, atol=1e-4)
    z = (y + 1.0).sum(dim=0)
    np.testing.assert_allclose(z.full_tensor().numpy(), (x @ w + 1.0).sum(0), rtol=1e-4,
                               atol=1e-4)
    return str(y.placements)


if __name__ == "__main__":
    workers.main()
