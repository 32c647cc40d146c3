"""Train a small MLP with kiln.nn + kiln.optim and one compiled training step.

The task: regress the outputs of a fixed random "teacher" network on Gaussian inputs
(a target the student can learn exactly). The student is two hidden layers with GELU,
LayerNorm and Dropout; AdamW updates it. `step` runs forward, loss, backward and the
optimizer update, and `kn.compile(step)` turns all of it into one native program. Each
step gets its own Dropout key as an argument (a tensor input), so the masks change every
step while the compiled program stays the same.

    .venv/bin/python examples/train_mlp.py [--steps 300] [--batch 128] [--eager-steps 20]

It prints the loss falling, then the steps/s of the compiled step against the same step
run eagerly.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kiln as kn
from kiln import nn, optim
from kiln.nn import functional as F

D_IN, HIDDEN, D_OUT = 32, 128, 8


class MLP(nn.Module):
    def __init__(self, seed: int = 0, p: float = 0.1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(D_IN, HIDDEN, seed=seed), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Dropout(p),
            nn.Linear(HIDDEN, HIDDEN, seed=seed + 1), nn.GELU(), nn.LayerNorm(HIDDEN),
        )
        self.head = nn.Linear(HIDDEN, D_OUT, seed=seed + 2)

    def forward(self, x):
        return self.head(self.body(x))


def make_teacher(seed: int = 100) -> nn.Module:
    teacher = nn.Sequential(nn.Linear(D_IN, 64, seed=seed), nn.Tanh(),
                            nn.Linear(64, D_OUT, seed=seed + 1))
    return teacher.eval()


def make_step(model: nn.Module, opt: optim.Optimizer):
    """The training step as a pure function of tensors (what kn.compile compiles)."""

    def loss_fn(params, x, y, key):
        with nn.rng(key):  # Dropout draws its masks from this key
            return F.mse_loss(nn.functional_call(model, params, x), y)

    def step(params, opt_state, x, y, key):
        loss, grads = kn.value_and_grad(loss_fn)(params, x, y, key)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, loss

    return step


def batches(teacher: nn.Module, batch: int, seed: int):
    """An endless stream of (x, teacher(x)) batches, batch i from seed (seed, i)."""
    i = 0
    while True:
        x = kn.randn(batch, D_IN, seed=seed * 1_000_003 + i)
        yield x, teacher(x)
        i += 1


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="compiled training steps")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eager-steps", type=int, default=20,
                    help="steps of the same function run eagerly, for the speed comparison")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    teacher, model = make_teacher(), MLP(seed=args.seed)
    opt = optim.AdamW(lr=args.lr, weight_decay=1e-4)
    step = make_step(model, opt)
    compiled_step = kn.compile(step)
    base_key = nn.random.key(args.seed)

    params = dict(model.named_parameters())
    opt_state = opt.init(params)
    data = batches(teacher, args.batch, args.seed)

    start = time.perf_counter()
    x, y = next(data)
    params, opt_state, loss = compiled_step(params, opt_state, x, y,  # traces + compiles
                                            nn.random.fold_in(base_key, 0))
    compile_s = time.perf_counter() - start
    losses = [loss.item()]
    print(f"step     0  loss {losses[0]:.5f}   (first call, compiles: {compile_s:.2f} s)")
    step_time = 0.0
    every = max(1, args.steps // 10)
    for i in range(1, args.steps):
        x, y = next(data)
        key = nn.random.fold_in(base_key, i)  # a new key per step: a new input, no recompile
        t0 = time.perf_counter()
        params, opt_state, loss = compiled_step(params, opt_state, x, y, key)
        step_time += time.perf_counter() - t0
        losses.append(loss.item())
        if i % every == 0 or i == args.steps - 1:
            print(f"step {i:5d}  loss {losses[-1]:.5f}")
    compiled_sps = (args.steps - 1) / step_time if args.steps > 1 else float("nan")

    # the same step eagerly (op by op on numpy), from the current parameters
    eager_params, eager_state = params, opt_state
    t0 = time.perf_counter()
    for i in range(args.eager_steps):
        x, y = next(data)
        key = nn.random.fold_in(base_key, args.steps + i)
        eager_params, eager_state, _ = step(eager_params, eager_state, x, y, key)
    eager_sps = args.eager_steps / (time.perf_counter() - t0) if args.eager_steps else float("nan")

    model.load_state_dict(params, strict=False)  # the trained weights back into the model
    model.eval()
    x_test = kn.randn(1024, D_IN, seed=12345)
    test_loss = F.mse_loss(kn.compile(model)(x_test), teacher(x_test)).item()
    baseline = F.mse_loss(kn.zeros(1024, D_OUT), teacher(x_test)).item()

    print(f"\nloss {losses[0]:.5f} -> {np.mean(losses[-10:]):.5f} (mean of the last 10 steps); "
          f"held-out {test_loss:.5f} vs {baseline:.5f} predicting zeros")
    print(f"compiled step: {compiled_sps:8.1f} steps/s ({1e3 / compiled_sps:.2f} ms)   "
          f"eager: {eager_sps:6.1f} steps/s ({1e3 / eager_sps:.2f} ms)   "
          f"speed-up {compiled_sps / eager_sps:.1f}x   (batch {args.batch}, compiled "
          f"{compiled_step.stats()['compiles']} time)")
    return {"losses": losses, "test_loss": test_loss, "baseline": baseline,
            "compiled_steps_per_s": compiled_sps, "eager_steps_per_s": eager_sps,
            "compiles": compiled_step.stats()["compiles"]}


if __name__ == "__main__":
    main()
