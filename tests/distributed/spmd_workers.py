"""Multiprocess scenarios of the SPMD tests (see harness.py): the examples of
examples/sharded_training.py on 4 ranks against one process."""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import workers  # noqa: E402
from workers import join, scenario  # noqa: E402

from kiln.distributed import DeviceMesh  # noqa: E402


@scenario
def tp_and_fsdp(rank, world, addr, args):
    import sharded_training as ex

    join(rank, world, addr, timeout=60.0)
    mesh = DeviceMesh((world,), ("x",))
    got, want = ex.tensor_parallel_mlp(mesh)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    sharded = ex.fsdp_losses(mesh, steps=args.get("steps", 3))
    # one process's curve, computed once (rank 0) rather than compiled on every rank
    single = ex.fsdp_losses(None, steps=args.get("steps", 3)) if rank == 0 else None
    return {"sharded": sharded, "single": single}


@scenario
def mesh_2d(rank, world, addr, args):
    """DP x TP and FSDP x TP training of the MLP on a 2 x 2 ("dp", "tp") mesh."""
    import sharded_training as ex

    join(rank, world, addr, timeout=60.0)
    mesh = DeviceMesh((2, 2), ("dp", "tp"))
    steps = args.get("steps", 3)
    out = {"coord": list(mesh.get_coordinate()),
           "dp_tp": ex.mesh_2d_losses(mesh, steps),
           "fsdp_tp": ex.mesh_2d_losses(mesh, steps, fsdp=True)}
    out["single"] = ex.mesh_2d_losses(None, steps) if rank == 0 else None
    # a sub-mesh by name: each dp row runs the tensor-parallel MLP over its own tp pair
    got, want = ex.tensor_parallel_mlp(mesh["tp"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    out["tp_group"] = mesh["tp"].get_group().name
    return out


if __name__ == "__main__":
    workers.main()
