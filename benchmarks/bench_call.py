"""The per-call cost of a compiled function (issue 22): a compiled 4x4 `x + 1`, the
small and batched GEMMs of bench_gemm.py, against numpy, torch eager, torch.compile and
jax.jit in the same run, and bench_train.py's small MLP and GPT training steps (kiln's
prepared call vs its general path vs torch eager).

    .venv/bin/python benchmarks/bench_call.py [--quick] [--no-peers] [--torch-compile] [--out FILE]
    .venv/bin/python benchmarks/bench_call.py --gemm-rows    # bench_gemm.py's small rows only
    .venv/bin/python benchmarks/bench_call.py --micro-rows   # kiln's micro-kernel per thread vs torch
    .venv/bin/python benchmarks/bench_call.py --trees before=/tmp/base,after=. [--rounds 6]
        # --gemm-rows of each tree in a fresh process, the trees round-robin (before/after)

Every implementation of a row is timed round-robin in this one process, in a shuffled
order per round (a shared machine's load and a library's spinning threads fall on all
alike). A sample is the mean of a block of calls (many for the microsecond rows), the
table gives the median and the minimum of the samples in microseconds per call, wall
time and CPU time of this process (all its threads: a BLAS library's spinning threads
count). `kiln` is `kn.compile` as users call it (the prepared call of a repeated
signature); `kiln general` is the same compiled function with prepared calls turned off
(the executor's general path, as before this work). `np.matmul` uses numpy's OpenBLAS
with its default threads, `1t` with one; torch eager runs with 1 thread and with all.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import time

import numpy as np

import kiln as kn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_eager_devices import cpu_model  # noqa: E402  (lscpu's model name)
from report import write_section  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu.md")


def general_path(f):
    """`f` with prepared calls off: every call takes the executor's general path."""
    f._remember_call = lambda *args: None
    f._fast.clear()
    return f


def with_blas_threads(fn, n: int):
    from kiln.runtime.threads import blas_num_threads, set_blas_num_threads

    def run():
        saved = blas_num_threads()
        set_blas_num_threads(n)
        try:
            return fn()
        finally:
            if saved is not None:
                set_blas_num_threads(saved)
    return run


def with_torch_threads(torch, fn, n: int, grad: bool = False):
    def run():
        saved = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            with torch.enable_grad() if grad else torch.no_grad():
                return fn()
        finally:
            torch.set_num_threads(saved)
    return run


