"""Multiprocess scenarios of the checkpoint tests (see harness.py): save on one world
size, load on another, async save while training goes on, a rank killed mid-save."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workers  # noqa: E402
from workers import join, scenario  # noqa: E402

import kiln.distributed as dist  # noqa: E402
from kiln.distributed import DeviceMesh, Partial, Replicate, Shard, distribute_tensor  # noqa: E402


def values(version: int = 0) -> dict:
    """The global values every scenario saves (version 1: after a 'training step')."""
    rng = np.random.default_rng(42)
    out = {"w": rng.standard_normal((7, 5)).astype(np.float32),
           "m": rng.standard_normal((6, 9)).astype(np.float32),
           "steps": np.arange(10, dtype=np.int64)}
    return {k: v + version for k, v in out.items()}


@scenario
def save_world(rank, world, addr, args):
    join(rank, world, addr)
    v = values()
    mesh = DeviceMesh((world,), ("x",))
    state = {"w": distribute_tensor(v["w"], mesh, [Shard(0)], src_data_rank=None),
             "m": distribute_tensor(v["m"], mesh, [Partial("sum")], src_data_rank=None),
             "steps": v["steps"]}
    if world == 4:
        mesh2 = DeviceMesh((2, 2), ("dp", "tp"))
        state["m"] = distribute_tensor(v["m"], mesh2, [Shard(1), Shard(0)], src_data_rank=None)
    dist.checkpoint.save(state, args["path"])
    data = _load_and_check(world, args["path"], v)
    if args.get("async_path"):
        _async_while_training(world, args["async_path"])
    return data


def _load_and_check(world, path, v):
    mesh = DeviceMesh((world,), ("x",))
    target = {"w": distribute_tensor(np.zeros((7, 5), np.float32), mesh, [Shard(1)],
                                     src_data_rank=None),
              "m": distribute_tensor(np.zeros((6, 9), np.float32), mesh, [Replicate()],
                                     src_data_rank=None),
              "steps": np.zeros(10, np.int64)}
    dist.checkpoint.load(target, path)
    np.testing.assert_array_equal(target["w"].full_tensor().numpy(), v["w"])
    np.testing.assert_array_equal(target["m"].to_local().numpy(), v["m"])
    np.testing.assert_array_equal(target["steps"], v["steps"])
    assert target["w"].placements == (Shard(1),)
    return {"files": len([n for n in os.listdir(path) if n.startswith("shard-")])}


@scenario
def load_world(rank, world, addr, args):
    join(rank, world, addr)
    return _load_and_check(world, args["path"], values(args.get("version", 0)))


def _async_while_training(world, path):
    """async_save, then three steps that change the state in place; the checkpoint
    holds the values of the call."""
    v = values()
    mesh = DeviceMesh((world,), ("x",))
    state = {"w": distribute_tensor(v["w"], mesh, [Shard(0)], src_data_rank=None),
             "m": distribute_tensor(v["m"], mesh, [Replicate()], src_data_rank=None),
             "steps": v["steps"].copy()}
    fut = dist.checkpoint.async_save(state, path)
    for _ in range(3):  # training goes on and changes the state in place
        state["w"].local_array().setflags(write=True)
        np.add(state["w"].local_array(), 1.0, out=state["w"].local_array())
        state["steps"] += 1
        x = state["w"] + 1.0
        x.full_tensor()
    fut.result(timeout=60)
    return _load_and_check(world, path, v)


@scenario
def killed_mid_save(rank, world, addr, args):
    join(rank, world, addr)
    mesh = DeviceMesh((world,), ("x",))
    for version in (0, 1):
        v = values(version)
        state = {"w": distribute_tensor(v["w"], mesh, [Shard(0)], src_data_rank=None),
                 "m": distribute_tensor(v["m"], mesh, [Shard(1)], src_data_rank=None),
                 "steps": v["steps"]}
        if version == 0:
            dist.checkpoint.save(state, args["path"])
            continue
        if rank == 2:  # die half way through writing the first shard file
            from kiln.distributed.checkpoint import io

            def dying_write(folder, save_id, rank_, items):
                with open(os.path.join(folder, "shard-%s-r2-0.bin" % save_id), "wb") as f:
                    f.write(b"\0" * 8)
                    f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)

            io._write_shards = dying_write
        fut = dist.checkpoint.async_save(state, args["path"], timeout=4.0)
        try:
            fut.result(timeout=60)
        except dist.CheckpointError as err:
            return {"error": str(err)}
        raise AssertionError("the save with a dead rank committed")


if __name__ == "__main__":
    workers.main()
