"""The batched GEMM of bench_call.py ((16,32,256) x (16,256,64)) split over two threads
beside torch in one process (issue 22): is kiln's split rule right, and what does the
split itself cost, while another library's threads spin after its calls?

    .venv/bin/python benchmarks/bench_batched_split.py --turns [--rounds 10]
    .venv/bin/python benchmarks/bench_batched_split.py --interleaved [--rounds 300]
    PYTHONPATH=/tmp/base .venv/bin/python /tmp/base/benchmarks/...   # another tree: run its copy

`--turns`: kiln as `kn.compile` calls it (default threads: the split rule decides), kiln
at one thread and torch at two, each a turn of 200 calls in a shuffled order per round;
microseconds per call, median (minimum) of every call, and kiln's median per round (a
round at the one-thread time is a round the rule ran serial). `--interleaved`: bench_gemm's
method (one call of each implementation per round, shuffled: torch 1t/2t, numpy's OpenBLAS
at its threads, jax.jit, whose threads all spin after their calls) with a `kiln split`
variant, the same product compiled with every launch forced to split (its verdict `sure`),
beside kiln at its default, and `kiln aligned`: kiln at its default on operands copied to
64-byte aligned memory (as `torch.tensor` copies them; numpy's arrays of 128 KB and more,
and `kn.tensor`'s copies of them, start 16 bytes past a page).

Run from a tree's root with the root first on PYTHONPATH to measure that tree; compare
trees round-robin by alternating processes (the machine's load falls on both alike).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kiln as kn  # noqa: E402


def operands():
    rng = np.random.default_rng(0)
    return rng.standard_normal((16, 32, 256)).astype(np.float32), rng.standard_normal((16, 256, 64)).astype(np.float32)


def placed(x: np.ndarray) -> np.ndarray:
    """x copied to 64-byte aligned memory."""
    raw = np.empty(x.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def turns(rounds: int) -> str:
    import torch

    a, b = operands()
    f = kn.compile(lambda x, y: x @ y)
    ta, tb = kn.tensor(a), kn.tensor(b)
    xa, xb = torch.tensor(a), torch.tensor(b)
    np.testing.assert_allclose(f(ta, tb).numpy(), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    threads = kn.get_num_threads()

    def kiln_1t():
        kn.set_num_threads(1)
        try:
            f(ta, tb)
        finally:
            kn.set_num_threads(threads)

    def torch_2t():
        torch.set_num_threads(2)
        with torch.no_grad():
            xa @ xb

    fns = {"kiln": lambda: f(ta, tb), "kiln 1t": kiln_1t, "torch 2t": torch_2t}
    every = {k: [] for k in fns}
    per_round = []
    order = list(fns)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                fns[name]()
                times.append(time.perf_counter() - t0)
            every[name] += times
            if name == "kiln":
                per_round.append(np.median(times))
    cells = " | ".join(f"{np.median(v) * 1e6:.0f} ({np.min(v) * 1e6:.0f})" for v in every.values())
    return (f"| {os.getloadavg()[0]:.1f} | {cells} | " + " ".join(f"{t * 1e6:.0f}" for t in per_round) + " |")


def interleaved(rounds: int) -> str:
    import bench_gemm
    from kiln.codegen.cpu import split_rule

    row = [r for r in bench_gemm.rows(False) if r[0].startswith("batched")][0]
    label, kfn, npfn, tfn, args, flops = row
    real_init = split_rule.Split.__init__
    force = [True]

    def init(self, claim, unit, max_threads, sure=False, win=split_rule.WIN):
        real_init(self, claim, unit, max_threads, sure or force[0], win)

    split_rule.Split.__init__ = init
    try:
        forced = kn.compile(kfn)
        targs = [kn.tensor(x) for x in args]
        forced(*targs)  # its launch states are made now, forced
    finally:
        force[0] = False
        split_rule.Split.__init__ = real_init
    real_round_robin = bench_gemm.round_robin

    aligned = [kn.asarray(placed(x)) for x in args]
    assert all(t.numpy().ctypes.data % 64 == 0 for t in aligned)
    plain = kn.compile(kfn)

    def round_robin(fns, repeat, warmup=2):
        more = {"kiln split": lambda: forced(*targs), "kiln aligned": lambda: plain(*aligned)}
        return real_round_robin(dict(fns, **more), rounds, warmup)

    bench_gemm.round_robin, bench_gemm.rows = round_robin, lambda quick: iter([row])
    try:
        res = bench_gemm.measure_rows(False, True)[0]
    finally:
        bench_gemm.round_robin = real_round_robin
    names = [k for k, v in res.items() if isinstance(v, tuple)]
    return "| " + " | ".join(names) + " |\n| " + " | ".join(
        f"{res[k][0] * 1e6:.0f} ({res[k][1] * 1e6:.0f})" for k in names) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", action="store_true")
    ap.add_argument("--interleaved", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    if args.turns or not args.interleaved:
        print("| load | kiln | kiln 1t | torch 2t | kiln per round |\n|---|---|---|---|---|")
        print(turns(args.rounds or 10))
    if args.interleaved:
        print(interleaved(args.rounds or 300))
    return 0


if __name__ == "__main__":
    sys.exit(main())
