"""kiln's split rule (kiln/codegen/cpu/split_rule.py) on the large workloads of bench_cpu.py
and the batched GEMM rows: each row on kiln's default threads and on one thread, this tree
against a baseline tree (e.g. `git archive <commit> | tar -x -C /tmp/before`), every
variant a fresh process with empty caches, variants round-robin so load hits them alike.

    .venv/bin/python benchmarks/bench_split.py --baseline /tmp/before [--rounds 3] [--calls 15]

Per row and variant: the median and minimum of `calls` calls after 10 warm-up calls (a
measured launch's trials are over by then); the table gives each round's numbers, then
the same-round ratios: baseline / this tree at default threads, and one thread / default
threads within this tree (the two-thread speed-up the rule must keep).
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
ROOT = os.path.dirname(HERE)
ROWS = ("chain", "softmax", "layer_norm", "ssq", "newton", "bgemm", "bgemm_t")


def _rows(names):
    """(name, label, kiln fn, inputs) of bench_cpu's full-size workloads named, plus the
    batched GEMM rows of bench_call.py --gemm-rows."""
    import numpy as np

    import bench_cpu
    import kiln as kn

    for name, label, fn, _np_fn, inputs, _bytes, _flops in bench_cpu.workloads(quick=False):
        if name in names and "call overhead" not in label:
            yield name, label, fn, inputs
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 32, 256)).astype(np.float32)
    b = rng.standard_normal((16, 256, 64)).astype(np.float32)
    if "bgemm" in names:
        yield "bgemm", "batched GEMM (16,32,256)x(16,256,64)", lambda a, b: a @ b, (a, b)
    if "bgemm_t" in names:
        q = rng.standard_normal((64, 32, 16)).astype(np.float32)
        yield "bgemm_t", "attention scores (64,32,16)x(64,16,32)^T", \
            lambda q, k: q @ kn.transpose(k, 1, 2), (q, q)


def worker(names, threads: int, calls: int) -> dict:
    sys.path.insert(0, HERE)
    import kiln as kn

    if threads:
        kn.set_num_threads(threads)
    out = {}
    for name, label, fn, inputs in _rows(names):
        f = kn.compile(fn)
        args = [kn.tensor(x) for x in inputs]
        for _ in range(10):
            f(*args)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            f(*args)
            times.append(time.perf_counter() - t0)
        out[name] = {"label": label, "median": statistics.median(times), "min": min(times)}
    return out


def run(tree: str, names, threads: int, calls: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    root = tempfile.mkdtemp(prefix="bench-split-")
    for var in ("KILN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[var] = os.path.join(root, var.lower())
    cmd = [sys.executable, __file__, "--worker", ",".join(names), "--threads", str(threads),
           "--calls", str(calls)]
    out = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                         timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="root of another kiln tree to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ", ".join(ROWS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker.split(","), args.threads, args.calls)))
        return
    names = [r for r in ROWS if r in args.rows.split(",")]
    variants = [("after", ROOT, 0), ("after-1t", ROOT, 1)]
    if args.baseline:
        variants += [("before", os.path.abspath(args.baseline), 0), ("before-1t", os.path.abspath(args.baseline), 1)]
    results: dict = {v[0]: [] for v in variants}
    for _ in range(args.rounds):
        for label, tree, threads in variants:
            results[label].append(run(tree, names, threads, args.calls))
    print("| row | variant | median ms per round | minimum ms per round |\n|---|---|---|---|")
    for name in names:
        for label, *_ in variants:
            rs = [r[name] for r in results[label]]
            medians = ", ".join(f"{r['median'] * 1e3:.3f}" for r in rs)
            mins = ", ".join(f"{r['min'] * 1e3:.3f}" for r in rs)
            print(f"| {rs[0]['label']} | {label} | {medians} | {mins} |")
    print("\nsame-round ratios of medians (minimums):")
    pairs = [("after-1t", "after")] + ([("before", "after"), ("before-1t", "before")] if args.baseline else [])
    for name in names:
        for num, den in pairs:
            a, b = results[num], results[den]
            print(f"- {name}: {num} / {den}: " + ", ".join(
                f"{x[name]['median'] / y[name]['median']:.2f}x ({x[name]['min'] / y[name]['min']:.2f}x)"
                for x, y in zip(a, b)))


if __name__ == "__main__":
    main()
