"""Data-parallel training that survives `kill -9`: shrink in place, a replacement rejoins.

    .venv/bin/python examples/train_ddp_ft.py [--nproc 4] [--steps 60] [--kill-step 20]
                                              [--backend tcp|mpi]

The driver (this script without --worker) runs the job twice on this machine:

1. fault-free, as one process on the whole global batch (the reference loss curve);
2. under `kiln launch --nproc 4 --on-failure replace --inject kill:rank=2,step=K`: four
   workers train the MLP of examples/train_mlp.py data-parallel. Each step a worker
   computes its shard's loss and gradients with one compiled function, the gradients
   are averaged with one all_reduce, and `pg.should_commit()` decides whether the
   AdamW update (a second compiled function) is applied. At step K the launcher
   SIGKILLs rank 2: the survivors' all_reduce fails with PeerFailure, the step is rolled
   back, they shrink to 3 ranks in place and go on; the launcher starts a replacement,
   which joins at the next step commit, receives parameters and optimizer state from
   rank 0 and takes part from then on.

With `--backend mpi` the job runs under `kiln launch --engine mpi` (mpirun with ULFM) on
the mpi backend: rank 2 sends itself SIGKILL at step K (mpirun starts the ranks, so
there is no launcher to inject it), Open MPI reports the death, the survivors shrink,
and rank 0 spawns the replacement into the running job.

The global batch is the same at every step whatever the world size (each rank takes an
equal slice), so the loss curve of the faulty run follows the fault-free one up to
float rounding. The driver checks that every rank ends with identical parameters and
prints detection time (kill to PeerFailure), recovery time (shrink, grow) and steps
lost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kiln as kn  # noqa: E402
from kiln import nn, optim  # noqa: E402
from kiln.nn import functional as F  # noqa: E402
from train_mlp import MLP, make_teacher  # noqa: E402

GLOBAL_BATCH = 96  # divisible by 1, 2, 3 and 4 ranks


def batch(teacher, step: int, seed: int = 0):
    """The global batch of `step` (the same on every rank and in every run)."""
    x = kn.randn(GLOBAL_BATCH, 32, seed=seed * 1_000_003 + step)
    return x, teacher(x)


def build(lr: float):
    model, opt = MLP(seed=0, p=0.0), optim.AdamW(lr=lr, weight_decay=1e-4)

    def loss_fn(params, x, y):
        return F.mse_loss(nn.functional_call(model, params, x), y)

    grad_step = kn.compile(kn.value_and_grad(loss_fn))
    apply = kn.compile(lambda grads, state, params: opt.update(grads, state, params))
    params = dict(model.named_parameters())
    return params, opt.init(params), grad_step, apply


def flat(tree) -> dict[str, np.ndarray]:
    """A {path: array} view of a dict pytree (what the state transfer sends)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update({"%s/%s" % (key, k): v for k, v in flat(value).items()})
        else:
            out[key] = np.array(value)
    return out


def unflat(arrays: dict[str, np.ndarray], like) -> dict:
    out = {}
    for key, value in like.items():
        if isinstance(value, dict):
            sub = {k[len(key) + 1:]: v for k, v in arrays.items() if k.startswith(key + "/")}
            out[key] = unflat(sub, value)
        else:
            out[key] = kn.asarray(arrays[key])
    return out


def reference(steps: int, lr: float) -> list[float]:
    """The fault-free run: one process, the whole global batch."""
    teacher = make_teacher()
    params, state, grad_step, apply = build(lr)
    losses = []
    for step in range(1, steps + 1):
        x, y = batch(teacher, step)
        loss, grads = grad_step(params, x, y)
        params, state = apply(grads, state, params)
        losses.append(float(loss.item()))
    return losses


