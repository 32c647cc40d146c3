"""Tensor parallelism and FSDP with one compiled SPMD program per rank.

    kiln launch --nproc 4 examples/sharded_training.py

1. A tensor-parallel MLP (Megatron): w1 split by columns, w2 by rows. `kn.compile` of
   the plain function, called with DTensors, partitions it: the hidden activations stay
   sharded and one all_reduce at the end makes the result whole.
2. FSDP-style training of the transformer block (examples/transformer_block.py): every
   parameter is Shard(0), the batch is Shard(0). The SPMD pass gathers each parameter
   where it is used (all_gather), and the gradients, Partial sums over the batch
   shards, are reduce-scattered back into the parameters' shards for the SGD update.
   The loss curve matches the single-process run.
3. The same MLP trained on a 2-d mesh, 2 x 2 = ("dp", "tp"): the batch is split over
   "dp", the weights Megatron-style over "tp" (data x tensor parallel), and with
   `fsdp=True` the weights are also sharded over "dp" (FSDP x TP). One compiled program
   holds the collectives of both mesh dims, each over its own sub-group.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kiln as kn  # noqa: E402
import kiln.distributed as dist  # noqa: E402
from kiln.distributed import DeviceMesh, Replicate, Shard, distribute_tensor  # noqa: E402
from transformer_block import example_inputs, transformer_block  # noqa: E402


def mlp(x, w1, b1, w2, b2):
    return kn.gelu(x @ w1 + b1, approximate="tanh") @ w2 + b2


def mlp_inputs(seed: int = 0, dim: int = 64, hidden: int = 256, tokens: int = 32):
    rng = np.random.default_rng(seed)
    f = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    return f(tokens, dim), f(dim, hidden), f(hidden), f(hidden, dim), f(dim)


def tensor_parallel_mlp(mesh: DeviceMesh) -> tuple[np.ndarray, np.ndarray]:
    """(sharded result, single-process result) of the column- then row-parallel MLP."""
    x, w1, b1, w2, b2 = mlp_inputs()
    placements = [Replicate(), Shard(1), Shard(0), Shard(0), Replicate()]
    args = [distribute_tensor(a, mesh, [p]) for a, p in zip((x, w1, b1, w2, b2), placements)]
    tp = kn.compile(mlp)
    tp.out_placements = Replicate()  # the caller wants the whole result on every rank
    y = tp(*args)
    return y.to_local().numpy(), kn.compile(mlp)(x, w1, b1, w2, b2).numpy()


def _loss(params, x, y):
    out = transformer_block(x, *params)
    return ((out - y) * (out - y)).mean()


def train_step(x, y, *params):
    """One SGD step: (loss, *new params)."""
    loss, grads = kn.value_and_grad(lambda *p: _loss(p, x, y), argnums=tuple(range(len(params))))(
        *params)
    return (loss, *[p - 0.05 * g for p, g in zip(params, grads)])


def block_data(steps: int, batch: int = 8, seq: int = 8, dim: int = 32, hidden: int = 64):
    inputs = [np.asarray(t.numpy()) for t in example_inputs(batch, seq, dim, hidden, seed=1)]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((batch, seq, dim)).astype(np.float32)
    y = 0.5 * rng.standard_normal((batch, seq, dim)).astype(np.float32)
    return inputs[1:], [x] * steps, [y] * steps  # one batch, fitted step by step


def fsdp_losses(mesh: DeviceMesh | None, steps: int = 4) -> list[float]:
    """The loss curve of `steps` SGD steps: FSDP on `mesh`, or one process (None)."""
    params, xs, ys = block_data(steps)
    step = kn.compile(train_step)
    if mesh is not None:
        step.out_placements = [Replicate()] + [Shard(0)] * len(params)
        params = [distribute_tensor(p, mesh, [Shard(0)]) for p in params]
    losses = []
    for x, y in zip(xs, ys):
        if mesh is not None:
            x, y = (distribute_tensor(a, mesh, [Shard(0)]) for a in (x, y))
        loss, *params = step(x, y, *params)
        losses.append(float(loss.to_local().numpy() if mesh is not None else loss.numpy()))
    return losses


def mlp_train_step(x, y, w1, b1, w2, b2):
    """One SGD step of the MLP on a mean squared error: (loss, *new params)."""
    def loss(*p):
        out = mlp(x, *p)
        return ((out - y) * (out - y)).mean()

    value, grads = kn.value_and_grad(loss, argnums=(0, 1, 2, 3))(w1, b1, w2, b2)
    return (value, *[p - 2.0 * g for p, g in zip((w1, b1, w2, b2), grads)])


def mesh_2d_setup(mesh: DeviceMesh | None, fsdp: bool = False, seed: int = 2, dim: int = 64,
                  hidden: int = 256, tokens: int = 32):
    """(compiled step, x, y, params) of the MLP's training on a 2-d ("dp", "tp") mesh, or
    whole arrays in one process (None). The batch is Shard(0) over dp; w1 / b1 are
    column-parallel and w2 row-parallel over tp; `fsdp` also shards every weight over dp
    (FSDP x TP)."""
    x, w1, b1, w2, b2 = mlp_inputs(seed=seed, dim=dim, hidden=hidden, tokens=tokens)
    y = 0.5 * np.random.default_rng(seed + 1).standard_normal(x.shape).astype(np.float32)
    params = [w1, b1, w2, b2]
    step = kn.compile(mlp_train_step)
    if mesh is not None:
        dp = Shard(0) if fsdp else Replicate()
        layout = [(dp, Shard(1)), (dp, Shard(0)), (Shard(1) if fsdp else dp, Shard(0)),
                  (dp, Replicate())]
        step.out_placements = [(Replicate(), Replicate())] + layout
        params = [distribute_tensor(p, mesh, pl) for p, pl in zip(params, layout)]
        x, y = (distribute_tensor(a, mesh, [Shard(0), Replicate()]) for a in (x, y))
    return step, x, y, params


def mesh_2d_losses(mesh: DeviceMesh | None, steps: int = 3, fsdp: bool = False) -> list[float]:
    """The loss curve of `steps` SGD steps of `mesh_2d_setup`'s training."""
    step, x, y, params = mesh_2d_setup(mesh, fsdp)
    losses = []
    for _ in range(steps):
        loss, *params = step(x, y, *params)
        losses.append(float(loss.to_local().numpy() if mesh is not None else loss.numpy()))
    return losses


def main() -> int:
    dist.init_process_group()
    world = dist.get_world().world_size
    mesh = DeviceMesh((world,), ("x",))
    got, want = tensor_parallel_mlp(mesh)
    sharded, single = fsdp_losses(mesh), fsdp_losses(None)
    if mesh.get_rank() == 0:
        print("TP MLP max |error|:", float(np.abs(got - want).max()), flush=True)
        print("FSDP losses:  ", ["%.5f" % v for v in sharded], flush=True)
        print("single losses:", ["%.5f" % v for v in single], flush=True)
    if world == 4:
        mesh2 = DeviceMesh((2, 2), ("dp", "tp"))
        dp_tp, fsdp_tp = mesh_2d_losses(mesh2), mesh_2d_losses(mesh2, fsdp=True)
        if mesh.get_rank() == 0:
            print("DP x TP losses:  ", ["%.5f" % v for v in dp_tp], flush=True)
            print("FSDP x TP losses:", ["%.5f" % v for v in fsdp_tp], flush=True)
            print("single losses:   ", ["%.5f" % v for v in mesh_2d_losses(None)], flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
