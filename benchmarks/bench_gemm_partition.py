"""How kiln partitions a large GEMM over its threads, before and after (issue 22 item 2):
the GEMM-bound rows of bench_cpu.py and the single products inside them, timed with
this tree, an older kiln tree (`--baseline`), the bare BLAS products (numpy's OpenBLAS
at its default threads) and torch eager, in one run.

    git archive <rev> | tar -x -C /tmp/before
    .venv/bin/python benchmarks/bench_gemm_partition.py --baseline /tmp/before [--rounds 9]

Every implementation runs in a persistent process of its own (two kiln trees cannot
share one), set up and warmed once; the driver then asks them in turn, in a shuffled
order per round, for a block of calls lasting ~30 ms (round-robin), so the machine's
load falls on all alike. A worker reports each block's wall time per call and its
process CPU time per call (all its threads: a split call's total work, which the load
disturbs less than the wall time). Medians and minimums over the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
IMPLS = ("kiln", "kiln before", "BLAS alone", "torch eager")


def inputs(key: str):
    rng = np.random.default_rng(0)

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    if key == "gemm":
        return r(2048, 2048), r(2048, 2048, scale=2048 ** -0.5), r(2048)
    if key in ("mlp", "mlp1", "mlp2"):
        x, w1, b1, w2, b2 = r(512, 1024), r(1024, 4096, scale=0.03), r(4096), r(4096, 1024, scale=0.015), r(1024)
        return {"mlp": (x, w1, b1, w2, b2), "mlp1": (x, w1, b1), "mlp2": (r(512, 4096), w2, b2)}[key]
    if key in ("dx", "dw"):
        return r(512, 1024), r(1024, 1024, scale=0.03), r(512, 1024)
    if key == "cgemm":
        return tuple((r(512, 512) + 1j * r(512, 512)).astype(np.complex64) for _ in range(2))
    raise KeyError(key)


LABELS = {
    "gemm": "matmul+bias+relu 2048^3",
    "mlp": "MLP 512x1024 -> 4096 -> 1024 (gelu)",
    "mlp1": "gelu(x @ W1 + b1): 512x4096x1024",
    "mlp2": "h @ W2 + b2: 512x1024x4096",
    "dx": "dY @ W: 512x1024x1024",
    "dw": "dY^T @ X: 1024x1024x512 (A transposed)",
    "cgemm": "complex64 matmul 512^3",
    "train": "training step, MLP 512 -> 1024 -> 1024 -> 512, batch 512 (bench_train.py)",
}


def train_step(impl: str):
    """bench_train.py's large-MLP step (forward, backward, AdamW) for kiln or torch eager."""
    sys.path.insert(0, HERE)
    import bench_train
    import kiln as kn

    model = bench_train.MLP(512, 1024, 512, p=0.1)
    x, y = kn.randn(512, 512, seed=1), kn.randn(512, 512, seed=2)
    if impl.startswith("kiln"):
        return bench_train.setup_kiln(model, x, y)[0]
    return bench_train.setup_torch(model, x, y, use_compile=False)[0]


def kiln_fns(kn):
    return {
        "gemm": lambda x, w, b: kn.relu(x @ w + b),
        "mlp": lambda x, w1, b1, w2, b2: kn.gelu(x @ w1 + b1) @ w2 + b2,
        "mlp1": lambda x, w, b: kn.gelu(x @ w + b),
        "mlp2": lambda x, w, b: x @ w + b,
        "dx": lambda dy, w, x: dy @ w,
        "dw": lambda dy, w, x: dy.T @ x,
        "cgemm": lambda a, b: a @ b,
    }


BARE = {  # the matrix products alone (numpy, OpenBLAS's default threads)
    "gemm": lambda x, w, b: x @ w,
    "mlp": lambda x, w1, b1, w2, b2: (x @ w1) @ w2,
    "mlp1": lambda x, w, b: x @ w,
    "mlp2": lambda x, w, b: x @ w,
    "dx": lambda dy, w, x: dy @ w,
    "dw": lambda dy, w, x: dy.T @ x,
    "cgemm": lambda a, b: a @ b,
}


def torch_fns(torch):
    gelu = torch.nn.functional.gelu
    return {
        "gemm": lambda x, w, b: torch.relu(x @ w + b),
        "mlp": lambda x, w1, b1, w2, b2: gelu(x @ w1 + b1) @ w2 + b2,
        "mlp1": lambda x, w, b: gelu(x @ w + b),
        "mlp2": lambda x, w, b: x @ w + b,
        "dx": lambda dy, w, x: dy @ w,
        "dw": lambda dy, w, x: dy.T @ x,
        "cgemm": lambda a, b: a @ b,
    }


