"""The batched GEMM of bench_call.py ((16,32,256) x (16,256,64)) split over two threads
beside torch in one process (issue 22): is kiln's split rule right, and what does the
split itself cost, while another library's threads spin after its calls?

    .venv/bin/python benchmarks/bench_batched_split.py --turns [--rounds 10]
    .venv/bin/python benchmarks/bench_batched_split.py --interleaved [--rounds 300]
    .venv/bin/python benchmarks/bench_batched_split.py --diagnose
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

`--diagnose`: bench_call.py `--gemm-rows`'s setting (bench_gemm's method, kiln at its
default) once, traced: every timed call the split rule saw (its threads, its time, what
its regions waited for workers: `native_team.join_wait_ns`), each with its regions
(start after the call began, the caller's own part, the wait after it, units the caller
ran of all, a worker's first claim), the back-offs, and over the whole run how many
regions a worker joined and how soon.

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


def diagnose(shown: int = 40) -> str:
    import bench_gemm
    from kiln.codegen.cpu import native_pool, native_team, split_rule

    reports, waits = [], []
    real_report, real_waited = split_rule.Split.report, split_rule.waited

    join_wait = getattr(native_team, "join_wait_ns", lambda: None)  # (a tree before it: None)

    def report(self, threads, ns):
        w0 = getattr(self, "_wait0", None)
        real_report(self, threads, ns)
        w1 = join_wait()
        reports.append((threads, ns, time.monotonic_ns(), None if w0 is None or w1 is None else w1 - w0))

    def waited():
        waits.append(time.monotonic_ns())
        return real_waited()

    row = [r for r in bench_gemm.rows(False) if r[0].startswith("batched")]
    real_rows = bench_gemm.rows
    split_rule.Split.report, split_rule.waited, bench_gemm.rows = report, waited, lambda quick: iter(row)
    try:
        native_pool._built()
        traced = native_team.start_trace()
        res = bench_gemm.measure_rows(False, True)[0]
        regions = native_team.stop_trace()
    finally:
        split_rule.Split.report, split_rule.waited, bench_gemm.rows = real_report, real_waited, real_rows
    us = lambda ns: f"{ns / 1e3:.0f}"  # noqa: E731
    lines = [f"load {os.getloadavg()[0]:.1f}; traced: {traced}; us per call, median (min): " + ", ".join(
        f"{k} {v[0] * 1e6:.0f} ({v[1] * 1e6:.0f})" for k, v in res.items() if isinstance(v, tuple))]
    for threads, ns, end, jw in reports[:shown]:
        inside = [r for r in regions if r["kind"] != "wake" and end - ns <= r["start"] <= end]
        parts = "; ".join(
            f"+{us(r['start'] - end + ns)} own {us(r['own_done'] - r['start'])} wait {us(r['end'] - r['own_done'])} "
            f"caller {r['by_caller']}/{r['units']} claim "
            + (us(r["first_claim"] - r["start"]) if r["first_claim"] else "-") for r in inside)
        lines.append(f"{'split' if threads > 1 else 'serial'} {us(ns)} us" + (
            f", waited for workers {'?' if jw is None else us(jw)}: {parts}" if threads > 1 else ""))
    claimed = [r for r in regions if r["kind"] == "claim"]
    joined = [r["first_claim"] - r["start"] for r in claimed if r["first_claim"]]
    lines.append(f"timed calls {len(reports)} (split {sum(r[0] > 1 for r in reports)}), back-offs {len(waits)}, "
                 f"regions {len(claimed)}, joined by a worker {len(joined)}" + (
                     f", its first claim after {np.median(joined) / 1e3:.1f} us (median)" if joined else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", action="store_true")
    ap.add_argument("--interleaved", action="store_true")
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    if args.diagnose:
        print(diagnose())
        return 0
    if args.turns or not args.interleaved:
        print("| load | kiln | kiln 1t | torch 2t | kiln per round |\n|---|---|---|---|---|")
        print(turns(args.rounds or 10))
    if args.interleaved:
        print(interleaved(args.rounds or 300))
    return 0


if __name__ == "__main__":
    sys.exit(main())
