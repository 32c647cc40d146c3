"""`kn.profile()` of bench_train.py's compiled small-GPT training step, with float
max/min row reductions on the integer-key path (kiln/codegen/cpu/minmax_keys.py) and on
the `llvm.maximum` path it replaced, each in a fresh process with empty caches,
alternating.

    .venv/bin/python benchmarks/profile_gpt_step.py [--rounds 2] [--steps 7] [--top 8]

Per variant: the sum over kernels of each kernel's minimum time per step (the profile
total with the load's noise taken out), the step's minimum wall time, and the largest
kernels by minimum.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(keys: bool, steps: int) -> dict:
    sys.path.insert(0, HERE)
    import kiln as kn
    from kiln.codegen.cpu import minmax_keys

    import bench_train as bt

    minmax_keys.ENABLED = keys
    compiled, params, state, x, y, key = bt.kiln_gpt_step()
    for _ in range(3):
        params, state, loss = compiled(params, state, x, y, key)
    walls = []
    with kn.profile() as p:
        for _ in range(steps):
            t0 = time.perf_counter()
            params, state, loss = compiled(params, state, x, y, key)
            walls.append(time.perf_counter() - t0)
    per_kernel: dict = {}
    for e in p.events:  # each kernel's launches per step, then its minimum over steps
        per_kernel.setdefault(e.name, []).append(e.duration_ns)
    mins = {name: min(d) * (len(d) // steps) / 1e6 for name, d in per_kernel.items()}
    return {"kernel_min_sum_ms": sum(mins.values()), "step_min_ms": min(walls) * 1e3,
            "launches": len(p.events) // steps, "loss": float(loss.numpy()),
            "top": sorted(mins.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--worker", choices=["on", "off"])
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker == "on", args.steps)))
        return
    results: dict = {"off": [], "on": []}
    for _ in range(args.rounds):
        for variant in ("off", "on"):
            env = dict(os.environ, KILN_CACHE_DIR=tempfile.mkdtemp(prefix="gpt-prof-"))
            out = subprocess.run([sys.executable, __file__, "--worker", variant, "--steps",
                                  str(args.steps)], env=env, capture_output=True, text=True,
                                 timeout=900, check=True)
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for variant, label in (("off", "llvm.maximum path"), ("on", "key path")):
        runs = results[variant]
        print(f"## {label}: kernel minimums summed "
              + ", ".join(f"{r['kernel_min_sum_ms']:.2f}" for r in runs) + " ms; step minimum "
              + ", ".join(f"{r['step_min_ms']:.2f}" for r in runs) + f" ms; {runs[0]['launches']}"
              f" launches; loss {runs[0]['loss']:.6f}")
        best = min(runs, key=lambda r: r["kernel_min_sum_ms"])
        for name, ms in best["top"][:args.top]:
            print(f"  {name:<40} {ms:.3f} ms")


if __name__ == "__main__":
    main()
