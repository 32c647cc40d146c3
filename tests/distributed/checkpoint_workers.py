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
from kiln.distributed import (DeviceMesh, DTensor, Partial, Replicate, Shard,  # noqa: E402
                              distribute_tensor)


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


def _cow_state(world, rng):
    """Every kind of state an async save holds copy-on-write: parameters and AdamW state
    (kn.Tensors), plain kn.Tensors and a DTensor; plus a numpy array (copied)."""
    import kiln as kn
    from kiln import nn, optim

    w = nn.Parameter(kn.tensor(rng.standard_normal((6, 4)).astype(np.float32)))
    b = nn.Parameter(kn.tensor(rng.standard_normal(4).astype(np.float32)))
    opt = optim.AdamW([w, b], lr=0.1)
    state = {"w": w, "b": b,
             "buf": kn.tensor(np.arange(8, dtype=np.float32)),   # eager in-place ops
             "arg": kn.tensor(np.ones((3, 3), np.float32)),       # compiled write-back
             "raw": kn.tensor(np.zeros(5, np.float32)),           # written through .numpy()
             "coll": kn.tensor(np.full(4, 2.0, np.float32)),      # an in-place all_reduce
             "d": DTensor.from_local(rng.standard_normal((3, 5)).astype(np.float32),
                                     DeviceMesh((world,), ("x",)), [Shard(0)]),
             "steps": np.arange(4, dtype=np.int64)}
    return state, opt


def cow_while_training(pg, world, path, sync_path):
    """The default async_save (copy-on-write: no copy of the tensors' blocks) while the
    loop writes every kind of tensor through every write path; the checkpoint equals a
    synchronous save taken at the call, and the loop sees its own writes."""
    import concurrent.futures

    import kiln as kn
    from kiln.distributed.checkpoint import io, staging

    rng = np.random.default_rng(11)
    state, opt = _cow_state(world, rng)
    w, b = state["w"], state["b"]

    def step():  # two parameters with grads: the fused AdamW step (one compiled program)
        ((w * w).sum() + (b * 3.0).sum()).backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer state exists: save it too
    for i, p in enumerate((w, b)):
        for k, v in opt.state[p].items():
            if isinstance(v, kn.Tensor):
                state["opt%d.%s" % (i, k)] = v

    @kn.compile
    def bump(x):
        x.add_(1.0)
        return x.sum()

    dist.checkpoint.save(state, sync_path)  # the oracle: the values at the call
    before = {k: (v.local_array() if isinstance(v, DTensor) else np.asarray(v)).copy()
              for k, v in state.items()}
    blocker: concurrent.futures.Future = concurrent.futures.Future()
    io._IN_FLIGHT[os.path.realpath(path)] = blocker  # the save stays in flight meanwhile
    fut = dist.checkpoint.async_save(state, path)
    held = [state["d"]._local]  # the kn.Tensors are saved by rank 0
    held += [state[k]._x for k in state if isinstance(state[k], kn.Tensor) and pg.rank == 0]
    cow = all(id(a) in staging._HELD and staging._HELD[id(a)][3] > 0 for a in held)
    # training goes on, through every path that writes a tensor
    state["buf"].add_(1.0)
    state["buf"][2] = 100.0
    state["buf"].copy_(state["buf"] * 2.0)
    bump(state["arg"])
    state["raw"].numpy()[:] = 7.0
    np.asarray(state["raw"])[0] = 9.0
    pg.all_reduce(state["coll"], op="sum").wait()
    np.add(state["d"].local_array(), 1.0, out=state["d"].local_array())
    state["steps"] += 1  # a numpy array of the state: copied at the call
    step()
    step()
    in_flight = not fut.done()
    blocker.set_result(None)
    fut.result(timeout=60)
    got, want = {}, {}
    for folder, out in ((path, got), (sync_path, want)):
        target = {k: np.zeros_like(v) if not isinstance(state[k], DTensor)
                  else np.zeros((3 * world, 5), np.float32) for k, v in before.items()}
        target["d"] = DTensor.from_local(np.zeros((3, 5), np.float32), state["d"].device_mesh,
                                         [Shard(0)])
        dist.checkpoint.load(target, folder)
        out.update({k: (v.local_array() if isinstance(v, DTensor) else v).tolist()
                    for k, v in target.items()})
    buf = np.arange(8, dtype=np.float32) + 1.0
    buf[2] = 100.0
    seen = {"buf": np.asarray(state["buf"]).tolist() == (buf * 2.0).tolist(),
            "arg": np.asarray(state["arg"]).tolist() == [[2.0] * 3] * 3,
            "raw": np.asarray(state["raw"]).tolist() == [9.0] + [7.0] * 4,
            "coll": np.asarray(state["coll"]).tolist() == [2.0 * world] * 4,
            "d": np.array_equal(state["d"].local_array(), before["d"] + 1.0),
            "w": not np.array_equal(np.asarray(w), before["w"])}
    released = all(a.flags.writeable for a in held) and not staging._HELD
    return {"same": got == want, "at_call": got == {k: v.tolist() for k, v in before.items()},
            "cow": cow, "in_flight": in_flight, "seen": seen, "released": released}


@scenario
def cow_world(rank, world, addr, args):
    pg = join(rank, world, addr)
    return cow_while_training(pg, world, args["path"], args["path"] + "-sync")


if __name__ == "__main__":
    workers.main()
