"""Compiled kernels built with and without LLVM's loop strength reduction (LSR).

kiln generates code with LSR off (kiln/codegen/cpu/jit.py, `_no_codegen_lsr`): it was
~12-14% of the small GPT step's LLVM time. This measures what that costs at run time:
small GEMMs (kiln's register-tiled micro-kernels), a batched product and row reductions,
each compiled in a fresh process with `jit.CODEGEN_LSR` on (LLVM's default) or off
(kiln's), the two alternating round by round; per workload the median over rounds of
each process's fastest call.

    .venv/bin/python benchmarks/bench_lsr.py --rounds 5
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

GEMMS = ((512, 64, 65), (512, 65, 64), (64, 512, 65), (512, 64, 256), (512, 256, 64), (128, 128, 128))
ROWS = ((512, 64), (64, 4096))


def worker(lsr: bool) -> dict:
    import numpy as np

    import kiln as kn
    from kiln.codegen.cpu import jit

    jit.CODEGEN_LSR = lsr
    rng = np.random.default_rng(0)
    out = {}

    def bench(name, fn, *arrays, reps=300):
        compiled = kn.compile(fn)
        args = [kn.tensor(a) for a in arrays]
        for _ in range(5):
            compiled(*args)
        best = float("inf")
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(reps):
                compiled(*args)
            best = min(best, (time.perf_counter() - t0) / reps)
        out[name] = best * 1e6

    for m, k, n in GEMMS:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        bench(f"relu(a @ b + 1), {m}x{k}x{n}", lambda a, b: kn.relu(a @ b + 1.0), a, b)
    a = rng.standard_normal((16, 32, 64)).astype(np.float32)
    b = rng.standard_normal((16, 64, 32)).astype(np.float32)
    bench("batched a @ b, 16 x 32x64x32", lambda a, b: a @ b, a, b)
    for shape in ROWS:
        x = rng.standard_normal(shape).astype(np.float32)
        bench(f"sum of squares along rows, {shape}", lambda x: (x * x).sum(-1), x)
        bench(f"softmax along rows, {shape}", lambda x: kn.softmax(x, -1), x)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker == "on")))
        return
    runs: dict = {"on": [], "off": []}
    for _ in range(args.rounds):
        for variant in ("on", "off"):
            env = dict(os.environ, KILN_CACHE_DIR=tempfile.mkdtemp(prefix="bench-lsr-"))
            done = subprocess.run([sys.executable, __file__, "--worker", variant], env=env,
                                  capture_output=True, text=True, timeout=900, check=True)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"## LLVM's LSR in code generation on / off (bench_lsr.py --rounds {args.rounds})\n")
    print("us per call, median over rounds of each process's fastest\n")
    print("| workload | LSR on (LLVM's default) | LSR off (kiln) | off / on |")
    print("|---|---|---|---|")
    for name in runs["on"][0]:
        on = statistics.median(r[name] for r in runs["on"])
        off = statistics.median(r[name] for r in runs["off"])
        print(f"| {name} | {on:.1f} | {off:.1f} | {off / on:.2f} |")


if __name__ == "__main__":
    main()