def rows(quick: bool):
    """(label, kiln fn, numpy fn, torch fn, jax fn, args, calls per sample)."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    yield ("compiled x + 1, 4x4 float32", lambda x: x + 1, lambda x: x + 1,
           lambda t, x: x + 1, lambda jnp, x: x + 1, (r(4, 4),), 200)
    yield ("batched GEMM (16,32,256) x (16,256,64)", lambda a, b: a @ b, np.matmul,
           lambda t, a, b: a @ b, lambda jnp, a, b: a @ b, (r(16, 32, 256), r(16, 256, 64)), 4)
    yield ("attention scores (64,32,16) x (64,32,16)^T", lambda q, k: q @ k.transpose(1, 2),
           lambda q, k: q @ k.transpose(0, 2, 1), lambda t, q, k: q @ k.transpose(1, 2),
           lambda jnp, q, k: q @ jnp.swapaxes(k, 1, 2), (r(64, 32, 16), r(64, 32, 16)), 10)


def implementations(kfn, npfn, tfn, jfn, args, peers: bool, compile_peers: bool) -> dict:
    tensors = [kn.tensor(a) for a in args]
    fast = kn.compile(kfn)
    general = general_path(kn.compile(kfn))
    fns = {"kiln": lambda: fast(*tensors), "kiln general": lambda: general(*tensors),
           "np": lambda: npfn(*args), "np 1t": with_blas_threads(lambda: npfn(*args), 1)}
    if not peers:
        return fns
    try:
        import torch

        tt = [torch.tensor(a) for a in args]
        fns["torch 1t"] = with_torch_threads(torch, lambda: tfn(torch, *tt), 1)
        cores = os.cpu_count() or 1
        if cores > 1:
            fns[f"torch {cores}t"] = with_torch_threads(torch, lambda: tfn(torch, *tt), cores)
        if compile_peers:
            tc = torch.compile(lambda *xs: tfn(torch, *xs))
            fns["torch.compile"] = with_torch_threads(torch, lambda: tc(*tt), cores)
    except ImportError:
        pass
    try:
        import jax
        import jax.numpy as jnp

        jf = jax.jit(lambda *xs: jfn(jnp, *xs))
        ja = [jnp.asarray(a) for a in args]
        fns["jax.jit"] = lambda: jax.block_until_ready(jf(*ja))
    except ImportError:
        pass
    return fns


def round_robin(fns: dict, rounds: int, calls: int, seed: int = 0) -> dict:
    """{name: (wall median, wall min, cpu median, cpu min)} seconds per call."""
    for fn in fns.values():  # compile, warm caches
        for _ in range(3):
            fn()
    wall: dict = {name: [] for name in fns}
    cpu: dict = {name: [] for name in fns}
    order = list(fns)
    shuffle = random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            fn = fns[name]
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            w1, c1 = time.perf_counter(), time.process_time()
            wall[name].append((w1 - w0) / calls)
            cpu[name].append((c1 - c0) / calls)
    return {name: (float(np.median(wall[name])), float(np.min(wall[name])),
                   float(np.median(cpu[name])), float(np.min(cpu[name]))) for name in fns}


def train_rows(quick: bool, peers: bool) -> list[dict]:
    """bench_train.py's small MLP and small GPT training steps (forward, backward, AdamW,
    dicts of parameters in and out): kiln prepared vs kiln's general path vs torch eager,
    round-robin in this process."""
    import bench_train as bt
    from kiln import optim

    out = []
    for label, batch, d_in, hidden, d_out in list(bt.workloads(quick))[0::2]:  # small MLP, GPT
        if d_in is None:
            kn.manual_seed(0)
            module = bt.gpt_module("kiln")
            model = module.GPT(module.GPTConfig(**bt.GPT))
            rng = np.random.default_rng(0)
            x, y = (kn.tensor(rng.integers(0, bt.GPT["vocab_size"], (batch, bt.GPT["block_size"])))
                    for _ in range(2))
        else:
            model = bt.MLP(d_in, hidden, d_out, p=0.1)
            x, y = kn.randn(batch, d_in, seed=1), kn.randn(batch, d_out, seed=2)
        key = kn.nn.random.key(0)
        fns = {}
        for name in ("kiln", "kiln general"):
            opt = optim.AdamW(lr=1e-3, weight_decay=0.1 if d_in is None else 1e-2)
            compiled = kn.compile(bt.kiln_step_fn(model, opt))
            if name == "kiln general":
                general_path(compiled)
            params = dict(model.named_parameters())
            carry = [params, opt.init(params)]

            def run(compiled=compiled, carry=carry):
                carry[0], carry[1], _ = compiled(carry[0], carry[1], x, y, key)
            fns[name] = run
        if peers:
            try:
                import torch

                for threads in sorted({1, os.cpu_count() or 1}):
                    step, _ = bt.setup_torch(model, x, y, use_compile=False)
                    fns[f"torch {threads}t"] = with_torch_threads(torch, step, threads, grad=True)
            except ImportError:
                pass
        load = os.getloadavg()[0]
        res = round_robin(fns, 8 if quick else 30, 3)
        out.append({"workload": f"training step: {label}", "load": load, "results": res})
        print(label, {k: round(v[0] * 1e6, 1) for k, v in res.items()}, flush=True)
    return out


def check(kfn, npfn, args) -> None:
    got = kn.compile(kfn)(*args).numpy()
    want = npfn(*[a.astype(np.float64) for a in args])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def measure(quick: bool, peers: bool, compile_peers: bool) -> list[dict]:
    out = []
    for label, kfn, npfn, tfn, jfn, args, calls in rows(quick):
        check(kfn, npfn, args)
        fns = implementations(kfn, npfn, tfn, jfn, args, peers, compile_peers)
        load = os.getloadavg()[0]
        res = round_robin(fns, 15 if quick else 60, calls)
        out.append({"workload": label, "load": load, "results": res})
        print(label, {k: round(v[0] * 1e6, 2) for k, v in res.items()}, flush=True)
    return out


def render(table: list[dict], load0: float, argv: list[str]) -> str:
    names = []
    for row in table:
        names += [n for n in row["results"] if n not in names]
    lines = [
        "## The per-call cost of a compiled function (bench_call.py, issue 22)",
        "",
        "- command: `.venv/bin/python benchmarks/bench_call.py" + "".join(" " + a for a in argv) + "`",
        f"- machine: {os.cpu_count()} cores, {cpu_model()} (lscpu model name); load average "
        f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (a shared machine)",
        f"- date: {datetime.date.today().isoformat()}; numpy {np.__version__}",
        "",
        "Microseconds per call, round-robin in one process: wall median (minimum) / CPU-time "
        "median (minimum), CPU time of the whole process (a library's spinning threads "
        "count). Ratios are same-run medians by wall time (by CPU time in brackets), "
        "above 1 kiln is faster.",
        "",
        "| workload | load | " + " | ".join(names) + " | np / kiln | best peer / kiln |",
        "|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for row in table:
        res = row["results"]
        cells = []
        for n in names:
            v = res.get(n)
            cells.append("—" if v is None else f"{v[0] * 1e6:.1f} ({v[1] * 1e6:.1f}) / "
                                                f"{v[2] * 1e6:.1f} ({v[3] * 1e6:.1f})")
        k = res["kiln"]
        np_best = min((res[n] for n in ("np", "np 1t") if n in res), key=lambda v: v[0],
                      default=None)
        peers = [res[n] for n in res if n.startswith(("torch", "jax"))]
        peer_wall = min((v[0] for v in peers), default=None)
        peer_cpu = min((v[2] for v in peers), default=None)
        ratio_np = "—" if np_best is None else f"{np_best[0] / k[0]:.2f}x ({np_best[2] / k[2]:.2f}x)"
        ratio_peer = "—" if peer_wall is None else f"{peer_wall / k[0]:.2f}x ({peer_cpu / k[2]:.2f}x)"
        lines.append(f"| {row['workload']} | {row['load']:.1f} | " + " | ".join(cells)
                     + f" | {ratio_np} | {ratio_peer} |")
    return "\n".join(lines) + "\n"


def gemm_small_rows() -> str:
    """bench_gemm.py's small rows (batched GEMM, attention scores, and its one-thread
    table of small products: BLAS path vs micro-kernel vs np.matmul), measured exactly as
    bench_gemm.py measures them (its functions, its table format), for updating those
    rows of its results section without rerunning its large rows."""
    import bench_gemm

    every = list(bench_gemm.rows(False))
    small = [r for r in every if r[-1] < 1e8]
    real_rows = bench_gemm.rows
    bench_gemm.rows = lambda quick: iter(small)
    try:
        table = bench_gemm.measure_rows(False, True)
    finally:
        bench_gemm.rows = real_rows
    micro = bench_gemm.micro_rows()
    args = argparse.Namespace(quick=False)
    text = bench_gemm.render(args, table, micro, [], {}, os.getloadavg()[0])
    shapes = [" x ".join(map(str, shape)) for shape, _, _ in micro]
    return "\n".join(line for line in text.splitlines() if line.startswith("| ") and (
        any(line.startswith(f"| {r[0]} ") for r in small)
        or any(line.startswith(f"| {shape} ") for shape in shapes)))


def tree_rounds(trees: list[tuple[str, str]], rounds: int) -> str:
    """`--gemm-rows` of each kiln tree (its own bench_call.py, run from its root with the
    root first on PYTHONPATH, a fresh process each time), the trees in a shuffled order
    per round, `rounds` rounds: per row, variant and tree the median of the rounds'
    medians and the least minimum, and per round the same-process ratio best peer / kiln
    (torch, jax; by median, and by minimum in brackets)."""
    import json
    import subprocess

    got: dict = {}  # (row, tree) -> list of {variant: (median, min)}
    order = [name for name, _ in trees]
    roots = dict(trees)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            root = os.path.abspath(roots[name])
            env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
            out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_call.py"), "--gemm-rows"],
                                 cwd=root, env=env, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise RuntimeError(f"{name}: bench_call.py --gemm-rows failed:\n{out.stderr[-2000:]}")
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    times = {k: tuple(v) for k, v in row.items() if isinstance(v, list)}
                    got.setdefault((row["workload"], name), []).append((times, row["load"]))
            print(f"round {r + 1}: {name} done", flush=True)
    lines = ["| row | tree | " + " | ".join(["kiln", "kiln 1t", "torch 1t", f"torch {os.cpu_count()}t", "jax.jit"])
             + " | best peer / kiln per round, median (min) | load |", "|---|---|---|---|---|---|---|---|---|"]
    for (row, name), samples in got.items():
        cells = []
        for v in ("kiln", "kiln 1t", "torch 1t", f"torch {os.cpu_count()}t", "jax.jit"):
            meds = [t[v][0] for t, _ in samples if v in t]
            mins = [t[v][1] for t, _ in samples if v in t]
            cells.append("—" if not meds else f"{np.median(meds) * 1e3:.3f} ({min(mins) * 1e3:.3f})")
        ratios = []
        for t, _ in samples:
            peers = [t[v] for v in t if v.startswith(("torch", "jax"))]
            ratios.append(f"{min(p[0] for p in peers) / t['kiln'][0]:.2f} ({min(p[1] for p in peers) / t['kiln'][1]:.2f})")
        loads = [load for _, load in samples]
        lines.append(f"| {row} | {name} | " + " | ".join(cells) + f" | {', '.join(ratios)} | "
                     f"{min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also torch.compile (its first use costs 15-25 s here)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results file ('' to only print)")
    parser.add_argument("--no-train", action="store_true", help="skip the training-step rows")
    parser.add_argument("--gemm-rows", action="store_true",
                        help="only print bench_gemm.py's small rows, measured as it does")
    parser.add_argument("--micro-rows", action="store_true",
                        help="only print bench_micro_gemm.py's tables (the micro-kernel per thread)")
    parser.add_argument("--trees", help="NAME=ROOT,...: --gemm-rows of each kiln tree, round-robin")
    parser.add_argument("--rounds", type=int, default=6, help="with --trees: rounds")
    args = parser.parse_args()
    if args.trees:
        trees = [tuple(item.split("=", 1)) for item in args.trees.split(",")]
        print(tree_rounds(trees, args.rounds))
        return 0
    if args.micro_rows:
        import bench_micro_gemm

        print("\n".join(bench_micro_gemm.one_thread(60, None)) + "\n")
        print("\n".join(bench_micro_gemm.two_threads(180)))
        return 0
    if args.gemm_rows:
        print(gemm_small_rows())
        return 0
    load0 = os.getloadavg()[0]
    table = measure(args.quick, not args.no_peers, args.torch_compile)
    if not args.no_train:
        table += train_rows(args.quick, not args.no_peers)
    text = render(table, load0, sys.argv[1:])
    print(text)
    if args.out:
        write_section(args.out, "bench_call", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
