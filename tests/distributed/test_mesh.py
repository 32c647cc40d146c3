"""DeviceMesh and DTensor in one process: errors name the mesh and the rule broken;
a one-rank mesh runs every placement (the 4-rank tests are in test_sharding.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.distributed import (
    DeviceMesh, DTensor, MeshError, Partial, PlacementError, Replicate, Shard, distribute_tensor,
)


def test_mesh_shape_must_cover_the_group():
    with pytest.raises(MeshError, match="(?s)K240.*shape \\(2, 2\\) holds 4 ranks but the process "
                       "group has 1.*init_process_group"):
        DeviceMesh((2, 2), ("dp", "tp"))
    with pytest.raises(MeshError, match="names \\('a', 'a'\\) must be 2 distinct"):
        DeviceMesh((1, 1), ("a", "a"))
    with pytest.raises(MeshError, match="positive ints"):
        DeviceMesh((0,))


def test_sub_meshes_and_dims_by_name():
    mesh = DeviceMesh((1, 1), ("dp", "tp"))
    assert mesh["tp"].shape == (1,) and mesh["tp"].mesh_dim_names == ("tp",)
    assert mesh.size("dp") == 1 and mesh.get_coordinate() == (0, 0)
    with pytest.raises(MeshError, match="no mesh dim named 'pp'; its dims are dp, tp"):
        mesh["pp"]


def test_one_rank_mesh_round_trips_every_placement():
    mesh = DeviceMesh((1,), ("x",))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for p in (Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max")):
        d = distribute_tensor(x, mesh, [p])
        for q in (Shard(1), Replicate(), Partial("sum")):
            np.testing.assert_array_equal(d.redistribute(mesh, [q]).full_tensor().numpy(), x)
    x[0, 0] = 99.0  # distribute_tensor copied its input
    assert d.to_local().numpy()[0, 0] == 0.0


def test_dtensor_ops_and_errors():
    mesh = DeviceMesh((1,), ("x",))
    a = distribute_tensor(np.ones((2, 3), np.float32), mesh, [Shard(0)])
    b = distribute_tensor(np.full((3, 2), 2.0, np.float32), mesh, [Replicate()])
    np.testing.assert_array_equal((a @ b).full_tensor().numpy(), np.full((2, 2), 6.0))
    np.testing.assert_array_equal(((a + 1.0) * 2.0).sum(dim=1).full_tensor().numpy(), [12.0, 12.0])
    with pytest.raises(PlacementError, match="(?s)K241.*DTensor of global shape \\[5, 3\\].*must hold "
                       "a block of shape \\[5, 3\\], got \\[2, 3\\]"):
        DTensor.from_local(np.ones((2, 3), np.float32), mesh, [Shard(0)], shape=(5, 3))
    with pytest.raises(PlacementError, match="on DTensors: every operand must be a DTensor"):
        a @ np.ones((3, 2), np.float32)