def worker(args) -> None:
    import kiln.distributed as dist
    from kiln.distributed.elastic import on_drop_conn, report_step

    pg = dist.init_process_group(args.backend, fault_tolerant=True, timeout=10.0)
    joined = os.environ.get("KILN_JOIN") == "1"
    if args.backend == "mpi":
        from kiln.distributed.mpi_world import spawned
        joined = spawned()
    teacher = make_teacher()
    params, state, grad_step, apply = build(args.lr)
    model = {"params": params, "opt": state}

    def load(arrays):
        model.update(unflat(arrays, model))

    if args.resume:  # a full restart reloads the checkpoint (the baseline of the benchmark)
        with np.load(args.resume) as ckpt:
            load({k: ckpt[k] for k in ckpt.files})
    pg.register_state(lambda: flat(model), load)  # a joiner receives the state here
    on_drop_conn(lambda: pg.store.close())
    names = sorted(flat(model["params"]))
    kill_self = {int(a): int(b) for a, b in (kv.split(":") for kv in
                                             (args.kill_self or "").split(",") if kv)}
    losses, began, first_commit_at = {}, time.time(), None
    full = pg.world_size
    while pg.committed_step < args.steps:
        step = pg.committed_step + 1
        if step == args.hold_for_joiner and not joined and pg.world_size < full:
            # the demonstration needs the replacement in the job: hold here (bounded)
            # until it asks to join, so that the survivors cannot finish every step while
            # it starts Python and kiln; the next commit admits it
            held = time.monotonic() + 60.0
            while not pg.pending_joins() and time.monotonic() < held:
                time.sleep(0.05)
        report_step(step)  # where `kiln launch --inject kill:...,step=K` strikes
        if kill_self.get(step) == pg.global_ranks[pg.rank] and not joined:
            # under mpirun, the kill comes from inside: note when, then SIGKILL
            Path(args.out, "killed_%d.json" % step).write_text(json.dumps({"time": time.time()}))
            os.kill(os.getpid(), 9)
        x, y = batch(teacher, step)
        lo = pg.rank * GLOBAL_BATCH // pg.world_size
        hi = (pg.rank + 1) * GLOBAL_BATCH // pg.world_size
        loss, grads = grad_step(model["params"], x[lo:hi], y[lo:hi])
        g = flat(grads)
        bucket = np.concatenate([g[n].ravel() for n in names] + [np.array([loss.item()],
                                                                           np.float32)])
        try:
            pg.all_reduce(bucket, op="avg").wait()
        except dist.DistributedError as err:
            print("rank %d step %d: %s" % (pg.rank, step, type(err).__name__), flush=True)
        if pg.should_commit():
            offsets = np.cumsum([0] + [g[n].size for n in names])
            avg = {n: kn.asarray(bucket[offsets[i]:offsets[i + 1]].reshape(g[n].shape))
                   for i, n in enumerate(names)}
            model["params"], model["opt"] = apply(unflat(avg, grads), model["opt"],
                                                  model["params"])
            losses[step] = float(bucket[-1])
            first_commit_at = first_commit_at or time.time()
    digest = hashlib.sha256(b"".join(a.tobytes() for _, a in sorted(flat(model).items())))
    out = {"uid": pg.global_ranks[pg.rank], "rank": pg.rank, "world_size": pg.world_size,
           "epoch": pg.epoch, "committed": pg.committed_step, "losses": losses,
           "rolled_back": pg._ft.rolled_back, "history": pg._ft.history,
           "digest": digest.hexdigest(), "seconds": time.time() - began,
           "joined": joined, "started_at": began,
           "first_commit_at": first_commit_at}
    if args.save and pg.rank == 0:
        np.savez(args.save, **flat(model))
    Path(args.out, "rank_uid%d.json" % out["uid"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def drive(args) -> dict:
    print("fault-free reference (1 process, global batch %d) ..." % GLOBAL_BATCH, flush=True)
    ref = reference(args.steps, args.lr)
    out = Path(args.out or tempfile.mkdtemp(prefix="kiln-ddp-ft-"))
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.json"
    worker_args = [__file__, "--worker", "--steps", str(args.steps), "--lr", str(args.lr),
                   "--out", str(out), "--backend", args.backend]
    if args.backend == "mpi":  # mpirun starts the ranks: rank 2 kills itself at step K
        launch = ["--engine", "mpi"]
        worker_args += ["--kill-self", "%d:2" % args.kill_step]
    else:
        launch = ["--events-json", str(events), "--inject", "kill:rank=2,step=%d"
                  % args.kill_step]
        worker_args += ["--hold-for-joiner", str(args.kill_step + 2)]
    cmd = [sys.executable, "-m", "kiln", "launch", "--nproc", str(args.nproc),
           "--on-failure", "replace", "--max-restarts", "1"] + launch + worker_args
    print("$ kiln launch --nproc %d --on-failure replace %s (kill -9 of rank 2 at step %d)"
          % (args.nproc, " ".join(launch[:2]), args.kill_step), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t0
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
        raise SystemExit("the fault-tolerant job failed (exit %d)" % proc.returncode)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank_uid*.json"))]
    if args.backend == "mpi":
        killed = json.loads((out / ("killed_%d.json" % args.kill_step)).read_text())
    else:
        launch_events = json.loads(events.read_text())["events"]
        killed = next(e for e in launch_events if e["kind"] == "injected")
    digests = {r["digest"] for r in ranks}
    survivor = next(r for r in ranks if not r["joined"])
    shrink = next(h for h in survivor["history"] if h["failed_at"])
    grow = next((h for h in survivor["history"] if h["joined"]), None)
    joiner = next((r for r in ranks if r["joined"]), None)
    losses = {int(k): v for k, v in survivor["losses"].items()}
    diff = max(abs(losses[s] - ref[s - 1]) / max(abs(ref[s - 1]), 1e-12) for s in losses)
    report = {
        "ranks_finished": len(ranks), "identical_parameters": len(digests) == 1,
        "final_world_size": survivor["world_size"], "epochs": survivor["epoch"],
        "detection_s": shrink["failed_at"] - killed["time"],
        "shrink_s": shrink["total_s"], "grow_s": grow["total_s"] if grow else None,
        "steps_lost": survivor["rolled_back"],
        "joiner_joined_at_step": None if joiner is None else min(int(k) for k in
                                                                 joiner["losses"]),
        "loss_first": ref[0], "loss_last": losses[args.steps],
        "max_rel_loss_diff_vs_fault_free": diff, "job_wall_s": wall,
    }
    print("step  fault-free   with the kill")
    for s in sorted(set(range(1, args.steps + 1, max(1, args.steps // 10))) | {args.steps}):
        print("%4d  %.6f   %.6f" % (s, ref[s - 1], losses[s]))
    print("ranks finished: %d, identical parameters: %s, world size %d at epoch %d"
          % (len(ranks), report["identical_parameters"], report["final_world_size"],
             report["epochs"]))
    print("detection %.3f s (SIGKILL sent to PeerFailure), shrink %.3f s, grow %s, steps lost %d"
          % (report["detection_s"], report["shrink_s"],
             "%.3f s" % report["grow_s"] if grow else "-", report["steps_lost"]))
    print("loss curve vs fault-free: max relative difference %.2e" % diff)
    ok = report["identical_parameters"] and len(ranks) == args.nproc and diff < 1e-3
    print("OK" if ok else "FAILED")
    if not ok:
        raise SystemExit(1)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-step", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=None, help="where workers write their results")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--backend", choices=("tcp", "mpi"), default="tcp",
                    help="tcp (kiln launch) or mpi (kiln launch --engine mpi: mpirun + ULFM)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kill-self", default=None, help=argparse.SUPPRESS)  # "STEP:UID,..."
    ap.add_argument("--hold-for-joiner", type=int, default=0,
                    help="(worker) at this step, a shrunk group waits (at most 60 s) for a "
                    "replacement to ask to join")
    ap.add_argument("--save", default=None, help="(worker) rank 0 saves the state here (.npz)")
    ap.add_argument("--resume", default=None, help="(worker) load the state from this .npz")
    args = ap.parse_args(argv)
    return worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    main()
