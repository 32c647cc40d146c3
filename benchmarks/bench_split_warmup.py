"""The first calls of a compiled program, one by one: how many of them the split rule
(kiln/codegen/cpu/split_rule.py) and the prepared call's whole-run check spend on one
thread while they measure, for the workloads of bench_cpu.py and bench_train.py's
small-GPT step, this tree against a baseline tree (e.g. `git archive <commit> | tar -x
-C /tmp/before`).

    .venv/bin/python benchmarks/bench_split_warmup.py --baseline /tmp/before [--tree /tmp/after] [--rounds 3]
        [--calls 40] [--rows chain,softmax,layer_norm,gemm,mlp,ssq,newton]

Every (tree, row) runs in a fresh process with empty caches, variants round-robin, so the
load hits them alike. A process compiles the row's function, makes its first call
(compile and load), then times `calls` calls one by one. Per variant and round: the series
of the first 16 calls (ms), the median of calls 2-10 (what bench_cpu.py's 9 timed calls
after the first see), the median and minimum of the last 20, and the number of calls
among the first 10 slower than 1.3x the last 20's median ("slow"), and the number of calls
that ran a serial trial of the split rule (a launch's, or a prepared call's whole run's).
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
ROWS = ("chain", "softmax", "layer_norm", "gemm", "mlp", "ssq", "newton", "gpt")


def worker(name: str, calls: int) -> dict:
    """One row of bench_cpu.py's full-size workloads: the first call, then `calls` calls,
    each timed (seconds)."""
    sys.path.insert(0, HERE)
    import bench_cpu
    import kiln as kn

    if name == "gpt":  # bench_train.py's small-GPT training step, its state carried
        import bench_train

        step, params, state, x, y, key = bench_train.kiln_gpt_step()
        carry = [params, state]
        label = bench_train.GPT_LABEL

        def fn():
            carry[0], carry[1], _ = step(carry[0], carry[1], x, y, key)

        inputs = ()
    else:
        for key, label, fn, _np_fn, inputs, _bytes, _flops in bench_cpu.workloads(quick=False):
            if key == name and "call overhead" not in label:
                break
        else:
            raise SystemExit(f"no row {name!r}")
    from kiln.codegen.cpu import split_rule

    trials = [0]  # serial trials (a launch's or a whole run's) in the current call
    real_report = split_rule.Split.report

    def report(self, threads, ns):
        if self.verdict is None and threads <= 1:
            trials[0] += 1
        return real_report(self, threads, ns)

    split_rule.Split.report = report
    f = fn if name == "gpt" else kn.compile(fn)
    t0 = time.perf_counter()
    f(*inputs)
    first = time.perf_counter() - t0
    times, serial = [], []
    for _ in range(calls):
        trials[0] = 0
        t0 = time.perf_counter()
        f(*inputs)
        times.append(time.perf_counter() - t0)
        serial.append(trials[0])
    return {"label": label, "first": first, "times": times, "serial": serial}


def run(tree: str, name: str, calls: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    root = tempfile.mkdtemp(prefix="bench-split-warmup-")
    for var in ("KILN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[var] = os.path.join(root, var.lower())
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--calls", str(calls)]
    out = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                         timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(r: dict) -> dict:
    t = [x * 1e3 for x in r["times"]]
    settled = statistics.median(t[-20:])
    return {"series": t[:16], "first9": statistics.median(t[:9]), "settled": settled,
            "min": min(t), "slow": sum(1 for x in t[:10] if x > 1.3 * settled),
            "trials": sum(1 for k in r["serial"] if k)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="root of another kiln tree to compare against")
    ap.add_argument("--tree", default=ROOT, help="the kiln tree measured as 'after' (default: this one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ", ".join(ROWS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.calls)))
        return
    names = [r for r in ROWS if r in args.rows.split(",")]
    variants = [("after", os.path.abspath(args.tree))] + ([("before", os.path.abspath(args.baseline))] if args.baseline else [])
    results: dict = {}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in names:
            for label, tree in variants:
                results.setdefault((name, label), []).append(summary(run(tree, name, args.calls)))
    loads.append(os.getloadavg()[0])
    print(f"load average at each round's start and the end: {', '.join(f'{x:.2f}' for x in loads)}\n")
    print("| row | variant | calls 2-10, median ms | last 20, median (min) ms | slow of first 10 "
          "| calls with a serial trial |")
    print("|---|---|---|---|---|---|")
    for name in names:
        for label, _ in variants:
            rs = results[(name, label)]
            first9 = ", ".join(f"{r['first9']:.2f}" for r in rs)
            settled = ", ".join(f"{r['settled']:.2f} ({r['min']:.2f})" for r in rs)
            slow = ", ".join(str(r["slow"]) for r in rs)
            trials = ", ".join(str(r["trials"]) for r in rs)
            print(f"| {name} | {label} | {first9} | {settled} | {slow} | {trials} |")
    print("\nper-call series, first 16 calls after the first (ms), round 1:")
    for name in names:
        for label, _ in variants:
            r = results[(name, label)][0]
            print(f"- {name} {label}: " + " ".join(f"{x:.1f}" for x in r["series"]))


if __name__ == "__main__":
    main()
