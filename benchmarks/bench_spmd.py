"""SPMD step time: the tensor-parallel MLP and the FSDP transformer-block training step
on N ranks against the same compiled step in one process, same machine, same run.

    python benchmarks/bench_spmd.py                  # 4 ranks, 20 timed steps each
    python benchmarks/bench_spmd.py --ranks 2 --steps 10 --out /tmp/r.md

The functions are examples/sharded_training.py's (`mlp`, `train_step`, and on 4 ranks
`mesh_2d_setup`'s MLP training step on a 2 x 2 ("dp", "tp") mesh); each is
compiled once (`kn.compile` called with DTensors on the ranks, with whole arrays in
the single process), warmed up, then timed step by step: ranks from a barrier to the
step's end on every rank (rank 0's median reported). The single process and the ranks
alternate `--rounds` times, every process with one BLAS thread. Results: benchmarks/results/distributed.md, section "spmd".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))

MLP = dict(seed=0, dim=256, hidden=1024, tokens=256)
BLOCK = dict(batch=8, seq=16, dim=64, hidden=256)
MLP2D = dict(dim=256, hidden=1024, tokens=256)  # the 2 x 2 mesh's MLP training step


def _time(fn, steps: int, sync=lambda: None) -> list[float]:
    fn()  # warm (compiles)
    fn()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def single(steps: int) -> dict:
    import kiln as kn
    import sharded_training as ex

    mlp = kn.compile(ex.mlp)
    args = ex.mlp_inputs(**MLP)
    params, xs, ys = ex.block_data(1, **BLOCK)
    step = kn.compile(ex.train_step)
    state = {"p": params}

    def train():
        loss, *state["p"] = step(xs[0], ys[0], *state["p"])
        loss.numpy()

    out = {"mlp": _time(lambda: mlp(*args).numpy(), steps), "fsdp": _time(train, steps)}
    out["dp_tp"] = out["fsdp_tp"] = _time(_train_2d(None, False), steps)  # one process: same
    return out


def _train_2d(mesh, fsdp: bool):
    """One training step of the MLP on the 2 x 2 mesh (or whole, mesh None), as a thunk."""
    import sharded_training as ex

    step, x, y, params = ex.mesh_2d_setup(mesh, fsdp, **MLP2D)
    state = {"p": params}

    def train():
        loss, *state["p"] = step(x, y, *state["p"])
        (loss.to_local() if mesh is not None else loss).numpy()

    return train


def worker(rank: int, world: int, address: str, steps: int) -> None:
    import kiln as kn
    import kiln.distributed as dist
    import sharded_training as ex
    from kiln.distributed import DeviceMesh, Replicate, Shard, distribute_tensor

    pg = dist.init_process_group(rank=rank, world_size=world, store=address,
                                 token=os.environ["KILN_TOKEN"], timeout=120.0, host_store=False)
    mesh = DeviceMesh((world,), ("x",))
    sync = lambda: pg.barrier().wait()  # noqa: E731
    mlp = kn.compile(ex.mlp)
    mlp.out_placements = Replicate()
    x, w1, b1, w2, b2 = ex.mlp_inputs(**MLP)
    placements = [Replicate(), Shard(1), Shard(0), Shard(0), Replicate()]
    args = [distribute_tensor(a, mesh, [p]) for a, p in zip((x, w1, b1, w2, b2), placements)]
    params, xs, ys = ex.block_data(1, **BLOCK)
    step = kn.compile(ex.train_step)
    step.out_placements = [Replicate()] + [Shard(0)] * len(params)
    state = {"p": [distribute_tensor(p, mesh, [Shard(0)]) for p in params]}
    xd, yd = (distribute_tensor(a, mesh, [Shard(0)]) for a in (xs[0], ys[0]))

    def train():
        loss, *state["p"] = step(xd, yd, *state["p"])
        loss.to_local().numpy()

    out = {"mlp": _time(lambda: mlp(*args).to_local().numpy(), steps, sync),
           "fsdp": _time(train, steps, sync)}
    if world == 4:
        mesh2 = DeviceMesh((2, 2), ("dp", "tp"))
        out["dp_tp"] = _time(_train_2d(mesh2, False), steps, sync)
        out["fsdp_tp"] = _time(_train_2d(mesh2, True), steps, sync)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def run_job(world: int, steps: int) -> dict:
    from benchmarks.bench_checkpoint import run_ranks

    # more ranks than cores: each rank's BLAS on one thread (as a launcher pins them)
    return run_ranks(__file__, world, str(steps), {"OPENBLAS_NUM_THREADS": "1"})


def run_single(steps: int) -> dict:
    """`single` in a fresh process with the ranks' BLAS setting (one thread)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--single", str(steps)], env=env,
                         capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit("single-process run failed:\n" + out.stderr[-2000:])
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    from benchmarks.bench_allreduce import machine
    from benchmarks.report import write_section

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "distributed.md"))
    opts = parser.parse_args()
    one: dict = {}
    many: dict = {}
    for _ in range(opts.rounds):  # alternate, so both see the same machine load
        for key, values in run_single(opts.steps).items():
            one.setdefault(key, []).extend(values)
        for key, values in run_job(opts.ranks, opts.steps).items():
            many.setdefault(key, []).extend(values)
    rows = []
    mlp2d = "MLP train step %(tokens)d x %(dim)d, hidden %(hidden)d" % MLP2D
    for name, what in (("mlp", "TP MLP (column then row parallel), %(tokens)d x %(dim)d, "
                        "hidden %(hidden)d" % MLP),
                       ("fsdp", "FSDP train step, transformer block b%(batch)d s%(seq)d "
                        "d%(dim)d h%(hidden)d" % BLOCK),
                       ("dp_tp", "2 x 2 mesh, DP x TP: " + mlp2d),
                       ("fsdp_tp", "2 x 2 mesh, FSDP x TP: " + mlp2d)):
        if name not in many:
            continue
        a, b = statistics.median(one[name]), statistics.median(many[name])
        rows.append("| %s | %.2f ms | %.2f ms | %.2fx |" % (what, 1e3 * a, 1e3 * b, a / b))
    section = "\n".join([
        "## SPMD step time: %d ranks vs one process" % opts.ranks,
        "",
        "- command: `python benchmarks/bench_spmd.py %s`" % " ".join(sys.argv[1:]),
        "- machine: %s; %s UTC; load average %.1f at the end (other jobs share the "
        "cores)" % (machine(), datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"),
                    os.getloadavg()[0]),
        "- medians of %d steps x %d rounds after 2 warm-up steps; ranks: barrier to barrier "
        "around each step (rank 0); one process and the ranks alternate, each process with "
        "OPENBLAS_NUM_THREADS=1, same run. Speedup = single / sharded (on a machine with "
        "fewer cores than ranks, below 1 is expected)" % (opts.steps, opts.rounds),
        "",
        "| step | one process | %d ranks | speedup |" % opts.ranks,
        "|---|---|---|---|",
        *rows,
    ])
    write_section(opts.out, "spmd", section)
    print(section)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--single":
        print("RESULT " + json.dumps(single(int(sys.argv[2]))), flush=True)
    else:
        main()