def worker(impl: str, keys: list[str]) -> None:
    """Set up `keys` for `impl`, then answer 'KEY CALLS' lines with one JSON line each."""
    fns = {}
    for key in keys:
        if key == "train":
            if impl == "BLAS alone":
                continue
            fns[key] = train_step(impl)
            continue
        xs = inputs(key)
        if impl.startswith("kiln"):
            import kiln as kn

            f = kn.compile(kiln_fns(kn)[key])
            fns[key] = (lambda f=f, xs=xs: f(*xs))
        elif impl == "BLAS alone":
            fns[key] = (lambda f=BARE[key], xs=xs: f(*xs))
        else:
            import torch

            torch.set_num_threads(os.cpu_count() or 1)
            ts = [torch.from_numpy(x) for x in xs]

            def call(f=torch_fns(torch)[key], ts=ts):
                with torch.no_grad():
                    return f(*ts)

            fns[key] = call
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:  # settle: caches, kiln's split trials
            fns[key]()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        key, calls = line.split()
        calls = int(calls)
        if key not in fns:
            print(json.dumps({"wall": float("nan"), "cpu": float("nan")}), flush=True)
            continue
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            fns[key]()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(json.dumps({"wall": wall / calls, "cpu": cpu / calls}), flush=True)


def start(impl: str, keys: list[str], baseline: str | None, forced: bool):
    env = dict(os.environ)
    root = baseline if impl == "kiln before" else ROOT
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if forced and impl.startswith("kiln"):  # split every candidate on every thread asked for
        env.update(KILN_SPLIT="always", KILN_DYNAMIC_THREADS="0")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", impl, "--keys", ",".join(keys)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    ready = p.stdout.readline()
    if not ready:
        raise RuntimeError(f"worker {impl} failed to start")
    return p


def ask(p, key: str, calls: int) -> dict:
    p.stdin.write(f"{key} {calls}\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--keys", default=",".join(LABELS))
    parser.add_argument("--baseline", help="root of an older kiln tree (its kiln/ on PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--forced", action="store_true",
                        help="kiln splits every candidate (KILN_SPLIT=always, KILN_DYNAMIC_THREADS=0): "
                             "the partition itself, not the split rule's verdict under load")
    args = parser.parse_args()
    keys = args.keys.split(",")
    if args.worker:
        worker(args.worker, keys)
        return 0
    impls = [i for i in IMPLS if (i != "kiln before" or args.baseline) and (i != "torch eager" or not args.no_torch)]
    if "torch eager" in impls:
        try:
            import torch  # noqa: F401
        except ImportError:
            impls.remove("torch eager")
    load0 = os.getloadavg()[0]
    procs = {i: start(i, keys, args.baseline, args.forced) for i in impls}
    rng = random.Random(0)
    res = {}
    try:
        for key in keys:
            calls = {i: max(1, min(50, int(0.03 / max(np.nan_to_num(ask(p, key, 1)["wall"], nan=1.0), 1e-6))))
                     for i, p in procs.items()}
            got = {i: [] for i in impls}
            order = list(impls)
            for _ in range(args.rounds):
                rng.shuffle(order)
                for i in order:
                    got[i].append(ask(procs[i], key, calls[i]))
            res[key] = {i: {f: (float(np.median([g[f] for g in v])), float(np.min([g[f] for g in v])))
                            for f in ("wall", "cpu")} for i, v in got.items()}
            res[key]["load"] = os.getloadavg()[0]
            print(key, json.dumps(res[key]), flush=True)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=60)
    print(render(res, impls, args, load0))
    return 0


def render(res: dict, impls: list, args, load0: float) -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if ln.startswith("Model name")), "?")
    out = [f"- command: `.venv/bin/python benchmarks/bench_gemm_partition.py"
           f"{' --baseline TREE' if args.baseline else ''}{' --forced' if args.forced else ''} "
           f"--rounds {args.rounds} --keys {','.join(res)}`",
           f"- machine: {model}, {os.cpu_count()} CPUs; load average {load0:.1f} at the start",
           f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
           "Wall milliseconds per call, median (minimum); `cpu` is the process CPU time per call "
           "(all threads), median. Ratios of medians (minimums).", ""]
    head = "| workload | load | " + " | ".join(impls) + " | " + " | ".join(f"{i} cpu" for i in impls)
    ratios = [("BLAS alone", "kiln", "BLAS / kiln")]
    if "kiln before" in impls:
        ratios.append(("kiln before", "kiln", "before / after"))
    if "torch eager" in impls:
        ratios.append(("torch eager", "kiln", "torch / kiln"))
    out += [head + " | " + " | ".join(r[2] for r in ratios) + " |",
            "|---" * (2 + 2 * len(impls) + len(ratios)) + "|"]
    for key, row in res.items():
        cells = ["—" if row[i]["wall"][0] != row[i]["wall"][0] else
                 f"{row[i]['wall'][0] * 1e3:.2f} ({row[i]['wall'][1] * 1e3:.2f})" for i in impls]
        cells += ["—" if row[i]["cpu"][0] != row[i]["cpu"][0] else f"{row[i]['cpu'][0] * 1e3:.2f}" for i in impls]
        cells += ["—" if row[a]["wall"][0] != row[a]["wall"][0] else
                  f"{row[a]['wall'][0] / row[b]['wall'][0]:.2f}x ({row[a]['wall'][1] / row[b]['wall'][1]:.2f}x)"
                  for a, b, _ in ratios]
        out.append(f"| {LABELS[key]} | {row['load']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
