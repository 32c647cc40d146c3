"""bench_train.py's small-GPT training step (forward, backward, AdamW): kiln compiled as
the tree is ("after") and with three of issue 22's fixes undone in the process ("before":
the float32 exp that computed its underflow, an x86 microcode assist per lane;
scatter_along's np.add.at; fusion's earlier plan: loops merged before cyclic groups
were split, and split halves recomputing the reductions they share), against
torch eager on one and two threads ("kiln-after1t": kiln after, `kn.set_num_threads(1)`); every variant a fresh process with empty caches,
variants round-robin, so load hits them alike.

    .venv/bin/python benchmarks/bench_gpt_step.py [--rounds 3] [--steps 30] [--top 10]
        [--variants kiln-after,kiln-after1t,torch-2t]   # a subset, same round-robin
        [--baseline /tmp/base]   # adds kiln-baseline: kiln-after on another tree

Per variant: the step's wall-clock median and minimum over `steps` steps (after 3 warm-up
steps), and for kiln a `kn.profile()` (each kernel's minimum per step) and for torch a
torch.profiler table (self CPU time per op) of one round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("kiln-before", "kiln-after", "kiln-after1t", "kiln-baseline", "torch-1t", "torch-2t")


def _undo_fixes() -> None:
    """The code as it was before the two fixes, patched into this process only."""
    import numpy as np

    from kiln.codegen.cpu import mathlib_f32 as m
    from kiln.ir.ops import shape
    from kiln.passes import fusion

    def old_exp(fn, x):
        em1, k = m.exp_core(fn, m.clamp(fn, x, -104.0, 89.0))
        k1 = fn.bin("ashr", k, m.i32(1))
        s1, s2 = m.pow2(fn, k1), m.pow2(fn, fn.bin("sub", k, k1))
        return fn.fmul(fn.fma(s1, em1, s1), s2)

    def add_at(out, where, src):
        out = out.copy()
        np.add.at(out, where, src)
        return out

    m.BODIES["exp"] = old_exp
    shape.scatter_add_sums = add_at
    fusion.SPLIT_BEFORE_MERGE = False


def kiln_worker(before: bool, steps: int, threads: int = 0) -> dict:
    import bench_train as bt
    import kiln as kn

    if before:
        _undo_fixes()
    if threads:
        kn.set_num_threads(threads)
    compiled, params, state, x, y, key = bt.kiln_gpt_step()
    for _ in range(3):
        params, state, loss = compiled(params, state, x, y, key)
    first_loss = float(loss.numpy())
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, state, loss = compiled(params, state, x, y, key)
        walls.append(time.perf_counter() - t0)
    with kn.profile() as p:
        for _ in range(7):
            params, state, loss = compiled(params, state, x, y, key)
    per: dict = {}
    for e in p.events:
        per.setdefault(e.name, []).append(e.duration_ns)
    mins = {n: min(d) * (len(d) // 7) / 1e6 for n, d in per.items()}
    return {"walls": walls, "loss3": first_loss, "launches": len(p.events) // 7,
            "kernel_min_sum_ms": sum(mins.values()),
            "top": sorted(mins.items(), key=lambda kv: -kv[1])}


def torch_worker(threads: int, steps: int) -> dict:
    import torch

    import bench_train as bt

    torch.set_num_threads(threads)
    step = bt.torch_gpt_step()
    for _ in range(3):
        step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(7):
            step()
    rows = sorted(((e.key, e.self_cpu_time_total / 7e3, e.count // 7) for e in prof.key_averages()),
                  key=lambda r: -r[1])
    return {"walls": walls, "top": rows, "self_sum_ms": sum(r[1] for r in rows)}


def run_variant(variant: str, steps: int, baseline: str | None = None) -> dict:
    """One variant in a fresh process with empty caches; "kiln-baseline" is kiln-after
    run on the kiln tree at `baseline` (its root on PYTHONPATH), the others on this one."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(baseline) if variant == "kiln-baseline"
               else os.path.dirname(HERE))
    root = tempfile.mkdtemp(prefix="gpt-step-")
    for var in ("KILN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[var] = os.path.join(root, var.lower())
    worker = "kiln-after" if variant == "kiln-baseline" else variant
    out = subprocess.run([sys.executable, __file__, "--worker", worker, "--steps", str(steps)],
                         env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of " + ", ".join(VARIANTS))
    ap.add_argument("--baseline", help="another kiln tree's root: adds the variant kiln-baseline "
                    "(e.g. `git archive <commit> | tar -x -C /tmp/base`)")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, HERE)
        kind, arg = args.worker.split("-")
        result = (kiln_worker(arg == "before", args.steps, 1 if arg.endswith("1t") else 0)
                  if kind == "kiln"
                  else torch_worker(int(arg[0]), args.steps))
        print(json.dumps(result))
        return
    variants = [v for v in VARIANTS if v in args.variants.split(",")
                and (v != "kiln-baseline" or args.baseline)]
    results: dict = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            results[variant].append(run_variant(variant, args.steps, args.baseline))
    medians = {v: [statistics.median(r["walls"]) * 1e3 for r in rs] for v, rs in results.items()}
    mins = {v: [min(r["walls"]) * 1e3 for r in rs] for v, rs in results.items()}
    print("| variant | step median per round (ms) | step minimum per round (ms) |")
    print("|---|---|---|")
    for v in variants:
        print(f"| {v} | {', '.join(f'{m:.2f}' for m in medians[v])} | "
              f"{', '.join(f'{m:.2f}' for m in mins[v])} |")
    print("\nsame-round ratios of medians (minimums):")
    for num, den in (("kiln-before", "kiln-after"), ("torch-1t", "kiln-after"),
                     ("torch-2t", "kiln-after"), ("torch-1t", "kiln-after1t"),
                     ("kiln-after1t", "kiln-after"), ("kiln-baseline", "kiln-after")):
        if num not in results or den not in results:
            continue
        print(f"- {num} / {den}: " + ", ".join(
            f"{a / b:.2f}x ({c / d:.2f}x)" for a, b, c, d in
            zip(medians[num], medians[den], mins[num], mins[den])))
    for v in ("kiln-before", "kiln-after"):
        if v not in results:
            continue
        best = min(results[v], key=lambda r: r["kernel_min_sum_ms"])
        print(f"\n## {v}: kernel minimums summed {best['kernel_min_sum_ms']:.2f} ms, "
              f"{best['launches']} launches per step, loss after 3 steps {best['loss3']:.6f}")
        print("| kernel | ms per step | share |\n|---|---|---|")
        for name, ms in best["top"][:args.top]:
            print(f"| {name} | {ms:.3f} | {ms / best['kernel_min_sum_ms']:.1%} |")
    for v in ("torch-1t",):
        if v not in results:
            continue
        best = min(results[v], key=lambda r: r["self_sum_ms"])
        print(f"\n## {v}: torch.profiler self CPU time summed {best['self_sum_ms']:.2f} ms per step")
        print("| op | self ms per step | calls per step |\n|---|---|---|")
        for name, ms, calls in best["top"][:args.top]:
            print(f"| {name} | {ms:.3f} | {calls} |")


if __name__ == "__main__":
    main()
